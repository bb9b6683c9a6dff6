"""The copy kernel compiled in a child process and loaded from the kernel cache, on a device:
the serving process compiles nothing, a second process (here: a cleared table) loads from disk,
and a cache entry that is garbled, another's, writable by others, a symlink or another variant's
is compiled again, never loaded."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from offload.transfer import kernel_cache, triton_available
from offload.transfer.registration import host_registered
from tests.transfer.helpers import kv_set, round_trip, scattered_job, slot_layout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not triton_available(), reason="needs triton")]
KiB = 1 << 10
PAGES = [16 * KiB, 4 * KiB]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh kernel cache and an empty table of loaded kernels; the kernels directory."""
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_cache, "_loaded", {})
    monkeypatch.setattr(kernel_cache, "_child_failed", False)
    yield tmp_path / "cache" / "kernels"


def _children(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the child processes `kernel_cache` starts (each appends its variant count)."""
    calls: list[int] = []
    real = kernel_cache.compile_in_child

    def counted(variants: Any, device: int) -> Any:
        calls.append(len(variants))
        return real(variants, device)

    monkeypatch.setattr(kernel_cache, "compile_in_child", counted)
    return calls


def _serve(integrity: bool = True) -> Any:
    """A Triton engine prepared as a tier prepares it (`compile_all`), then a round trip; the
    engine's kernel state."""
    from offload.transfer.kernel import TritonEngine

    kv = kv_set(64, PAGES, "cuda")
    layout = slot_layout(PAGES, 4, integrity=integrity)
    buffer = torch.randint(0, 256, (layout.region_bytes(16),), dtype=torch.uint8)
    with host_registered(buffer):
        engine = TritonEngine(kv, buffer, layout, 16)
        try:
            engine.compile_all()
            round_trip(engine, kv, buffer, layout,
                       scattered_job(np.random.default_rng(3), 9, 64, 16, 4))
            return engine.kernel
        finally:
            engine.close()


def test_the_serving_process_never_compiles_the_copy_kernel(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold cache: one child compiles every variant the engine launches; this process only
    loads and binds them (nothing went through Triton here).  A second process (the table
    cleared) loads them from disk without a child."""
    children = _children(monkeypatch)
    kernel = _serve()
    assert children == [6]  # copy, sum-only and staged passes, both directions
    assert kernel._compiled == {} and kernel.launches["triton"] == 0
    entries = sorted(cache.glob("*.json"))
    assert len(entries) == 6 and all(e.stat().st_mode & 0o777 == 0o600 for e in entries)
    monkeypatch.setattr(kernel_cache, "_loaded", {})
    children.clear()
    kernel = _serve()
    assert children == [] and kernel._compiled == {} and kernel.launches["triton"] == 0


def _garble(entries: list[Path]) -> None:
    for entry in entries:
        text = json.loads(entry.read_text())
        text["cubin"] = "AAAA" * 64  # decodes, but is no cubin: the driver refuses it
        entry.write_text(json.dumps(text))


def _other_writable(entries: list[Path]) -> None:
    for entry in entries:
        entry.chmod(0o666)


def _symlink(entries: list[Path]) -> None:
    for entry in entries:
        target = entry.with_name(entry.stem + ".elsewhere")
        entry.rename(target)
        entry.symlink_to(target)


def _another_variants(entries: list[Path]) -> None:
    contents = [entry.read_bytes() for entry in entries]
    for entry, content in zip(entries, contents[1:] + contents[:1], strict=True):
        entry.write_bytes(content)


@pytest.mark.parametrize("spoil", [_garble, _other_writable, _symlink, _another_variants])
def test_a_spoiled_cache_entry_is_compiled_again_not_loaded(
        cache: Path, monkeypatch: pytest.MonkeyPatch, spoil: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """Every entry spoiled the same way: the next process compiles them again in a child,
    replaces each with a good private file, and moves the same bytes."""
    _serve()
    spoil(sorted(cache.glob("*.json")))
    monkeypatch.setattr(kernel_cache, "_loaded", {})
    children = _children(monkeypatch)
    kernel = _serve()
    assert children == [6], caplog.text
    assert kernel._compiled == {} and kernel.launches["triton"] == 0
    for entry in cache.glob("*.json"):
        assert not entry.is_symlink() and entry.stat().st_mode & 0o777 == 0o600
        assert json.loads(entry.read_text())["key"] == entry.stem
    assert "compiling it again" in caplog.text


def test_a_failing_child_leaves_compiling_to_this_process(
        cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A child that cannot run: one warning, no child tried again, and the engine compiles
    through Triton here (the bytes as exact)."""
    monkeypatch.setattr(kernel_cache.sys, "executable", "/bin/false")
    children = _children(monkeypatch)
    kernel = _serve(integrity=False)
    assert children == [4]  # tried once (copy and staged passes, both directions), not again
    assert kernel.launches["triton"] > 0 and kernel._compiled
    assert "compiling it in this one" in caplog.text
    assert not os.path.exists(cache) or not list(cache.glob("*.json"))
