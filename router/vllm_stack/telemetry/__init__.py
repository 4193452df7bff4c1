"""Engine telemetry (``/metrics`` scraping) and the router's own request tracking."""
