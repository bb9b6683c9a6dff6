# SPDX-License-Identifier: Apache-2.0
"""The native build cache (offload/system/build_cache.py): what it builds, where, and what it
refuses to load.

Each trust test plants a library at the name the cache would load (`library_name`): the planted
code has a constructor that writes a marker file, so "not run" means "no marker".  The cache
must instead hand back a working library it built itself and log one warning.  Tests that need
a second user (uid 65534) run as root only; the others use a directory or file of ours with a
mode that lets others write it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import sysconfig
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from offload.system import build_cache
from offload.transfer.native import IssueContext

pytestmark = pytest.mark.skipif(build_cache.compiler() is None, reason="needs a C compiler")

ISSUE = build_cache.SOURCES["issue"]
SYMBOL = "offload_issue"
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Private builds go to a temporary directory inside tmp_path (and must leave it empty)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    yield tmp


def cc() -> str:
    compiler = build_cache.compiler()
    assert compiler is not None
    return compiler


def make_planted(tmp_path: Path, marker: Path) -> bytes:
    """A library exporting the cache's entry point whose constructor writes ``marker``."""
    source = tmp_path / "planted.c"
    source.write_text(f'#include <stdio.h>\n'
                      f'__attribute__((constructor)) static void planted(void) {{\n'
                      f'    FILE *f = fopen("{marker}", "w"); if (f) fclose(f);\n}}\n'
                      f'int {SYMBOL}(void) {{ return 0; }}\n')
    return build_cache.compile_private(source, cc())


def plant(directory: Path, data: bytes, mode: int = 0o644, uid: int | None = None) -> Path:
    """``data`` at the name the cache loads ``issue.c`` from, in ``directory``."""
    target = directory / build_cache.library_name(ISSUE, cc())
    target.write_bytes(data)
    os.chmod(target, mode)
    if uid is not None:
        os.chown(target, uid, uid)
    return target


def load_issue(directory: Path, monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(directory))
    monkeypatch.delenv("OFFLOAD_NATIVE", raising=False)
    lib = build_cache.load(ISSUE, "tests", SYMBOL)
    assert lib is not None
    return lib


def verify_real_issue(lib: ctypes.CDLL) -> None:
    """The library is issue.c's, not a planted stand-in that merely exports the symbol: a count
    that does not fit the context's types is refused with -1 and step 1, before any call."""
    context = IssueContext(*[None] * 8, 4, 4, 0, 0, None, None, 0, 0)
    issue = lib.offload_issue
    issue.argtypes = [ctypes.POINTER(IssueContext), ctypes.c_int32, ctypes.c_void_p,
                      ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_uint32]
    issue.restype = ctypes.c_int
    assert issue(ctypes.pointer(context), 0, None, None, 0, -1, 0, 1) == -1
    assert context.failed_step == 1


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build_cache, "_warned", set())


# ---------------------------------------------------------------------------- building


