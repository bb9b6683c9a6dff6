"""The file tier under the SPMD API: rank 0's chunk manager decides (stores that spill, a
promotion), the decision travels as the engine's step broadcast would carry it, and every rank
runs it (`submit` with the store's spills, `collective_promote`); the promoted key loads back
byte-exact, and a damaged file is a miss on every rank alike."""

from __future__ import annotations

import pathlib

import pytest

from offload.config import TierConfig
from tests.harness import run_group

KiB = 1 << 10
BPC = 4  # blocks per chunk
PAGE = 4 * KiB


def spmd_promote_body(rank: int, layout: str, fs_dir: str, damage: bool,
                      broken_rank: int | None = None) -> object:
    import glob
    import os

    import torch
    import torch.distributed as dist

    import offload.fs_actions
    from offload import CopyJob, HostTier, OffloadError

    if rank == broken_rank:
        def broken(*args: object) -> None:
            raise OSError("the disk went away")

        offload.fs_actions.promote = broken  # type: ignore[assignment]

    gen = torch.Generator().manual_seed(100 + rank)
    kv = [torch.randint(0, 256, (3 * BPC, PAGE), generator=gen, dtype=torch.uint8)]
    original = kv[0].clone()
    # room for two chunks in host memory, the rest on disk
    row = 2 * BPC * PAGE  # both ranks' slots (private: one region each, same total)
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=2 * row, layout=layout,
                                          blocks_per_chunk=BPC, tp=2, timeout_s=30,
                                          fs_dir=fs_dir, fs_namespace="test-model",
                                          fs_bytes=8 * row))
    manager = tier.manager

    def decided(make: object) -> object:  # rank 0 decides, everyone gets the decision
        box = [make() if rank == 0 else None]  # type: ignore[operator]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def copy(job_id: int, direction: str, pairs: object, spills: object = ()) -> None:
        blocks, chunks, positions = [], [], []
        for key, chunk in pairs:  # type: ignore[attr-defined]
            blocks += [key * BPC + p for p in range(BPC)]
            chunks += [chunk] * BPC
            positions += list(range(BPC))
        tier.submit(CopyJob(job_id, direction, blocks, chunks, positions,  # type: ignore[arg-type]
                            spills=tuple(spills)))  # type: ignore[arg-type]
        tier.wait([job_id])

    for key in range(3):  # the third store evicts key 0, which is spilled on the way
        job = decided(lambda k=key: manager.prepare_store([k]))  # type: ignore[union-attr]
        copy(job.job_id, "store", job.chunks, job.spills)  # type: ignore[attr-defined]
        if rank == 0:
            manager.complete_store(job.job_id, ok=True)  # type: ignore[union-attr]
    on_disk = decided(lambda: manager.residence(0))  # type: ignore[union-attr]
    files = tier.actor.files
    if damage and files is not None and files.tier is not None:
        files.tier.flush()  # the spill is written (and renamed into place) before it is damaged
    dist.barrier()
    if damage and tier.topology.is_leader:
        for path in glob.glob(os.path.join(fs_dir, "**", "*"), recursive=True):
            if os.path.isfile(path) and not path.endswith(".lock"):
                with open(path, "r+b") as f:  # flip a byte past any header
                    f.seek(os.path.getsize(path) - 1)
                    last = f.read(1)
                    f.seek(-1, os.SEEK_END)
                    f.write(bytes([last[0] ^ 0xFF]))
    dist.barrier()
    kv[0].zero_()
    promotion = decided(lambda: manager.prepare_promote([0]))  # type: ignore[union-attr]
    try:
        failed = tier.collective_promote(promotion)  # type: ignore[arg-type]
    except OffloadError as exc:
        error = str(exc)
        gone = decided(lambda: manager.residence(0))  # type: ignore[union-attr]
        tier.close()
        return error, gone
    after = decided(lambda: manager.residence(0))  # type: ignore[union-attr]
    restored = None
    if not failed:
        load = decided(lambda: manager.prepare_load([0]))  # type: ignore[union-attr]
        copy(load.job_id, "load", load.chunks)  # type: ignore[attr-defined]
        if rank == 0:
            manager.complete_load(load.job_id)  # type: ignore[union-attr]
        restored = torch.equal(kv[0][:BPC], original[:BPC])
    tier.close()
    return on_disk, failed, after, restored


@pytest.mark.parametrize("layout", ["private", "shared"])
def test_spmd_ranks_promote_a_spilled_key_and_load_it_back(layout: str,
                                                           tmp_path: pathlib.Path) -> None:
    out = run_group(spmd_promote_body, 2, args=(layout, str(tmp_path), False))
    assert all(o.ok for o in out), [o.error for o in out]
    assert [o.value for o in out] == [("disk", [], "both", True)] * 2


def test_a_damaged_file_is_the_same_miss_on_every_rank(tmp_path: pathlib.Path) -> None:
    out = run_group(spmd_promote_body, 2, args=("private", str(tmp_path), True))
    assert all(o.ok for o in out), [o.error for o in out]
    assert [o.value for o in out] == [("disk", [0], None, None)] * 2


def test_a_rank_whose_promotion_raised_fails_it_on_every_rank(tmp_path: pathlib.Path) -> None:
    out = run_group(spmd_promote_body, 2, args=("private", str(tmp_path), False, 1))
    assert all(o.ok for o in out), [o.error for o in out]
    message = "promotion 3 failed on rank 1: OSError: the disk went away"
    assert [o.value for o in out] == [(message, None)] * 2  # the key is a miss everywhere
