"""The router's HTTP surface: OpenAI-compatible proxied endpoints, its own endpoints, errors and auth."""
