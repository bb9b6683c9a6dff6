"""offload: a host-memory tier for KV-cache blocks of TP x PP torchrun jobs.

The package mirrors the lifecycle: `topology` -> `plan` (pure capacity math) -> `region`
(shm files, pre-fault, pinning) -> `transfer` (batched block copies) -> `quorum` -> `manager` ->
`actor` / `tier` (the per-rank API).  Public names are imported lazily so that importing one
layer does not drag in the others.
"""

from __future__ import annotations

from offload.exports import lazy_exports

_EXPORTS = {
    "HostTier": "offload.tier",
    "CopyJob": "offload.actor",
    "TierConfig": "offload.config",
    "ChunkManager": "offload.manager",
    "OffloadError": "offload.errors",
    "PeerError": "offload.errors",
    "JobFailed": "offload.errors",
    "MalformedJob": "offload.errors",
    "TransferResult": "offload.tier",
    "parse_size": "offload.sizes",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
