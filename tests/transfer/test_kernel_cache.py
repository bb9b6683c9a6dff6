"""The kernel cache without a GPU: what a variant's key depends on, the entries' format, the
trust rules for reading and writing them, and a child process that fails (the real child, which
needs CUDA: on a host without it, it exits with its error)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from offload.system.cuda_driver import libcuda
from offload.transfer import kernel_cache
from offload.transfer.kernel_cache import Built, Variant, int_type

POINTERS = {0: "int64", 1: "int32", 3: "uint8"}
SPECIALISED = (0, 1)
CONSTANTS = {"LOAD": True, "PIECES": 4, "ELEMENT": 8}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh cache; no kernel loaded; the kernels directory (not made yet)."""
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_cache, "_loaded", {})
    monkeypatch.setattr(kernel_cache, "_child_failed", False)
    monkeypatch.setattr(kernel_cache, "_warned", set())
    yield tmp_path / "cache" / "kernels"


def _variant(values: list[int], constants: dict[str, int | bool] | None = None,
             num_warps: int = 4) -> Variant:
    return Variant.of(constants or CONSTANTS, num_warps, values, POINTERS, SPECIALISED)


@pytest.mark.parametrize(("value", "expected"), [
    (-(1 << 31), "i32"), ((1 << 31) - 1, "i32"), (1 << 31, "i64"), (-(1 << 31) - 1, "i64"),
    ((1 << 63) - 1, "i64"), (-(1 << 63), "i64"), (1 << 63, "u64"), ((1 << 64) - 1, "u64")])
def test_an_integer_is_compiled_for_the_narrowest_type_that_holds_it(value: int,
                                                                     expected: str) -> None:
    assert int_type(value) == expected


def test_an_integer_beyond_64_bits_is_refused() -> None:
    with pytest.raises(ValueError, match="fits no 64-bit integer type"):
        int_type(1 << 64)


def test_a_variant_names_pointer_types_alignment_where_specialised_and_integer_widths() -> None:
    variant = _variant([4096, 4104, 7, 4104, 1 << 40])
    assert variant.args == ("*int64:16", "*int32", "i32", "*uint8", "i64")
    assert variant.constants == (("ELEMENT", 8), ("LOAD", True), ("PIECES", 4))


@given(st.lists(st.integers(0, 1 << 40), min_size=5, max_size=5),
       st.lists(st.integers(0, 1 << 40), min_size=5, max_size=5))
def test_launches_of_one_compilation_share_a_key(first: list[int], second: list[int]) -> None:
    """The key follows what Triton specialises on, not the values: two launches whose
    specialised pointers agree on 16-byte alignment and whose integers need the same width
    name one variant; any difference there names another."""
    env = "env"
    same = ([a % 16 == 0 for a in first[:2]] == [b % 16 == 0 for b in second[:2]]
            and [int_type(a) for a in (first[2], first[4])]
            == [int_type(b) for b in (second[2], second[4])])
    assert (_variant(first).key(env) == _variant(second).key(env)) == same


def test_the_key_changes_with_every_input() -> None:
    values = [4096, 4096, 7, 4096, 7]
    keys = {_variant(values).key("env"), _variant(values).key("other env"),
            _variant(values, num_warps=8).key("env"),
            _variant(values, {**CONSTANTS, "LOAD": False}).key("env"),
            _variant(values, {**CONSTANTS, "PIECES": 5}).key("env"),
            _variant([4104, *values[1:]]).key("env")}
    assert len(keys) == 6


