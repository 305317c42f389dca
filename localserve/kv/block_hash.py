"""Prefix-cache keys of full KV blocks: a hash of the block's tokens chained with its parent's key."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = bytes(32)
"""Parent hash of a sequence's first block."""

BlockContent = bytes
"""What a block's key is the hash of (`block_payload`): its parent's key, the extra key, its token ids. One
bytes object per cached block, not tuples of tokens: the pool's books stay small (tens of thousands of
blocks), and the token ints of finished sequences are not kept alive."""
PrefixHit = tuple[bytes, int]
"""(key, block id) of a prompt block found in the prefix cache."""

_token_packers: dict[int, struct.Struct] = {}  # by number of tokens (mostly one: the block size)


def block_payload(parent_hash: bytes, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockContent:
    """The bytes `hash_block` hashes: the parent's key, `extra_key` length-prefixed, the tokens as int64."""
    packer = _token_packers.get(len(token_ids))
    if packer is None:
        packer = _token_packers[len(token_ids)] = struct.Struct(f"<{len(token_ids)}q")
    return parent_hash + len(extra_key).to_bytes(8, "little") + extra_key + packer.pack(*token_ids)


def hash_payload(payload: BlockContent) -> bytes:
    """The key of a block whose `block_payload` this is."""
    return hashlib.blake2b(payload, digest_size=32).digest()


def block_extra_key(extra_key: bytes, block_extra_keys: Sequence[bytes], index: int) -> bytes:
    """The extra key of block `index`: the sequence's `extra_key`, joined by the block's own (an image's content
    where the block covers image tokens, engine/multimodal.py) where it has one.

    A block with no key of its own (none given past the end of `block_extra_keys`, or an empty one) keeps
    `extra_key` as it is, so text-only keys never change. Else the sequence's part is length-prefixed, so
    that the two parts cannot run into each other.
    """
    block_key = block_extra_keys[index] if index < len(block_extra_keys) else b""
    if not block_key:
        return extra_key
    return len(extra_key).to_bytes(8, "little") + extra_key + block_key


def hash_block(parent_hash: bytes, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """Prefix-cache key of a full block: BLAKE2b-256 of its parent's key, `extra_key` and its tokens.

    Chaining through the parent's key makes the key stand for every token up to the block's end. A
    collision would hand a request someone else's KV, hence a cryptographic hash. `extra_key` is for
    whatever else shapes the KV (a LoRA adapter, images); it is length-prefixed so that it cannot run
    into the token bytes.
    """
    return hashlib.blake2b(block_payload(parent_hash, token_ids, extra_key), digest_size=32).digest()
