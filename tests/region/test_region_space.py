"""Space checks made before any region memory is created: real directories, real meminfo."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest

from offload.config import TierConfig
from offload.errors import OffloadError
from offload.region import space
from offload.system import paths
from offload.system.nameless import create_memfds
from tests.other_user import NOBODY, as_root

MiB = 1 << 20


def test_a_tmpfs_shm_dir_is_accepted(shm_dir: str) -> None:
    paths.check_shm_dir(shm_dir)
    assert TierConfig(cpu_bytes_per_node=MiB, shm_dir=shm_dir).shm_dir == shm_dir


def test_nameless_is_the_default() -> None:
    assert TierConfig(cpu_bytes_per_node=MiB).shm_dir is None


@pytest.mark.parametrize("problem", ["missing", "file", "disk"])
def test_an_unusable_shm_dir_is_one_clear_line(tmp_path: Path, problem: str) -> None:
    if problem == "disk" and paths.filesystem_magic(str(tmp_path)) in paths.MEMORY_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is memory-backed on this host")
    path = {"missing": tmp_path / "nope", "file": tmp_path / "f", "disk": tmp_path}[problem]
    if problem == "file":
        path.write_text("")
    expected = {"missing": "does not exist", "file": "is not a directory",
                "disk": "filesystem, not a memory-backed one (tmpfs, hugetlbfs, ramfs)"}[problem]
    with pytest.raises(OffloadError) as info:
        TierConfig(cpu_bytes_per_node=MiB, shm_dir=str(path))
    message = str(info.value)
    assert message.startswith(f"shm_dir (--shm-dir) {path} ") and expected in message
    assert "leave it unset for nameless regions" in message and "\n" not in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to a mode 0500 directory")
def test_a_read_only_shm_dir_is_refused(shm_dir: str) -> None:
    os.chmod(shm_dir, 0o500)
    try:
        with pytest.raises(OffloadError, match="is not writable by uid"):
            paths.check_shm_dir(shm_dir)
    finally:
        os.chmod(shm_dir, 0o700)


def test_a_shm_dir_where_others_may_rename_our_files_is_refused(shm_dir: str) -> None:
    """Others who may rename entries could swap a region's segments before the peers open
    them: a directory others can write must be sticky (as /dev/shm is)."""
    os.chmod(shm_dir, 0o777)
    try:
        with pytest.raises(OffloadError) as info:
            TierConfig(cpu_bytes_per_node=MiB, shm_dir=shm_dir)
        message = str(info.value)
        assert message.startswith(f"shm_dir (--shm-dir) {shm_dir} is writable by other users "
                                  "and not sticky (mode 777)")
        assert f"run chmod +t {shm_dir}" in message and "\n" not in message
        mine = os.path.join(shm_dir, "offload")
        assert f"mkdir -m 700 {mine}" in message
        os.mkdir(mine, 0o700)  # the fix it names, where chmod is not allowed
        TierConfig(cpu_bytes_per_node=MiB, shm_dir=mine)
        os.rmdir(mine)
        os.chmod(shm_dir, 0o1777)
        TierConfig(cpu_bytes_per_node=MiB, shm_dir=shm_dir)  # sticky: only owners rename
        TierConfig(cpu_bytes_per_node=MiB, shm_dir="/dev/shm")
    finally:
        os.chmod(shm_dir, 0o700)


@as_root
def test_a_shm_dir_of_another_user_is_refused(shm_dir: str) -> None:
    """The owner of the directory may rename anything in it, sticky or not."""
    os.chown(shm_dir, NOBODY, -1)
    try:
        with pytest.raises(OffloadError, match=f"{shm_dir} belongs to uid {NOBODY}, who may "
                                               "rename or replace the tier's files in it"):
            TierConfig(cpu_bytes_per_node=MiB, shm_dir=shm_dir)
    finally:
        os.chown(shm_dir, os.geteuid(), -1)


def test_more_than_available_memory_names_needed_available_and_the_fix() -> None:
    available, bound = space.available_memory()
    with pytest.raises(OffloadError) as info:
        space.check_space(None, 2 * available + 4096)
    message = str(info.value)
    assert message.startswith(f"the node's regions need {2 * available + 4096} B")
    assert f"of memory is available ({bound}); lower --cpu-bytes or free memory" in message
    assert "`python -m offload.keep list`" in message  # memory a kept tier may hold
    space.check_space(None, MiB)  # what fits passes


def test_a_full_shm_dir_is_checked_before_memory(shm_dir: str) -> None:
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize  # (parallel tests change it: the message has its own)
    with pytest.raises(OffloadError) as info:
        space.check_space(shm_dir, free + 1024 * MiB)
    said = re.fullmatch(f"{shm_dir} has (\\d+) B \\(.*\\) free but the node's regions need "
                        f"{free + 1024 * MiB} B .*; lower --cpu-bytes or enlarge the mount",
                        str(info.value))
    assert said is not None, str(info.value)
    assert abs(int(said.group(1)) - free) < 1024 * MiB


def test_available_memory_is_at_most_meminfo() -> None:
    available, _ = space.available_memory()
    assert 0 < available <= space.meminfo()["MemAvailable"]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_the_tightest_enclosing_cgroup_limit_counts_reclaimable_cache(tmp_path: Path,
                                                                      version: str) -> None:
    """A cgroup tree as the kernel lays it out: the job's cgroup has no limit, its parent
    allows 10 GiB and uses 9 GiB of which 3 GiB is file cache (reclaimable): 4 GiB of room."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    GiB = 1 << 30
    if version == "v2":
        _write(proc, "0::/jobs/job1\n")
        base = root
        files = ("memory.max", "memory.current", "active_file", "inactive_file")
        unlimited = "max"
    else:
        _write(proc, "5:memory:/jobs/job1\n3:cpu,cpuacct:/jobs/job1\n")
        base = root / "memory"
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_active_file",
                 "total_inactive_file")
        unlimited = str(9223372036854771712)
    limit, usage, active, inactive = files
    _write(base / "jobs" / "job1" / limit, unlimited)
    _write(base / "jobs" / "job1" / usage, str(GiB))
    _write(base / "jobs" / limit, str(10 * GiB))
    _write(base / "jobs" / usage, str(9 * GiB))
    _write(base / "jobs" / "memory.stat", f"{active} {GiB}\n{inactive} {2 * GiB}\nshmem 5\n")
    rooms = list(space._cgroup_rooms(str(proc), str(root)))
    assert rooms == [(4 * GiB, str(base / "jobs"))]


