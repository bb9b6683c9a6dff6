"""Pinning rules on the recording registrar, rollback, the pin pipeline, and (where CUDA is
present) the driver-API registrar from a non-main thread."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from offload.region import RecordingRegistrar, choose_registrar
from offload.region.geometry import ByteRange
from offload.region.pin import CudaRegistrar, Pinner
from offload.region.pipeline import PinPipeline
from tests.region.test_region_host import single_rank_region

KiB, MiB = 1 << 10, 1 << 20


class FailingRegistrar(RecordingRegistrar):
    """Pins for real as far as the books go (counts_as_pinned) and fails on call ``fail_on``."""

    name = "failing"
    counts_as_pinned = True

    def __init__(self, fail_on: int) -> None:
        super().__init__()
        self.fail_on = fail_on

    def register(self, address: int, length: int) -> None:
        if self.calls + 1 == self.fail_on:
            self.calls += 1
            raise RuntimeError(f"injected registration failure on call {self.fail_on}")
        super().register(address, length)


def test_pinner_registers_at_the_base_address() -> None:
    registrar = RecordingRegistrar()
    pinner = Pinner(registrar, 1 << 40)
    ranges = [ByteRange(0, 4096), ByteRange(8192, 4096)]
    for r in ranges:
        pinner.pin(r)
    assert pinner.registered == ranges
    assert registrar.registered == {1 << 40: 4096, (1 << 40) + 8192: 4096}


def test_a_failed_registration_rolls_back_the_ones_before_it() -> None:
    registrar = FailingRegistrar(fail_on=3)
    pinner = Pinner(registrar, 0)
    with pytest.raises(RuntimeError, match="call 3"):
        for i in range(5):
            pinner.pin(ByteRange(i * 4096, 4096))
    assert len(pinner.registered) == 2
    pinner.unpin_all()
    assert registrar.registered == {} and registrar.calls == 3


def test_unpin_all_tries_every_range_even_after_a_failure() -> None:
    class StickyUnregister(RecordingRegistrar):
        def unregister(self, address: int) -> None:
            super().unregister(address)
            if address == 4096:
                raise RuntimeError("unregister failed")

    registrar = StickyUnregister()
    pinner = Pinner(registrar, 0)
    for i in range(3):
        pinner.pin(ByteRange(i * 4096, 4096))
    with pytest.raises(RuntimeError, match="unregister failed"):
        pinner.unpin_all()
    assert registrar.registered == {} and pinner.registered == []


def test_private_region_registrations_respect_the_cap_and_rows() -> None:
    registrar = RecordingRegistrar()
    region = single_rank_region("private", 3 * MiB, registrar, job_id=uuid.uuid4().hex[:12],
                                max_registration_bytes=1 * MiB)
    try:
        stride = region.geometry.row_stride
        got = sorted((a - region.address, n) for a, n in registrar.registered.items())
        assert all(n <= 1 * MiB and off % stride == 0 and n % stride == 0 for off, n in got)
        assert sum(n for _, n in got) == region.size == region.stats.pin_plan_bytes
        assert region.stats.registrations == len(got) > 1
        assert not region.pinned and region.stats.pinned_bytes == 0  # recording pins nothing
    finally:
        region.close()
    assert registrar.registered == {}  # close unregistered everything


def test_region_pin_failure_rolls_back_and_leaves_a_working_unpinned_region() -> None:
    registrar = FailingRegistrar(fail_on=2)
    region = single_rank_region("private", 3 * MiB, registrar, job_id=uuid.uuid4().hex[:12],
                                max_registration_bytes=512 * KiB)
    try:
        assert not region.pinned and registrar.registered == {}
        assert region.stats.pin_error and "call 2" in region.stats.pin_error
        region.tensor_view(0).fill_(3)  # still usable
    finally:
        region.close()


def test_pipeline_registers_a_range_as_soon_as_its_pieces_are_done() -> None:
    registrar = RecordingRegistrar()
    ranges = [ByteRange(0, 4 * MiB), ByteRange(4 * MiB, 4 * MiB)]
    pieces = [ByteRange(i * 3 * MiB, min(3 * MiB, 8 * MiB - i * 3 * MiB)) for i in range(3)]
    pipeline = PinPipeline(Pinner(registrar, 0), ranges, pieces)
    pipeline.piece_done(pieces[2])  # [6, 8) MiB: range 1 still waits for [3, 6)
    pipeline.piece_done(pieces[1])  # now range 1 is complete; range 0 waits for [0, 3)
    deadline = time.monotonic() + 5
    while 4 * MiB not in registrar.registered and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(registrar.registered) == [4 * MiB]
    pipeline.piece_done(pieces[0])
    pipeline.finish()
    assert registrar.registered == {0: 4 * MiB, 4 * MiB: 4 * MiB}


def test_pipeline_holds_ranges_populated_elsewhere_until_release() -> None:
    registrar = RecordingRegistrar()
    ranges = [ByteRange(0, 4 * MiB), ByteRange(4 * MiB, 4 * MiB)]
    pieces = [ByteRange(0, 6 * MiB)]  # ours; [6, 8) MiB is another rank's
    pipeline = PinPipeline(Pinner(registrar, 0), ranges, pieces, held=[ranges[1]])
    pipeline.piece_done(pieces[0])
    deadline = time.monotonic() + 5
    while not registrar.registered and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert list(registrar.registered) == [0]  # range 1 waits for the release
    pipeline.release()
    pipeline.finish()
    assert registrar.registered == {0: 4 * MiB, 4 * MiB: 4 * MiB}


def test_pipeline_finish_reports_ranges_still_waiting() -> None:
    pipeline = PinPipeline(Pinner(RecordingRegistrar(), 0), [ByteRange(0, 4096)],
                           [ByteRange(0, 4096)])
    with pytest.raises(RuntimeError, match="still wait"):
        pipeline.finish()


def test_cpu_kv_gets_the_recording_registrar() -> None:
    assert isinstance(choose_registrar("cpu"), RecordingRegistrar)
    assert isinstance(choose_registrar("cpu", own_context=True), RecordingRegistrar)


class ClosingRegistrar(RecordingRegistrar):
    """Records what was still registered each time it was closed."""

    def __init__(self) -> None:
        super().__init__()
        self.closed_with: list[dict[int, int]] = []

    def close(self) -> None:
        self.closed_with.append(dict(self.registered))


@pytest.mark.parametrize("background", [False, True])
def test_closing_a_region_closes_its_registrar_after_every_unregistration(
        background: bool) -> None:
    """A registrar's own CUDA context unregisters what is left when destroyed, so the region
    closes it last, with nothing registered (a background set-up stopped first)."""
    registrar = ClosingRegistrar()
    region = single_rank_region("private", 64 * MiB, registrar, job_id=uuid.uuid4().hex[:12],
                                background=background)
    region.start_setup()
    setup = region.background_setup
    deadline = time.monotonic() + 30
    while setup is not None and setup.ready_rows < 1:  # close with rows registered
        assert time.monotonic() < deadline, "background set-up registered no row"
        time.sleep(0.001)
    assert registrar.registered and registrar.closed_with == []
    region.close()
    assert registrar.closed_with == [{}]
    region.close()  # idempotent: the registrar's close is too, and the region's is one call
    assert len(registrar.closed_with) in (1, 2) and all(c == {} for c in registrar.closed_with)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_registrar_works_from_a_non_main_thread() -> None:
    registrar = choose_registrar("cuda")
    assert isinstance(registrar, CudaRegistrar)
    region = single_rank_region("private", 8 * MiB, registrar, job_id=uuid.uuid4().hex[:12])
    try:
        assert region.pinned and region.stats.pinned_bytes == region.size
        region.unpin()
        errors: list[BaseException] = []

        def pin_in_thread() -> None:
            try:
                registrar.register(region.address, region.size)
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=pin_in_thread)
        worker.start()
        worker.join()
        assert not errors
        data = torch.arange(region.size, device="cuda", dtype=torch.int64).to(torch.uint8)
        region.tensor.copy_(data, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(region.tensor.to("cuda"), data)
        with pytest.raises(RuntimeError, match="cuMemHostRegister"):
            registrar.register(region.address, region.size)  # already registered
        registrar.unregister(region.address)
    finally:
        region.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_registration_in_the_registrars_own_context_is_pinned_for_the_engines() -> None:
    """Background set-up's registrar (``own_context``): its context is not the engine's, yet
    the engine's (primary) context sees the range pinned and mapped and copies from it
    byte-exact; a registration leaves the calling thread's context stack as it was (no
    context current on a fresh thread after it), and closing the registrar unregisters the
    range."""
    import ctypes

    from offload.system.cuda_driver import require_libcuda

    cuda = require_libcuda()
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    current = ctypes.c_void_p()
    cuda.cuCtxGetCurrent(ctypes.byref(current))
    engine_context = current.value
    registrar = CudaRegistrar(torch.device("cuda"), own_context=True)
    assert not registrar.own_context  # made by `prepare`, off `create`'s path
    registrar.prepare()
    assert registrar.own_context
    cuda.cuCtxGetCurrent(ctypes.byref(current))
    assert current.value == engine_context  # creating it left this thread's context alone
    host = torch.empty(16 * MiB, dtype=torch.uint8)
    left_current: list[int | None] = []

    def register_in_thread() -> None:
        registrar.register(host.data_ptr(), 16 * MiB)
        seen = ctypes.c_void_p()
        cuda.cuCtxGetCurrent(ctypes.byref(seen))
        left_current.append(seen.value)

    try:
        worker = threading.Thread(target=register_in_thread)
        worker.start()
        worker.join()
        assert left_current == [None]  # pushed and popped, not left current
        assert host.is_pinned()
        flags = ctypes.c_uint()
        assert cuda.cuMemHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(host.data_ptr())) == 0
        assert flags.value & 0x02  # mapped into the device's address space
        data = torch.randint(0, 256, (16 * MiB,), dtype=torch.uint8, device="cuda")
        host.copy_(data, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(host.to("cuda", non_blocking=True), data)
    finally:
        registrar.close()
    assert not host.is_pinned()  # destroying the context unregistered it
    registrar.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        registrar.register(host.data_ptr(), 4096)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_unprepared_own_context_registrar_makes_its_context_on_first_use() -> None:
    """Without `prepare` the first registration makes the context; one closed before any
    use made none and registers nothing after."""
    host = torch.empty(4 * MiB, dtype=torch.uint8)
    registrar = CudaRegistrar(torch.device("cuda"), own_context=True)
    try:
        registrar.register(host.data_ptr(), 4 * MiB)
        assert registrar.own_context and host.is_pinned()
    finally:
        registrar.close()
    assert not host.is_pinned()
    unused = CudaRegistrar(torch.device("cuda"), own_context=True)
    unused.close()
    assert not unused.own_context
    with pytest.raises(RuntimeError, match="closed"):
        unused.register(host.data_ptr(), 4096)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_closing_a_primary_context_registrar_leaves_it_usable() -> None:
    """The primary context outlives the tier: a second closer still unpinning after the first
    closed the registrar (the file tier's late closer beside an exit handler) must succeed."""
    host = torch.empty(4 * MiB, dtype=torch.uint8)
    registrar = CudaRegistrar(torch.device("cuda"))
    registrar.register(host.data_ptr(), 4 * MiB)
    registrar.close()
    assert host.is_pinned() and not registrar.own_context
    registrar.unregister(host.data_ptr())
    assert not host.is_pinned()
