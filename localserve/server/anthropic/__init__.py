"""Anthropic's Messages API: its field maps, its route and its answers."""
