# SPDX-License-Identifier: Apache-2.0
"""Which optional GPU parts this process can use, asked without importing them.

A leaf: the backend factory (`offload.transfer.engine`) and the backends it builds both ask
here, so no backend imports the factory back.
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """Whether Triton is installed (the copy kernel and every checksum pass on CUDA need it)."""
    return importlib.util.find_spec("triton") is not None
