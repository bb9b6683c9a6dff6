# SPDX-License-Identifier: Apache-2.0
"""A wheel install has every native path.

The wheel is built offline (``pip wheel --no-deps --no-build-isolation --no-index``, with the
venv's setuptools) from a copy of the project in tmp_path, so the checkout gets no ``build/``
directory, and installed with ``pip install --target`` into a fresh directory.  A Python whose
path puts that directory first then loads the issue library (``issue.c``), the job-check library
(``job_check.c``) and background set-up's pre-fault loop (``populate.c``) from the installed
package, building each into a fresh cache: a wheel without one of the C files would turn that
path off with a warning.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from offload.system import build_cache

ROOT = Path(__file__).resolve().parents[2]
PROJECT_FILES = ("setup.cfg", "pyproject.toml", "README.md")
PACKAGES = ("offload", "launch")

PROBE = """
import json, sys
import offload
from offload.system import build_cache
from offload.region import background
from offload.transfer import native, fast_check
print(json.dumps({
    "package": offload.__file__,
    "sources": [str(p) for p in build_cache.SOURCES.values() if p.exists()],
    "issue": native.library() is not None,
    "job_check": fast_check.checker_library() is not None,
    "populate": background.native_populator() is not None,
}))
"""



def can_build_wheels() -> bool:
    """setuptools >= 70.1 builds wheels itself; older ones need the ``wheel`` package."""
    return any(importlib.util.find_spec(m) is not None
               for m in ("setuptools.command.bdist_wheel", "wheel"))


pytestmark = [
    pytest.mark.skipif(build_cache.compiler() is None, reason="needs a C compiler"),
    pytest.mark.skipif(not can_build_wheels(),
                       reason="needs setuptools >= 70.1 or wheel in the venv "
                              "(scripts/setup_env.sh installs them)"),
]


def pip(*args: str, cwd: Path) -> None:
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PIP_NO_CACHE_DIR": "1"}
    proc = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def make_wheel(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    source.mkdir()
    for name in PROJECT_FILES:
        shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    out = tmp_path / "dist"
    pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(out),
        str(source), cwd=tmp_path)
    (wheel,) = out.glob("offload-*.whl")
    return wheel


def test_a_wheel_install_builds_every_native_library(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    package = build_cache.HERE.parent
    for source in build_cache.SOURCES.values():
        name = source.relative_to(package).as_posix()
        assert name in names, f"{name} missing from the wheel"
    site = tmp_path / "site"
    pip("install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel),
        cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(site), "OFFLOAD_CACHE_DIR": str(tmp_path / "cache"),
           "OFFLOAD_NATIVE": "1"}
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    assert probe["package"].startswith(str(site)), probe  # the installed copy, not the checkout
    assert len(probe["sources"]) == len(build_cache.SOURCES), probe
    assert probe["issue"] and probe["job_check"] and probe["populate"], proc.stderr[-2000:]
    assert "could not build" not in proc.stderr
    built = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").glob("*.so"))
    assert built == ["issue", "job_check", "populate"]
