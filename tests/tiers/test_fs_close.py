# SPDX-License-Identifier: Apache-2.0
"""Closing a tier while a file-tier read is stalled: the read still writes into its host row
when it returns, so the region must stay mapped until then (a close that unmapped it would let
the late read write into freed address space).  One real rank, the read stalled through the
tier's I/O seam (`FileIO`)."""

from __future__ import annotations

from tests.harness import run_group

KiB = 1 << 10
BPC, PAGE = 2, 4 * KiB
IO_TIMEOUT = 0.5


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        return any(int(line.split("-", 1)[0], 16) <= address
                   < int(line.split("-", 1)[1].split()[0], 16) for line in f)


def _stall_reads(gate) -> None:  # type: ignore[no-untyped-def]
    """From now on every file-tier read of this process waits for ``gate`` (at most 30 s)."""
    from offload.tiers.fs_io import FileIO

    plain_read = FileIO.preadv

    def stalled_read(self, fd, buffers, offset):  # type: ignore[no-untyped-def]
        gate.wait(30)
        return plain_read(self, fd, buffers, offset)

    FileIO.preadv = stalled_read  # type: ignore[method-assign]


def _store_three(tier) -> None:  # type: ignore[no-untyped-def]
    """Store keys 0, 1 and 2 one job each; with two chunks to hand, the third spills key 0."""
    from offload import CopyJob

    manager = tier.manager
    for key in range(3):
        job = manager.prepare_store([key])
        blocks = [key * BPC + p for p in range(BPC)]
        for _, chunk in job.chunks:
            tier.submit(CopyJob(job.job_id, "store", blocks, [chunk] * BPC, list(range(BPC)),
                                spills=job.spills))
        tier.wait([job.job_id])
        manager.complete_store(job.job_id, ok=True)


def _close_while_a_read_stalls(rank: int, fs_dir: str) -> object:
    import threading
    import time

    import torch

    from offload import HostTier
    from offload.config import TierConfig

    gate = threading.Event()
    kv = [torch.randint(0, 256, (3 * BPC, PAGE), dtype=torch.uint8)]
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=2 * BPC * PAGE + 2 * 4096,
                                          blocks_per_chunk=BPC, timeout_s=10, fs_dir=fs_dir,
                                          fs_namespace="test-model", fs_bytes=1 << 20,
                                          fs_io_timeout_s=IO_TIMEOUT))
    manager = tier.manager
    _store_three(tier)  # two host chunks: the third store spills key 0 to disk
    _stall_reads(gate)
    missed = tier.collective_promote(manager.prepare_promote([0]))
    address = tier.actor.region.address
    began = time.monotonic()
    tier.close()
    closed_s = time.monotonic() - began
    closer = [t for t in threading.enumerate() if t.name == "offload-region-closer"]
    kept_while_stalled = _mapped(address)
    gate.set()
    for t in closer:
        t.join(10)
    return missed, closed_s, len(closer), kept_while_stalled, _mapped(address)


def test_a_region_outlives_a_read_still_stalled_at_close(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = run_group(_close_while_a_read_stalls, 1, args=(str(tmp_path),), timeout=90)
    assert out[0].ok, out[0].error
    missed, closed_s, closers, kept, after = out[0].value
    assert missed == [0]  # the stalled read is a miss at the deadline
    assert closed_s < 5 * IO_TIMEOUT + 2  # close does not wait for the stall
    assert closers == 1 and kept  # the region stays mapped while the read may still write
    assert not after  # and is unmapped once it returned


def _close_during_set_up_while_a_read_stalls(rank: int, fs_dir: str) -> object:
    """The same stalled read, on a tier still being set up in the background: close hands the
    region to the closer thread, and set-up stops there and then -- no row is registered
    after close."""
    import threading
    import time

    import torch

    import offload.region.host_region as host_region
    from offload import HostTier
    from offload.config import TierConfig
    from offload.region.pin import RecordingRegistrar

    class SlowAfterTwo(RecordingRegistrar):  # two rows at once, then one a second
        def register(self, address: int, length: int) -> None:
            if self.calls >= 2:
                time.sleep(1.0)
            super().register(address, length)

    host_region.UNIT_BYTES = 1  # one row per unit
    registrar = SlowAfterTwo()
    gate = threading.Event()
    kv = [torch.randint(0, 256, (3 * BPC, PAGE), dtype=torch.uint8)]
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=16 * (BPC * PAGE + 4096),
                                          blocks_per_chunk=BPC, timeout_s=10, fs_dir=fs_dir,
                                          fs_namespace="test-model", fs_bytes=1 << 20,
                                          fs_io_timeout_s=IO_TIMEOUT,
                                          background=True),
                           registrar_factory=lambda device: registrar)
    tier.wait_ready(10, rows=2)
    manager = tier.manager
    _store_three(tier)  # two ready chunks: the third store spills key 0 to disk
    _stall_reads(gate)
    missed = tier.collective_promote(manager.prepare_promote([0]))
    tier.close()
    calls = registrar.calls
    time.sleep(2.5)  # long enough for two more rows, were set-up still running
    alive = [t.name for t in threading.enumerate() if t.name.startswith("offload-bg")]
    later = registrar.calls
    gate.set()
    for t in threading.enumerate():
        if t.name == "offload-region-closer":
            t.join(10)
    return missed, calls < tier.plan.chunk_count, later - calls, alive


def test_close_stops_background_set_up_even_while_a_read_stalls(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = run_group(_close_during_set_up_while_a_read_stalls, 1, args=(str(tmp_path),),
                    timeout=90)
    assert out[0].ok, out[0].error
    missed, unfinished, registered_after, alive = out[0].value
    assert missed == [0] and unfinished  # closed mid set-up, with the read stalled
    assert registered_after == 0 and alive == []
