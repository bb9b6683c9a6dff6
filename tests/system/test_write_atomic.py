# SPDX-License-Identifier: Apache-2.0
"""Files the package writes (`offload.system.paths.write_atomic`, behind the JSON report, the
timeline and the build caches) never follow a link planted in their directory.

The scenario: the report goes to a directory other users can write.  One of them plants a
symlink at the report's temporary name, or at the report's own name, pointing to a file of ours.
Writing the report must leave that file as it was, and leave the report a regular file of ours
and nothing else behind."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from offload.errors import OffloadError
from offload.observe.report import write_json
from offload.system.paths import write_atomic
from tests.other_user import NOBODY, other_process

PRECIOUS = b"a file of ours the writer must not touch\n"


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may write, not sticky (mode 777): a Kubernetes emptyDir, a
    group's scratch space."""
    path = Path(tempfile.mkdtemp(prefix="pytest-write-atomic-", dir="/tmp"))
    os.chmod(path, 0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _plant(link: Path, target: Path, planter: str) -> None:
    """``link`` -> ``target``, made by this user or by another one (uid 65534)."""
    if planter == "this user":
        link.symlink_to(target)
        return
    if os.geteuid() != 0:
        pytest.skip("needs root to plant the link as another user (uid 65534)")

    def action(pipe: int) -> None:
        os.symlink(target, link)
        os.write(pipe, b"k")

    with other_process(action) as child:
        assert child.read() == b"k"
    assert link.lstat().st_uid == NOBODY


def _write_report(path: Path) -> None:
    write_json(str(path), {"verified": True})


def _write_timeline(path: Path) -> None:
    pytest.importorskip("matplotlib")
    from offload.observe.timeline import draw_timeline

    draw_timeline([{"rank": 0, "node_id": "n0", "timings_s": {"plan": 0.1}}], str(path))


WRITERS: dict[str, Callable[[Path], None]] = {"report": _write_report,
                                              "timeline": _write_timeline}


@pytest.mark.parametrize("planter", ["this user", "another user"])
@pytest.mark.parametrize("where", ["temporary name", "own name"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_planted_link_is_replaced_never_followed(shared_dir: Path, tmp_path: Path,
                                                   writer: str, where: str,
                                                   planter: str) -> None:
    """The report used to be written through ``<path>.tmp`` with a plain ``open``, the
    timeline straight to ``path``: a link planted there made the job overwrite our file."""
    victim = tmp_path / "precious"
    victim.write_bytes(PRECIOUS)
    path = shared_dir / ("report.json" if writer == "report" else "timeline.png")
    _plant(Path(f"{path}.tmp") if where == "temporary name" else path, victim, planter)
    WRITERS[writer](path)
    assert victim.read_bytes() == PRECIOUS
    st = path.lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) == 0o600
    if writer == "report":
        assert json.loads(path.read_text()) == {"verified": True}
    left = sorted(p.name for p in shared_dir.iterdir())
    expected = [path.name] + ([f"{path.name}.tmp"] if where == "temporary name" else [])
    assert left == sorted(expected)  # the planted link stays; no temporary file of ours


def test_a_report_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(OffloadError, match=r"^--report-json .*/missing/report.json cannot be "
                                           r"written \(No such file or directory\); pass a "
                                           "path in a directory you can write$"):
        write_json(str(tmp_path / "missing" / "report.json"), {})


def test_a_write_replaces_the_old_file_whole_and_relative_to_a_directory(tmp_path: Path
                                                                          ) -> None:
    path = tmp_path / "f"
    write_atomic(str(path), "old")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        write_atomic("f", b"new", dir_fd=fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["f"]
