"""The main job end to end under real torchrun: report contract, layouts, and user errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.synthetic import split_payload
from offload.integrity import trailer_bytes
from offload.region.hugepages import shmem_huge_mode
from offload.sizes import round_up
from tests.harness import free_port, has_our_traceback, run_on_free_port, tail

ROOT = Path(__file__).resolve().parents[2]


def torchrun(nproc: int, *args: str, env: dict[str, str] | None = None, timeout: float = 120,
             shm_dir: str | None = None, prefix: tuple[str, ...] = ()
             ) -> subprocess.CompletedProcess[str]:
    """The main job under torchrun; nameless regions unless ``shm_dir`` is given.  ``prefix``
    runs the whole command under a wrapper (e.g. a private mount namespace)."""
    return run_on_free_port(
        lambda port: [*prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                      "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                      "--master-port", port, str(ROOT / "launch" / "run.py"),
                      "--device", "cpu", "--timeout", "30",
                      *(("--shm-dir", shm_dir) if shm_dir else ()), *args],
        cwd=ROOT, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def our_errors(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("offload: error:")]


def our_tracebacks(proc: subprocess.CompletedProcess[str]) -> bool:
    """Whether any traceback shows a frame of our code (torchrun prints its own when a worker
    exits non-zero)."""
    return has_our_traceback(proc.stderr)


def slot_of(payload: int, bpc: int = 16, page: int = 4096) -> int:
    """The plan's slot formula for the main job's synthetic KV: ``bpc`` blocks of the payload
    (8-byte aligned), then their page checksums' trailer, rounded up to the page."""
    return round_up(round_up(bpc * payload, 8) + trailer_bytes(split_payload(payload), bpc),
                    page)


