"""vllm-stack: router, test bed and tools for serving LLMs with vLLM on Kubernetes."""
