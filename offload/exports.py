# SPDX-License-Identifier: Apache-2.0
"""Public names of a package imported when first asked for, so that importing one layer does
not drag in the others (the pure geometry without the syscall layers, ``offload.vllm.core``
without vLLM)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``exports`` maps each public name to the
    module that defines it."""

    def __getattr__(name: str) -> Any:  # noqa: N807 (the module hook's own name)
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
