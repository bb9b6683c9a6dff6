# SPDX-License-Identifier: Apache-2.0
"""Scenarios on a real vLLM engine (CPU build) with the tier turned on, for
`tests/vllm/test_vllm_engine.py`: ``python tests/vllm/engine.py SCENARIO MODEL_DIR [FS_DIR]``
runs one engine configuration through its checks and prints one JSON line of what it saw.

Each scenario is its own process: vLLM keeps process-wide state (its distributed groups), so
one engine per process is the reliable way to run several configurations.  The engine core
runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the scheduler's index can be
read; TP ranks are vLLM's own worker processes.  Prompts are token ids (no tokenizer), greedy.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

BLOCK = 32  # tokens per vLLM block (the CPU backend wants a multiple of 32)
BPC = 2  # vLLM blocks per offloaded block: one chunk of the tier
PREFIX = list(range(1, 129))  # 128 tokens: 4 blocks, 2 chunks


def build_model(path: str) -> None:
    """A tiny random Llama (2 layers, head size 64), saved where vLLM will load it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


_ENGINES: list[Any] = []  # shut down before this process exits


def make_llm(model: str, tp: int = 1, pp: int = 1, extra: dict | None = None,
             **engine_args: Any) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if extra is not None:
        transfer = KVTransferConfig(
            kv_connector="HostTierConnector", kv_connector_module_path="offload.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"blocks_per_chunk": BPC, **extra})
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK,
              tensor_parallel_size=tp, pipeline_parallel_size=pp, max_model_len=512,
              max_num_seqs=4, enforce_eager=True, kv_cache_memory_bytes=4 << 20,
              kv_transfer_config=transfer,
              distributed_executor_backend="mp" if tp * pp > 1 else None, **engine_args)
    _ENGINES.append(llm)
    return llm


def run(llm: Any, prompts: list[list[int]]) -> list[dict]:
    """Greedy, 8 tokens each: the tokens, their logprobs and how many prompt tokens were
    cached (GPU prefix cache or the tier)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    results = []
    for out in outs:
        seq = out.outputs[0]
        results.append({"tokens": list(seq.token_ids), "cached": out.num_cached_tokens,
                        "logprobs": [lp[t].logprob for t, lp in zip(seq.token_ids,
                                                                   seq.logprobs,
                                                                   strict=True)]})
    return results


def engine_core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def drain(llm: Any, timeout_s: float = 60) -> None:
    """Step the engine until no transfer is pending (vLLM keeps stepping for them)."""
    core = engine_core(llm)
    deadline = time.monotonic() + timeout_s
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        core.step_fn()


def index_of(llm: Any) -> Any:
    return engine_core(llm).scheduler.connector.index


def counters(llm: Any) -> dict:
    index = index_of(llm)
    stats = index.manager.stats()
    return {**vars(index.stats), "held": stats.held, "storing": stats.storing,
            "quarantined": stats.quarantined, "evictions": stats.evictions,
            "chunk_count": stats.chunk_count, "spilled": stats.spilled}


def reload(llm: Any) -> dict:
    """A stores the prefix; B (same prefix) with the GPU's prefix cache hit is the reference;
    after the GPU's prefix cache is reset, B's prefix can only come from the tier."""
    a = run(llm, [PREFIX + [200, 201, 202]])[0]
    reference = run(llm, [PREFIX + [300, 301]])[0]
    drain(llm)
    llm.reset_prefix_cache()
    b = run(llm, [PREFIX + [300, 301]])[0]
    drain(llm)
    return {"a": a, "reference": reference, "b": b, "counters": counters(llm)}


def damage_every_row(_worker: Any = None, rank: int | None = None) -> None:
    """Flip one bit of every chunk's first page in this process's tier (only on tier rank
    ``rank`` when given); runs in a worker (`LLM.collective_rpc`) or, at TP=1, here."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    tier = get_kv_transfer_group().connector_worker.tier_worker.core.tier
    if rank is None or tier.topology.rank == rank:
        view = tier.actor.region.tensor_view(0)
        view[:, 0, 7] ^= 0x10


