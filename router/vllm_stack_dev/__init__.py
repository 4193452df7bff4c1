"""Development tooling (model builders, the engine testbed, the local stack, set-up): never imported by the router at run time."""
