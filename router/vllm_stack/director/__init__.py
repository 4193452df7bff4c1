"""The director: runs each proxied request through its stages (admit, prepare, schedule, pre-request,
relay legs), retries, keeps the circuit breakers' books and turns every refusal into one error."""
