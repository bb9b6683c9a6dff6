"""The copy kernel compiled in a child process and kept, as cubins, in the build cache.

Why a child: a Triton compilation in a process -- even one that Triton answers from its own
cache -- makes a later CUDA host registration in that process stall.  At 100 GiB in 8 MiB
calls, one call takes 50-130 ms, where the same registrations without the compilation, or after
a cubin loaded with the driver alone, take at most a few ms (docs/BENCHMARKS.md, "The 100 GiB
registration stall needs Triton in the process").  A tier registers while the engine serves
(background set-up), and the engine's launches wait for that call.  So the serving process
never compiles the copy kernel: it loads each variant's cubin with ``cuModuleLoadData`` and
launches it with ``cuLaunchKernel`` (`offload.transfer.launcher`), and only a child process
(``python -m offload.transfer.kernel_cache``) runs Triton's compiler.

* `Variant` -- one compilation of the kernel: its constexprs, warps and argument types, the
  things Triton specialises on.  Its `Variant.key` names it in the cache, together with the
  kernel's source, Triton's version, the GPU's compute capability and Triton's environment.
* `load` -- a variant's function in the current CUDA context, from this process's table or
  from the cache; never compiles.
* `build` -- the variants missing from the cache, compiled in one child process and written
  to the cache, then loaded.

Trust: the cache is the build cache's directory (`offload.build_cache`, ``kernels/`` below it),
with its rules.  A cubin is code the GPU runs with the process's access to its memory.  So a
cubin is loaded only from a directory this user owns and no one else can write, only from a
regular file of this user that no one else can write, opened without following a symlink.
The file must also name the variant it was asked for.  Anything else is compiled again.  Where
the directory is not ours alone, the child's cubins serve this process only and nothing is
written.  The child inherits this process's environment (``PATH``, ``TRITON_*``, Triton's own
cache), as an in-process compilation would.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from offload import build_cache
from offload.cuda_driver import driver_call

log = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).with_name("kernel.py")
CHILD_TIMEOUT_S = 600.0  # a cold compilation of every variant takes tens of seconds
# A pointer argument is compiled for a 16-byte-aligned address or for any; an integer argument
# for the narrowest of Triton's integer types that holds it.
ALIGN = 16
_INT_TYPES = (("i32", -(1 << 31), 1 << 31), ("i64", -(1 << 63), 1 << 63), ("u64", 0, 1 << 64))
_SAMPLE = {"i32": 2, "i64": 1 << 40, "u64": (1 << 63) + 2}  # a value of each, for the child


def int_type(value: int) -> str:
    """The Triton integer type a runtime integer argument is compiled for."""
    for name, low, high in _INT_TYPES:
        if low <= value < high:
            return name
    raise ValueError(f"{value} fits no 64-bit integer type")


@dataclass(frozen=True)
class Variant:
    """One compilation of the copy kernel.

    ``args`` has one entry per runtime argument, in order: ``"*<dtype>"`` for a pointer to a
    torch dtype (``"*int64"``), with ``":16"`` appended where the kernel is compiled for a
    16-byte-aligned address; ``"i32"``, ``"i64"`` or ``"u64"`` for an integer (`int_type`).
    ``constants`` holds the constexprs, by name."""

    constants: tuple[tuple[str, int | bool], ...]  # a bool stays one: Triton keys on the type
    num_warps: int
    args: tuple[str, ...]

    @classmethod
    def of(cls, constants: dict[str, int | bool], num_warps: int, values: Sequence[int],
           pointers: dict[int, str], specialised: Iterable[int]) -> Variant:
        """The variant a launch with ``values`` compiles to: ``pointers`` gives the dtype of
        each pointer argument by position, ``specialised`` the positions whose alignment
        Triton specialises on (the rest are ``do_not_specialize``)."""
        aligned = set(specialised)
        args = tuple(
            (f"*{pointers[i]}" + (f":{ALIGN}" if i in aligned and value % ALIGN == 0 else ""))
            if i in pointers else int_type(value) for i, value in enumerate(values))
        return cls(tuple(sorted(constants.items())), num_warps, args)

    def key(self, environment: str) -> str:
        """The cache's name for this variant, built in ``environment`` (`environment`)."""
        text = json.dumps([environment, self.constants, self.num_warps, self.args])
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Built:
    """A compiled variant as the child returns it and the cache keeps it."""

    name: str  # the kernel's symbol in the cubin
    num_warps: int
    shared: int
    plain: bool  # launched with a plain cuLaunchKernel (`launcher.plain_launch`)
    cubin: bytes

    def to_json(self, key: str) -> str:
        return json.dumps(self.to_entry(key))

    def to_entry(self, key: str) -> dict[str, Any]:
        return {"key": key, "name": self.name, "num_warps": self.num_warps,
                "shared": self.shared, "plain": self.plain,
                "cubin": base64.b64encode(self.cubin).decode()}

    @classmethod
    def from_json(cls, text: str | bytes, key: str) -> Built:
        """Raises ValueError for anything but a well-formed entry for ``key``."""
        try:
            return cls.from_entry(json.loads(text), key)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"not a kernel cache entry ({exc})") from None

    @classmethod
    def from_entry(cls, entry: Any, key: str) -> Built:
        """Raises ValueError for anything but a well-formed entry for ``key``."""
        try:
            if entry.get("key") != key:
                raise ValueError(f"the entry is for variant {entry.get('key')!r}, not {key!r}")
            return cls(str(entry["name"]), int(entry["num_warps"]), int(entry["shared"]),
                       bool(entry["plain"]), base64.b64decode(entry["cubin"], validate=True))
        except (KeyError, TypeError, AttributeError, binascii.Error) as exc:
            raise ValueError(f"not a kernel cache entry ({exc})") from None


