"""``ctxmem bench``: :mod:`.datapath` (the data path against the machine's limits),
:mod:`.ttft` (time to first token vs reused-prefix length, reported by
:mod:`.ttft_report`) and :mod:`.recovery` (index rebuild time vs stored blocks)."""
