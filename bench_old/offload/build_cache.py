# SPDX-License-Identifier: Apache-2.0
"""The native build cache: the package's C sources compiled once per host and loaded safely.

Runs in every rank that uses a native path (`offload.transfer.native`, `offload.transfer.
fast_check`, `offload.region.background`).  Primitives:

* `SOURCES` -- every C file the package compiles (setup.cfg ships ``*.c`` with the package).
* `compiler` -- the C compiler command line, or None.
* `cache_dir` -- where compiled libraries are kept (``OFFLOAD_CACHE_DIR``, XDG, ``~/.cache``).
* `build` -- compile one source into a directory we trust, unless it is there already.
* `load` -- the compiled library, loaded with ctypes, or None (logged) where it cannot be.

What is trusted (nothing another local user made or can write is ever loaded):

* The cache directory must be owned by this user and writable by no one else; one we create is
  made with mode 0700, one of ours that others can read is narrowed to 0700.  Otherwise (a
  shared ``OFFLOAD_CACHE_DIR``, another user's directory, a symlink swapped in) the library is
  built in a fresh private directory for this process only and one warning is logged.
* A cached library is loaded only if it is a regular file owned by this user that no one else
  can write, opened with ``O_NOFOLLOW`` and loaded through that very descriptor
  (``/proc/self/fd/N``), so what was checked is what runs.  Anything else at the name, or a
  library that does not load or lacks its entry point (a corrupt file), is rebuilt in place.
* The compiler writes only into a private ``mkdtemp`` directory; the result is copied into the
  cache under an ``O_EXCL`` temporary name and renamed into place relative to the directory's
  descriptor.  Ranks may build at once: each renames its own complete file (the last one wins,
  all identical).

What stays trusted, as for any program: this process's environment (``$CC``, ``PATH``,
``TMPDIR``) and the compiler and headers it names.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
# Every C file of the package, by library name.  setup.cfg's package_data ships ``*.c`` next to
# them; tests/test_wheel.py checks that a wheel holds each one.
SOURCES = {"issue": HERE / "transfer" / "issue.c", "job_check": HERE / "transfer" / "job_check.c",
           "populate": HERE / "region" / "populate.c"}

_DIR_MODE = 0o700
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

# Descriptors of the loaded libraries, kept open for the process's life: the dynamic loader
# knows each library by its ``/proc/self/fd/N`` name, and a reused N would make a later dlopen
# return the earlier library.
_held: list[int] = []
_warned: set[str] = set()


class Untrusted(Exception):
    """A directory or file another user made or can write (the message says which and why)."""


def compiler() -> str | None:
    """``$CC`` (a command line: ``ccache gcc`` works), else ``cc`` or ``gcc`` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    """``OFFLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/offload``, else ``~/.cache/offload``."""
    if os.environ.get("OFFLOAD_CACHE_DIR"):
        return Path(os.environ["OFFLOAD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "offload"


def library_name(source: Path, cc: str, flags: Sequence[str] = ()) -> str:
    """The cached library's file name: a hash of the source, the compiler, its extra ``flags``
    and the machine type (a cache on a shared home may serve hosts of several architectures and
    Pythons)."""
    key = hashlib.sha256(b"\0".join([source.read_bytes(), cc.encode(),
                                     platform.machine().encode(),
                                     *(flag.encode() for flag in flags)])).hexdigest()[:16]
    return f"{source.stem}-{key}.so"


# ---------------------------------------------------------------------------- trust checks


def open_trusted_dir(directory: Path) -> int:
    """A descriptor of ``directory`` (created with mode 0700 if missing), which this user owns
    and no one else can write; narrowed to 0700 if others may read it.

    Raises:
        Untrusted: it is another user's, others can write it, or it is a symlink.
        OSError: it cannot be created or opened.
    """
    real = os.path.realpath(directory)  # a symlinked home is fine: the opened dir is checked
    os.makedirs(os.path.dirname(real), exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(real, _DIR_MODE)
    try:
        fd = os.open(real, _OPEN_DIR)
    except OSError as exc:
        if os.path.islink(real):  # swapped in after realpath
            raise Untrusted(f"{real} is a symlink") from None
        raise exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise Untrusted(f"{real} is owned by uid {st.st_uid}, not by this user "
                            f"(uid {os.geteuid()})")
        if st.st_mode & _OTHERS_WRITE:
            raise Untrusted(f"{real} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")
        if stat.S_IMODE(st.st_mode) != _DIR_MODE:
            os.fchmod(fd, _DIR_MODE)  # ours and written only by us: readers need not see it
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_trusted_file(name: str, dir_fd: int) -> int:
    """A descriptor of ``name`` in ``dir_fd``: a regular file this user owns that no one else
    can write, opened without following a symlink.

    Raises:
        Untrusted: it is a symlink, not a regular file, another user's, or writable by others.
        FileNotFoundError: there is no such file.
    """
    try:
        fd = os.open(name, _OPEN_FILE, dir_fd=dir_fd)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise Untrusted(f"{name} cannot be opened safely ({exc.strerror})") from None
    st = os.fstat(fd)
    why = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
           f"is owned by uid {st.st_uid}" if st.st_uid != os.geteuid() else
           f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
           if st.st_mode & _OTHERS_WRITE else None)
    if why is not None:
        os.close(fd)
        raise Untrusted(f"{name} {why}")
    return fd


# ---------------------------------------------------------------------------- build and load


def compile_private(source: Path, cc: str, flags: Sequence[str] = ()) -> bytes:
    """``source`` compiled into a shared library in a fresh private directory (removed after);
    its bytes.

    Raises:
        RuntimeError: the compiler failed (its first lines of error).
        OSError, subprocess.SubprocessError: it could not run.
    """
    with tempfile.TemporaryDirectory(prefix="offload-build-") as private:  # 0700, ours alone
        output = os.path.join(private, "out.so")
        command = [*shlex.split(cc), "-O2", "-std=c11", "-shared", "-fPIC", "-o", output,
                   *flags, str(source)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source.name}: {result.stderr.strip()[:400]}")
        return Path(output).read_bytes()


def install(data: bytes, name: str, dir_fd: int) -> None:
    """Write ``data`` as ``name`` in ``dir_fd`` atomically: an ``O_EXCL`` temporary name,
    renamed over whatever was there (the rename replaces a symlink, never follows it)."""
    partial = f".{name}.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(partial, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial, dir_fd=dir_fd)
        raise


def build(source: Path, directory: Path, cc: str, flags: Sequence[str] = ()) -> Path:
    """``source`` compiled into ``directory`` (a directory we trust) unless a trusted library is
    there already; its path.  Not loaded.

    Raises:
        Untrusted: ``directory`` is not ours alone (`open_trusted_dir`).
        RuntimeError, OSError, subprocess.SubprocessError: the build failed.
    """
    name = library_name(source, cc, flags)
    dir_fd = open_trusted_dir(directory)
    try:
        try:
            os.close(open_trusted_file(name, dir_fd))
        except (FileNotFoundError, Untrusted):
            install(compile_private(source, cc, flags), name, dir_fd)
    finally:
        os.close(dir_fd)
    return Path(os.path.realpath(directory)) / name


def _dlopen(fd: int, loader: type[ctypes.CDLL], symbol: str) -> ctypes.CDLL:
    """The library open at ``fd``, loaded through that descriptor.  ``fd`` stays open once the
    loader has mapped it, even when ``symbol`` is missing: the loader keeps that library under
    the ``/proc/self/fd/N`` name and would hand it out again for a reused N.

    Raises:
        OSError: it does not load or lacks ``symbol`` (a corrupt file).
    """
    try:
        lib = loader(f"/proc/self/fd/{fd}")
    except BaseException:
        os.close(fd)
        raise
    _held.append(fd)
    if not hasattr(lib, symbol):
        raise OSError(f"the library has no {symbol}")
    return lib


def _load_cached(source: Path, directory: Path, cc: str, flags: Sequence[str],
                 loader: type[ctypes.CDLL], symbol: str) -> ctypes.CDLL:
    name = library_name(source, cc, flags)
    dir_fd = open_trusted_dir(directory)
    try:
        try:
            return _dlopen(open_trusted_file(name, dir_fd), loader, symbol)
        except FileNotFoundError:
            pass
        except Untrusted as exc:
            log.warning("not loading the cached %s: %s; rebuilding it", name, exc)
        except OSError as exc:  # truncated or garbled: rebuild, never fatal
            log.warning("the cached %s does not load (%s); rebuilding it", name, exc)
        install(compile_private(source, cc, flags), name, dir_fd)
        return _dlopen(open_trusted_file(name, dir_fd), loader, symbol)
    finally:
        os.close(dir_fd)


def _load_private(source: Path, cc: str, flags: Sequence[str], loader: type[ctypes.CDLL],
                  symbol: str) -> ctypes.CDLL:
    """Built for this process alone: a private directory, removed once the library is loaded
    (the loaded mapping keeps the file)."""
    with tempfile.TemporaryDirectory(prefix="offload-lib-") as private:
        dir_fd = os.open(private, _OPEN_DIR)
        try:
            name = library_name(source, cc, flags)
            install(compile_private(source, cc, flags), name, dir_fd)
            return _dlopen(open_trusted_file(name, dir_fd), loader, symbol)
        finally:
            os.close(dir_fd)


def load(source: Path, what: str, symbol: str, flags: Sequence[str] = (),
         loader: type[ctypes.CDLL] = ctypes.CDLL) -> ctypes.CDLL | None:
    """``source`` compiled (once per host, source and flags) and loaded with ``loader``, or None
    where it cannot be built or ``OFFLOAD_NATIVE=0``; the reason is logged, naming ``what``,
    which keeps its Python path.  ``symbol`` is the library's entry point: a cached library
    without it is corrupt and rebuilt.

    Args:
        source: a C file of `SOURCES`.
        what: the callers, for the log ("job checks").
        symbol: a function the library must export.
        flags: extra compiler flags (part of the cache key).
        loader: ``ctypes.CDLL``, or ``ctypes.PyDLL`` for code that holds the GIL.

    Returns:
        The loaded library, or None.
    """
    if os.environ.get("OFFLOAD_NATIVE", "1") == "0":
        return None
    cc = compiler()
    if cc is None:
        log.info("no C compiler (cc, gcc or $CC): %s keep the Python path", what)
        return None
    if not source.is_file():  # a packaging error, not a cache problem
        log.warning("%s is missing from the installed offload package (%s): %s keep the "
                    "Python path; reinstall offload", source.name, source.parent, what)
        return None
    directory = cache_dir()
    try:
        try:
            return _load_cached(source, directory, cc, flags, loader, symbol)
        except Untrusted as exc:
            if str(directory) not in _warned:  # one warning per process and directory
                _warned.add(str(directory))
                log.warning("not using the build cache: %s; building %s for this process "
                            "only (set OFFLOAD_CACHE_DIR to a directory only you can write)",
                            exc, source.name)
            return _load_private(source, cc, flags, loader, symbol)
    except (OSError, RuntimeError, subprocess.SubprocessError, Untrusted) as exc:
        log.warning("could not build %s (%s); %s keep the Python path (set OFFLOAD_CACHE_DIR "
                    "to a writable directory, or OFFLOAD_NATIVE=0 to skip the build)",
                    source.name, exc, what)
        return None