def test_tp2_pp2_report_matches_the_plan_formula(tmp_path: Path, shm_dir: str) -> None:
    report_path = tmp_path / "r.json"
    proc = torchrun(4, "--tp", "2", "--pp", "2", "--cpu-bytes", "64MiB",
                    "--report-json", str(report_path), "--timeline", str(tmp_path / "t.png"),
                    shm_dir=shm_dir)
    assert proc.returncode == 0, tail(proc)
    report = json.loads(report_path.read_text())
    assert (report["world_size"], report["tp"], report["pp"]) == (4, 2, 2)
    assert len(report["nodes"]) == 1 and report["nodes"][0]["leader_rank"] == 0
    assert report["nodes"][0]["ranks"] == [0, 1, 2, 3]
    plan = report["plan"]
    slot = slot_of(64 * 1024)
    assert slot == 16 * 64 * 1024 + 4096  # the trailer takes one more page
    assert plan["slot_bytes"] == {str(r): slot for r in range(4)}
    (row,) = plan["row_bytes"].values()
    assert row == 4 * slot and plan["chunk_count"] == (64 << 20) // row
    assert [(r["rank"], r["tp_rank"], r["pp_rank"]) for r in report["ranks"]] == [
        (0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    for r in report["ranks"]:
        assert r["region_bytes"] == plan["chunk_count"] * slot
        assert set(r["timings_s"]) >= {"plan", "create", "prefault", "pin", "total"}
    assert report["transfer"]["verified"] and report["transfer"]["rounds"] == 2
    assert report["shm_files_left"] == 0
    assert "shm files left: 0" in proc.stdout
    # every copy each rank made, on the CPU's one path, counted per rank and in total
    assert set(report["paths"]) == {"host"}
    assert report["paths"]["host"] == sum(r["paths"]["host"] for r in report["ranks"]) > 0
    assert "paths: host " in proc.stdout
    header = next(line for line in proc.stdout.splitlines() if line.lstrip().startswith("rank"))
    assert header.split()[:8] == ["rank", "node", "lr", "tp", "pp", "slot", "memory", "region"]
    for r in report["ranks"]:
        assert r["shmem_huge"] == (shmem_huge_mode() if r["memory"] == "memfd" else None)
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dp2_gives_each_replica_its_own_verified_tier(tmp_path: Path, shm_dir: str) -> None:
    """World = dp x tp: replicas of consecutive ranks, each with its own plan, tier and
    rounds (data distinct per replica), reported side by side."""
    report_path = tmp_path / "r.json"
    proc = torchrun(4, "--dp", "2", "--tp", "2", "--layout", "shared", "--cpu-bytes", "64MiB",
                    "--report-json", str(report_path), shm_dir=shm_dir)
    assert proc.returncode == 0, tail(proc)
    report = json.loads(report_path.read_text())
    assert (report["world_size"], report["dp"], report["tp"], report["pp"]) == (4, 2, 2, 1)
    replicas = report["replicas"]
    assert [r["replica"] for r in replicas] == [0, 1]
    assert [r["world_ranks"] for r in replicas] == [[0, 1], [2, 3]]
    assert len({r["tier_id"] for r in replicas}) == 2
    slot = slot_of(64 * 1024)
    for r in replicas:  # the whole budget per node, per replica
        assert r["plan"]["chunk_count"] == (64 << 20) // (2 * slot)
        assert [(x["rank"], x["tp_rank"], x["slot"]) for x in r["ranks"]] == [(0, 0, 0),
                                                                           (1, 1, 1)]
        assert r["transfer"]["verified"] and r["transfer"]["checked_blocks"] > 0
    assert report["plan"] == replicas[0]["plan"] and report["shm_files_left"] == 0
    assert "replica 0 (world ranks 0-1" in proc.stdout
    assert "replica 1 (world ranks 2-3" in proc.stdout


@pytest.mark.parametrize("layout", ["shared", "replicated"])
def test_node_layouts_with_eviction_verify(layout: str, tmp_path: Path, shm_dir: str) -> None:
    report_path = tmp_path / "r.json"
    # 40 chunks of work for a tier of 16 (shared) / 32 (replicated) chunks: eviction happens
    proc = torchrun(2, "--layout", layout, "--cpu-bytes", "32MiB", "--num-gpu-blocks", "640",
                    "--report-json", str(report_path), shm_dir=shm_dir)
    assert proc.returncode == 0, tail(proc)
    transfer = json.loads(report_path.read_text())["transfer"]
    assert transfer["verified"] and transfer["evictions"] > 0
    assert transfer["loaded_bytes"] < transfer["stored_bytes"] * (2 if layout == "shared" else 4)


@pytest.mark.parametrize("layout", ["private", "shared", "replicated"])
def test_background_set_up_serves_while_rows_come_online_and_reports_readiness(
        layout: str, tmp_path: Path, shm_dir: str) -> None:
    report_path = tmp_path / "r.json"
    proc = torchrun(2, "--layout", layout, "--background-setup", "--cpu-bytes", "64MiB",
                    "--num-gpu-blocks", "256", "--report-json", str(report_path),
                    shm_dir=shm_dir)
    assert proc.returncode == 0, tail(proc)
    report = json.loads(report_path.read_text())
    readiness = report["readiness"]
    assert readiness["background"] is True
    assert readiness["create_s"] > 0 and readiness["first_job_s"] > 0
    assert readiness["full_s"] is not None and readiness["full_s"] > 0
    assert report["transfer"]["verified"]
    for rank in report["ranks"]:  # set-up finished on every rank: every row, registered
        assert rank["background"] and rank["setup_error"] is None
        assert rank["ready_rows"] == report["plan"]["chunk_count"]
        assert rank["registrations"] > 0
        assert rank["own_registration_context"] is False  # no CUDA here: nothing to make
    assert "readiness (background set-up)" in proc.stdout


def test_heterogeneous_stages_share_one_chunk_count(tmp_path: Path) -> None:
    report_path = tmp_path / "r.json"
    proc = torchrun(2, "--tp", "1", "--pp", "2", "--stage-kv-bytes", "64KiB,16KiB",
                    "--cpu-bytes", "16MiB", "--report-json", str(report_path))
    assert proc.returncode == 0, tail(proc)
    plan = json.loads(report_path.read_text())["plan"]
    slots = slot_of(64 * 1024), slot_of(16 * 1024)
    assert plan["slot_bytes"] == {"0": slots[0], "1": slots[1]}
    assert plan["chunk_count"] == (16 << 20) // sum(slots)


@pytest.mark.parametrize("tp", [1, 2])
def test_replicated_pipeline_stages_verify_with_their_own_slots(tp: int, tmp_path: Path,
                                                                 shm_dir: str) -> None:
    """Each stage has its own slot in the node's rows; every rank loads its own stage's data
    (the seed holds the stage), and only one rank per stage stores."""
    report_path = tmp_path / "r.json"
    proc = torchrun(2 * tp, "--layout", "replicated", "--tp", str(tp), "--pp", "2",
                    "--stage-kv-bytes", "64KiB,16KiB", "--cpu-bytes", "16MiB",
                    "--report-json", str(report_path), shm_dir=shm_dir)
    assert proc.returncode == 0, tail(proc)
    report = json.loads(report_path.read_text())
    plan, transfer = report["plan"], report["transfer"]
    slots = [slot_of(64 * 1024), slot_of(16 * 1024)]  # stage 0, stage 1
    assert plan["slot_bytes"] == {str(r): slots[r // tp] for r in range(2 * tp)}
    assert list(plan["row_bytes"].values()) == [sum(slots)]  # one node: this host
    assert plan["chunk_count"] == (16 << 20) // sum(slots)
    assert [s["slot_offset"] for s in plan["slots"]] == [0] * tp + [slots[0]] * tp
    assert [r["slot"] for r in report["ranks"]] == [0] * tp + [1] * tp
    assert transfer["verified"] and transfer["mismatched_blocks"] == 0
    # 2 rounds of 64 blocks: one writer per stage stores, every rank loads
    assert transfer["stored_bytes"] == 2 * 64 * (64 + 16) * 1024
    assert transfer["loaded_bytes"] == tp * transfer["stored_bytes"]


@pytest.mark.parametrize("args,needle", [
    (["--cpu-bytes", "1MiB"], f"holds no chunk: one chunk needs {2 * slot_of(64 * 1024)} B"),
    (["--tp", "3"], "--tp 3 x --pp 1 = 3 but the world has 2 ranks"),
    (["--cpu-bytes", "12 parsecs"], "--cpu-bytes '12 parsecs' is not a size"),
    (["--stage-kv-bytes", "64KiB,32KiB,1KiB"], "--stage-kv-bytes gives 3 payloads but --pp is 1"),
    (["--pp", "3"], "--pp 3 does not divide the 2 ranks"),
    (["--tp", "1", "--pp", "3"], "--tp 1 x --pp 3 = 3 but the world has 2 ranks"),
    (["--segment-bytes", "0"], "(--segment-bytes) = 0 is below its minimum"),
    (["--kv-bytes-per-block", "0"], "a KV payload of 0 bytes per block is empty"),
    (["--dp", "3"], "--dp 3 does not divide the 2 ranks; choose a dp that divides 2"),
    (["--dp", "0"], "--dp 0 must be at least 1"),
    (["--dp", "2", "--tp", "2"], "--dp 2 x --tp 2 x --pp 1 = 4 but the world has 2 ranks"),
])
def test_bad_input_is_one_line_nonzero_and_leaves_nothing(args: list[str], needle: str,
                                                          shm_dir: str) -> None:
    if "--shm-dir" not in args:
        args = ["--shm-dir", shm_dir, *args]
    proc = torchrun(2, *args)
    assert proc.returncode != 0
    errors = our_errors(proc)
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-3000:]
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr


@pytest.mark.parametrize("problem", ["missing", "file", "disk"])
def test_an_unusable_shm_dir_is_one_line_before_anything_is_created(tmp_path: Path,
                                                                    problem: str) -> None:
    path = {"missing": tmp_path / "nope", "file": tmp_path / "f", "disk": ROOT}[problem]
    if problem == "file":
        path.write_text("")
    needle = {"missing": "does not exist", "file": "is not a directory",
              "disk": "filesystem, not a memory-backed one (tmpfs, hugetlbfs, ramfs)"}[problem]
    proc = torchrun(2, "--layout", "shared", shm_dir=str(path))
    assert proc.returncode == 1
    errors = our_errors(proc)
    assert len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith(f"offload: error: shm_dir (--shm-dir) {path} ")
    assert needle in errors[0] and "leave it unset for nameless regions" in errors[0]
    assert not our_tracebacks(proc), proc.stderr[-3000:]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("offload")]


def test_a_read_only_shm_dir_is_one_line_before_anything_is_created(tmp_path: Path) -> None:
    """A read-only tmpfs (root may write anywhere else), mounted in a private mount namespace
    that lives only as long as the job."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o500)
        prefix: tuple[str, ...] = ()
    else:
        prefix = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
                  f'mount -t tmpfs -o ro,size=1m tmpfs "{ro}" && exec "$0" "$@"')
        probe = subprocess.run([*prefix, "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs here: {probe.stderr[-200:]!r}")
    proc = torchrun(2, "--layout", "shared", shm_dir=str(ro), prefix=prefix)
    assert proc.returncode == 1
    assert our_errors(proc) == [f"offload: error: shm_dir (--shm-dir) {ro} is not writable by "
                                f"uid {os.geteuid()} (read-only mount or permissions); give a "
                                "tmpfs directory such as /dev/shm, or leave it unset for "
                                "nameless regions"], proc.stderr[-2000:]
    assert not our_tracebacks(proc), proc.stderr[-3000:]


@pytest.mark.parametrize("layout", ["private", "shared"])
def test_more_than_the_hosts_memory_is_one_line_before_anything_is_created(layout: str) -> None:
    """Nameless regions are not bounded by /dev/shm: the budget meets available memory."""
    proc = torchrun(2, "--layout", layout, "--cpu-bytes", "64TiB")
    assert proc.returncode == 1
    errors = our_errors(proc)
    assert len(errors) == 1, proc.stderr[-3000:]
    row = 2 * slot_of(64 * 1024)  # both ranks' slots, in one row or in two private regions
    need = (64 << 40) // row * row
    assert f"the node's regions need {need} B (64.00 TiB) but only" in errors[0]
    assert "of memory is available (MemAvailable in /proc/meminfo); lower --cpu-bytes or free " \
        "memory" in errors[0]
    assert not our_tracebacks(proc), proc.stderr[-3000:]


def test_unknown_layout_is_refused_by_the_parser() -> None:
    proc = torchrun(1, "--layout", "striped")
    assert proc.returncode != 0 and "invalid choice: 'striped'" in proc.stderr


def test_help_lists_every_flag() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "run.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--cpu-bytes", "--dp", "--tp", "--pp", "--layout", "--kv-bytes-per-block",
                 "--stage-kv-bytes", "--blocks-per-chunk", "--num-gpu-blocks", "--device",
                 "--rounds", "--fs-tier", "--fs-bytes", "--report-json",
                 "--background-setup", "OFFLOAD_NODE_ID"):
        assert flag in out


@pytest.mark.parametrize(("layout", "nprocs"), [("shared", (2, 2)), ("replicated", (2, 2)),
                                                ("shared", (3, 1))])
def test_two_simulated_nodes_elect_two_leaders_and_size_rows_per_node(
        layout: str, nprocs: tuple[int, int], tmp_path: Path) -> None:
    """Two torchrun "nodes" (as scripts/two_nodes.sh starts them, NPROC0 / NPROC1), equal or
    not: each node sizes its rows from its own ranks, the chunk count fits the fuller one."""
    report_path = tmp_path / "r.json"
    grid = ("--tp", "2", "--pp", "2") if nprocs == (2, 2) else ("--tp", str(sum(nprocs)))

    def node(rank: int, port: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
               str(rank), "--nproc-per-node", str(nprocs[rank]), "--master-addr", "127.0.0.1",
               "--master-port", port, str(ROOT / "launch" / "run.py"), "--device", "cpu",
               *grid, "--layout", layout, "--cpu-bytes", "8MiB",
               "--timeout", "30", "--report-json", str(report_path)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OFFLOAD_NODE_ID": f"host{rank}"}
        return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)

    for attempt in range(3):  # node 0's agent binds a port picked in advance: it can be taken
        port = str(free_port())  # by a parallel test first, and then node 1 must not wait on it
        procs = [node(0, port), node(1, port)]
        first_out = procs[0].communicate(timeout=120)[0]
        if "EADDRINUSE" in first_out and attempt < 2:
            procs[1].kill()
            procs[1].communicate()
            continue
        outputs = [first_out, procs[1].communicate(timeout=120)[0]]
        break
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    report = json.loads(report_path.read_text())
    first = list(range(nprocs[0]))
    assert report["nodes"] == [
        {"node_id": "host0", "leader_rank": 0, "ranks": first},
        {"node_id": "host1", "leader_rank": nprocs[0],
         "ranks": list(range(nprocs[0], sum(nprocs)))}]
    slot = slot_of(64 * 1024)
    rows = ({"host0": nprocs[0] * slot, "host1": nprocs[1] * slot} if layout == "shared"
            else {"host0": slot, "host1": slot})  # replicated: one stage per node here
    assert report["plan"]["row_bytes"] == rows
    assert report["plan"]["chunk_count"] == (8 << 20) // max(rows.values())
    assert [r["slot"] for r in report["ranks"]] == (
        [*first, *range(nprocs[1])] if layout == "shared" else [0] * sum(nprocs))
    assert report["transfer"]["verified"] and report["shm_files_left"] == 0


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.parametrize("layout", ["private", "shared"])
def test_a_killed_rank_fails_the_job_quickly_and_leaves_nothing(layout: str,
                                                                shm_dir: str) -> None:
    import signal
    import time

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           str(ROOT / "launch" / "run.py"), "--device", "cpu", "--layout", layout,
           "--cpu-bytes", "48MiB", "--rounds", "100000", "--timeout", "20",
           "--shm-dir", shm_dir]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 60
    workers: list[int] = []
    while time.monotonic() < deadline and len(workers) < 3:
        workers = _children(proc.pid)
        time.sleep(0.2)
    time.sleep(6)  # past set-up: the ranks are serving rounds
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    os.kill(sorted(workers)[-1], signal.SIGKILL)
    killed_at = time.monotonic()
    _, err = proc.communicate(timeout=90)
    assert proc.returncode != 0
    assert time.monotonic() - killed_at < 45, err[-2000:]
