"""The whole tier on CUDA across real ranks: every rank registers exactly its own bytes, the
Triton engine round-trips KV blocks byte-exact in every layout, and a failed registration rolls
back without leaving a sticky CUDA error."""

from __future__ import annotations

import pytest
import torch

from offload.config import TierConfig
from tests.harness import run_group, store_drop_load
from tests.test_tier import STAGE_PAGES, replicated_stages_body

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MiB = 1 << 20


@pytest.mark.parametrize("layout", ["private", "shared", "replicated"])
def test_pinned_bytes_are_own_slot_bytes_and_blocks_round_trip(layout: str, shm_dir: str
                                                                ) -> None:
    def body(rank: int) -> object:
        import torch

        from offload import HostTier

        torch.cuda.set_device(rank % torch.cuda.device_count())
        gen = torch.Generator(device="cuda").manual_seed(7 if layout == "replicated" else rank)
        kv = [torch.randint(0, 256, (64, 16384), generator=gen, dtype=torch.uint8,
                            device="cuda"),
              torch.randint(0, 256, (64, 4096), generator=gen, dtype=torch.uint8,
                            device="cuda")]
        original = [t.clone() for t in kv]
        tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=64 * MiB, layout=layout,
                                              blocks_per_chunk=8, tp=2, timeout_s=60,
                                              shm_dir=shm_dir))
        row = tier.actor.report()
        blocks = tuple(range(64))
        chunks = tuple((7 * (b // 8)) % tier.plan.chunk_count for b in blocks)
        positions = tuple(b % 8 for b in blocks)
        store_drop_load(tier, kv, blocks, chunks, positions)
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(kv, original, strict=True))
        own = tier.plan.chunk_count * tier.plan.slots[rank].slot_bytes
        tier.close()
        return same, row["engine"], row["pinned"], row["pinned_bytes"], own, row["region_bytes"]

    out = run_group(body, 2, timeout=120, pg_timeout=60)
    assert all(o.ok for o in out), [o.error for o in out]
    for same, engine, pinned, pinned_bytes, own, region in (o.value for o in out):
        assert same and engine in ("hybrid", "triton") and pinned
        assert pinned_bytes == own  # replicated with one stage: the slot is the row
        assert layout == "shared" or own == region


@pytest.mark.parametrize(("tp", "stages", "nodes"), [
    (1, 2, None), (2, 2, None), (1, 4, None), (1, 4, ["n0", "n0", "n1", "n1"])])
@pytest.mark.parametrize("equal", [False, True], ids=["unequal", "equal"])
def test_replicated_pipeline_stages_load_their_own_stage_bytes_on_cuda(
        tp: int, stages: int, nodes: list[str] | None, equal: bool, shm_dir: str) -> None:
    """The CPU test's replicated TP x PP round trip with CUDA KV tensors, pinned regions and
    the CUDA engines: each stage's writer stores, every rank loads its own stage's bytes and
    registers only its stage's slot."""
    pages = (STAGE_PAGES[0],) * stages if equal else STAGE_PAGES[:stages]
    out = run_group(replicated_stages_body, tp * stages, args=(tp, pages, shm_dir, "cuda"),
                    nodes=nodes, timeout=180, pg_timeout=90)
    assert all(o.ok for o in out), [o.error for o in out]
    assert [o.value[:3] for o in out] == [(True, True, True)] * len(out)
    per_node = len(out) if nodes is None else 2
    assert [o.value[3] for o in out] == [(r % per_node) // tp for r in range(len(out))]
    assert all(o.value[4] == o.value[5] for o in out)  # pinned bytes = own stage slot bytes


def test_failed_registration_rolls_back_and_leaves_no_sticky_error() -> None:
    from offload.region.geometry import ByteRange
    from offload.region.pin import CudaRegistrar, Pinner
    from offload.system.nameless import create_memfds
    from offload.system.shm import Mapping, close_fds

    fds = create_memfds(f"gputest-{torch.cuda.current_device()}-rollback", [8 * MiB], 1)
    mapping = Mapping(fds, [8 * MiB])
    close_fds(fds)
    registrar = CudaRegistrar(torch.device("cuda"))
    try:
        good = ByteRange(0, 4 * MiB)
        overlapping = ByteRange(2 * MiB, 4 * MiB)  # overlaps the first: the driver refuses
        pinner = Pinner(registrar, mapping.address)
        pinner.pin(good)
        with pytest.raises(RuntimeError, match="cuMemHostRegister"):
            pinner.pin(overlapping)
        pinner.unpin_all()
        # rolled back: the first range registers again, and CUDA still works normally
        registrar.register(mapping.address, 4 * MiB)
        registrar.unregister(mapping.address)
        x = torch.ones(1024, device="cuda")
        assert float(x.sum().item()) == 1024.0
    finally:
        mapping.close()


def test_submit_returns_the_copy_event_the_compute_stream_waits_on() -> None:
    """A load's event orders the compute stream after the copy with no host round trip; a
    store ordered ``after`` a side stream sees that stream's pending write."""

    def body(rank: int) -> object:
        import torch

        from offload import CopyJob, HostTier

        torch.cuda.set_device(rank % torch.cuda.device_count())
        kv = [torch.zeros((16, 16384), dtype=torch.uint8, device="cuda")]
        tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=16 * MiB, blocks_per_chunk=4,
                                              tp=2, timeout_s=60))
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)
            kv[0][3].fill_(7 + rank)
        stored = tier.submit(CopyJob(1, "store", (3,), (2,), (1,)), after=side)
        tier.wait([1])
        kv[0].zero_()
        loaded = tier.submit(CopyJob(2, "load", (5,), (2,), (1,)))
        torch.cuda.current_stream().wait_event(loaded)
        seen = kv[0][5].clone()  # on the compute stream, after the load's event
        tier.wait([2])
        ok = bool((seen == 7 + rank).all())
        tier.close()
        return ok, stored is not None and loaded is not None

    out = run_group(body, 2, timeout=120, pg_timeout=60)
    assert all(o.ok for o in out), [o.error for o in out]
    assert [o.value for o in out] == [(True, True)] * 2


