"""localserve: a single-GPU LLM server with a paged, quantizable KV cache."""
