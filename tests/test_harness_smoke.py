from tests.harness import run_group


def test_group_runs_and_reports_errors() -> None:
    def body(rank: int) -> int:
        import torch
        import torch.distributed as dist

        t = torch.tensor([rank + 1])
        dist.all_reduce(t)
        if rank == 1:
            raise ValueError("boom on one")
        return int(t.item())

    out = run_group(body, 2)
    assert out[0].ok and out[0].value == 3
    assert not out[1].ok and "boom on one" in (out[1].error or "")


def test_shm_dirs_of_dead_test_processes_are_removed_and_live_ones_kept() -> None:
    """A test process killed before the ``shm_dir`` fixture's teardown leaves its directory;
    the next ``shm_dir`` removes it, and never one whose creator still runs."""
    import os
    import subprocess
    import sys

    from tests.conftest import SHM_PREFIX, remove_orphaned_shm_dirs

    make = (f"import os, tempfile; print(tempfile.mkdtemp(prefix='{SHM_PREFIX}' + "
            "str(os.getpid()) + '-', dir='/dev/shm'))")
    orphan = subprocess.run([sys.executable, "-c", make], capture_output=True, text=True,
                            check=True).stdout.strip()
    live = f"/dev/shm/{SHM_PREFIX}{os.getpid()}-live"
    os.mkdir(live)
    try:
        assert os.path.isdir(orphan)
        remove_orphaned_shm_dirs()
        assert not os.path.exists(orphan) and os.path.isdir(live)
    finally:
        os.rmdir(live)