def test_build_caches_by_source_compiler_and_machine(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    first = build_cache.build(ISSUE, tmp_path, cc())
    stamp = first.stat().st_mtime_ns
    assert build_cache.build(ISSUE, tmp_path, cc()) == first
    assert first.stat().st_mtime_ns == stamp  # not rebuilt
    source = tmp_path / "issue.c"
    source.write_text(ISSUE.read_text() + "\n/* changed */\n")
    assert build_cache.build(source, tmp_path, cc()) != first
    # a cache shared by hosts of another architecture keeps their libraries apart
    monkeypatch.setattr(build_cache.platform, "machine", lambda: "other-arch")
    assert build_cache.build(ISSUE, tmp_path, cc()) != first


def test_cc_may_be_a_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``CC="ccache gcc"`` or ``CC="gcc -m64"`` are common; the words are the command."""
    plain = cc()
    monkeypatch.setenv("CC", f"{plain} -Wall")
    assert build_cache.compiler() == f"{plain} -Wall"
    library = build_cache.build(ISSUE, tmp_path, f"{plain} -Wall")
    assert hasattr(ctypes.CDLL(str(library)), SYMBOL)
    assert library != build_cache.build(ISSUE, tmp_path, plain)  # the flags are in the key


def test_ranks_building_at_once_leave_one_library_and_no_partial_files(
        tmp_path: Path, private_tmp: Path) -> None:
    cache = tmp_path / "cache"
    built: list[Path] = []
    threads = [threading.Thread(target=lambda: built.append(
        build_cache.build(ISSUE, cache, cc()))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(built)) == 1 and len(built) == 4
    assert sorted(p.name for p in cache.iterdir()) == [built[0].name]
    assert hasattr(ctypes.CDLL(str(built[0])), SYMBOL)  # a complete library
    assert list(private_tmp.iterdir()) == []  # the compiler's private directories are gone


def test_a_failing_compiler_is_reported_and_leaves_nothing(tmp_path: Path,
                                                          private_tmp: Path) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("int offload_issue( {\n")
    with pytest.raises(RuntimeError, match="failed on broken.c"):
        build_cache.build(broken, tmp_path / "cache", cc())
    assert list((tmp_path / "cache").iterdir()) == []
    assert list(private_tmp.iterdir()) == []


def test_every_c_file_of_the_package_is_a_listed_source() -> None:
    """`SOURCES` is the one list of C files (setup.cfg ships ``*.c``; test_wheel checks it)."""
    on_disk = sorted(build_cache.HERE.rglob("*.c"))
    assert sorted(build_cache.SOURCES.values()) == on_disk


# ---------------------------------------------------------------------------- the directory


def test_a_new_cache_directory_is_made_ours_alone(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    old = os.umask(0o022)
    try:
        cache = tmp_path / "a" / "b" / "offload"
        load_issue(cache, monkeypatch)
    finally:
        os.umask(old)
    st = cache.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    (library,) = cache.iterdir()
    assert library.stat().st_uid == os.geteuid()
    assert not library.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def test_an_own_readable_directory_is_narrowed_to_0700(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, 0o755)
    load_issue(cache, monkeypatch)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert len(list(cache.glob("issue-*.so"))) == 1


def test_a_library_planted_in_a_directory_others_can_write_is_not_run(
        tmp_path: Path, private_tmp: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A shared ``OFFLOAD_CACHE_DIR`` (mode 0777, so anyone may have put the library there):
    the library is built privately for this process, the planted one never loads, nothing is
    written into the shared directory, one warning is logged (for both libraries), and the
    private build leaves nothing behind."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    marker = tmp_path / "planted-ran"
    planted = plant(shared, make_planted(tmp_path, marker))
    with caplog.at_level(logging.WARNING, logger="offload.system.build_cache"):
        lib = load_issue(shared, monkeypatch)
        other = build_cache.load(build_cache.SOURCES["job_check"], "tests", "offload_check_job",
                                 [f"-I{sysconfig.get_paths()['include']}"],
                                 ctypes.PyDLL)
    assert not marker.exists()
    verify_real_issue(lib)
    assert other is None or hasattr(other, "offload_check_job")
    assert sorted(p.name for p in shared.iterdir()) == [planted.name]
    assert list(private_tmp.iterdir()) == []
    warnings = [r for r in caplog.records if "not using the build cache" in r.getMessage()]
    assert len(warnings) == 1 and "writable by others" in warnings[0].getMessage()
    assert str(shared) in warnings[0].getMessage()


@as_root
def test_a_library_planted_in_another_users_directory_is_not_run(
        tmp_path: Path, private_tmp: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """``OFFLOAD_CACHE_DIR`` is another user's (uid 65534, mode 0755: only that user can write
    it, and that user planted the library): not trusted, built privately."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    marker = tmp_path / "planted-ran"
    plant(theirs, make_planted(tmp_path, marker), uid=NOBODY)
    os.chmod(theirs, 0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING, logger="offload.system.build_cache"):
        verify_real_issue(load_issue(theirs, monkeypatch))
    assert not marker.exists()
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o755  # not ours to change
    assert f"owned by uid {NOBODY}" in caplog.text
    assert list(private_tmp.iterdir()) == []


# ---------------------------------------------------------------------------- the file


@as_root
def test_another_users_library_in_our_directory_is_rebuilt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    marker = tmp_path / "planted-ran"
    target = plant(cache, make_planted(tmp_path, marker), mode=0o644, uid=NOBODY)
    with caplog.at_level(logging.WARNING, logger="offload.system.build_cache"):
        verify_real_issue(load_issue(cache, monkeypatch))
    assert not marker.exists()
    assert target.stat().st_uid == os.geteuid()  # replaced by our own build
    assert f"owned by uid {NOBODY}" in caplog.text


def test_a_library_others_can_write_is_rebuilt(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    marker = tmp_path / "planted-ran"
    target = plant(cache, make_planted(tmp_path, marker), mode=0o666)
    verify_real_issue(load_issue(cache, monkeypatch))
    assert not marker.exists()
    assert not target.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def test_a_symlink_at_the_name_is_not_followed(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    marker = tmp_path / "planted-ran"
    elsewhere = tmp_path / "elsewhere.so"
    elsewhere.write_bytes(make_planted(tmp_path, marker))
    target = cache / build_cache.library_name(ISSUE, cc())
    target.symlink_to(elsewhere)
    verify_real_issue(load_issue(cache, monkeypatch))
    assert not marker.exists()
    assert not target.is_symlink() and target.is_file()


@pytest.mark.parametrize("content", [b"", b"\x7fELF garbage", b"not a library at all\n"],
                         ids=["empty", "bad-elf", "text"])
def test_a_corrupt_cached_library_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             content: bytes) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    target = plant(cache, content, mode=0o600)
    verify_real_issue(load_issue(cache, monkeypatch))
    assert target.stat().st_size > len(content)


def test_a_library_without_the_entry_point_is_rebuilt(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A loadable library of other code (an interrupted or foreign build) is corrupt too."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    source = tmp_path / "other.c"
    source.write_text("int something_else(void) { return 1; }\n")
    plant(cache, build_cache.compile_private(source, cc()), mode=0o600)
    verify_real_issue(load_issue(cache, monkeypatch))


def test_an_unusable_cache_directory_keeps_the_python_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A cache path that cannot be a directory (a file is in the way): logged, None."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger="offload.system.build_cache"):
        assert build_cache.load(ISSUE, "tests", SYMBOL) is None
    assert "could not build issue.c" in caplog.text


def test_a_source_missing_from_the_install_is_named_as_such(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A package without a C file (a wheel that did not ship it) says so, not "cache"."""
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="offload.system.build_cache"):
        assert build_cache.load(tmp_path / "job_check.c", "job checks", "x") is None
    assert "job_check.c is missing from the installed offload package" in caplog.text
    assert "OFFLOAD_CACHE_DIR" not in caplog.text
    assert not (tmp_path / "cache").exists()
