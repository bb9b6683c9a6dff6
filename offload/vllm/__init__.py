# SPDX-License-Identifier: Apache-2.0
"""The tier as a vLLM offloading spec and connector (docs/VLLM.md).

``offload.vllm.core`` holds the logic and imports without vLLM.  `HostTierSpec` and
`HostTierConnector` need vLLM and are imported only when asked for, so that vLLM's
``spec_module_path: "offload.vllm"`` and ``kv_connector_module_path: "offload.vllm"`` work and
``import offload.vllm.core`` works without vLLM.
"""

from __future__ import annotations

from offload.exports import lazy_exports

_EXPORTS = {
    "HostTierSpec": "offload.vllm.spec",
    "HostTierConnector": "offload.vllm.connector",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
