"""Engine discovery: sources of endpoints (static, Kubernetes) and the registry that tracks them."""
