"""Pre-fault of real memfd mappings: residency is read back from /proc/self/smaps."""

from __future__ import annotations

import errno
import mmap
import re
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from offload.errors import OffloadError
from offload.region import prefault as pf
from offload.region.geometry import ByteRange
from offload.system import shm
from offload.system.nameless import create_memfds

MiB = 1 << 20
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def resident_bytes(address: int, size: int) -> int:
    """Rss of the VMAs inside [address, address + size): pages mapped in our page tables."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            header = _HEADER.match(line)
            if header:
                start, end = (int(x, 16) for x in header.groups())
                inside = start >= address and end <= address + size
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def all_pages_mapped(address: int, size: int) -> bool:
    """Whether every page of [address, address + size) is present in this process's page
    tables (/proc/self/pagemap bit 63), at page granularity unlike smaps' Rss per VMA."""
    page = mmap.PAGESIZE
    first, last = address // page, (address + size - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    return bool((entries >> np.uint64(63)).all())


@pytest.fixture
def mapping() -> Iterator[shm.Mapping]:
    """Two 2 MiB nameless segments mapped back to back."""
    lengths = [2 * MiB, 2 * MiB]
    fds = create_memfds("pf", lengths, 2)
    m = shm.Mapping(fds, lengths)
    shm.close_fds(fds)
    yield m
    m.close()


def pieces_of(m: shm.Mapping, threads: int = 2) -> list[ByteRange]:
    segments = [ByteRange(0, 2 * MiB), ByteRange(2 * MiB, 2 * MiB)]
    return pf.plan_pieces([ByteRange(0, m.size)], segments, threads, 4096)


def test_madvise_populates_every_page_from_threads(mapping: shm.Mapping) -> None:
    assert resident_bytes(mapping.address, mapping.size) == 0
    assert not all_pages_mapped(mapping.address + 4096, 8192)
    seen: list[ByteRange] = []
    reports: list[tuple[int, int]] = []
    result = pf.prefault(mapping.address, pieces_of(mapping), threads=2, on_piece=seen.append,
                         progress=lambda done, total, _s: reports.append((done, total)))
    assert result.bytes == mapping.size and not result.fallback
    assert resident_bytes(mapping.address, mapping.size) == mapping.size
    assert all_pages_mapped(mapping.address + 4096, 8192)
    assert sorted(seen) == sorted(pieces_of(mapping))
    assert reports[-1] == (mapping.size, mapping.size)


def test_large_regions_are_cut_into_short_pieces() -> None:
    # 24 GiB over 16 threads: 256 MiB pieces (and registration runs) made private start-up
    # 1.5-1.8x the floor on an H200 host; 32 MiB ones 0.94x
    GiB = 1 << 30
    pieces = pf.plan_pieces([ByteRange(0, 24 * GiB)],
                            [ByteRange(i * GiB, GiB) for i in range(24)], 16, 4096)
    assert max(p.length for p in pieces) <= 32 * MiB
    assert sum(p.length for p in pieces) == 24 * GiB


def test_pieces_alternate_between_segments() -> None:
    pieces = pf.plan_pieces([ByteRange(0, 8 * MiB)],
                            [ByteRange(0, 4 * MiB), ByteRange(4 * MiB, 4 * MiB)], 8, 4096)
    halves = [p.offset >= 4 * MiB for p in pieces]
    assert halves[:4] == [False, True, False, True]
    assert sum(p.length for p in pieces) == 8 * MiB


def test_einval_falls_back_to_touching_pages_and_keeps_data(mapping: shm.Mapping) -> None:
    calls: list[int] = []

    def old_kernel(address: int, length: int) -> int:
        calls.append(length)
        return errno.EINVAL

    # Data written through another mapping of the file must survive the touch (it rewrites
    # each page's first byte with its own value).
    mapping.tensor[:4096 * 3:4096].copy_(torch.tensor([5, 6, 7], dtype=torch.uint8))
    before = resident_bytes(mapping.address, mapping.size)
    result = pf.prefault(mapping.address, pieces_of(mapping), threads=2, populate=old_kernel)
    assert result.fallback and result.bytes == mapping.size
    assert before < mapping.size
    assert resident_bytes(mapping.address, mapping.size) == mapping.size
    assert mapping.tensor[:4096 * 3:4096].tolist() == [5, 6, 7]
    assert 1 <= len(calls) <= 2  # after the first EINVAL the kernel is not asked again


@pytest.mark.parametrize("err", ["ENOMEM", "EFAULT"])
def test_running_out_of_memory_while_populating_is_one_clear_error(
        mapping: shm.Mapping, err: str) -> None:
    """Private anonymous regions are not reserved: their pre-fault is where a host or cgroup
    without room shows, as ENOMEM (or EFAULT, a page that would SIGBUS)."""
    def no_room(address: int, length: int) -> int:
        return int(getattr(errno, err))

    with pytest.raises(OffloadError, match=rf"^pre-faulting 2.00 MiB at 0x[0-9a-f]+ ran out of "
                                           rf"memory \({err}\): .*; lower --cpu-bytes or free "
                                           "memory$"):
        pf.prefault(mapping.address, pieces_of(mapping), threads=2, populate=no_room)


def test_other_errors_propagate_with_their_errno(mapping: shm.Mapping) -> None:
    def broken(address: int, length: int) -> int:
        return errno.EPERM

    with pytest.raises(OSError) as info:
        pf.prefault(mapping.address, pieces_of(mapping), threads=2, populate=broken)
    assert info.value.errno == errno.EPERM


def test_progress_logger_reports_rate_and_eta(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    log = logging.getLogger("test.prefault")
    with caplog.at_level(logging.INFO, logger="test.prefault"):
        pf.progress_logger(log)(1 << 30, 4 << 30, 0.5)
    assert "1.00 GiB of 4.00 GiB, 2.00 GiB/s, ETA 1.5 s" in caplog.text
