"""A real model reloads its prompts' KV cache through the host tier and decodes on, end to end.

    torchrun --standalone --nproc-per-node 2 launch/prefix_reload.py --layout private

Every rank runs the same small Llama model (Hugging Face ``transformers``, seeded random weights,
no download) and keeps, like a tensor-parallel engine, a paged KV cache of its share of the KV
heads: per layer one K and one V tensor ``[num_gpu_blocks, block_tokens, heads_per_rank,
head_dim]``.  For each prompt the engine loop prefills, copies its share of the model's cache into
the pages of a block table, stores those blocks into the host tier and keeps the never-offloaded
continuation (greedy decoding from the model's own cache) as the reference.  Then, several times
per prompt, it poisons the whole paged cache, loads the prompt's blocks back into *different*
blocks, checks the pages byte for byte, rebuilds the model's cache from them (the ranks'
head shares gathered, as the TP all-gather would) and decodes again: the tokens must be the
reference's.  Rank 0 prints a summary and writes ``--report-json``; exit 0 only when every reload
matched and nothing was left in the shm directory.

``transformers`` is an optional dependency: ``pip install 'offload[model]'``.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):  # run as a script by torchrun: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from launch.run import pick_device, shm_files_left, start
from offload import CopyJob, HostTier, TierConfig
from offload.config import LAYOUTS
from offload.errors import OffloadError
from offload.observe.report import write_json
from offload.region import cleanup
from offload.sizes import parse_size
from offload.transfer.base import Direction
from offload.transfer.layout import tensor_ranges

log = logging.getLogger("launch.prefix_reload")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N launch/prefix_reload.py",
        description="Prefill prompts on a small seeded Llama model, store each prompt's KV "
                    "blocks in the host tier, reload them into different blocks several times "
                    "and check that greedy decoding continues exactly as from the "
                    "never-offloaded cache (KV byte-exact too).  Needs transformers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layout", default="private", choices=LAYOUTS,
                   help="private / shared: each rank holds its share of the KV heads; "
                        "replicated: every rank holds all of them (default 1 KV head), stored "
                        "once per node")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the model and the paged KV cache live (cuda: bfloat16)")
    p.add_argument("--prompt-tokens", default="37,64,90", metavar="T0,T1,...",
                   help="one prompt (seeded random token ids) of each length")
    p.add_argument("--reloads-per-prompt", type=int, default=3, help="reloads of each prompt")
    p.add_argument("--decode-tokens", type=int, default=8,
                   help="greedy tokens decoded after each prefill and each reload")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-gpu-blocks", type=int, default=64, help="blocks in the paged cache")
    p.add_argument("--blocks-per-chunk", type=int, default=8, help="blocks per host chunk")
    p.add_argument("--cpu-bytes", default="64MiB", metavar="SIZE", help="host budget per node")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--hidden-size", type=int, default=256, help="model width")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="KV heads (default: 1 for replicated, else 4); split layouts need a "
                        "multiple of the world size")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the prompts")
    p.add_argument("--kv-views", action="store_true",
                   help="hold each layer's K and V as views kv[:, 0], kv[:, 1] of one "
                        "[blocks, 2, ...] tensor instead of two tensors")
    p.add_argument("--layerwise", type=int, default=0, metavar="G",
                   help="also reload every prompt layer-wise each time: the load in G groups "
                        "of KV tensors (G = layers: one a layer), the forward pass starting at "
                        "once with each decoder layer waiting only for its group; reports the "
                        "time to first token with and without the overlap (0: off; needs "
                        "every rank to hold all KV heads: --layout replicated or one rank)")
    p.add_argument("--corrupt-after-load", action="store_true",
                   help="self-test of the check: rank 0 flips one byte of the first reloaded "
                        "page (of each mode with --layerwise); the job must report a mismatch "
                        "and exit 1")
    p.add_argument("--report-json", default=None, metavar="PATH",
                   help="rank 0 writes the JSON report there")
    p.add_argument("--shm-dir", default=None, metavar="DIR",
                   help="keep the region in visible files in DIR (default: nameless memfds)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any rank waits for a peer before failing the job")
    return p


# ---------------------------------------------------------------------- geometry (pure)
def head_range(kv_heads: int, world: int, rank: int, replicated: bool) -> tuple[int, int]:
    """The KV heads ``[lo, hi)`` this rank holds: its TP share, or all of them when the KV is
    replicated (identical on every rank)."""
    if replicated:
        return 0, kv_heads
    if kv_heads % world:
        raise OffloadError(f"--kv-heads {kv_heads} does not split over {world} ranks; give a "
                           f"multiple of {world} or --layout replicated")
    share = kv_heads // world
    return rank * share, (rank + 1) * share


def blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


def to_pages(x: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """``[heads, T, dim]`` -> ``[blocks, block_tokens, heads, dim]``, the last block zero-padded."""
    heads, tokens, dim = x.shape
    padded = x.new_zeros((heads, blocks_for(tokens, block_tokens) * block_tokens, dim))
    padded[:, :tokens] = x
    return padded.view(heads, -1, block_tokens, dim).permute(1, 2, 0, 3)


def from_pages(pages: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[blocks, block_tokens, heads, dim]`` -> ``[heads, tokens, dim]`` (contiguous)."""
    blocks, block_tokens, heads, dim = pages.shape
    flat = pages.permute(2, 0, 1, 3).reshape(heads, blocks * block_tokens, dim)
    return flat[:, :tokens].contiguous()


