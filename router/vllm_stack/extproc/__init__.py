"""Envoy's External Processing protocol (ext_proc v3) as the Gateway API Inference Extension uses it:
the names both sides agree on and the messages they build (:mod:`.wire`). Imported only when the
endpoint picker or the gateway mode runs (the Envoy messages are a large import)."""
