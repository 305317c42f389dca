"""No folder of the repository stands in for an installed distribution, in the test process or in the
Pythons it starts: `kernels/` (the Triton kernels, installed as localserve.kernels) once hid Hugging Face's
`kernels`, which transformers imports, and failed every test that built a reference model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
ENVIRONMENT = Path(sys.prefix).resolve()  # the virtual environment, which `make` puts inside the repository
# Where each name resolves on this process's sys.path, as a first `import NAME` would look (sys.modules
# aside). Run here and, as a script, in child processes.
FIND_LOCATIONS = """
import importlib.machinery, json, sys

def locations(names):
    found = {}
    for name in names:
        spec = importlib.machinery.PathFinder.find_spec(name, sys.path)
        found[name] = None if spec is None else (spec.origin or list(spec.submodule_search_locations or []))
    return found

if __name__ == "__main__":
    print(json.dumps(locations(json.loads(sys.argv[1]))))
"""
_namespace: dict = {"__name__": "find_locations"}
exec(FIND_LOCATIONS, _namespace)
locations = _namespace["locations"]


def top_level_folders() -> list[str]:
    """Every top-level folder an import could take for a package, `__init__.py` or not (namespace
    packages), but `localserve` itself."""
    return sorted(path.name for path in REPOSITORY.iterdir() if path.is_dir() and path.name.isidentifier()
                  and not path.name.startswith(".") and path.name != "localserve")


def in_repository(found: dict[str, str | list[str] | None]) -> dict[str, str | list[str] | None]:
    """The names among `found` whose location is a folder of the repository (its .venv aside)."""
    def inside(location: str | list[str] | None) -> bool:
        places = [Path(place).resolve() for place in ([location] if isinstance(location, str) else location or [])]
        return any(place.is_relative_to(REPOSITORY) and not place.is_relative_to(ENVIRONMENT) for place in places)

    return {name: location for name, location in found.items() if inside(location)}


def test_the_folders_checked_include_those_installed_under_other_names():
    assert {"kernels", "models", "tui", "scripts", "tests"} <= set(top_level_folders())


def test_no_top_level_folder_resolves_into_the_repository_in_the_test_process():
    assert in_repository(locations(top_level_folders())) == {}


def test_every_module_loaded_from_the_repository_is_localserve_or_the_tests():
    # a module called `kernels` (or `models`, `tui`) with its file in the repository is the shadowing itself
    loaded = {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())}
    strays = in_repository({name: file for name, file in loaded.items()
                            if file and Path(file).is_absolute()  # torch.ops' __file__ is '_ops.py'
                            and name.split(".")[0] not in ("localserve", "tests")})
    assert strays == {}


def test_hugging_face_kernels_is_the_installed_distribution():
    try:
        distribution = metadata.distribution("kernels")
    except metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed (transformers before 5.x did not need it)")
    import kernels

    assert Path(kernels.__file__).resolve().is_relative_to(Path(distribution.locate_file("")).resolve())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH arrived in Python 3.11")
@pytest.mark.parametrize("how", ["-c", "-m"])
def test_child_pythons_started_in_the_repository_root_do_not_see_its_folders(how, tmp_path):
    # the tests start `python -m localserve.cli ...` and `python -c ...` with the root as their folder
    names = json.dumps(top_level_folders())
    if how == "-c":
        command, environment = [sys.executable, "-c", FIND_LOCATIONS, names], None
    else:
        (tmp_path / "find_locations.py").write_text(FIND_LOCATIONS)
        command = [sys.executable, "-m", "find_locations", names]
        environment = dict(os.environ, PYTHONPATH=str(tmp_path))
    result = subprocess.run(command, cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert in_repository(json.loads(result.stdout)) == {}
