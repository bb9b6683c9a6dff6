"""The native issue path (offload/transfer/issue.c) built with this host's compiler and driven
with stand-in driver functions: the calls it makes, in order, with which arguments, what the
kernel's parameter block holds at launch, and its failures.  The real driver runs it in
tests/gpu/test_transfer_gpu.py."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest

from offload.system import build_cache
from offload.transfer import native

pytestmark = pytest.mark.skipif(build_cache.compiler() is None, reason="needs a C compiler")

RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
UPLOAD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                          ctypes.c_void_p)
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                          ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
STREAM, ORDERED, FUNCTION, DEVICE_INDEX = 0x5000, 0x6000, 0x7000, 0x8000


class FakeKernel:
    """The parameter block of a kernel with five parameters, n (index 3) an int32 and items
    (index 4) an int64, as Triton may compile them."""

    function, threads, shared = FUNCTION, 128, 0

    def __init__(self) -> None:
        self.cells: list[Any] = [ctypes.c_int64(1), ctypes.c_int64(2), ctypes.c_int64(3),
                                 ctypes.c_int32(0), ctypes.c_int64(0)]
        self.params = (ctypes.c_void_p * 5)(*[ctypes.addressof(c) for c in self.cells])
        self.params_address = ctypes.addressof(self.params)

    def cell(self, index: int) -> tuple[int, int]:
        return ctypes.addressof(self.cells[index]), ctypes.sizeof(self.cells[index])


class FakeDriver:
    """Stand-ins for the four driver calls; each appends what it was given to ``calls`` and
    returns ``fail.get(name, 0)``.  The launch also reads n and items through the parameter
    block it receives."""

    def __init__(self, fail: dict[str, int] | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail or {}

        def record(event: int | None, stream: int | None) -> int:
            self.calls.append(("record", event, stream or 0))
            return self.fail.get("record", 0)

        def wait(stream: int | None, event: int | None, flags: int) -> int:
            self.calls.append(("wait", stream, event, flags))
            return self.fail.get("wait", 0)

        def upload(dst: int, src: int | None, size: int, stream: int | None) -> int:
            self.calls.append(("upload", dst, src, size, stream))
            return self.fail.get("upload", 0)

        def launch(function: int | None, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,
                   shared: int, stream: int | None, params: Any, extra: int | None) -> int:
            n = ctypes.cast(params[3], ctypes.POINTER(ctypes.c_int32)).contents.value
            items = ctypes.cast(params[4], ctypes.POINTER(ctypes.c_int64)).contents.value
            self.calls.append(("launch", function, (gx, gy, gz), (bx, by, bz), shared, stream,
                               n, items, extra))
            return self.fail.get("launch", 0)

        self._functions = [RECORD(record), WAIT(wait), UPLOAD(upload), LAUNCH(launch)]
        self.entry_points = tuple(int(ctypes.cast(f, ctypes.c_void_p).value or 0)
                                  for f in self._functions)


def issuer(driver: FakeDriver) -> native.NativeIssuer:
    lib = native.library()
    assert lib is not None, "the native issue path must build on this host"
    return native.NativeIssuer(lib, driver.entry_points, FakeKernel(), 3, STREAM, ORDERED,
                               DEVICE_INDEX)


def test_issue_orders_uploads_sets_the_sizes_and_launches_in_that_order() -> None:
    driver = FakeDriver()
    job = issuer(driver)
    assert job.issue(True, 0x9000, 0xA000, 64, 8, 480, 3)
    assert driver.calls == [
        ("record", ORDERED, 0x9000),
        ("wait", STREAM, ORDERED, 0),
        ("upload", DEVICE_INDEX, 0xA000, 64, STREAM),
        ("launch", FUNCTION, (3, 1, 1), (128, 1, 1), 0, STREAM, 8, 480, None)]


def test_the_legacy_default_stream_is_still_waited_for_and_no_order_skips_it() -> None:
    driver = FakeDriver()
    job = issuer(driver)
    assert job.issue(True, 0, 0xA000, 16, 2, 4, 1)  # raw handle 0: the legacy default stream
    assert driver.calls[0] == ("record", ORDERED, 0)
    driver.calls.clear()
    job.set_device_index(0x8800)
    assert job.issue(False, 0, 0xA000, 16, 2, 4, 1)
    assert [c[0] for c in driver.calls] == ["upload", "launch"]
    assert driver.calls[0][1] == 0x8800


def test_sizes_beyond_the_compiled_types_issue_nothing() -> None:
    driver = FakeDriver()
    job = issuer(driver)
    assert not job.issue(True, 1, 0xA000, 16, 2**31, 4, 1)  # n is an int32 parameter
    assert not job.issue(True, 1, 0xA000, 16, 2, -1, 1)
    assert driver.calls == []
    assert job.issue(True, 1, 0xA000, 16, 2**31 - 1, 2**40, 1)  # items is an int64
    assert driver.calls[-1][6:8] == (2**31 - 1, 2**40)


@pytest.mark.parametrize(("step", "name", "issued"), [
    ("record", "cuEventRecord", 1), ("wait", "cuStreamWaitEvent", 2),
    ("upload", "cuMemcpyHtoDAsync_v2", 3), ("launch", "cuLaunchKernel", 4)])
def test_a_failed_driver_call_raises_with_its_name_and_stops_there(step: str, name: str,
                                                                   issued: int) -> None:
    driver = FakeDriver(fail={step: 700})
    with pytest.raises(RuntimeError, match=f"{name} failed: CUDA error 700"):
        issuer(driver).issue(True, 1, 0xA000, 16, 2, 4, 1)
    assert len(driver.calls) == issued


def test_library_is_off_with_offload_native_0_or_without_a_compiler(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
    native.library.cache_clear()
    try:
        monkeypatch.setenv("OFFLOAD_NATIVE", "0")
        assert native.library() is None
        native.library.cache_clear()
        monkeypatch.delenv("OFFLOAD_NATIVE")
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        assert native.library() is None  # logged; the kernel keeps its Python path
        assert list(tmp_path.iterdir()) == []
        native.library.cache_clear()
        monkeypatch.delenv("CC")
        assert native.library() is not None
        assert len(list(tmp_path.glob("issue-*.so"))) == 1
    finally:
        native.library.cache_clear()
