# SPDX-License-Identifier: Apache-2.0
"""The host backend's page checksums end to end (DESIGN.md section 6, "Trust"), on both of its
implementations (native and numpy; the definition itself: `tests/test_checksum.py`).

A store writes the sums into the slot's trailer; a
load of damaged bytes -- a flipped bit, a zeroed page, two swapped pages, a stale page, a
page (with its sum) from another chunk, tensor or rank -- still finishes but `job_error`
names the tensor, chunk and position, and `mismatches` counts it; integrity off writes no
trailer and checks nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload import integrity
from offload.config import TierConfig
from offload.control.plan import RankDescriptor, compute_plan
from offload.errors import OffloadError
from offload.observe.report import integrity_block, render_table
from offload.transfer import SlotLayout, make_engine
from offload.transfer import host as host_module
from offload.transfer.base import TransferEngine
from offload.transfer.host import HostEngine
from tests.transfer.helpers import kv_set

PAGES = (512, 40_000, 60, 512)  # one unit, three units (16 KiB pieces), odd sizes, a twin
BPC, CHUNKS, BLOCKS = 4, 6, 32


# ------------------------------------------------------------------ the host engine
@pytest.fixture(autouse=True, params=["native", "numpy"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every host-engine test runs on both implementations of a job: the native one
    (``page_sums.c``) and the numpy reference (no compiler, ``OFFLOAD_NATIVE=0``)."""
    if request.param == "native":
        if host_module.page_sums_library() is None:
            pytest.skip("no C compiler: the native host path cannot be built")
    else:
        monkeypatch.setattr(host_module, "page_sums_library", lambda: None)
    return str(request.param)


def make_layout(config: TierConfig, rank: int = 0, pages: tuple[int, ...] = PAGES
                ) -> tuple[SlotLayout, int]:
    plan = compute_plan([RankDescriptor(r, "n0", r, 2, r, 0, pages, config) for r in range(2)])
    return SlotLayout.from_plan(plan, rank), plan.chunk_count


def make_engine_for(integrity_on: bool = True, rank: int = 0,
                    region: torch.Tensor | None = None, pages: tuple[int, ...] = PAGES
                    ) -> tuple[TransferEngine, list[torch.Tensor], torch.Tensor, SlotLayout]:
    config = TierConfig(cpu_bytes_per_node=CHUNKS * 2 * 200_000, layout="shared",
                        blocks_per_chunk=BPC, tp=2, integrity=integrity_on)
    layout, chunk_count = make_layout(config, rank, pages)
    assert chunk_count >= CHUNKS
    if region is None:
        region = torch.zeros(layout.region_bytes(CHUNKS), dtype=torch.uint8)
    kv = [t.view(torch.uint8).reshape(BLOCKS, -1) for t in kv_set(BLOCKS, pages, seed=rank)]
    return make_engine(kv, region, None, layout, CHUNKS, pinned=False), kv, region, layout


def page_at(layout: SlotLayout, tensor: int, chunk: int, position: int) -> slice:
    page = layout.page_bytes[tensor]
    start = (chunk * layout.row_stride + layout.slot_offset + layout.tensor_offsets[tensor]
             + position * page)
    return slice(start, start + page)


def sums_at(layout: SlotLayout, tensor: int, chunk: int, position: int) -> slice:
    units = layout.units[tensor]
    start = (int(layout.trailer_offsets()[tensor]) + chunk * layout.row_stride
             + 8 * position * units)
    return slice(start, start + 8 * units)


def store_all(engine: TransferEngine, job_id: int = 1, first_block: int = 0) -> None:
    """Blocks first_block.. into chunks 0..2, every position (a large job: one gather per
    tensor), then one small job into chunk 3 (page by page)."""
    n = 3 * BPC
    engine.submit(job_id, "store", np.arange(first_block, first_block + n),
                  np.repeat(np.arange(3), BPC), np.tile(np.arange(BPC), 3))
    engine.submit(job_id + 1, "store", [first_block + n], [3], [1])
    assert engine.wait_all() == [job_id, job_id + 1]
    assert engine.job_error(job_id) is None and engine.job_error(job_id + 1) is None


def load_chunk(engine: TransferEngine, chunk: int, job_id: int = 9) -> str | None:
    engine.submit(job_id, "load", list(range(20, 20 + BPC)), [chunk] * BPC, list(range(BPC)))
    assert engine.wait_all() == [job_id]  # finished, and its failure is on record
    return engine.job_error(job_id)


