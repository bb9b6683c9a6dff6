"""Live metrics across real gloo ranks: every rank serves ``/metrics`` on its own port while jobs
run, the values move with the jobs and agree with what `finished` returned; a caller's registry
gets the same families; a taken port fails every rank with one line; the core imports without
``prometheus_client``."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest

from offload.config import TierConfig
from tests.harness import free_port_range, run_group

pytest.importorskip("prometheus_client")

MiB = 1 << 20


def _scrape(url: str) -> dict[str, float]:
    """Every sample of one scrape: 'name{labels}' -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def _serve_and_scrape(rank: int, port: int) -> object:
    import time

    import torch
    import torch.distributed as dist

    from offload import CopyJob, HostTier, OffloadError

    kv = [torch.ones((6 if rank == 1 else 8, 1024), dtype=torch.uint8)]
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4, tp=2,
                                          timeout_s=20, metrics_port=port))
    urls = [f"http://127.0.0.1:{port + r}/metrics" for r in range(2)]
    dist.barrier()  # rank 1's server reports its tier once rank 1's create returned
    before = [_scrape(u) for u in urls] if rank == 0 else None
    dist.barrier()
    tier.submit(CopyJob(1, "store", (0, 1), (0, 0), (0, 1)))
    with contextlib.suppress(OffloadError):  # rank 1 has no block 7: it refuses job 2
        tier.submit(CopyJob(2, "store", (7,), (1,), (0,)))
    tier.submit(CopyJob(3, "load", (2,), (0,), (0,)))
    results = []
    if rank == 0:
        while len(results) < 3:
            results += [(r.job_id, r.success) for r in tier.finished()]
            time.sleep(0.001)
    box = [tier.mark if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if rank == 1:
        results = [(r.job_id, r.success) for r in tier.finished(box[0])]
    dist.barrier()
    after = [_scrape(u) for u in urls] if rank == 0 else None
    dist.barrier()
    tier.close()
    closed = []
    if rank == 0:
        import urllib.error
        for u in urls:
            try:
                _scrape(u)
                closed.append(False)
            except (urllib.error.URLError, ConnectionError):
                closed.append(True)
    return before, after, results, closed


def test_every_rank_serves_metrics_that_move_with_its_jobs() -> None:
    port = free_port_range(2)
    out = run_group(_serve_and_scrape, 2, args=(port,), timeout=120)
    assert all(o.ok for o in out), [o.error for o in out]
    before, after, results, closed = out[0].value
    assert results == out[1].value[2] == [(1, True), (2, False), (3, True)]
    assert closed == [True, True]  # close stops the servers
    for rank in range(2):
        b, a = before[rank], after[rank]
        assert b["offload_jobs_total{direction=store,outcome=ok}"] == 0
        assert a["offload_jobs_total{direction=store,outcome=ok}"] == 1
        assert a["offload_jobs_total{direction=store,outcome=failed}"] == 1
        assert a["offload_jobs_total{direction=load,outcome=ok}"] == 1
        assert a["offload_transfer_bytes_total{direction=store}"] == 2 * 1024
        assert a["offload_transfer_bytes_total{direction=load}"] == 1024
        assert a["offload_rows_total{}"] == a["offload_rows_ready{}"] > 0
    # the host engine's one path moved every copy the rank took (rank 1 refused job 2)
    assert [a["offload_copies_by_path_total{path=host}"] for a in after] == [3, 2]
    # the decider times jobs and sees every rank's watermark; rank 0 also owns the manager
    assert after[0]["offload_job_seconds_count{direction=store}"] == 2
    assert after[1].get("offload_job_seconds_count{direction=store}", 0) == 0
    assert after[0]["offload_watermark_lag_jobs{rank=1}"] == 0
    assert after[0]["offload_chunks{state=free}"] == after[0]["offload_rows_total{}"]
    assert "offload_chunks{state=free}" not in after[1]


def _into_registry(rank: int) -> object:
    import torch
    from prometheus_client import CollectorRegistry, generate_latest

    from offload import CopyJob, HostTier

    registry = CollectorRegistry()
    tier = HostTier.create([torch.ones((4, 512), dtype=torch.uint8)],
                           TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=2),
                           metrics=registry)
    tier.submit(CopyJob(1, "store", (0,), (0,), (0,)))
    tier.wait([1])
    text = generate_latest(registry).decode()
    tier.close()
    return text, generate_latest(registry).decode()


