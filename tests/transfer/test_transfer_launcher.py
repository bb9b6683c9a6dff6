"""The pre-bound kernel launch (offload/transfer/launcher.py) where no GPU is needed: when a
compiled kernel may be launched directly and when Triton's own launcher must stay.  The launch
itself runs on the device (tests/gpu/test_transfer_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from offload.transfer import launcher
from offload.transfer.launcher import BoundKernel, bind, plain_launch

PLAIN = dict(num_ctas=1, cluster_dims=(1, 1, 1), launch_cooperative_grid=False,
             launch_pdl=False, global_scratch_size=0, profile_scratch_size=0, num_warps=4,
             shared=0)


def compiled(function: int = 0x1234, **metadata: Any) -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(**{**PLAIN, **metadata}), function=function,
                           _init_handles=lambda: None)


def test_a_plain_kernel_is_launchable_and_older_metadata_defaults_to_plain() -> None:
    assert plain_launch(SimpleNamespace(**PLAIN))
    assert plain_launch(SimpleNamespace(num_warps=4, shared=0))  # fields an old Triton lacks


@pytest.mark.parametrize("field", [dict(num_ctas=2), dict(cluster_dims=(2, 1, 1)),
                                   dict(launch_cooperative_grid=True), dict(launch_pdl=True),
                                   dict(global_scratch_size=256), dict(profile_scratch_size=64)])
def test_anything_but_a_plain_launch_keeps_tritons_launcher(field: dict[str, Any]) -> None:
    assert not plain_launch(SimpleNamespace(**{**PLAIN, **field}))
    assert bind(compiled(**field), [1, 2]) is None


def test_a_profiler_hook_keeps_tritons_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "param_sizes", lambda function: [8, 4])
    monkeypatch.setattr(launcher, "bound_function", lambda *a: None)
    empty_chain, chain = SimpleNamespace(calls=[]), SimpleNamespace(calls=[print])
    assert bind(compiled(), [1, 2], hooks=(None, None)) is not None
    assert bind(compiled(), [1, 2], hooks=(empty_chain, empty_chain)) is not None  # Triton 3.5+
    assert bind(compiled(), [1, 2], hooks=(print, None)) is None  # older Triton: a callable
    assert bind(compiled(), [1, 2], hooks=(empty_chain, chain)) is None


@pytest.mark.parametrize(("sizes", "ok"), [
    ([8, 4], True),            # exactly the values
    ([8, 4, 8, 8], True),      # plus Triton's two hidden scratch pointers
    ([8, 4, 8, 8, 8], False),  # more hidden parameters than Triton appends
    ([8], False),              # fewer parameters than values
    ([8, 2], False),           # a parameter size no cell holds
    ([8, 4, 4], False),        # a trailing parameter that is not a pointer
    (None, False),             # a driver that cannot describe the function
])
def test_the_parameter_block_must_match_what_the_driver_reports(
        monkeypatch: pytest.MonkeyPatch, sizes: list[int] | None, ok: bool) -> None:
    monkeypatch.setattr(launcher, "param_sizes", lambda function: sizes)
    monkeypatch.setattr(launcher, "bound_function", lambda *a: None)
    assert (bind(compiled(), [0xDEAD_BEEF_0000, 7]) is not None) == ok


def test_values_that_outgrow_an_int32_parameter_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "param_sizes", lambda function: [8, 4])
    monkeypatch.setattr(launcher, "bound_function", lambda *a: None)
    assert bind(compiled(), [1, 2**31]) is None
    kernel = bind(compiled(), [1, 5])
    assert isinstance(kernel, BoundKernel)
    assert kernel.fits(1, 2**31 - 1) and not kernel.fits(1, 2**31) and kernel.fits(0, 2**40)


def test_cells_hold_the_values_the_driver_will_read(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    monkeypatch.setattr(launcher, "bound_function", lambda *a: None)
    kernel = BoundKernel(0x1234, 128, 0, [8, 4, 8], [0xABCD_0000_0000, 3])
    kernel.set(1, 1024)
    read = [ctypes.cast(kernel._params[i], ctypes.POINTER(t))[0]
            for i, t in enumerate((ctypes.c_int64, ctypes.c_int32, ctypes.c_int64))]
    assert read == [0xABCD_0000_0000, 1024, 0]  # the hidden scratch pointer is NULL


def test_no_driver_means_no_bound_launch() -> None:
    if launcher.libcuda() is not None:
        pytest.skip("this host has a CUDA driver")
    assert launcher.param_sizes(0x1234) is None and bind(compiled(), [1, 2]) is None