def flip(region: torch.Tensor, layout: SlotLayout, byte: int) -> None:
    region[page_at(layout, 1, 2, 3).start + byte] ^= 0x10


def zero(region: torch.Tensor, layout: SlotLayout, byte: int) -> None:
    region[page_at(layout, 1, 2, 3)] = 0


def swap(region: torch.Tensor, layout: SlotLayout, byte: int) -> None:
    a, b = page_at(layout, 1, 2, 3), page_at(layout, 1, 2, 1)
    region[a], region[b] = region[b].clone(), region[a].clone()


def other_chunk(region: torch.Tensor, layout: SlotLayout, byte: int) -> None:
    """Chunk 1's page and its sums copied over chunk 2's: a valid page, the wrong chunk."""
    region[page_at(layout, 1, 2, 3)] = region[page_at(layout, 1, 1, 3)]
    region[sums_at(layout, 1, 2, 3)] = region[sums_at(layout, 1, 1, 3)]


def other_tensor(region: torch.Tensor, layout: SlotLayout, byte: int) -> None:
    """Tensor 0's page and sum over tensor 3's (same page size)."""
    region[page_at(layout, 3, 2, 3)] = region[page_at(layout, 0, 2, 3)]
    region[sums_at(layout, 3, 2, 3)] = region[sums_at(layout, 0, 2, 3)]


def bad_sum(region: torch.Tensor, layout: SlotLayout, byte: int) -> None:
    region[sums_at(layout, 1, 2, 3).start + byte % 24] ^= 0x01


DAMAGE: dict[str, tuple[Callable[[torch.Tensor, SlotLayout, int], None], str]] = {
    "flipped bit": (flip, "tensor 1 chunk 2 position 3"),
    "zeroed page": (zero, "tensor 1 chunk 2 position 3"),
    "swapped pages": (swap, "tensor 1 chunk 2 position 1"),
    "page of another chunk": (other_chunk, "tensor 1 chunk 2 position 3"),
    "page of another tensor": (other_tensor, "tensor 3 chunk 2 position 3"),
    "damaged sum": (bad_sum, "tensor 1 chunk 2 position 3"),
}


@pytest.mark.parametrize("pages", [PAGES, (512, 16384, 64, 512)], ids=["pieces", "one-unit"])
@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_loads_fail_naming_tensor_chunk_and_position(damage: str,
                                                             pages: tuple[int, ...]) -> None:
    """Store chunks 0..3, damage chunk 2, load chunk 0 (fine), chunk 2 (fails), chunk 1 (fine):
    the failed job is reported finished, its error names the first damaged unit, the counter
    counts one job, and the error is handed out once.  Pages of one unit each take the
    engine's all-tensors-at-once path."""
    engine, kv, region, layout = make_engine_for(pages=pages)
    store_all(engine)
    apply, where = DAMAGE[damage]
    apply(region, layout, 5)
    assert load_chunk(engine, 0, 10) is None
    error = load_chunk(engine, 2, 11)
    assert error is not None and error.startswith(f"integrity: {where}")
    assert error.endswith("does not match what was stored")
    tensor, position = int(where.split()[1]), int(where.split()[5])
    first_unit = kv[tensor][20 + position][:integrity.UNIT_BYTES]
    assert bool((first_unit == 0xFF).all())  # the damaged copy is poison, not the bytes read
    assert engine.mismatches == 1 and engine.job_error(11) is None
    assert load_chunk(engine, 1, 12) is None and engine.mismatches == 1


