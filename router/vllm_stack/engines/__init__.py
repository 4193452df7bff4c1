"""Engines: the router's view of each engine, the registry, health, circuit breaker and load; discovery."""
