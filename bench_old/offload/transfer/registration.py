"""Register a host tensor with CUDA for as long as a block runs.

The region module pins real regions; tests and the benchmark need the same kind of memory (a
plain host allocation registered portable + mapped, as the region is) without a region.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

PORTABLE_AND_MAPPED = 0x1 | 0x2  # cudaHostRegisterPortable | cudaHostRegisterMapped


@contextmanager
def host_registered(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """Yield ``tensor`` registered with CUDA; unregister on exit."""
    cudart = torch.cuda.cudart()
    nbytes = tensor.numel() * tensor.element_size()
    torch.cuda.check_error(cudart.cudaHostRegister(tensor.data_ptr(), nbytes, PORTABLE_AND_MAPPED))
    try:
        yield tensor
    finally:
        torch.cuda.check_error(cudart.cudaHostUnregister(tensor.data_ptr()))