def test_the_environment_follows_the_kernel_source_capability_and_tritons_knobs(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Not the knobs that only say where Triton keeps files (ranks with a cache directory
    each share compilations); the source as first read, not as edited later (an upgrade
    under a running process)."""
    base = kernel_cache.environment((9, 0))
    assert kernel_cache.environment((9, 0)) == base
    assert kernel_cache.environment((10, 0)) != base
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert kernel_cache.environment((9, 0)) == base
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    assert kernel_cache.environment((9, 0)) != base
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION")
    edited = tmp_path / "kernel.py"
    edited.write_bytes(kernel_cache.KERNEL_SOURCE.read_bytes() + b"\n# edited\n")
    monkeypatch.setattr(kernel_cache, "KERNEL_SOURCE", edited)
    assert kernel_cache.environment((9, 0)) == base  # read once
    kernel_cache.source_hash.cache_clear()
    try:
        assert kernel_cache.environment((9, 0)) != base
    finally:
        kernel_cache.source_hash.cache_clear()


BUILT = Built("copy_pages", 4, 0, True, bytes(range(256)))


def test_an_entry_round_trips_and_names_its_variant() -> None:
    assert Built.from_json(BUILT.to_json("k1"), "k1") == BUILT
    with pytest.raises(ValueError, match="for variant 'k1', not 'k2'"):
        Built.from_json(BUILT.to_json("k1"), "k2")


@pytest.mark.parametrize("text", [
    b"", b"\xff\xfe", b"[]", b"{}", b'{"key": "k"}',
    b'{"key": "k", "name": "f", "num_warps": 4, "shared": 0, "plain": true, "cubin": "@@@"}',
    b'{"key": "k", "name": "f", "num_warps": "x", "shared": 0, "plain": true, "cubin": ""}'])
def test_a_malformed_entry_is_refused_with_a_value_error(text: bytes) -> None:
    with pytest.raises(ValueError):
        Built.from_json(text, "k")


def test_an_entry_written_is_read_back_private(cache: Path) -> None:
    kernel_cache._write("k1", BUILT)
    assert (cache / "k1.json").stat().st_mode & 0o777 == 0o600
    assert cache.stat().st_mode & 0o777 == 0o700
    assert kernel_cache._read("k1") == BUILT
    assert kernel_cache._read("k2") is None
    assert sorted(os.listdir(cache)) == ["k1.json"]  # no temporary file left


def _others_write(entry: Path) -> None:
    entry.chmod(0o622)


def _symlinked(entry: Path) -> None:
    target = entry.with_name("target")
    entry.rename(target)
    entry.symlink_to(target)


def _renamed_from_another(entry: Path) -> None:
    kernel_cache._write("other", BUILT)
    entry.write_bytes((entry.parent / "other.json").read_bytes())


def _a_directory(entry: Path) -> None:
    entry.unlink()
    entry.mkdir()


@pytest.mark.parametrize("spoil", [_others_write, _symlinked, _renamed_from_another,
                                   _a_directory])
def test_an_entry_that_is_not_ours_alone_or_not_its_variants_is_never_read(
        cache: Path, spoil: object, caplog: pytest.LogCaptureFixture) -> None:
    kernel_cache._write("k1", BUILT)
    spoil(cache / "k1.json")  # type: ignore[operator]
    with caplog.at_level(logging.WARNING):
        assert kernel_cache._read("k1") is None
    assert "not loading the cached copy kernel k1.json" in caplog.text
    assert "compiling it again" in caplog.text


def test_a_cache_others_can_write_is_neither_read_nor_written(
        cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    kernel_cache._write("k1", BUILT)
    cache.chmod(0o777)
    try:
        with caplog.at_level(logging.WARNING):
            assert kernel_cache._read("k1") is None
            kernel_cache._write("k2", BUILT)
            kernel_cache._write("k3", BUILT)
        assert sorted(os.listdir(cache)) == ["k1.json"]
        assert caplog.text.count("it serves this process only") == 1
        assert "OFFLOAD_CACHE_DIR" in caplog.text
    finally:
        cache.chmod(0o700)


def test_a_failing_child_is_reported_once_and_not_tried_again(
        cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The real child on a host without CUDA exits with its error: the caller gets no kernel
    (and compiles in its own process), the child's last words are logged, nothing is cached,
    and no second child is started in this process."""
    variant = _variant([4096, 4096, 7, 4096, 7])
    with caplog.at_level(logging.WARNING):
        assert kernel_cache.build([variant], 0, (9, 0)) == [None]
    assert "the copy kernel's compiler process exited with 1" in caplog.text
    assert "compiling it in this one" in caplog.text
    assert not cache.exists() or not list(cache.iterdir())

    def refuse(*args: object) -> None:
        raise AssertionError("a second child was started")

    monkeypatch.setattr(kernel_cache, "compile_in_child", refuse)
    assert kernel_cache.build([variant], 0, (9, 0)) == [None]


def _answer(source: str | None = None, kernels: int = 1) -> str:
    return json.dumps({"source": source or kernel_cache.source_hash(),
                       "triton": kernel_cache.triton_version(),
                       "kernels": [BUILT.to_entry("")] * kernels})


@pytest.mark.parametrize(("answer", "why"), [
    ("not json", "Expecting value"),
    ('[{"key": ""}]', "list indices"),
    (_answer(kernels=2), "2 kernels for 1 variants"),
    (_answer(source="0" * 64), "upgraded under this process"),
])
def test_a_child_whose_answer_is_not_for_this_process_gives_no_kernel(
        cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        tmp_path: Path, answer: str, why: str) -> None:
    """A child that exits 0 but answers with something other than one entry per variant,
    compiled from the kernel source and Triton this process runs."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\ncat > /dev/null\nprintf '%s' \"$ANSWER\"\n")
    fake.chmod(0o700)
    monkeypatch.setattr(kernel_cache.sys, "executable", str(fake))
    monkeypatch.setenv("ANSWER", answer)
    variant = _variant([4096, 4096, 7, 4096, 7])
    with caplog.at_level(logging.WARNING):
        assert kernel_cache.compile_in_child([variant], 0) is None
    assert "not using the copy kernel's compiler process's answer" in caplog.text
    assert why in caplog.text


def test_the_fake_child_of_these_tests_is_accepted_when_its_answer_is_right(
        cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The same fake child answering correctly gives the kernel: the refusals above are for
    the reasons they name."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\ncat > /dev/null\nprintf '%s' \"$ANSWER\"\n")
    fake.chmod(0o700)
    monkeypatch.setattr(kernel_cache.sys, "executable", str(fake))
    monkeypatch.setenv("ANSWER", _answer())
    assert kernel_cache.compile_in_child([_variant([4096, 4096, 7, 4096, 7])], 0) == [BUILT]


def test_a_cached_kernel_the_driver_refuses_is_not_loaded(
        cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An entry that passes every check but does not load (here: no driver at all) gives no
    kernel, so the caller compiles it again."""
    if libcuda() is not None:
        pytest.skip("a CUDA driver is present: the GPU tests cover a cubin it refuses")
    variant = _variant([4096, 4096, 7, 4096, 7])
    key = variant.key(kernel_cache.environment((9, 0)))
    kernel_cache._write(key, BUILT)
    with caplog.at_level(logging.WARNING):
        assert kernel_cache.load(variant, 0, (9, 0)) is None
    assert f"the cached copy kernel {key} does not load" in caplog.text
    assert json.loads((cache / f"{key}.json").read_text())["key"] == key


def test_build_compiles_only_the_missing_variants_once_and_keeps_them(
        cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With the driver's two load calls stood in for (no CUDA here): a cold cache sends the
    variants to one child and loads every answer; the same variants again come from this
    process's table, and, the table cleared, from disk; a new variant beside them is the only
    one a second child is asked for."""
    def driver(name: str, *args: object) -> None:
        if name == "cuModuleGetFunction":
            args[0]._obj.value = 0x1000  # type: ignore[attr-defined]

    monkeypatch.setattr(kernel_cache, "driver_call", driver)
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\ncat > /dev/null\nprintf '%s' \"$ANSWER\"\n")
    fake.chmod(0o700)
    monkeypatch.setattr(kernel_cache.sys, "executable", str(fake))
    asked: list[int] = []
    real = kernel_cache.compile_in_child

    def counted(variants: list[Variant], device: int) -> object:
        asked.append(len(variants))
        monkeypatch.setenv("ANSWER", _answer(kernels=len(variants)))
        return real(variants, device)

    monkeypatch.setattr(kernel_cache, "compile_in_child", counted)
    first = [_variant([4096, 4096, 7, 4096, 7]), _variant([4104, 4096, 7, 4096, 7])]
    loaded = kernel_cache.build(first, 0, (9, 0))
    assert asked == [2] and all(got is not None and got.function == 0x1000 for got in loaded)
    assert len(list(cache.glob("*.json"))) == 2
    assert kernel_cache.build(first, 0, (9, 0)) == loaded and asked == [2]
    monkeypatch.setattr(kernel_cache, "_loaded", {})
    assert kernel_cache.build(first, 0, (9, 0)) == loaded and asked == [2]
    again = kernel_cache.build([*first, _variant([4096, 4096, 1 << 40, 4096, 7])], 0, (9, 0))
    assert asked == [2, 1] and all(got is not None for got in again)
