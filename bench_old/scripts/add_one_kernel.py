"""A one-line Triton kernel for `bench_registrations.py --before`: imported, it is compiled in
the caller's process; run as a script, it compiles for the current GPU and writes the cubin to
stdout, so that a parent can load it with the driver alone, never importing Triton itself.

    python3 scripts/add_one_kernel.py > add_one.cubin
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl


@triton.jit
def add_one(x, n, BLOCK: tl.constexpr):  # Triton reads the parameters' hints: only its own
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)


def run(device: torch.device) -> None:
    """Compile, load and run the kernel on ``device`` (one 4096-element tensor)."""
    values = torch.zeros(4096, device=device)
    add_one[(4,)](values, values.numel(), BLOCK=1024)


def cubin() -> bytes:
    """The kernel compiled for the current GPU, not loaded."""
    values = torch.zeros(4096, device="cuda")
    return add_one.warmup(values, values.numel(), BLOCK=1024, grid=(4,)).asm["cubin"]


if __name__ == "__main__":
    sys.stdout.buffer.write(cubin())
