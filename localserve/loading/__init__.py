"""Weights and configs from a Hugging Face folder, the hub, or a GGUF file; the default model."""
