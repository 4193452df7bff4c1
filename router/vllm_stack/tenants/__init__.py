"""Tenants: who sent a request (:mod:`.identity`), what each tenant is given (:mod:`.declaration`), and
who holds more than its share of a model's engines now (:mod:`.shares`).

A tenant is the unit the director's admission counts by: the fair queue takes waiting requests by
tenant in turn, rate limits and eviction are per tenant, and the headroom keeps slots free of a tenant
past its share. It decides when a request may be scheduled; where, only by the slots the headroom keeps
(docs/tenants.md). Below the settings layer: it reads nothing of the router but what it
is handed, so the settings, the API layer and the director all read one definition.
"""