def test_a_cgroup_namespace_walks_up_from_the_deepest_visible_directory(tmp_path: Path) -> None:
    """Inside a cgroup namespace /proc/self/cgroup names a path the mount does not show."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    _write(proc, "0::/outer/inner\n")
    _write(root / "memory.max", str(8 * MiB))
    _write(root / "memory.current", str(3 * MiB))
    assert list(space._cgroup_rooms(str(proc), str(root))) == [(5 * MiB, str(root))]


def test_out_of_memory_at_reservation_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cgroup that runs out while memfds are reserved answers ENOMEM (injected here)."""
    def no_memory(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(os, "posix_fallocate", no_memory)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OffloadError, match="reserving 1048576 B .*Cannot allocate memory; "
                                           "lower --cpu-bytes, free memory"):
        create_memfds("enomem", [MiB, MiB], 2)
    assert set(os.listdir("/proc/self/fd")) <= before  # every memfd closed, so freed


@pytest.mark.parametrize(("setting", "strict"), [("2\n", True), ("0\n", False), ("1\n", False),
                                                 (None, False)])
def test_strict_overcommit_reads_the_hosts_setting(tmp_path: Path, setting: str | None,
                                                   strict: bool) -> None:
    """Mode 2 (never overcommit) makes set-up reserve node memfds in `create`; a missing file
    (not Linux) is no strict host."""
    path = tmp_path / "overcommit_memory"
    if setting is not None:
        path.write_text(setting)
    assert space.strict_overcommit(str(path)) is strict
