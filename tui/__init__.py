"""localserve.tui."""
