# SPDX-License-Identifier: Apache-2.0
"""The tier under a real vLLM engine (vLLM's CPU build, a tiny random Llama), end to end.

Each configuration runs once, in its own process (`tests/vllm/engine.py`), and the checks
below read what it saw:

* **reload** -- request A stores its prefix; the GPU's prefix cache is reset; request B with
  the same prefix gets it from the tier only: B's cached tokens cover the prefix, the index
  counts chunks stored and loaded, and B's tokens and logprobs are those of B served from the
  GPU's prefix cache and those of an engine without the connector.
* **negative control** -- every stored host page damaged: B's load fails its checksum, vLLM
  recomputes (``kv_load_failure_policy: recompute``), B's tokens and logprobs are unchanged,
  the failure is counted, and the engine keeps serving (the next runs store and reload).
* **pressure** -- 24 prompts against a tier of 15 chunks, then again in reverse order:
  tokens identical, chunks evicted, the last prompts reloaded, no hold or store left over.
* TP=2 over vLLM's worker processes with the shared layout and background set-up (and the
  tier's metrics served); the replicated layout with a file tier, whose prefix comes back
  from disk, also in a restarted engine.

PP=2: vLLM 0.32's CPU backend does not run pipeline stages (its model runner fails the first
step without any connector), so pipeline stages are covered by the core's tests only.
Skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (scripts/setup_env.sh installs its CPU "
                              "build)"),
    # one xdist worker runs every engine (scripts/test.sh: --dist loadgroup): each scenario
    # once, one engine at a time
    pytest.mark.xdist_group("vllm"),
]

SCENARIO_TIMEOUT_S = 900
PREFIX_TOKENS = 128


def run_scenario(name: str, *args: str, env: dict[str, str] | None = None) -> dict:
    """Run one scenario in a fresh process (``env`` added to its environment); its JSON
    result (or the failure's output)."""
    model = tempfile.mkdtemp(prefix="offload-vllm-model-")
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, **(env or {}),
               "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.run([sys.executable, os.path.join(root, "tests", "vllm", "engine.py"),
                               name, model, *args], capture_output=True, text=True, env=env,
                              timeout=SCENARIO_TIMEOUT_S)
    finally:
        shutil.rmtree(model, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"scenario {name} failed (exit {proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def private() -> dict:
    return run_scenario("private")


@pytest.fixture(scope="module")
def baseline() -> dict:
    return run_scenario("baseline")


@pytest.fixture(scope="module")
def shared_tp2() -> dict:
    return run_scenario("shared_tp2")


@pytest.fixture(scope="module")
def replicated_fs() -> Iterator[dict]:
    fs_dir = tempfile.mkdtemp(prefix="offload-vllm-fs-")
    try:
        result = run_scenario("replicated_fs", fs_dir)
        result["restart"] = run_scenario("fs_restart", fs_dir)
        yield result
    finally:
        shutil.rmtree(fs_dir, ignore_errors=True)


def same_output(run: dict, reference: dict) -> None:
    assert run["tokens"] == reference["tokens"]
    assert run["logprobs"] == reference["logprobs"]


def verify_reload(reload: dict) -> None:
    """B's prefix came from the tier, and B is what the GPU's prefix cache gave."""
    assert reload["a"]["cached"] == 0
    assert reload["reference"]["cached"] >= PREFIX_TOKENS  # the GPU's prefix cache hit
    assert reload["b"]["cached"] >= PREFIX_TOKENS  # ... and after its reset, the tier's
    same_output(reload["b"], reload["reference"])
    counters = reload["counters"]
    assert counters["stored_chunks"] >= 2 and counters["loaded_chunks"] >= 2
    assert counters["held"] == counters["storing"] == 0


def test_a_prefix_reloads_from_host_memory(private: dict, baseline: dict) -> None:
    verify_reload(private["reload"])
    # the engine without the connector computes the same A and B
    same_output(private["reload"]["a"], baseline["a"])
    same_output(private["reload"]["b"], baseline["b"])


def test_a_damaged_page_is_recomputed_and_the_engine_keeps_serving(private: dict) -> None:
    damaged, reference = private["damaged"], private["reload"]["reference"]
    assert damaged["b"]["cached"] < PREFIX_TOKENS  # not served from the damaged pages
    same_output(damaged["b"], reference)
    counters = damaged["counters"]
    assert counters["damaged_loads"] == counters["failed_loads"] == 1
    assert counters["held"] == 0
    recomputed, reloaded = damaged["served"]
    same_output(recomputed, reference)
    assert reloaded["cached"] >= PREFIX_TOKENS  # stored again, and from the tier again
    same_output(reloaded, reference)


def test_pressure_evicts_without_changing_outputs_or_leaking_holds(private: dict) -> None:
    pressure = private["pressure"]
    assert [r["tokens"] for r in pressure["second"]] == [r["tokens"] for r in pressure["first"]]
    assert any(r["cached"] >= PREFIX_TOKENS for r in pressure["second"])  # some from the tier
    counters = pressure["counters"]
    assert counters["evictions"] > 0
    assert counters["stored_chunks"] > counters["chunk_count"]
    assert counters["held"] == counters["storing"] == counters["quarantined"] == 0


def test_tp2_shared_layout_with_background_setup(shared_tp2: dict) -> None:
    verify_reload(shared_tp2["reload"])
    for rank_lines in shared_tp2["metrics"]:  # each worker counts the decided loads
        loads = [float(line.split()[-1]) for line in rank_lines
                 if 'direction="load"' in line and 'outcome="ok"' in line]
        assert loads and loads[0] >= 1, rank_lines


def test_tp2_a_page_damaged_on_the_other_rank_is_recomputed(shared_tp2: dict) -> None:
    """Rank 1's pages damaged: its load fails its checksum, rank 0 decides the job failed for
    both, vLLM recomputes on both; afterwards no worker holds a job or a load."""
    damaged, reference = shared_tp2["damaged"], shared_tp2["reload"]["reference"]
    assert damaged["b"]["cached"] < PREFIX_TOKENS
    same_output(damaged["b"], reference)
    assert damaged["counters"]["damaged_loads"] == 1
    for books in damaged["books"]:
        assert books["live"] == books["load_jobs"] == books["loads"] == 0, books


def test_replicated_layout_reloads_a_prefix_from_the_file_tier(replicated_fs: dict) -> None:
    assert replicated_fs["spilled"]["spilled"] > 0  # A's prefix left host memory for disk
    reload = replicated_fs["reload"]
    verify_reload(reload)
    assert reload["counters"]["promoted_chunks"] >= 2


def test_a_restarted_engine_adopts_the_file_tier(replicated_fs: dict) -> None:
    """A new engine (new process, empty host memory) on the same files: B's prefix comes
    from the files the engine before wrote."""
    restart = replicated_fs["restart"]
    assert restart["b"]["cached"] >= PREFIX_TOKENS
    same_output(restart["b"], replicated_fs["reload"]["reference"])
    assert restart["counters"]["promoted_chunks"] >= 2


@pytest.fixture(scope="module")
def kept() -> Iterator[dict]:
    """Two engine processes on one simulated node (so their keepers can be found and waited
    for): the first keeps its tier for 120 s, the second adopts it and keeps for 2 s."""
    import uuid

    from offload.region import kept as keep
    from tests.region.test_keeper import wait_gone

    node = f"vllm-keep-{uuid.uuid4().hex[:12]}"
    env = {"OFFLOAD_NODE_ID": node}
    try:
        result = run_scenario("keep_first", "120", env=env)
        result["keepers"] = len(keep.keepers(node))
        result["second"] = run_scenario("keep_second", "2", env=env)
        yield result
    finally:  # idle by now: dropped, so none outlives the test even when it failed early
        for name, info in keep.keepers(node):
            keep.drop(name)
            wait_gone(info["pid"], timeout_s=15)


def test_a_restarted_engine_adopts_the_kept_host_tier(kept: dict, baseline: dict) -> None:
    """Issue 49, test 6: an engine with keep_s stores A's prefix and exits; a new engine
    process gets B's prefix from the kept tier -- its cached tokens cover the prefix, the
    index adopted and loaded its chunks -- and B's tokens and logprobs are those of an engine
    without the connector."""
    assert kept["counters"]["stored_chunks"] >= 2 and kept["keepers"] == 1
    second = kept["second"]
    assert second["b"]["cached"] >= PREFIX_TOKENS
    counters = second["counters"]
    assert counters["adopted_chunks"] >= 2 and counters["adopted_loads"] >= 2
    assert counters["stored_chunks"] == 0  # nothing of the prefix computed and stored again
    same_output(second["b"], baseline["b"])


def offloading_config(extra: dict) -> object:
    """vLLM's normalized offloading config for a one-group, one-rank engine."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(32, ("layer.0",), 0),), worker_kv_bytes_per_block=65536,
        enable_kv_cache_events=False, extra_config=extra, engine_id="e",
        model=OffloadingModelConfig("tiny", "float32"), cache=OffloadingCacheConfig(32, 2),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, 0, True))


def test_the_spec_reads_its_extra_config_once_and_refuses_bad_keys() -> None:
    from offload.errors import OffloadError
    from offload.vllm import HostTierSpec

    spec = HostTierSpec(offloading_config({"cpu_bytes_per_node": "8MiB", "layout": "shared"}))
    assert (spec.tier_config.cpu_bytes_per_node, spec.tier_config.layout,
            spec.tier_config.blocks_per_chunk) == (8 << 20, "shared", 2)
    with pytest.raises(OffloadError) as err:
        HostTierSpec(offloading_config({"cpu_bytes_per_node": "8MiB", "colour": "red",
                                        "integrity": 1}))
    assert len(str(err.value).splitlines()) == 2


def test_the_spec_refuses_vllms_stock_connector() -> None:
    """The stock OffloadingConnector asserts every transfer succeeded: a failed checksum
    would end the worker, so the spec runs only under HostTierConnector."""
    from offload.errors import OffloadError
    from offload.vllm import HostTierSpec

    spec = HostTierSpec(offloading_config({"cpu_bytes_per_node": "8MiB"}))
    with pytest.raises(OffloadError, match="HostTierConnector"):
        spec.get_worker(None)  # type: ignore[arg-type]
