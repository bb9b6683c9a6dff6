"""shm segment files and their contiguous mapping: real files in /dev/shm, real mmap."""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Iterator

import pytest
import torch

from offload.errors import OffloadError
from offload.observe.report import count_shm_files
from offload.system import shm
from offload.system.shm import segment_paths
from tests.harness import shm_entries
from tests.other_user import NOBODY

MiB = 1 << 20
SHM = "/dev/shm"


@pytest.fixture
def paths() -> Iterator[list[str]]:
    """Three segment paths of a fresh job; afterwards no new entry of that job may remain in
    /dev/shm (tests remove what they planted themselves)."""
    before = shm_entries(SHM)
    job_id = uuid.uuid4().hex[:12]
    found = shm.segment_paths(SHM, job_id, "t", 3)
    yield found
    assert {n for n in shm_entries(SHM) - before if job_id in n} == set()


def test_multi_segment_mapping_is_contiguous_and_backed_by_the_files(paths: list[str]) -> None:
    lengths = [1 * MiB, 2 * MiB, 1 * MiB]
    fds = shm.create_segments(paths, lengths, threads=2)
    try:
        for p in paths:
            assert os.stat(p).st_mode & 0o777 == 0o600
        mapping = shm.Mapping(fds, lengths)
        pattern = (torch.arange(sum(lengths), dtype=torch.int64) % 251).to(torch.uint8)
        mapping.tensor.copy_(pattern)
        offset = 0
        for fd, length in zip(fds, lengths, strict=True):
            raw = os.pread(fd, length, 0)
            assert raw == pattern[offset:offset + length].numpy().tobytes()
            offset += length
        mapping.close()
        mapping.close()  # idempotent
        assert mapping.size == 0
    finally:
        shm.close_fds(fds)
        for p in paths:
            shm.unlink_quiet(p)


def test_write_across_a_seam_reads_back_through_both_files(paths: list[str]) -> None:
    lengths = [1 * MiB, 1 * MiB]
    fds = shm.create_segments(paths[:2], lengths, unlink=True)
    assert not any(os.path.lexists(p) for p in paths)  # unlinked at once
    try:
        mapping = shm.Mapping(fds, lengths)
        seam = lengths[0]
        data = torch.arange(1, 201, dtype=torch.uint8)
        mapping.tensor[seam - 100:seam + 100].copy_(data)
        assert os.pread(fds[0], 100, seam - 100) == data[:100].numpy().tobytes()
        assert os.pread(fds[1], 100, 0) == data[100:].numpy().tobytes()
        assert torch.equal(mapping.tensor[seam - 100:seam + 100], data)
        mapping.close()
    finally:
        shm.close_fds(fds)


def test_existing_path_or_symlink_is_refused_at_creation(paths: list[str]) -> None:
    os.symlink("/tmp/elsewhere", paths[1])
    with pytest.raises(OffloadError, match="is already a symbolic link") as info:
        shm.create_segments(paths, [MiB] * 3)
    assert paths[1] in str(info.value) and "\n" not in str(info.value)
    assert not os.path.lexists(paths[0])  # what was created before the refusal is removed
    assert os.path.islink(paths[1])  # and the planted link is left alone
    os.unlink(paths[1])


@pytest.mark.parametrize("problem", ["symlink", "foreign-owner", "mode", "size", "missing"])
def test_joiner_refuses_what_is_not_our_file(paths: list[str], problem: str) -> None:
    path = paths[0]
    if problem == "symlink":
        os.symlink("/tmp/elsewhere", path)
    elif problem != "missing":
        with open(path, "wb") as f:
            f.truncate(MiB)
        os.chmod(path, 0o644 if problem == "mode" else 0o600)
        if problem == "foreign-owner":
            if os.geteuid() != 0:
                pytest.skip("chown to another user needs root")
            os.chown(path, 65534, 65534)
    expected = {"symlink": "symbolic link", "foreign-owner": "owned by uid 65534",
                "mode": "mode 0644", "size": "expected 2097152", "missing": "does not exist"}
    with pytest.raises(OffloadError, match=expected[problem]) as info:
        shm.open_segment(path, 2 * MiB if problem == "size" else MiB)
    assert path in str(info.value) and "\n" not in str(info.value)
    shm.unlink_if_ours(path)
    planted_and_kept = problem in ("symlink", "foreign-owner", "mode")
    assert os.path.lexists(path) == planted_and_kept
    if planted_and_kept:
        os.unlink(path)


def test_enospc_at_reservation_is_the_same_clear_error(paths: list[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OffloadError, match="reserving 1048576 B .* No space left on device; "
                                           "lower --cpu-bytes, free memory or enlarge the mount"):
        shm.create_segments(paths, [MiB] * 3)
    assert not any(os.path.lexists(p) for p in paths)


def test_tier_id_must_be_a_plain_name() -> None:
    with pytest.raises(OffloadError, match="tier id"):
        shm.segment_paths(SHM, "../etc", "t", 1)
    assert shm.segment_paths(SHM, "j1", "r0", 2) == [f"{SHM}/offload-j1-r0-s0",
                                                      f"{SHM}/offload-j1-r0-s1"]


def test_files_left_count_only_this_users_segments_of_the_tier(shm_dir: str) -> None:
    """The main job fails when its tier left files; a name another user planted with the tier
    id in it (the id is no secret) must not make it fail."""
    tier_id = "0123456789abcdef"
    ours = segment_paths(shm_dir, tier_id, "L0", 1)[0]
    planted = [os.path.join(shm_dir, f"x-{tier_id}"), os.path.join(shm_dir, f"offload-{tier_id}")]
    try:
        for path in [ours, *planted]:
            open(path, "w").close()
        assert count_shm_files(shm_dir, tier_id) == 1
        if os.geteuid() == 0:  # a segment name, but another user's file
            os.chown(ours, NOBODY, -1)
            assert count_shm_files(shm_dir, tier_id) == 0
    finally:
        for path in [ours, *planted]:
            os.unlink(path)
    assert count_shm_files(shm_dir, tier_id) == 0