def first_difference(expected: torch.Tensor, got: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first element whose bytes differ (byte-exact: -0.0 != 0.0), else None."""
    a, b = expected.contiguous().view(torch.uint8), got.contiguous().view(torch.uint8)
    where = (a != b).nonzero()
    if where.shape[0] == 0:
        return None
    index = [int(i) for i in where[0]]
    index[-1] //= expected.element_size()
    return tuple(index)


def reload_table(gen: torch.Generator, num_blocks: int, avoid: set[int], count: int
                 ) -> list[int]:
    """``count`` blocks none of which is in ``avoid``, in seeded random order (identical on
    every rank: the jobs of an SPMD tier must be the same everywhere)."""
    free = [b for b in torch.randperm(num_blocks, generator=gen).tolist() if b not in avoid]
    if len(free) < count:
        raise OffloadError(f"--num-gpu-blocks {num_blocks} leaves {len(free)} blocks outside "
                           f"the previous tables but a prompt needs {count}; give at least "
                           f"{len(avoid) + count}")
    return free[:count]


# ---------------------------------------------------------------------- the paged cache
class PagedCache:
    """One rank's paged KV cache: ``tensors`` = [K0, V0, K1, V1, ...], each
    ``[num_blocks, block_tokens, heads, dim]`` (views of per-layer ``[blocks, 2, ...]`` tensors
    with ``views``); ``owners`` hold the memory."""

    def __init__(self, layers: int, num_blocks: int, block_tokens: int, heads: int, dim: int,
                 dtype: torch.dtype, device: torch.device, views: bool):
        shape = (num_blocks, block_tokens, heads, dim)
        if views:
            self.owners = [torch.zeros((num_blocks, 2, *shape[1:]), dtype=dtype, device=device)
                           for _ in range(layers)]
            self.tensors = [kv[:, half] for kv in self.owners for half in (0, 1)]
        else:
            self.owners = [torch.zeros(shape, dtype=dtype, device=device)
                           for _ in range(2 * layers)]
            self.tensors = list(self.owners)
        self.block_tokens = block_tokens
        self.views = views

    def write(self, table: Sequence[int], shares: Sequence[torch.Tensor]) -> None:
        """Write ``shares[t]`` (``[heads, T, dim]``, tensor t's share of the model cache) into
        the blocks of ``table``."""
        index = torch.tensor(table, device=self.tensors[0].device)
        for tensor, share in zip(self.tensors, shares, strict=True):
            tensor[index] = to_pages(share, self.block_tokens)

    def pages(self, table: Sequence[int]) -> list[torch.Tensor]:
        """Copies of the blocks of ``table`` in every tensor: ``[len(table), block_tokens,
        heads, dim]`` each."""
        index = torch.tensor(table, device=self.tensors[0].device)
        return [tensor[index] for tensor in self.tensors]

    def layer(self, layer: int, index: torch.Tensor, tokens: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` from the blocks ``index``, ``[heads, tokens, dim]`` each: one
        gather and one copy where K and V share a per-layer tensor (two views of it, not
        contiguous), else `from_pages` of each."""
        if self.views:
            pages = self.owners[layer][index]  # [blocks, 2, block_tokens, heads, dim]
            blocks, _, block_tokens, heads, dim = pages.shape
            flat = pages.permute(1, 3, 0, 2, 4).reshape(2, heads, blocks * block_tokens, dim)
            return flat[0, :, :tokens], flat[1, :, :tokens]
        k, v = (from_pages(self.tensors[2 * layer + half][index], tokens) for half in (0, 1))
        return k, v

    def poison(self) -> None:
        """Drop the cache: every byte becomes 0xA5, so only a real load brings a page back."""
        for owner in self.owners:
            owner.view(torch.uint8).fill_(0xA5)

    def corrupt(self, block: int) -> None:
        """Self-test: flip an exponent bit of the first element of ``block`` in K of layer 0."""
        page = self.tensors[0][block].view(torch.uint8).view(-1)
        last = self.tensors[0].element_size() - 1  # little-endian: the sign/exponent byte
        page[last] = page[last] ^ 0x40


# ---------------------------------------------------------------------- the model
def import_transformers() -> Any:
    """The optional dependency, imported by name: mypy then does not follow it into its
    1,300 modules (it ships py.typed), and a missing install is a one-line user error."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        raise OffloadError("launch/prefix_reload.py needs transformers, which is not "
                           "installed; pip install 'offload[model]'") from None
    transformers.logging.set_verbosity_error()
    return transformers


def build_model(tf: Any, args: argparse.Namespace, kv_heads: int, device: torch.device,
                dtype: torch.dtype) -> Any:
    """The same seeded random Llama on every rank (weights drawn on the CPU in float32)."""
    if args.hidden_size % args.heads or args.heads % kv_heads:
        raise OffloadError(f"--hidden-size {args.hidden_size}, --heads {args.heads}, --kv-heads "
                           f"{kv_heads}: heads must divide the width and KV heads the heads")
    config = tf.LlamaConfig(
        hidden_size=args.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=kv_heads,
        intermediate_size=2 * args.hidden_size, vocab_size=1000,
        max_position_embeddings=4096, initializer_range=0.1)
    torch.manual_seed(args.seed)
    model = tf.LlamaForCausalLM(config).eval()
    return model.to(device=device, dtype=dtype)


def layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[1, kv_heads, T, dim]`` of one layer of a DynamicCache, across the
    transformers API change (4.56 moved ``key_cache[i]`` to ``layers[i].keys``)."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def build_cache(tf: Any, kv: Sequence[torch.Tensor]) -> Any:
    """A DynamicCache holding ``kv`` = [K0, V0, K1, ...] (each ``[kv_heads, T, dim]``), built
    through ``update``, the one call every version in the supported range shares."""
    cache = tf.DynamicCache()
    for layer in range(len(kv) // 2):
        cache.update(kv[2 * layer][None], kv[2 * layer + 1][None], layer)
    return cache


def next_token(logits: torch.Tensor) -> int:
    return int(logits[0, -1].argmax().item())


def greedy(model: Any, cache: Any, first: int, position: int, steps: int) -> list[int]:
    """``first`` followed by ``steps`` greedy tokens decoded from ``cache`` (which grows)."""
    device = next(model.parameters()).device
    tokens = [first]
    for step in range(steps):
        at = torch.tensor([position + step], device=device)
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=device), past_key_values=cache,
                    use_cache=True, cache_position=at, position_ids=at[None])
        tokens.append(next_token(out.logits))
    return tokens


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------- the engine loop
@dataclass
class Prompt:
    """One prompt's never-offloaded state: where it was stored and what it must reload to."""

    index: int
    tokens: int
    chunks: tuple[int, ...]
    positions: tuple[int, ...]
    original_table: list[int]
    pages: list[torch.Tensor]     # this rank's original pages, per KV tensor
    reference_kv: list[torch.Tensor]  # the model's full cache, [K0, V0, ...] [kv_heads, T, dim]
    reference_tokens: list[int]
    first_token: int
    prefill_s: float
    store_s: float
    tables: list[list[int]] = field(default_factory=list)


@dataclass
class Engine:
    """What the loop needs on every rank."""

    tf: Any
    model: Any
    tier: HostTier
    paged: PagedCache
    device: torch.device
    heads: tuple[int, int]
    replicated: bool
    job_ids: Any = field(default_factory=lambda: itertools.count(1))

    def copy(self, direction: Direction, table: Sequence[int], chunks: tuple[int, ...],
             positions: tuple[int, ...]) -> None:
        """One SPMD job, waited for: done once every rank has copied (replicated stores: the
        node's writer copies, the other ranks check)."""
        job = CopyJob(next(self.job_ids), direction, blocks=tuple(table), chunks=chunks,
                      positions=positions, writer_only=self.replicated and direction == "store")
        self.tier.submit(job)
        self.tier.wait([job.job_id])

    def start_together(self) -> float:
        """Start a timed job on every rank at once: the quorum completes when the last rank
        copied, so a peer still busy with the previous step would be timed too."""
        sync(self.device)
        dist.barrier()
        return time.perf_counter()

    def gather_heads(self, shares: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's head share of every KV tensor -> the full KV heads (one gloo all-gather
        of bytes, through the CPU), in rank order = head order."""
        if self.replicated or dist.get_world_size() == 1:
            return shares
        local = torch.stack(shares).cpu()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather([p.view(torch.uint8) for p in parts], local.view(torch.uint8))
        full = torch.cat(parts, dim=1).to(self.device)
        return list(full.unbind(0))


def prefill_and_store(engine: Engine, index: int, tokens: int, base_chunk: int, args: Any,
                      gen: torch.Generator) -> Prompt:
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(
        args.seed * 1_000 + index)).to(engine.device)
    # an untimed pass first: the timed one is what recomputing costs a warm engine, not the
    # one-off kernel selection and loading for a new shape
    engine.model(input_ids=ids, past_key_values=engine.tf.DynamicCache(), use_cache=True)
    cache = engine.tf.DynamicCache()  # given, so that no version hands back legacy tuples
    sync(engine.device)
    started = time.perf_counter()
    out = engine.model(input_ids=ids, past_key_values=cache, use_cache=True)
    sync(engine.device)
    prefill_s = time.perf_counter() - started
    full = [t[0].clone() for layer in range(args.layers) for t in layer_kv(cache, layer)]
    lo, hi = engine.heads
    count = blocks_for(tokens, args.block_tokens)
    table = reload_table(gen, args.num_gpu_blocks, set(), count)
    engine.paged.write(table, [t[lo:hi] for t in full])
    chunks = tuple(base_chunk + j // args.blocks_per_chunk for j in range(count))
    positions = tuple(j % args.blocks_per_chunk for j in range(count))
    started = engine.start_together()
    engine.copy("store", table, chunks, positions)
    store_s = time.perf_counter() - started
    first = next_token(out.logits)
    reference = greedy(engine.model, cache, first, tokens, args.decode_tokens)
    return Prompt(index, tokens, chunks, positions, table, engine.paged.pages(table), full,
                  reference, first, prefill_s, store_s)


def reload_once(engine: Engine, prompt: Prompt, reload: int, table: list[int], args: Any
                ) -> dict[str, Any]:
    """Poison, load into ``table``, check the pages, rebuild the cache, decode; this rank's
    outcome with the first difference it saw."""
    engine.paged.poison()
    started = engine.start_together()
    engine.copy("load", table, prompt.chunks, prompt.positions)
    loaded = time.perf_counter()
    if args.corrupt_after_load and dist.get_rank() == 0 and prompt.index == 0 and reload == 0:
        engine.paged.corrupt(table[0])
    pages = engine.paged.pages(table)
    full = engine.gather_heads([from_pages(p, prompt.tokens) for p in pages])
    cache = build_cache(engine.tf, full)
    sync(engine.device)
    rebuilt = time.perf_counter()
    first = greedy(engine.model, cache, prompt.first_token, prompt.tokens, 1)
    sync(engine.device)
    answered = time.perf_counter()
    kv_diff = page_difference(prompt, pages, engine.heads, args) or cache_difference(prompt,
                                                                                     full)
    tokens = first + greedy(engine.model, cache, first[-1], prompt.tokens + 1,
                            args.decode_tokens - 1)[1:]
    outcome = judge(prompt, reload, tokens, kv_diff)
    return {**outcome, "mode": "whole", "reload_s": loaded - started,
            "rebuild_s": rebuilt - loaded, "ttft_s": answered - started,
            "forward_s": answered - rebuilt}


def reload_layerwise(engine: Engine, prompt: Prompt, reload: int, table: list[int],
                     args: Any) -> dict[str, Any]:
    """The same reload, layer-wise, against the step it overlaps.  First the load alone (its
    time against the whole load's; its pages are checked too); then the first decode step from
    those pages (``paged_forward_s``: every layer's cache entry built from the pages, as the
    engine's attention would read them, without waiting for anything); then both at once: the
    load goes in ``--layerwise`` groups, every layer's cache entry is queued on a side stream
    behind its group's event before the step starts, and each decoder layer's pre-hook only
    makes the step wait for its entry, so the first layers compute while later ones still
    load.  The host waits for the job's decision only after the first token; the step from
    the pages is timed again after it, and the faster of its two runs is the baseline.  Every
    rank holds all heads (no gather)."""
    layers, tokens = args.layers, prompt.tokens
    group = {t: g for g, (first, count) in enumerate(tensor_ranges(2 * layers, args.layerwise))
             for t in range(first, first + count)}
    index = torch.tensor(table, device=engine.device)
    side = torch.cuda.Stream(engine.device) if engine.device.type == "cuda" else None
    engine.paged.poison()
    started = engine.start_together()
    job = CopyJob(next(engine.job_ids), "load", blocks=tuple(table), chunks=prompt.chunks,
                  positions=prompt.positions)
    engine.tier.submit(job, layer_groups=args.layerwise)
    engine.tier.wait([job.job_id])
    alone_s = time.perf_counter() - started
    if args.corrupt_after_load and dist.get_rank() == 0 and prompt.index == 0 and reload == 0:
        engine.paged.corrupt(table[0])
    alone_diff = page_difference(prompt, engine.paged.pages(table), engine.heads, args)
    started = engine.start_together()
    step_from_pages(engine, prompt, index, [None] * layers, side)
    sync(engine.device)
    paged_forward_s = time.perf_counter() - started
    engine.paged.poison()
    started = engine.start_together()
    job = CopyJob(next(engine.job_ids), "load", blocks=tuple(table), chunks=prompt.chunks,
                  positions=prompt.positions)
    events = engine.tier.submit(job, layer_groups=args.layerwise)
    submitted = time.perf_counter()
    first, cache = step_from_pages(engine, prompt, index,
                                   [events[group[2 * at + 1]] for at in range(layers)], side)
    sync(engine.device)
    answered = time.perf_counter()
    engine.tier.wait([job.job_id])
    decided = time.perf_counter()
    pages = engine.paged.pages(table)
    full = [t[0] for layer in range(layers) for t in layer_kv(cache, layer)]
    kv_diff = alone_diff or page_difference(prompt, pages, engine.heads, args) or \
        cache_difference(prompt, [t[:, :tokens] for t in full])
    rest = greedy(engine.model, cache, first[-1], tokens + 1, args.decode_tokens - 1)
    outcome = judge(prompt, reload, first + rest[1:], kv_diff)
    # the step from the pages once more, now after the overlapped one: this host-bound step
    # drifts with what ran before it, and the lower of the two is the stricter baseline
    again = engine.start_together()
    step_from_pages(engine, prompt, index, [None] * layers, side)
    sync(engine.device)
    paged_forward_s = min(paged_forward_s, time.perf_counter() - again)
    return {**outcome, "mode": "layerwise", "reload_s": decided - started, "rebuild_s": 0.0,
            "ttft_s": answered - started, "forward_s": None, "load_alone_s": alone_s,
            "paged_forward_s": paged_forward_s, "submit_s": submitted - started}


def step_from_pages(engine: Engine, prompt: Prompt, index: torch.Tensor,
                    events: list[torch.cuda.Event | None], side: torch.cuda.Stream | None
                    ) -> tuple[list[int], Any]:
    """The first decode step after ``prompt`` from the pages of ``index``: every layer's
    cache entry queued (`queue_cache`; behind ``events[layer]`` where given), each decoder
    layer's pre-hook making the step wait for its entry.  Returns the token and the cache."""
    cache = engine.tf.DynamicCache()
    ready = queue_cache(engine, cache, events, index, prompt.tokens, side)

    def wait_for(layer: int) -> None:
        entry = ready[layer]
        if entry is not None:
            torch.cuda.current_stream(engine.device).wait_event(entry)

    hooks = [layer.register_forward_pre_hook(lambda _m, _a, at=at: wait_for(at))
             for at, layer in enumerate(engine.model.model.layers)]
    try:
        first = greedy(engine.model, cache, prompt.first_token, prompt.tokens, 1)
    finally:
        for hook in hooks:
            hook.remove()
    return first, cache


def queue_cache(engine: Engine, cache: Any, events: list[torch.cuda.Event | None],
                index: torch.Tensor, tokens: int, side: torch.cuda.Stream | None
                ) -> list[torch.cuda.Event | None]:
    """Put every layer's entry in ``cache``, built from the pages of ``index`` on the
    ``side`` stream once the layer's load event (``events[layer]``) fired, all queued now;
    returns per layer the event after which its entry is there (None on the CPU, where the
    entries are built at once)."""
    if side is None:
        for layer in range(len(events)):
            k, v = engine.paged.layer(layer, index, tokens)
            cache.update(k[None], v[None], layer)
        return [None] * len(events)
    main = torch.cuda.current_stream(engine.device)
    side.wait_stream(main)  # the poisoned pages and the index upload come first
    index.record_stream(side)  # made on the main stream, read on this one
    ready: list[torch.cuda.Event | None] = []
    with torch.cuda.stream(side):
        for layer, event in enumerate(events):
            if event is not None:
                side.wait_event(event)
            k, v = engine.paged.layer(layer, index, tokens)
            cache.update(k[None], v[None], layer)
            for entry in layer_kv(cache, layer):  # made on this stream, read on the main one
                entry.record_stream(main)
            done = torch.cuda.Event()
            done.record(side)
            ready.append(done)
    return ready


def judge(prompt: Prompt, reload: int, tokens: list[int], kv_diff: dict[str, Any] | None
          ) -> dict[str, Any]:
    """This rank's outcome of one reload: its first difference (KV or token), or none."""
    step = next((i for i, (a, b) in enumerate(zip(tokens, prompt.reference_tokens, strict=True))
                 if a != b), None)
    token_diff = None if step is None else {
        "what": "token", "position": prompt.tokens + step,
        "expected": prompt.reference_tokens[step], "got": tokens[step]}
    diff = kv_diff or token_diff
    if diff is not None:  # where, what, and whether decoding diverged (at which step)
        diff = {"rank": dist.get_rank(), "prompt": prompt.index, "reload": reload, **diff,
                "decode_diverged_at_step": step}
    return {"ok": diff is None, "difference": diff}


def tensor_name(t: int) -> tuple[int, str]:
    return t // 2, "KV"[t % 2]


def page_difference(prompt: Prompt, pages: list[torch.Tensor], heads: tuple[int, int],
                    args: Any) -> dict[str, Any] | None:
    for t, (expected, got) in enumerate(zip(prompt.pages, pages, strict=True)):
        at = first_difference(expected, got)
        if at is not None:
            block, offset, head, dim = at
            layer, kind = tensor_name(t)
            return {"what": "page", "layer": layer, "tensor": kind,
                    "position": block * args.block_tokens + offset, "head": heads[0] + head,
                    "dim": dim, "block_index": block}
    return None


def cache_difference(prompt: Prompt, full: list[torch.Tensor]) -> dict[str, Any] | None:
    for t, (expected, got) in enumerate(zip(prompt.reference_kv, full, strict=True)):
        at = first_difference(expected, got)
        if at is not None:
            head, position, dim = at
            layer, kind = tensor_name(t)
            return {"what": "cache", "layer": layer, "tensor": kind, "position": position,
                    "head": head, "dim": dim}
    return None


# ---------------------------------------------------------------------- the job
def parse_prompts(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise OffloadError(f"--prompt-tokens {text!r} is not a comma-separated list of token "
                           "counts; give e.g. 37,64,90") from None
    if not lengths or min(lengths) < 1:
        raise OffloadError(f"--prompt-tokens {text!r}: every prompt needs at least 1 token")
    return lengths


def check_args(args: argparse.Namespace) -> None:
    for name in ("reloads_per_prompt", "block_tokens", "num_gpu_blocks", "blocks_per_chunk",
                 "layers", "hidden_size", "heads"):
        if getattr(args, name) < 1:
            raise OffloadError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at "
                               "least 1")
    if args.decode_tokens < 1:
        raise OffloadError(f"--decode-tokens {args.decode_tokens} must be at least 1")
    if not 0 <= args.layerwise <= 2 * args.layers:
        raise OffloadError(f"--layerwise {args.layerwise} must be 0 (off) to 2 x --layers "
                           f"({2 * args.layers}): one group per layer is --layerwise "
                           f"{args.layers}")
    if args.layerwise and args.layout != "replicated" and dist.get_world_size() > 1:
        raise OffloadError(f"--layerwise needs every rank to hold all KV heads, but layout "
                           f"{args.layout!r} splits them over {dist.get_world_size()} ranks; "
                           "use --layout replicated or one rank")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    replicated = args.layout == "replicated"
    kv_heads = args.kv_heads if args.kv_heads is not None else (1 if replicated else 4)
    heads = head_range(kv_heads, world, rank, replicated)
    lengths = parse_prompts(args.prompt_tokens)
    tf = import_transformers()
    device = pick_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(tf, args, kv_heads, device, dtype)
    paged = PagedCache(args.layers, args.num_gpu_blocks, args.block_tokens, heads[1] - heads[0],
                       args.hidden_size // args.heads, dtype, device, args.kv_views)
    config = TierConfig(cpu_bytes_per_node=parse_size(args.cpu_bytes, "--cpu-bytes"),
                        layout=args.layout, blocks_per_chunk=args.blocks_per_chunk, tp=world,
                        shm_dir=args.shm_dir, timeout_s=args.timeout)
    tier = HostTier.create(paged.tensors, config)
    try:
        engine = Engine(tf, model, tier, paged, device, heads, replicated)
        with torch.no_grad():
            prompts, outcomes = drive(engine, lengths, args)
    finally:
        tier.close()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, outcomes)
    left = shm_files_left(tier, args.shm_dir or "/dev/shm")
    report = build_report(args, tier, kv_heads, heads, dtype, tf.__version__, prompts, gathered)
    report["shm_files_left"] = left
    ok = report["matched"] == report["reloads"] and report["mismatched"] == 0 and left == 0
    if rank == 0:
        print(summary(report), flush=True)
        if args.report_json:
            write_json(args.report_json, report)
        if not ok:
            log.error("prefix reload failed: %d of %d reloads mismatched, first difference %s, "
                      "%d shm files left", report["mismatched"], report["reloads"],
                      json.dumps(report["first_difference"]), left)
    return 0 if ok else 1


def drive(engine: Engine, lengths: list[int], args: Any
          ) -> tuple[list[Prompt], list[dict[str, Any]]]:
    """Store every prompt, then reload each ``--reloads-per-prompt`` times (prompts
    interleaved, so a later store clobbering an earlier prompt's chunks would show)."""
    chunk_count = engine.tier.plan.chunk_count
    need = sum(blocks_for(n, args.block_tokens) for n in lengths)
    per_chunk = args.blocks_per_chunk
    chunks_needed = sum(-(-blocks_for(n, args.block_tokens) // per_chunk) for n in lengths)
    if chunks_needed > chunk_count:
        raise OffloadError(f"the prompts need {chunks_needed} chunks ({need} blocks) but the "
                           f"tier holds {chunk_count}; raise --cpu-bytes or shorten "
                           "--prompt-tokens")
    gen = torch.Generator().manual_seed(args.seed)
    prompts: list[Prompt] = []
    base = 0
    for index, tokens in enumerate(lengths):
        prompts.append(prefill_and_store(engine, index, tokens, base, args, gen))
        base = prompts[-1].chunks[-1] + 1
    outcomes = []
    for reload in range(args.reloads_per_prompt):
        for prompt in prompts:
            # never the blocks it was stored from, nor those of its previous reload
            avoid = set(prompt.original_table).union(*prompt.tables[-1:])
            table = reload_table(gen, args.num_gpu_blocks, avoid, len(prompt.original_table))
            prompt.tables.append(table)
            outcomes.append(reload_once(engine, prompt, reload, table, args))
            if args.layerwise:
                avoid = set(prompt.original_table).union(table)
                table = reload_table(gen, args.num_gpu_blocks, avoid, len(table))
                prompt.tables.append(table)
                outcomes.append(reload_layerwise(engine, prompt, reload, table, args))
    return prompts, outcomes


def build_report(args: argparse.Namespace, tier: HostTier, kv_heads: int,
                 heads: tuple[int, int], dtype: torch.dtype, tf_version: str,
                 prompts: list[Prompt], gathered: list[list[dict[str, Any]]]
                 ) -> dict[str, Any]:
    """Every rank's outcomes -> one verdict per reload (matched only when every rank matched),
    job-level times (the slowest rank)."""
    per_reload = list(zip(*gathered, strict=True))
    matched = [all(o["ok"] for o in ranks) for ranks in per_reload]
    diffs = [o["difference"] for ranks in per_reload for o in ranks if o["difference"]]
    modes = ["whole", "layerwise"] if args.layerwise else ["whole"]
    order = [p for _ in range(args.reloads_per_prompt) for p in prompts for _ in modes]

    def slowest(field: str, mode: str = "whole") -> list[float]:
        """Per reload of ``mode``, the slowest rank's ``field``."""
        return [max(o[field] for o in ranks) for ranks in per_reload
                if ranks[0]["mode"] == mode]

    reload_s, rebuild_s = slowest("reload_s"), slowest("rebuild_s")
    prefill = statistics.median(p.prefill_s for p in prompts)
    reload = statistics.median(reload_s)
    ttft = {"whole": slowest("ttft_s"), "forward": slowest("forward_s")}
    if args.layerwise:
        ttft["layerwise"] = slowest("ttft_s", "layerwise")
        ttft["layerwise_load"] = slowest("reload_s", "layerwise")
        ttft["layerwise_load_alone"] = slowest("load_alone_s", "layerwise")
        ttft["paged_forward"] = slowest("paged_forward_s", "layerwise")
        ttft["layerwise_submit"] = slowest("submit_s", "layerwise")  # host time, in the TTFT
        # issue 23's measure, per reload: the overlapped first token against the longer of
        # the load alone and the step from the pages (the target is 1.15 at most)
        ttft["layerwise_over_longer"] = [
            t / max(a, f) for t, a, f in zip(ttft["layerwise"], ttft["layerwise_load_alone"],
                                             ttft["paged_forward"], strict=True)]
    return {
        "world_size": dist.get_world_size(), "tp": dist.get_world_size(), "layout": args.layout,
        "device": str(prompts[0].pages[0].device.type), "dtype": str(dtype).removeprefix("torch."),
        "kv_views": args.kv_views, "torch": torch.__version__, "transformers": tf_version,
        "model": {"family": "llama", "layers": args.layers, "hidden_size": args.hidden_size,
                  "heads": args.heads, "kv_heads": kv_heads, "head_dim":
                  args.hidden_size // args.heads, "vocab": 1000, "seed": args.seed},
        "kv_heads_per_rank": heads[1] - heads[0], "block_tokens": args.block_tokens,
        "plan": {"chunk_count": tier.plan.chunk_count,
                 "blocks_per_chunk": tier.plan.blocks_per_chunk},
        "prompts": [{"tokens": p.tokens, "blocks": len(p.original_table), "chunks":
                     sorted(set(p.chunks)), "prefill_s": p.prefill_s, "store_s": p.store_s,
                     "tables": [p.original_table, *p.tables],
                     "reference_tokens": p.reference_tokens} for p in prompts],
        "reloads": len(matched), "matched": sum(matched),
        "mismatched": len(matched) - sum(matched),
        "restored_tokens": sum(p.tokens for p, ok in zip(order, matched, strict=True) if ok),
        "time_s": {"prefill_median": prefill, "reload_median": reload,
                   "rebuild_median": statistics.median(rebuild_s),
                   "reload_over_prefill": reload / prefill if prefill else None,
                   "reload": reload_s, "rebuild": rebuild_s,
                   "ttft": ttft, "ttft_median": {k: statistics.median(v)
                                                 for k, v in ttft.items()}},
        "layerwise_groups": args.layerwise,
        "first_difference": diffs[0] if diffs else None,
    }


def summary(report: dict[str, Any]) -> str:
    t = report["time_s"]
    first = t["ttft_median"]
    line = (f"prefix reload ({report['layout']}, {report['world_size']} ranks, "
            f"{report['device']} {report['dtype']}): {report['matched']}/{report['reloads']} "
            f"reloads matched, {report['mismatched']} mismatched, {report['restored_tokens']} "
            f"tokens restored; median reload {t['reload_median'] * 1e3:.2f} ms (+ rebuild "
            f"{t['rebuild_median'] * 1e3:.2f} ms) vs prefill {t['prefill_median'] * 1e3:.2f} ms; "
            f"first token {first['whole'] * 1e3:.2f} ms after the load started")
    if "layerwise" in first:
        line += (f", layer-wise ({report['layerwise_groups']} groups) "
                 f"{first['layerwise'] * 1e3:.2f} ms (its load decided after "
                 f"{first['layerwise_load'] * 1e3:.2f} ms, alone after "
                 f"{first['layerwise_load_alone'] * 1e3:.2f} ms; one forward step "
                 f"{first['forward'] * 1e3:.2f} ms from a built cache, "
                 f"{first['paged_forward'] * 1e3:.2f} ms from the pages; "
                 f"{first['layerwise_over_longer']:.2f}x the longer of load and step)")
    return line + f"; shm files left: {report['shm_files_left']}"


def main(argv: list[str] | None = None) -> int:
    return start(run, build_parser(), argv)


if __name__ == "__main__":
    cleanup.exit_after(main)
