"""Indexes that outlive configuration reloads (kept in the router's plugin state)."""