@settings(max_examples=60, deadline=None)
@given(byte=st.integers(0, 39_999), bit=st.integers(0, 7))
def test_a_flipped_bit_anywhere_in_a_large_page_fails_its_load(byte: int, bit: int) -> None:
    """Tensor 1's 40,000-byte pages are three units; the error says which piece, and the
    loaded copy of that piece is poison (all-ones bytes) while every other byte loaded is what
    was stored."""
    engine, kv, region, layout = make_engine_for()
    store_all(engine)
    region[page_at(layout, 1, 2, 3).start + byte] ^= 1 << bit
    error = load_chunk(engine, 2)
    piece = byte // integrity.UNIT_BYTES
    where = f" (bytes from {piece * integrity.UNIT_BYTES})" if piece else ""
    assert error == (f"integrity: tensor 1 chunk 2 position 3{where} does not match what was "
                     "stored")
    unit = slice(piece * integrity.UNIT_BYTES, (piece + 1) * integrity.UNIT_BYTES)
    loaded, host = kv[1][20 + 3], region[page_at(layout, 1, 2, 3)]
    assert bool((loaded[unit] == 0xFF).all())
    rest = torch.ones(loaded.numel(), dtype=torch.bool)
    rest[unit] = False
    assert torch.equal(loaded[rest], host[rest])
    for t, tensor in enumerate(kv):  # every other page of the job loaded as stored
        for position in range(BPC):
            if (t, position) != (1, 3):
                assert torch.equal(tensor[20 + position], region[page_at(layout, t, 2, position)])


def test_a_stale_page_fails_its_load() -> None:
    """Chunk 2 stored twice from different blocks; the first store's page put back."""
    engine, _, region, layout = make_engine_for()
    store_all(engine)
    stale = region[page_at(layout, 0, 2, 2)].clone()
    store_all(engine, job_id=3, first_block=14)
    region[page_at(layout, 0, 2, 2)] = stale
    assert load_chunk(engine, 2) == ("integrity: tensor 0 chunk 2 position 2 does not match "
                                     "what was stored")


def test_a_store_whose_copy_went_missing_fails_the_next_load() -> None:
    """Chunk 2 stored, then stored again from other blocks by a job whose copy never ran (a
    lost copy reported done): the first store's pages and sums are intact and agree, yet the
    load fails, since they carry the first store's generation.  Without generations it would
    load the first store's bytes as a success."""
    engine, kv, region, layout = make_engine_for()
    store_all(engine)
    assert isinstance(engine, HostEngine)
    issue = engine._issue

    def lost(job_id: int, direction: str, job: object, after: object) -> None:
        engine._done.append(job_id)  # completes, having moved nothing

    engine._issue = lost  # type: ignore[method-assign]
    engine.submit(5, "store", np.arange(14, 14 + BPC), [2] * BPC, np.arange(BPC))
    assert engine.wait_all() == [5] and engine.job_error(5) is None
    engine._issue = issue  # type: ignore[method-assign]
    assert load_chunk(engine, 2) == ("integrity: tensor 0 chunk 2 position 0 does not match "
                                     "what was stored")
    assert load_chunk(engine, 1, 10) is None  # pages the lost store did not name still load
    engine.submit(6, "store", np.arange(14, 14 + BPC), [2] * BPC, np.arange(BPC))
    assert engine.wait_all() == [6]
    assert load_chunk(engine, 2, 11) is None  # stored again, for real


def test_a_store_renews_exactly_the_pages_it_writes() -> None:
    """A store renews exactly the pages it writes, on the rank's engine: a page it skipped
    keeps its generation (and still loads), and the job id sets the generation."""
    engine, _, _, _ = make_engine_for()
    engine.submit(4, "store", [0, 1], [2, 2], [0, 3])
    assert engine.wait_all() == [4]
    generations = engine.generations.reshape(-1, BPC)
    assert generations[2].tolist() == [integrity.store_generation(4), 0, 0,
                                       integrity.store_generation(4)]
    assert not generations[[0, 1, 3]].any()


def test_a_slot_of_another_rank_fails_its_load() -> None:
    """Two ranks of a shared region: rank 0's whole slot of chunk 2 (pages and trailer, all
    valid) copied into rank 1's slot does not load on rank 1 (another seed)."""
    engine0, _, region, layout0 = make_engine_for(rank=0)
    engine1, _, _, layout1 = make_engine_for(rank=1, region=region)
    store_all(engine0)
    store_all(engine1)
    assert load_chunk(engine1, 2) is None
    size = layout1.slot_offset - layout0.slot_offset
    start = 2 * layout0.row_stride
    region[start + size:start + 2 * size] = region[start:start + size]
    error = load_chunk(engine1, 2)
    assert error is not None and error.startswith("integrity: tensor 0 chunk 2 position 0")