@dataclass(frozen=True)
class Loaded:
    """A variant's function, loaded in one CUDA context."""

    function: int
    num_warps: int
    shared: int
    plain: bool


_loaded: dict[tuple[int, str], Loaded] = {}  # by (device, key)
_lock = threading.Lock()
_child_failed = False  # a child failed once: this process compiles in itself from then on
_warned: set[str] = set()  # cache directories already reported as not ours alone
_WHERE_KNOBS = ("TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR")


@cache
def source_hash() -> str:
    """The kernel's source as this process first read it (an upgrade under a running process
    must not make it file a new compilation under the code it runs)."""
    return hashlib.sha256(KERNEL_SOURCE.read_bytes()).hexdigest()


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "absent"  # nothing will compile: the child says why
    return str(triton.__version__)


def environment(capability: tuple[int, int]) -> str:
    """What a compiled variant depends on besides the variant itself: the kernel's source,
    Triton's version, the GPU's compute capability and Triton's environment variables (those
    that say where Triton keeps files left out)."""
    knobs = sorted((k, v) for k, v in os.environ.items()
                   if k.startswith("TRITON_") and k not in _WHERE_KNOBS)
    return json.dumps([source_hash(), triton_version(), list(capability), knobs])


def directory() -> Path:
    return build_cache.cache_dir() / "kernels"


def load(variant: Variant, device: int, capability: tuple[int, int]) -> Loaded | None:
    """``variant``'s function in the current context of ``device``, from this process's table
    or from a trusted cache entry; None where neither has it.  Never compiles."""
    return _load(device, variant.key(environment(capability)))


def _load(device: int, key: str) -> Loaded | None:
    with _lock:
        if (device, key) in _loaded:
            return _loaded[(device, key)]
    built = _read(key)
    return None if built is None else _register(device, key, built)


def build(variants: Sequence[Variant], device: int, capability: tuple[int, int]
          ) -> list[Loaded | None]:
    """Every one of ``variants`` loaded in the current context of ``device`` (`load`); those
    missing from the cache are compiled first in one child process on ``device`` and written
    to the cache (kept for this process alone where the cache is not trusted).  None for a
    variant that could not be had that way (the child failed: logged, and no child is tried
    again in this process); the caller compiles it in this process."""
    global _child_failed
    env = environment(capability)
    keys = [variant.key(env) for variant in variants]
    loaded = [_load(device, key) for key in keys]
    missing = {key: variant for key, variant, got in zip(keys, variants, loaded, strict=True)
               if got is None}
    if not missing or _child_failed:
        return loaded
    began = time.perf_counter()
    built = compile_in_child(list(missing.values()), device)
    log.info("compiled %d variants of the copy kernel in a child process in %.1f s",
             len(missing), time.perf_counter() - began)
    if built is None:
        _child_failed = True
        return loaded
    compiled: dict[str, Loaded | None] = {}
    for key, entry in zip(missing, built, strict=True):
        _write(key, entry)
        compiled[key] = _register(device, key, entry)
    return [compiled.get(key, got) for key, got in zip(keys, loaded, strict=True)]


def compile_in_child(variants: Sequence[Variant], device: int) -> list[Built] | None:
    """``variants`` compiled by Triton in a child process on ``device``; None (logged) where
    the child fails."""
    request = json.dumps({"device": device, "parent": os.getpid(), "variants": [
        {"constants": dict(v.constants), "num_warps": v.num_warps, "args": list(v.args)}
        for v in variants]})
    # The child imports offload from where this process did, never from its working directory
    # (``-P``; before Python 3.11 the working directory is that same place).
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    try:
        child = subprocess.run([sys.executable, *safe_path, "-m", "offload.transfer.kernel_cache"],
                               input=request.encode(), capture_output=True, env=env,
                               cwd=package_root, timeout=CHILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not compile the copy kernel in a child process (%s); compiling "
                    "it in this one", exc)
        return None
    if child.returncode != 0:
        tail = child.stderr.decode(errors="replace").strip().splitlines()[-3:]
        log.warning("the copy kernel's compiler process exited with %d (%s); compiling it in "
                    "this one", child.returncode, " | ".join(tail) or "no output")
        return None
    try:
        reply = json.loads(child.stdout)
        compiled_from = (reply["source"], reply["triton"])
        if compiled_from != (source_hash(), triton_version()):
            raise ValueError(f"it compiled source {compiled_from[0][:12]} with Triton "
                             f"{compiled_from[1]}, not {source_hash()[:12]} with "
                             f"{triton_version()} (offload or Triton was upgraded under this "
                             "process)")
        built = [Built.from_entry(entry, "") for entry in reply["kernels"]]
        if len(built) != len(variants):
            raise ValueError(f"{len(built)} kernels for {len(variants)} variants")
        return built
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("not using the copy kernel's compiler process's answer (%s); compiling it "
                    "in this one", exc)
        return None


