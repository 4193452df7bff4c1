"""The proxy's data path: pooled engine connections and the per-request exchange that relays bytes."""