def test_a_replicated_stage_loads_what_its_writer_stored() -> None:
    """Two ranks of one pipeline stage share a slot (and its seed): the writer's sums check
    on the other rank."""
    config = TierConfig(cpu_bytes_per_node=CHUNKS * 200_000, layout="replicated",
                        blocks_per_chunk=BPC, tp=2)
    plan = compute_plan([RankDescriptor(r, "n0", r, 2, r, 0, PAGES, config) for r in range(2)])
    layouts = [SlotLayout.from_plan(plan, r) for r in range(2)]
    assert layouts[0] == layouts[1]
    region = torch.zeros(layouts[0].region_bytes(CHUNKS), dtype=torch.uint8)
    kv = [[t.view(torch.uint8).reshape(BLOCKS, -1) for t in kv_set(BLOCKS, PAGES, seed=r)]
          for r in range(2)]
    writer, reader = (make_engine(kv[r], region, None, layouts[r], CHUNKS, pinned=False)
                      for r in range(2))
    store_all(writer)
    assert load_chunk(reader, 2) is not None  # the reader saw no store: generation 0
    n = 3 * BPC  # the non-writer's side of `store_all`'s two jobs
    reader.check(1, np.arange(n), np.repeat(np.arange(3), BPC), np.tile(np.arange(BPC), 3))
    reader.check(2, [n], [3], [1])
    assert load_chunk(reader, 2) is None and reader.mismatches == 1
    assert all(torch.equal(kv[1][t][20:20 + BPC], kv[0][t][2 * BPC:3 * BPC])
               for t in range(len(PAGES)))


@pytest.mark.parametrize("moved", [True, False])
def test_a_slot_copied_to_another_chunk_loads_once_its_sums_are_moved(moved: bool) -> None:
    """What the file tier does on a promotion: chunk 1's whole slot (pages and trailer) lands
    in chunk 4.  With `move_sums` it loads there; without, every page is from another chunk."""
    engine, _, region, layout = make_engine_for()
    store_all(engine)
    assert layout.trailer_offset is not None
    size = layout.trailer_offset + 8 * BPC * sum(layout.units)  # the slot's bytes in use
    start = layout.row_stride + layout.slot_offset
    src = slice(start, start + size)
    dst = slice(src.start + 3 * layout.row_stride, src.stop + 3 * layout.row_stride)
    region[dst] = region[src]
    if moved:
        at = int(layout.trailer_offsets()[0]) + 4 * layout.row_stride
        words = region[at:at + 8 * BPC * sum(layout.units)].numpy().view(np.uint64)
        integrity.move_sums(words, layout.page_bytes, BPC, layout.seed,
                            (1, engine.generations[BPC:2 * BPC]),
                            (4, engine.generations[4 * BPC:5 * BPC]))
    error = load_chunk(engine, 4)
    assert (error is None) == moved
    if not moved:
        assert error == ("integrity: tensor 0 chunk 4 position 0 does not match what was "
                         "stored")


def test_small_and_large_jobs_write_the_same_sums() -> None:
    """The page-by-page path (small jobs) and the gather path write identical trailers."""
    small, _, small_region, layout = make_engine_for()
    large, _, large_region, _ = make_engine_for()
    blocks, chunks, positions = np.arange(12), np.repeat(np.arange(3), 4), np.tile(np.arange(4), 3)
    for i in range(12):  # one job id, so one generation, as the large job's
        small.submit(0, "store", [int(blocks[i])], [int(chunks[i])], [int(positions[i])])
        assert small.wait_all() == [0]
    large.submit(0, "store", blocks, chunks, positions)
    assert torch.equal(small_region, large_region)
    assert small_region[int(layout.trailer_offsets()[0]):].any()


def test_a_region_off_word_alignment_is_refused_with_integrity() -> None:
    config = TierConfig(cpu_bytes_per_node=CHUNKS * 2 * 200_000, layout="shared",
                        blocks_per_chunk=BPC, tp=2)
    layout, _ = make_layout(config)
    buffer = torch.zeros(layout.region_bytes(CHUNKS) + 8, dtype=torch.uint8)
    kv = [t.view(torch.uint8).reshape(BLOCKS, -1) for t in kv_set(BLOCKS, PAGES)]
    with pytest.raises(OffloadError, match="do not lie on 8-byte boundaries"):
        make_engine(kv, buffer[4:4 + layout.region_bytes(CHUNKS)], None, layout, CHUNKS,
                    pinned=False)
    make_engine(kv, buffer[8:], None, layout, CHUNKS, pinned=False)


