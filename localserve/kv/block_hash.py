"""Prefix-cache keys of full KV blocks: a hash of the block's tokens chained with its parent's key."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = bytes(32)
"""Parent hash of a sequence's first block."""

BlockContent = tuple[bytes, tuple[int, ...], bytes]
"""What a block's key is computed from: (parent hash, its token ids, extra key)."""
PrefixHit = tuple[bytes, int]
"""(key, block id) of a prompt block found in the prefix cache."""


def hash_block(parent_hash: bytes, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """Prefix-cache key of a full block: BLAKE2b-256 of its parent's key, `extra_key` and its tokens.

    Chaining through the parent's key makes the key stand for every token up to the block's end. A
    collision would hand a request someone else's KV, hence a cryptographic hash. `extra_key` is for
    whatever else shapes the KV (a LoRA adapter, images); it is length-prefixed so that it cannot run
    into the token bytes.
    """
    payload = (parent_hash + len(extra_key).to_bytes(8, "little") + extra_key
               + struct.pack(f"<{len(token_ids)}q", *token_ids))
    return hashlib.blake2b(payload, digest_size=32).digest()
