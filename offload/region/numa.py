# SPDX-License-Identifier: Apache-2.0
"""NUMA placement: a rank's host memory on its GPU's NUMA node.

On a two-socket host a GPU reads memory of the far socket through the inter-socket link, at a
fraction of its PCIe rate.  Each rank therefore finds its GPU's node in sysfs and pre-faults its
pages from threads that run on that node's CPUs with a *preferred* memory policy for that node
(``set_mempolicy(MPOL_PREFERRED)``): pages land there while the node has room and elsewhere when
it has not (a strict bind would turn a full node into an OOM kill, not a slower tier).  The
policy is the faulting thread's, so it covers anonymous and memfd regions alike without
``mbind`` calls per slot (which would split a shared mapping into a VMA per row and run into
``vm.max_map_count``).

Runs in every rank's process; pure parsing is apart from the syscalls so it is tested on any
host with a fake sysfs tree.

* `cuda_numa_node` / `pci_numa_node` -- the node of a CUDA device (None: no GPU, no NUMA, or
  sysfs says -1);
* `node_cpus` / `parse_cpulist` -- the CPUs of a node;
* `Placement.enter` -- pin the calling thread's CPUs and memory policy to the node;
* `bytes_on_node` -- how much of an address range is resident on a node (`/proc/self/numa_maps`),
  the check the report carries.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.system.shm import libc

log = logging.getLogger(__name__)

MPOL_PREFERRED = 1
# mempolicy syscalls have no glibc wrapper; their numbers per machine type
_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}


def parse_cpulist(text: str) -> frozenset[int]:
    """A sysfs CPU list (``0-3,8,10-11``) as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def pci_numa_node(bus_id: str, sysfs: str | Path = "/sys") -> int | None:
    """The NUMA node sysfs gives the PCI device ``bus_id`` (``0000:3b:00.0``); None where the
    file is missing or says -1 (one node, or firmware that does not say)."""
    try:
        node = int((Path(sysfs) / "bus/pci/devices" / bus_id.lower() / "numa_node")
                   .read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(node: int, sysfs: str | Path = "/sys") -> frozenset[int]:
    """The CPUs of NUMA node ``node`` (empty where sysfs does not list them)."""
    try:
        return parse_cpulist((Path(sysfs) / f"devices/system/node/node{node}/cpulist")
                             .read_text())
    except OSError:
        return frozenset()


def cuda_numa_node(device: torch.device, sysfs: str | Path = "/sys") -> int | None:
    """The NUMA node of a CUDA device's PCI slot; None for a CPU device."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    domain = getattr(props, "pci_domain_id", 0)
    bus, dev = getattr(props, "pci_bus_id", None), getattr(props, "pci_device_id", None)
    if bus is None or dev is None:
        return None
    return pci_numa_node(f"{domain:04x}:{bus:02x}:{dev:02x}.0", sysfs)


@dataclass(frozen=True)
class Placement:
    """Where one rank's pre-fault threads run and allocate."""

    node: int
    cpus: frozenset[int]

    @classmethod
    def for_node(cls, node: int | None, sysfs: str | Path = "/sys") -> Placement | None:
        return None if node is None else cls(node, node_cpus(node, sysfs))

    def enter(self) -> None:
        """Bind the calling thread: its CPUs to those of the node's it may already run on (a
        launcher's binding or a container's cpuset is kept: setting the node's own would widen
        it; none there leaves them as they are) and its memory policy to prefer the node.  Best
        effort: a refusal (a kernel without NUMA) leaves the thread as it was."""
        with contextlib.suppress(OSError):  # 0: this thread on Linux
            allowed = self.cpus & frozenset(os.sched_getaffinity(0))
            if allowed:
                os.sched_setaffinity(0, allowed)
        number = _SET_MEMPOLICY.get(platform.machine())
        if number is None:
            return
        bits = ctypes.sizeof(ctypes.c_ulong) * 8
        mask = (ctypes.c_ulong * (self.node // bits + 1))()
        mask[self.node // bits] = 1 << (self.node % bits)
        if libc.syscall(ctypes.c_long(number), ctypes.c_long(MPOL_PREFERRED), mask,
                        ctypes.c_ulong(len(mask) * bits + 1)) != 0:
            _refused(ctypes.get_errno())


def bytes_on_node(address: int, length: int, node: int, maps: str | None = None,
                  numa_maps: str | None = None) -> int:
    """Bytes resident on ``node`` in the mappings that overlap ``[address, address + length)``
    (whole mappings: a region is mapped on its own), from ``/proc/self/numa_maps``."""
    maps = maps if maps is not None else Path("/proc/self/maps").read_text()
    numa_maps = numa_maps if numa_maps is not None else Path("/proc/self/numa_maps").read_text()
    end = address + length
    starts = set()
    for line in maps.splitlines():
        lo, _, hi = line.split(" ", 1)[0].partition("-")
        if int(lo, 16) < end and int(hi, 16) > address:
            starts.add(int(lo, 16))
    total = 0
    for line in numa_maps.splitlines():
        fields = line.split()
        if not fields or int(fields[0], 16) not in starts:
            continue
        page_kib = next((int(f.split("=")[1]) for f in fields
                         if f.startswith("kernelpagesize_kB=")), 4)
        pages = next((int(f.split("=")[1]) for f in fields if f.startswith(f"N{node}=")), 0)
        total += pages * page_kib * 1024
    return total


@functools.cache
def _refused(err: int) -> None:
    """Say once per process (and errno) that the kernel refused the memory policy."""
    log.warning("NUMA placement: set_mempolicy refused (%s); pages go where the kernel puts "
                "them (numa_bytes in the report says where)", errno.errorcode.get(err, err))
