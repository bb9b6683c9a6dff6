"""Reading the host's shmem huge-page mode and the hint the tier logs when memfd regions get
4 KiB pages."""

from __future__ import annotations

from pathlib import Path

import pytest

from offload.observe.report import memory_label
from offload.region.hugepages import SHMEM_ENABLED, shmem_huge_mode, small_page_hint

LINE = "always within_size advise never deny force"


@pytest.mark.parametrize("mode", LINE.split())
def test_the_bracketed_mode_is_read(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "shmem_enabled"
    path.write_text(LINE.replace(mode, f"[{mode}]") + "\n")
    assert shmem_huge_mode(path) == mode


def test_a_missing_or_odd_file_means_unknown(tmp_path: Path) -> None:
    assert shmem_huge_mode(tmp_path / "absent") is None
    (tmp_path / "odd").write_text("never\n")
    assert shmem_huge_mode(tmp_path / "odd") is None


@pytest.mark.parametrize(("mode", "hinted"), [
    ("never", True), ("advise", True), ("deny", True),  # fallocate gets 4 KiB pages
    ("always", False), ("within_size", False), ("force", False), (None, False)])
def test_the_hint_names_the_mode_and_the_fix_only_where_pages_are_small(
        mode: str | None, hinted: bool) -> None:
    hint = small_page_hint(mode)
    assert (hint is not None) == hinted
    if hint:
        assert f"shmem_enabled={mode}" in hint and f"echo within_size > {SHMEM_ENABLED}" in hint
        assert "\n" not in hint


def test_this_host_reports_a_known_mode_or_none() -> None:
    assert shmem_huge_mode() in {*LINE.split(), None}


def test_the_table_labels_memfd_regions_with_the_mode() -> None:
    assert memory_label({"memory": "memfd", "shmem_huge": "never"}) == "memfd/never"
    assert memory_label({"memory": "memfd", "shmem_huge": None}) == "memfd"
    assert memory_label({"memory": "anonymous", "shmem_huge": None}) == "anonymous"
