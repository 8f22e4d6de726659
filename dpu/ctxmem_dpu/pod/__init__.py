"""The pod tier (docs/pod.md): a cluster index on Redis/Valkey of what every node holds,
and fetches of blocks another node holds (peer fetch; shared flash plugs in as another
:class:`~ctxmem_dpu.pod.sources.RemoteSource`). Off unless ``pod.enabled``."""