def _read(key: str) -> Built | None:
    """The trusted cache entry for ``key``, or None (missing, untrusted or malformed: the
    reason is logged where it is not simply missing)."""
    name = f"{key}.json"
    try:
        dir_fd = build_cache.open_trusted_dir(directory())
    except (OSError, build_cache.Untrusted):
        return None  # `_write` says why, once
    try:
        fd = build_cache.open_trusted_file(name, dir_fd)
        with os.fdopen(fd, "rb") as entry:
            return Built.from_json(entry.read(), key)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, build_cache.Untrusted) as exc:
        log.warning("not loading the cached copy kernel %s: %s; compiling it again", name, exc)
        return None
    finally:
        os.close(dir_fd)


def _write(key: str, built: Built) -> None:
    """Keep ``built`` in the cache (atomically), unless the cache is not ours alone."""
    try:
        dir_fd = build_cache.open_trusted_dir(directory())
    except (OSError, build_cache.Untrusted) as exc:
        where = str(directory())
        if where not in _warned:
            _warned.add(where)
            log.warning("not keeping the copy kernel in %s: %s; it serves this process only "
                        "(set OFFLOAD_CACHE_DIR to a directory only you can write)", where, exc)
        return
    try:
        build_cache.install(built.to_json(key).encode(), f"{key}.json", dir_fd)
    except OSError as exc:
        log.warning("could not keep the copy kernel in %s: %s", directory(), exc)
    finally:
        os.close(dir_fd)


def _register(device: int, key: str, built: Built) -> Loaded | None:
    """Load ``built`` into the current context (once per device and key); None where the
    driver refuses it (logged: the caller compiles in this process)."""
    with _lock:
        if (device, key) in _loaded:
            return _loaded[(device, key)]
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        try:
            driver_call("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(built.cubin))
            try:
                driver_call("cuModuleGetFunction", ctypes.byref(function), module,
                            built.name.encode())
            except RuntimeError:
                driver_call("cuModuleUnload", module)
                raise
        except RuntimeError as exc:
            log.warning("the cached copy kernel %s does not load (%s); compiling it again",
                        key, exc)
            return None
        loaded = _loaded[(device, key)] = Loaded(int(function.value or 0), built.num_warps,
                                                 built.shared, built.plain)
        return loaded


# ---------------------------------------------------------------------------- the child


def _compile(spec: dict[str, Any]) -> Built:
    """One variant compiled by Triton (not loaded, not run): its arguments are stand-ins of
    the right type, alignment and integer width."""
    import torch

    from offload.transfer.kernel import Address, copy_pages
    from offload.transfer.launcher import plain_launch

    args: list[Any] = []
    for arg in spec["args"]:
        if arg.startswith("*"):
            dtype, _, align = arg[1:].partition(":")
            address = (1 << 20) + (0 if align else 8)  # 8: aligned to 8 bytes, not to 16
            args.append(Address(address, getattr(torch, dtype)))
        else:
            args.append(_SAMPLE[arg])
    compiled = copy_pages.warmup(*args, grid=(1,), num_warps=spec["num_warps"],
                                 **spec["constants"])
    metadata = compiled.metadata
    return Built(metadata.name, int(metadata.num_warps), int(metadata.shared),
                 plain_launch(metadata), compiled.asm["cubin"])


def _exit_with(parent: int) -> None:
    """End this child soon after its parent is gone (killed: nobody reads the answer), so no
    compiler keeps a CUDA context on the GPU."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def main() -> int:
    """The child: a request (device, parent pid, variants) on stdin, the compiled variants on
    the stdout it was given.  Whatever else writes to stdout (Triton's dump knobs, a
    sitecustomize) goes to stderr instead, so the answer stays parseable."""
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    request = json.load(sys.stdin)
    threading.Thread(target=_exit_with, args=(request["parent"],), daemon=True).start()
    import torch

    torch.cuda.set_device(request["device"])
    kernels = [_compile(spec).to_entry("") for spec in request["variants"]]
    json.dump({"source": source_hash(), "triton": triton_version(), "kernels": kernels}, answer)
    answer.close()
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):  # the parent gave up waiting
        sys.exit(main())
