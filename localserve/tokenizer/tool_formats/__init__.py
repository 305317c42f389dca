"""Tool-call formats, one module per chat-template family; `base` holds what they share."""
