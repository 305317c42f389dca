"""A GGUF file's scalar and string metadata read straight from its header: no tensor, no torch.

`gguf.GGUFReader` parses every field and tensor of a file (two seconds for SmolLM2-135M, whose
tokenizer arrays hold 49,152 strings); naming the models of a folder needs a handful of `general.*`
keys, so this reader walks the key-value section (GGUF versions 2 and 3, little-endian), skips arrays
without decoding them, and stops as soon as it has every key asked for.
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from pathlib import Path
from typing import BinaryIO

GGUF_MAGIC = b"GGUF"
# Value types of the GGUF spec: type id -> struct format of one value (strings and arrays apart).
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                  12: "<d"}
STRING_TYPE, ARRAY_TYPE = 8, 9
MAX_KEY_BYTES = 1 << 16  # a longer key means the bytes are not a GGUF header


class GGUFHeaderError(ValueError):
    """The file is not a GGUF file this reader understands; the message names the file and why."""


MetadataValue = int | float | bool | str


def read_gguf_metadata(path: Path, keys: Collection[str]) -> dict[str, MetadataValue]:
    """The values of those of `keys` the header holds as scalars or strings (arrays are left out)."""
    try:
        with open(path, "rb") as file:
            return _read(file, set(keys))
    except (struct.error, UnicodeDecodeError, OSError) as exc:
        raise GGUFHeaderError(f"{path}: cannot read its GGUF header ({type(exc).__name__}: {exc})") from None
    except GGUFHeaderError as exc:
        raise GGUFHeaderError(f"{path}: {exc}") from None


def _read(file: BinaryIO, wanted: set[str]) -> dict[str, MetadataValue]:
    if file.read(4) != GGUF_MAGIC:
        raise GGUFHeaderError("not a GGUF file (no GGUF magic)")
    (version,) = _unpack(file, "<I")
    if version not in (2, 3):
        raise GGUFHeaderError(f"GGUF version {version} is not supported (2 and 3 are)")
    _tensor_count, kv_count = _unpack(file, "<QQ")
    found: dict[str, MetadataValue] = {}
    for _ in range(kv_count):
        if len(found) == len(wanted):
            break
        key = _string(file)
        (value_type,) = _unpack(file, "<I")
        if value_type == ARRAY_TYPE:
            _skip_array(file)
        elif key in wanted:
            found[key] = _value(file, value_type)
        else:
            _skip_value(file, value_type)
    return found


def _unpack(file: BinaryIO, fmt: str) -> tuple:
    size = struct.calcsize(fmt)
    data = file.read(size)
    if len(data) != size:
        raise GGUFHeaderError("the header ends early")
    return struct.unpack(fmt, data)


def _string(file: BinaryIO) -> str:
    (length,) = _unpack(file, "<Q")
    if length > MAX_KEY_BYTES:
        raise GGUFHeaderError(f"a string of {length} bytes in the header")
    data = file.read(length)
    if len(data) != length:
        raise GGUFHeaderError("the header ends early")
    return data.decode("utf-8")


def _value(file: BinaryIO, value_type: int) -> MetadataValue:
    if value_type == STRING_TYPE:
        return _string(file)
    if value_type not in SCALAR_FORMATS:
        raise GGUFHeaderError(f"unknown value type {value_type}")
    return _unpack(file, SCALAR_FORMATS[value_type])[0]


def _skip_value(file: BinaryIO, value_type: int) -> None:
    if value_type == STRING_TYPE:
        (length,) = _unpack(file, "<Q")
        file.seek(length, 1)
    elif value_type in SCALAR_FORMATS:
        file.seek(struct.calcsize(SCALAR_FORMATS[value_type]), 1)
    else:
        raise GGUFHeaderError(f"unknown value type {value_type}")


def _skip_array(file: BinaryIO) -> None:
    element_type, count = _unpack(file, "<IQ")
    if element_type in SCALAR_FORMATS:
        file.seek(count * struct.calcsize(SCALAR_FORMATS[element_type]), 1)
    elif element_type == STRING_TYPE:
        for _ in range(count):
            _skip_value(file, STRING_TYPE)
    elif element_type == ARRAY_TYPE:
        for _ in range(count):
            _skip_array(file)
    else:
        raise GGUFHeaderError(f"unknown array element type {element_type}")
