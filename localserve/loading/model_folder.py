"""A folder of models (and models given one by one): finding them and the names they answer to.

`--models-dir DIR` serves every GGUF file and every Hugging Face folder (a folder with a `config.json`)
directly in DIR; `-m` may name more, one at a time. Each model answers to
- its file name (`SmolLM2-135M-Instruct.Q4_1.gguf`, or the folder's name; for a hub repo id, the id),
- a GGUF file's stem (`SmolLM2-135M-Instruct.Q4_1`) and the stem without its quantization suffix
  (`SmolLM2-135M-Instruct`), a repo id's last part,
- the names a GGUF's metadata gives it (`general.name`, `general.basename`),
- and `default` for the default model (the first one, or `--default-model NAME`), with `--alias` as its
  first name.

Its id, as `/v1/models` lists it, is its first name that no other model shares. File names must be
unique (two models both called `model.gguf` in different folders are refused at start, naming both
files); a name derived from a file name or the metadata that several models share is ambiguous: it names
none of them (asking for it is refused, naming their files), since two quantizations of one model in a
folder (`X.Q4_1.gguf`, `X.Q8_0.gguf`) share every name but their file names and are still worth serving.
No torch, and no tensor is read: a GGUF's names come from its header (loading/gguf_header.py).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from localserve.loading.gguf_header import GGUFHeaderError, read_gguf_metadata

log = logging.getLogger(__name__)

DEFAULT_NAME = "default"
# llama.cpp's quantization names at the end of a file stem, after `.`, `-` or `_`: Q4_1, Q4_K_M, IQ4_XS,
# TQ1_0, unsloth's UD-Q4_K_XL, and the float types.
QUANTIZATION_SUFFIX = re.compile(r"[._-]((?:UD-)?(?:[IT]?Q\d+(?:_[0-9A-Z]+)*|BF16|F16|F32|F64))$", re.IGNORECASE)
METADATA_KEYS = ("general.architecture", "general.name", "general.basename", "general.size_label")


class ModelCatalogError(ValueError):
    """Models that cannot be served together as given (refused at start); the message names the files."""


class UnknownModelError(LookupError):
    """A name no model answers to."""

    def __init__(self, name: str, served: Sequence[str]) -> None:
        super().__init__(name)
        self.name, self.served = name, tuple(served)


class AmbiguousModelError(LookupError):
    """A name several models answer to."""

    def __init__(self, name: str, paths: Sequence[str]) -> None:
        super().__init__(name)
        self.name, self.paths = name, tuple(paths)


@dataclass(frozen=True)
class ModelFiles:
    """One model as found on disk, before naming: where it is and what its files say about it."""

    path: Path | None  # a GGUF file or a model folder; None for a model handed over loaded (no files known)
    file_name: str  # the name that must be unique: the file or folder name, or the hub repo id asked for
    derived_names: tuple[str, ...]  # the other names it answers to, most telling first
    format: str | None = None  # "gguf" or "safetensors"
    size_bytes: int = 0  # of its weight files
    modified_s: float | None = None  # the weights' modification time (seconds since the epoch)
    architecture: str | None = None  # general.architecture of a GGUF, model_type of a config.json ("llama")
    parameter_size: str | None = None  # general.size_label ("135M")
    quantization: str | None = None  # the file name's suffix ("Q4_1")


@dataclass(frozen=True)
class ModelEntry:
    """A model the server can serve: its files, its id and every name it answers to (`default` aside)."""

    files: ModelFiles
    id: str
    names: tuple[str, ...]  # the id first


def quantization_suffix(stem: str) -> str | None:
    """The quantization named at the end of a file stem (`Q4_1` of `SmolLM2-135M-Instruct.Q4_1`), if any."""
    match = QUANTIZATION_SUFFIX.search(stem)
    return match.group(1) if match and match.start() > 0 else None


def find_model_paths(folder: Path) -> list[Path]:
    """The GGUF files and model folders (holding a config.json) directly in `folder`, by name."""
    if not folder.is_dir():
        raise ModelCatalogError(f"{folder}: no such folder (--models-dir)")
    found = [path for path in folder.iterdir() if not path.name.startswith(".")
             and ((path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").is_file()))]
    return sorted(found, key=lambda path: path.name.lower())


def read_model_files(path: Path, requested_as: str | None = None) -> ModelFiles:
    """What naming needs of the model at `path`; `requested_as`: the hub repo id it was downloaded for."""
    repo_names = (requested_as.rpartition("/")[2], requested_as) if requested_as else ()
    if path.is_file() and path.suffix == ".gguf":
        stem = path.stem
        quantization = quantization_suffix(stem)
        metadata = _gguf_metadata(path)
        names = (stem[:len(stem) - len(quantization) - 1] if quantization else stem, stem, *repo_names,
                 *(str(metadata[key]) for key in ("general.name", "general.basename") if key in metadata))
        stat = path.stat()
        return ModelFiles(path, path.name, _unique(names, path.name), "gguf", stat.st_size, stat.st_mtime,
                          _text(metadata.get("general.architecture")), _text(metadata.get("general.size_label")),
                          quantization)
    if path.is_dir() and (path / "config.json").is_file():
        weights = sorted(path.glob("*.safetensors"))
        size = sum(file.stat().st_size for file in weights)
        modified = max((file.stat().st_mtime for file in weights), default=None)
        # A hub snapshot's folder is named by its commit hash: the repo id names it instead.
        file_name = requested_as or path.name
        return ModelFiles(path, file_name, _unique(repo_names, file_name), "safetensors", size, modified,
                          _config_model_type(path / "config.json"))
    raise ModelCatalogError(f"{path}: not a model folder (with a config.json) or a .gguf file")


def _config_model_type(config_path: Path) -> str | None:
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):  # loading it will say what is wrong
        return None
    return _text(config.get("model_type")) if isinstance(config, dict) else None


def _gguf_metadata(path: Path) -> dict:
    try:
        return read_gguf_metadata(path, METADATA_KEYS)
    except GGUFHeaderError as exc:  # served by its file names; loading it will say what is wrong
        log.warning("%s; it answers to its file name only", exc)
        return {}


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _unique(names: Sequence[str], file_name: str) -> tuple[str, ...]:
    """`names` without blanks, repeats and the file name, in order."""
    kept: list[str] = []
    for name in names:
        name = name.strip()
        if name and name != file_name and name != DEFAULT_NAME and name not in kept:
            kept.append(name)
    return tuple(kept)


class ModelCatalog:
    """The models served, the names that find them, and which is the default."""

    def __init__(self, found: Sequence[ModelFiles], default_name: str | None = None,
                 alias: str | None = None) -> None:
        """Name the models in `found` (in order; the first is the default unless `default_name` names
        another); `alias` becomes the default model's id. Raises ModelCatalogError when two models share
        a file name, when `default_name` names no model or several, or when `alias` is another's name."""
        if not found:
            raise ModelCatalogError("no models to serve (the --models-dir folder holds no .gguf file and no "
                                    "model folder)")
        found = _without_repeats(found)
        by_file_name: dict[str, ModelFiles] = {}
        for files in found:
            if files.file_name in by_file_name:
                raise ModelCatalogError(f"two models are called {files.file_name!r}: "
                                        f"{by_file_name[files.file_name].path} and {files.path}; serve one of them")
            by_file_name[files.file_name] = files
        claims: dict[str, list[ModelFiles]] = {}
        for files in found:
            for name in files.derived_names:
                if name not in by_file_name:  # a file name belongs to its own model alone
                    claims.setdefault(name, []).append(files)
        self.ambiguous: dict[str, tuple[ModelFiles, ...]] = {
            name: tuple(owners) for name, owners in claims.items() if len(owners) > 1}
        for name, owners in self.ambiguous.items():
            log.warning("the name %r is ambiguous, it names none of %s: ask for a model by its file name",
                        name, " and ".join(str(files.path) for files in owners))
        self.entries: tuple[ModelEntry, ...] = tuple(self._entry(files, by_file_name) for files in found)
        self._by_name = {name: entry for entry in self.entries for name in entry.names}
        self.default = self._default(default_name) if default_name is not None else self.entries[0]
        if alias is not None:
            self._set_alias(alias)

    def _default(self, name: str) -> ModelEntry:
        try:
            return self.find(name)
        except UnknownModelError as exc:
            raise ModelCatalogError(f"--default-model {name!r} names no model; the models are "
                                    f"{', '.join(map(repr, exc.served))}") from None
        except AmbiguousModelError as exc:
            raise ModelCatalogError(f"--default-model {name!r} names several models: {', '.join(exc.paths)}; "
                                    "name one by its file name") from None

    def _entry(self, files: ModelFiles, by_file_name: dict[str, ModelFiles]) -> ModelEntry:
        derived = [name for name in files.derived_names if name not in self.ambiguous and name not in by_file_name]
        names = (*derived[:1], files.file_name, *derived[1:])  # `X` before `X.Q4_1.gguf`, when `X` is its own
        return ModelEntry(files, names[0], names)

    def _set_alias(self, alias: str) -> None:
        owner = self._by_name.get(alias)
        if owner is not None and owner is not self.default:
            raise ModelCatalogError(f"--alias {alias!r} is already a name of {owner.files.path}")
        default = self.default
        entry = ModelEntry(default.files, alias, (alias, *(name for name in default.names if name != alias)))
        self.entries = tuple(entry if item is default else item for item in self.entries)
        self._by_name = {name: item for item in self.entries for name in item.names}
        self.default = entry

    def find(self, name: str | None) -> ModelEntry:
        """The model `name` names (None and "default": the default model); raises UnknownModelError or
        AmbiguousModelError."""
        if name is None or name == DEFAULT_NAME:
            return self.default
        entry = self._by_name.get(name)
        if entry is not None:
            return entry
        if name in self.ambiguous:
            raise AmbiguousModelError(name, [str(files.path) for files in self.ambiguous[name]])
        raise UnknownModelError(name, [entry.id for entry in self.entries])


def _without_repeats(found: Sequence[ModelFiles]) -> list[ModelFiles]:
    """`found` without a model given twice (the same file by `-m` and in `--models-dir`, say)."""
    seen: set[Path] = set()
    kept = []
    for files in found:
        key = files.path.resolve() if files.path is not None else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        kept.append(files)
    return kept
