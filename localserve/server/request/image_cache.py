"""What the server remembers of pictures it has seen, so that a picture sent again (an agent's screenshot, resent
with every turn) skips the work its first request did: a bounded, thread-safe least-recently-used map
(`BytesLRU`), bounded by the bytes of what it holds.

Two of them serve the image path (docs/ARCHITECTURE.md):
- `DECODED_FILES` (one per process): the hash of an image file's bytes -> what decoding it found (`DecodedFile`:
  format, size, pixel hash), so a file sent again is neither decoded nor its pixels hashed (server/request/
  images.py's `decode_image`). A file's decoding depends on its bytes alone; the request's bounds are checked
  against the entry as they are against a decoded file.
- one per served model, made when the model is loaded and dropped with it (`ModelLease.prepared_images`):
  pixel hash -> the `PreparedImage` its encoder made (server/generation/image_prompt.py's `prepare_images`).
  Sound because each family's preprocessing begins with models/vision/preprocess.py's `to_rgb`, which reads
  exactly what the pixel hash hashes (RGB, or RGBA laid over white where the picture has transparency, and the
  size); the prefix cache and the embeddings cache rest on the same hash already. One corner: a processor
  configured with `do_convert_rgb: false` refuses a picture not in RGB mode, unless an RGB picture of the same
  pixels was prepared before (then it is served as that one; only successes are kept).

No torch here: the request parsing imports it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

DECODED_FILE_BYTES = 256  # what one DecodedFile entry is counted as (its key, fields and the map's own books)
DECODED_FILES_BOUND = 4 << 20  # about 16,000 files
PREPARED_IMAGES_BOUND = 256 << 20  # per served model: a few dozen large screenshots' pixel values


class BytesLRU(Generic[K, V]):
    """A map of at most `max_bytes` (the sizes its entries were put with, together), least recently used (got or
    put) dropped first; an entry larger than the bound is not kept. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"BytesLRU's max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value of `key` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: K, value: V, size: int) -> None:
        """Keep `value` under `key` counted as `size` bytes (replacing what `key` held), dropping the least
        recently used entries beyond the bound."""
        if size < 0:
            raise ValueError(f"BytesLRU.put: size must be >= 0, got {size}")
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if size > self.max_bytes:
                return
            self._entries[key] = (value, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    @property
    def num_bytes(self) -> int:
        """The sizes of the entries held, together."""
        with self._lock:
            return self._bytes

    def keys(self) -> list[K]:
        """The keys held, least recently used first."""
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


@dataclass(frozen=True)
class DecodedFile:
    """What decoding an image file found: its format (ours: "png", ...), size and pixel hash (engine/image_hash.py)."""

    format: str
    width: int
    height: int
    sha256: bytes


DECODED_FILES: BytesLRU[bytes, DecodedFile] = BytesLRU(DECODED_FILES_BOUND)
