"""The tokenizer (Hugging Face folders, or rebuilt from GGUF metadata) and chat templates."""
