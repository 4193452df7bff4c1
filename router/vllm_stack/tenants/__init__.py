"""Tenants: who sent a request (:mod:`.identity`) and what each tenant is given (:mod:`.declaration`).

A tenant is the unit the director's admission counts by: the fair queue takes waiting requests by
tenant in turn, rate limits and eviction are per tenant. It decides when a request may be scheduled,
never where (docs/tenants.md). Below the settings layer: it reads nothing of the router but what it
is handed, so the settings, the API layer and the director all read one definition.
"""
