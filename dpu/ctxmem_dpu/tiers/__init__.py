"""Storage tiers: DRAM (memfd slabs shared with same-host clients) and flash (O_DIRECT)."""
