"""The wheel carries the web page: every file under localserve/server/web/ is package data, so an
installed server (not only a checkout) answers `/`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WEB = ROOT / "localserve" / "server" / "web"


SOURCES = ("pyproject.toml", "README.md", "localserve", "kernels", "models", "tui")


def test_the_built_wheel_holds_every_file_of_the_page(tmp_path):
    source = tmp_path / "source"  # a copy: setuptools writes build/ beside the sources, and a stale one would pass
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(tmp_path / "wheels"), str(source)], check=True, timeout=300)
    (wheel,) = (tmp_path / "wheels").glob("localserve-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name.removeprefix("localserve/server/web/"): archive.read(name)
                   for name in archive.namelist() if name.startswith("localserve/server/web/")}
    on_disk = {str(path.relative_to(WEB)): path.read_bytes() for path in WEB.rglob("*") if path.is_file()}
    assert "index.html" in on_disk and "vendor/dompurify/LICENSE" in on_disk and len(on_disk) > 30
    assert shipped == on_disk