@pytest.mark.parametrize(("layout", "setup_context", "backend", "integrity"), [
    ("private", True, "auto", True), ("shared", True, "auto", True),
    ("replicated", True, "auto", True), ("shared", False, "auto", True),
    ("private", True, "copy_engine", False), ("private", False, "copy_engine", False),
    ("private", True, "copy_engine", True)])
def test_background_set_up_serves_ready_rows_on_cuda_while_the_rest_is_registered(
        layout: str, setup_context: bool, backend: str, integrity: bool) -> None:
    """Real CUDA registration behind `create`: jobs on ready rows run on the real engine and
    round-trip byte-exact while set-up continues, a job past the ready rows is failed on every
    rank, and once every row is ready every rank has registered exactly its blocking bytes --
    in a registrar context of the tier's own (``setup_context``, the tier's default
    `choose_registrar` wrapped to slow it) or in the engine's; on the default engine and on
    the copy engine (``cuMemcpyBatchAsync``, with and without checksums)."""

    def body(rank: int) -> object:
        import time

        import torch

        from offload import CopyJob, HostTier, OffloadError

        torch.cuda.set_device(rank % torch.cuda.device_count())
        gen = torch.Generator(device="cuda").manual_seed(7 if layout == "replicated" else rank)
        kv = [torch.randint(0, 256, (64, 16384), generator=gen, dtype=torch.uint8,
                            device="cuda") for _ in range(4)]
        original = [t.clone() for t in kv]
        from offload.region.pin import CudaRegistrar

        class Unhurried(CudaRegistrar):
            """Set-up must outlast the JIT and the first jobs for the test to see it: the
            first 64 registrations take 50 ms more each (the shared layout registers its
            ~2,000 slots one by one; all of them slowed took ~100 s)."""

            calls = 0

            def register(self, address: int, length: int) -> None:
                self.calls += 1
                if self.calls <= 64:
                    time.sleep(0.05)
                super().register(address, length)

        import offload.actor

        offload.actor.choose_registrar = Unhurried  # type: ignore[assignment]
        tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=2048 * MiB, layout=layout,
                                              blocks_per_chunk=8, tp=2, timeout_s=60,
                                              background=True, setup_context=setup_context,
                                              integrity=integrity), backend=backend)
        created = tier.ready
        while tier.ready.rows < 8:
            time.sleep(0.001)
        seen = tier.ready
        # refused on every rank: submit returns with no event, the decision says why
        refused = tier.submit(CopyJob(99, "store", (0,), (tier.plan.chunk_count - 1,),
                                      (0,))) is None
        blocks = tuple(range(64))
        chunks = tuple(b // 8 for b in blocks)  # rows 0..7: ready
        positions = tuple(b % 8 for b in blocks)
        tier.submit(CopyJob(1, "store", blocks, chunks, positions))
        try:
            tier.wait([99, 1])
            outcome = "all ok"
        except OffloadError as exc:
            outcome = str(exc)
        for t in kv:
            t.zero_()
        tier.submit(CopyJob(2, "load", blocks, chunks, positions))
        tier.wait([2])
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(kv, original, strict=True))
        tier.wait_ready(120)
        row = tier.actor.report()
        # set-up registered in a context of its own exactly when asked to, and says so
        own = (tier.actor.region.registrar.own_context, row["own_registration_context"])
        tier.close()
        return (created.rows < created.total, seen.rows < seen.total, refused, outcome,
                same, row["pinned"], row["pinned_bytes"], row["pin_plan_bytes"],
                row["setup_error"], row["longest_registration_s"], own, row["engine"])

    out = run_group(body, 2, timeout=240, pg_timeout=120)
    assert all(o.ok for o in out), [o.error for o in out]
    for (early, partial, refused, outcome, same, pinned, pinned_bytes, plan_bytes, error,
         longest, own, engine) in (o.value for o in out):
        assert own == (setup_context, setup_context)
        assert backend == "auto" or engine == backend
        assert early and partial  # create returned, and the jobs ran, before set-up finished
        assert refused  # every rank refuses a row it has not registered yet, and returns
        assert "job 99" in outcome and "not ready" in outcome  # decided failed everywhere
        assert same  # the ready rows round-tripped byte-exact on the real engine
        assert pinned and pinned_bytes == plan_bytes and error is None and longest > 0
