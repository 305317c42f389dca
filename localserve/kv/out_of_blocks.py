"""The error of a pool of KV blocks that is short of free blocks: the block manager's GPU pool and its tiers."""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """An operation needed more free blocks than its pool has; nothing was changed."""