def test_a_callers_registry_gets_the_tiers_families_until_close() -> None:
    (text, after_close), = [o.value for o in run_group(_into_registry, 1)]
    assert 'offload_jobs_total{direction="store",outcome="ok"} 1.0' in text
    assert "offload_" not in after_close


def _taken_port(rank: int, port: int) -> object:
    import socket

    import torch

    from offload import HostTier, OffloadError

    holder = None
    if rank == 1:  # rank 1's port (port + its local rank) is taken
        holder = socket.socket()
        holder.bind(("0.0.0.0", port + 1))
        holder.listen()
    try:
        HostTier.create([torch.ones((4, 512), dtype=torch.uint8)],
                        TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=2, tp=2,
                                   timeout_s=20, metrics_port=port))
    except OffloadError as exc:
        return str(exc)
    finally:
        if holder is not None:
            holder.close()
    return None


def test_a_taken_metrics_port_fails_every_rank_with_one_line() -> None:
    port = free_port_range(2)
    out = run_group(_taken_port, 2, args=(port,), timeout=90)
    for o in out:
        assert o.ok and o.value is not None, o.error
        assert f"cannot serve metrics on 127.0.0.1:{port + 1}" in o.value
        assert "\n" not in o.value


def _past_the_last_port(rank: int) -> object:
    import torch

    from offload import HostTier, OffloadError

    try:  # rank 1 would serve on 65536
        HostTier.create([torch.ones((4, 512), dtype=torch.uint8)],
                        TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=2, tp=2,
                                   timeout_s=20, metrics_port=65535))
    except OffloadError as exc:
        return str(exc)
    return None


def test_a_metrics_port_past_65535_fails_every_rank_at_once() -> None:
    out = run_group(_past_the_last_port, 2, timeout=60, pg_timeout=15)
    for o in out:
        assert o.ok and o.value is not None, o.error
        assert "cannot serve metrics on 127.0.0.1:65536 (port 65536 is past 65535)" in o.value


def test_the_core_imports_and_runs_without_prometheus_client() -> None:
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "import offload, offload.tier, offload.observe.metrics\n"
            "from offload.config import TierConfig\n"
            "TierConfig(cpu_bytes_per_node=1 << 20)\n"
            "try:\n"
            "    TierConfig(cpu_bytes_per_node=1 << 20, metrics_port=0)\n"
            "except offload.OffloadError as e: print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "metrics_port (--metrics-port) = 0 is not a TCP port" in proc.stdout


def _rows_come_online(rank: int, port: int, gate: str) -> object:
    import os
    import time

    import torch

    import offload.region.host_region as host_region
    from offload import CopyJob, HostTier, OffloadError
    from tests.test_tier_ready import GatedRegistrar

    host_region.UNIT_BYTES = 1  # one row per set-up unit
    registrar = GatedRegistrar(gate, free=2 if rank == 1 else 10 ** 6)
    kv = [torch.ones((8, 1024), dtype=torch.uint8)]
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=1, tp=2,
                                          timeout_s=20, metrics_port=port, background=True),
                           registrar_factory=lambda device: registrar)
    url = f"http://127.0.0.1:{port + rank}/metrics"
    tier.wait_ready(20, rows=2)
    with contextlib.suppress(OffloadError):  # a row past rank 1's two: "not ready" everywhere
        tier.submit(CopyJob(1, "store", (0,), (5,), (0,)))
    if rank == 0:
        while not tier.finished():
            time.sleep(0.001)
    early = _scrape(url)
    if rank == 0:
        open(gate, "w").close()
    else:
        while not os.path.exists(gate):
            time.sleep(0.001)
    tier.wait_ready(20)
    late = _scrape(url)
    tier.close()
    return early, late


def test_rows_ready_and_not_ready_jobs_move_while_set_up_runs_behind(tmp_path) -> None:
    port = free_port_range(2)
    outcomes = run_group(_rows_come_online, 2, args=(port, str(tmp_path / "gate")),
                         timeout=90)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    (early, late), _ = (o.value for o in outcomes)
    total = early["offload_rows_total{}"]
    assert early["offload_rows_ready{}"] == 2 and late["offload_rows_ready{}"] == total
    assert early["offload_chunks{state=not_ready}"] == total - 2
    assert early["offload_chunks{state=free}"] == 2
    assert late["offload_chunks{state=not_ready}"] == 0
    assert early["offload_jobs_total{direction=store,outcome=not_ready}"] == 1