def test_integrity_off_writes_no_trailer_and_checks_nothing() -> None:
    engine, kv, region, layout = make_engine_for(integrity_on=False)
    assert not layout.integrity
    store_all(engine)
    written = torch.zeros_like(region, dtype=torch.bool)
    for t in range(len(PAGES)):
        for c in range(4):
            for p in range(BPC):
                written[page_at(layout, t, c, p)] = True
    assert not region[~written].any()  # nothing but pages
    flip(region, layout, 5)
    assert load_chunk(engine, 2) is None and engine.mismatches == 0


def test_report_block_renders() -> None:
    block = integrity_block(True, 2)
    assert block == {"enabled": True, "mismatches": 2}
    report = {"world_size": 1, "tp": 1, "pp": 1, "layout": "private", "device": "cpu",
              "nodes": ["n0"], "shm_files_left": 0, "ranks": [], "integrity": block,
              "plan": {"chunk_count": 1, "blocks_per_chunk": 1, "cpu_bytes_per_node": 1,
                       "row_bytes": {}}}
    assert "integrity: on, 2 job(s) failed the page checksum check" in render_table(report)


# ------------------------------------------------------------------ error classes, end to end
def top_bit_pair(unit: np.ndarray, rng: np.random.Generator) -> None:
    """Bit 63 flipped in two words: two bf16 sign flips."""
    unit[rng.choice(unit.size, 2, replace=False)] ^= np.uint64(1 << 63)


def adjacent_swap(unit: np.ndarray, rng: np.random.Generator) -> None:
    """The two neighbouring words planted to differ only in bit 63, swapped."""
    at = int(np.flatnonzero((unit[:-1] ^ unit[1:]) == np.uint64(1 << 63))[0])
    unit[at], unit[at + 1] = unit[at + 1], unit[at]


def random_bits(count: int) -> Callable[[np.ndarray, np.random.Generator], None]:
    def damage(unit: np.ndarray, rng: np.random.Generator) -> None:
        for at in rng.choice(unit.size * 64, count, replace=False):
            unit[at // 64] ^= np.uint64(1) << np.uint64(at % 64)
    return damage


ERROR_CLASSES = {"top-bit pair": top_bit_pair, "adjacent swap": adjacent_swap,
                 **{f"{k} random bits": random_bits(k) for k in (1, 2, 3, 4)}}


@pytest.mark.parametrize("error", ERROR_CLASSES)
def test_every_damaged_page_of_a_load_is_caught(error: str) -> None:
    """Store every page of a tier of 16 KiB pages; damage each page of tensor 1 with one
    error of the class (an adjacent swap needs two words that differ only in bit 63: they are
    planted in the KV blocks before the store); load them all:
    every damaged page comes back poisoned (all-ones), every other page byte-exact, in
    four rounds of fresh damage."""
    pages = (16384, 16384)
    rng = np.random.default_rng(len(error))
    engine, kv, region, layout = make_engine_for(pages=pages)
    host_pages = CHUNKS * BPC
    chunks, positions = np.repeat(np.arange(CHUNKS), BPC), np.tile(np.arange(BPC), CHUNKS)
    for round_ in range(4):
        job = 10 * round_
        if error == "adjacent swap":  # the words it swaps must differ in bit 63 only
            words = kv[1][:host_pages].numpy().view(np.uint64)
            for block in range(host_pages):
                i = int(rng.integers(0, words.shape[1] - 1))
                words[block, i + 1] = words[block, i] ^ np.uint64(1 << 63)
        engine.submit(job + 1, "store", np.arange(host_pages), chunks, positions)
        assert engine.wait_all() == [job + 1] and engine.job_error(job + 1) is None
        stored = [t[:host_pages].clone() for t in kv]
        for chunk, position in zip(chunks, positions, strict=True):
            unit = region[page_at(layout, 1, int(chunk), int(position))].numpy().view(np.uint64)
            ERROR_CLASSES[error](unit, rng)
        back = np.arange(BLOCKS - host_pages, BLOCKS)
        engine.submit(job + 2, "load", back, chunks, positions)
        assert engine.wait_all() == [job + 2]
        assert engine.job_error(job + 2) is not None
        assert torch.equal(kv[0][back], stored[0])
        assert bool((kv[1][back] == 0xFF).all()), "a damaged page was not caught"
