"""localserve.models."""
