"""The ctxmem service: runs on a BlueField DPU's Arm cores ("DPU mode") or on a host CPU
("fallback mode"). Control plane, block index, tiers, placement, codecs, transports."""

__version__ = "0.1.0"
