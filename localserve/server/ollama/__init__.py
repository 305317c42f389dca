"""Ollama's API: its field maps, its routes and its answers."""