def worker_books(_worker: Any = None) -> dict:
    """What a worker still holds: its tier's jobs not yet handed back, vLLM's map of loads in
    flight, loads remembered for their GPU blocks."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector_worker = get_kv_transfer_group().connector_worker
    core = connector_worker.tier_worker.core
    return {"rank": core.tier.topology.rank, "live": core.tier.actor.jobs.live,
            "load_jobs": len(connector_worker._load_jobs), "loads": len(core._loads)}


def scenario_private(model: str) -> dict:
    """TP=1, private layout: reload; a damaged page (the load fails its checksum and vLLM
    recomputes); eviction under pressure (a tier smaller than the working set)."""
    llm = make_llm(model, extra={"cpu_bytes_per_node": "2MiB", "layout": "private"})
    result = {"reload": reload(llm)}
    # negative control: every stored page damaged, then B again from the tier
    damage_every_row()
    llm.reset_prefix_cache()
    failed = run(llm, [PREFIX + [300, 301]])[0]
    drain(llm)
    after = counters(llm)
    # the engine keeps serving: the damaged keys were dropped, so the next run computes and
    # stores the prefix again, and the one after loads it from the tier
    served = []
    for _ in range(2):
        llm.reset_prefix_cache()
        served.append(run(llm, [PREFIX + [300, 301]])[0])
        drain(llm)
    result["damaged"] = {"b": failed, "counters": after, "served": served,
                         "counters_after": counters(llm)}
    # eviction: 24 prompts of 4 chunks each against a tier of 15 chunks, then the same
    # prompts in reverse order (the last ones stored are still in the tier)
    prompts = [[(13 * i + 3 * j) % 509 + 1 for j in range(250)] for i in range(1, 25)]
    first = run(llm, prompts)
    drain(llm)
    llm.reset_prefix_cache()
    second = run(llm, prompts[::-1])[::-1]
    drain(llm)
    result["pressure"] = {"first": first, "second": second, "counters": counters(llm)}
    return result


def scenario_baseline(model: str) -> dict:
    """The same A and B without the connector: what vLLM computes without the tier."""
    llm = make_llm(model)
    a = run(llm, [PREFIX + [200, 201, 202]])[0]
    b = run(llm, [PREFIX + [300, 301]])[0]
    return {"a": a, "b": b}


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free TCP ports on this host (best effort)."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError("no free ports")


def scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def scenario_shared_tp2(model: str) -> dict:
    """TP=2 over vLLM's worker processes, shared layout, background set-up, the tier's
    metrics served by each worker (port + local rank)."""
    port = free_ports(2)
    llm = make_llm(model, tp=2, extra={"cpu_bytes_per_node": "4MiB", "layout": "shared",
                                       "background": True, "metrics_port": port})
    result = {"reload": reload(llm)}
    result["metrics"] = [[line for line in scrape(port + r).splitlines()
                          if line.startswith("offload_jobs_total")] for r in range(2)]
    # negative control on the rank that does not decide: its pages damaged, B again
    llm.collective_rpc(damage_every_row, kwargs={"rank": 1})
    llm.reset_prefix_cache()
    b = run(llm, [PREFIX + [300, 301]])[0]
    drain(llm)
    run(llm, [[5] * 40])  # one more step each, so every worker learns the last decisions
    drain(llm)
    result["damaged"] = {"b": b, "counters": counters(llm),
                         "books": llm.collective_rpc(worker_books)}
    return result


def fs_extra(fs_dir: str) -> dict:
    # the namespace names the model for the files' fingerprint: each scenario process saves
    # the same weights under another temporary path, so the path cannot name them
    return {"cpu_bytes_per_node": "1MiB", "layout": "replicated", "fs_tier": fs_dir,
            "fs_bytes": "16MiB", "fs_namespace": "tiny-llama-seed0"}


def scenario_replicated_fs(model: str, fs_dir: str) -> dict:
    """TP=1, replicated layout, a file tier behind a host tier of a few chunks: A's prefix is
    evicted to disk by later prompts and B's comes back from disk."""
    llm = make_llm(model, extra=fs_extra(fs_dir))
    a = run(llm, [PREFIX + [200, 201, 202]])[0]
    reference = run(llm, [PREFIX + [300, 301]])[0]
    drain(llm)
    others = [[(11 * i + 5 * j) % 509 + 1 for j in range(250)] for i in range(1, 5)]
    run(llm, others)
    drain(llm)
    spilled = counters(llm)
    llm.reset_prefix_cache()
    b = run(llm, [PREFIX + [300, 301]])[0]
    drain(llm)
    return {"reload": {"a": a, "reference": reference, "b": b, "counters": counters(llm)},
            "spilled": spilled}


def scenario_fs_restart(model: str, fs_dir: str) -> dict:
    """A new engine on the file tier of `scenario_replicated_fs`: B's prefix is on disk only,
    from the engine before."""
    llm = make_llm(model, extra=fs_extra(fs_dir))
    b = run(llm, [PREFIX + [300, 301]])[0]
    drain(llm)
    return {"b": b, "counters": counters(llm)}


def keep_extra(keep_s: str) -> dict:
    # the namespace names the model (each scenario process saves the same weights under
    # another temporary path); keep_s is not part of what is adopted, so the first engine
    # keeps long enough for the next one to start on a busy host, and the last one briefly
    return {"cpu_bytes_per_node": "2MiB", "layout": "private", "keep_s": float(keep_s),
            "fs_namespace": "tiny-llama-seed0"}


def scenario_keep_first(model: str, keep_s: str) -> dict:
    """An engine with ``keep_s`` serves A, whose prefix is stored, and shuts down: the tier
    is kept (docs/KEEP.md)."""
    llm = make_llm(model, extra=keep_extra(keep_s))
    a = run(llm, [PREFIX + [200, 201, 202]])[0]
    drain(llm)
    return {"a": a, "counters": counters(llm)}


def scenario_keep_second(model: str, keep_s: str) -> dict:
    """A new engine process, same model and geometry: B's prefix comes from the kept tier
    (no GPU prefix cache yet, no file tier)."""
    llm = make_llm(model, extra=keep_extra(keep_s))
    b = run(llm, [PREFIX + [300, 301]])[0]
    drain(llm)
    return {"b": b, "counters": counters(llm)}


def scenario_pp2(model: str) -> dict:
    """PP=2 without the connector: whether vLLM's CPU backend runs pipeline stages."""
    llm = make_llm(model, pp=2, async_scheduling=False)
    return {"b": run(llm, [PREFIX + [300, 301]])[0]}


def main() -> None:
    name, model = sys.argv[1], sys.argv[2]
    if not os.path.exists(os.path.join(model, "config.json")):
        build_model(model)
    started = time.monotonic()
    fn = globals()[f"scenario_{name}"]
    result = fn(model, *sys.argv[3:])
    result["seconds"] = time.monotonic() - started
    print("RESULT " + json.dumps(result), flush=True)
    for llm in _ENGINES:  # the executor stops its worker processes (the tiers close)
        llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    # NOTE: past this point gloo's threads can abort the interpreter's shutdown after the
    # work is done (docs/API.md, "Closing and exiting"); end without it
    os._exit(0)


if __name__ == "__main__":
    main()
