"""Per-rank transfer engine: moves KV blocks between GPU KV tensors and the host region
(DESIGN.md section 6).  `make_engine` picks the backend; `kv_geometry` checks KV tensors before
any memory exists; `check_job` and `page_addresses` are the pure job rules."""

from offload.transfer.base import Direction, TransferEngine
from offload.transfer.engine import BACKENDS, make_engine, triton_available
from offload.transfer.layout import Job, SlotLayout, check_job, page_addresses
from offload.transfer.tensors import KVGeometry, kv_geometry

__all__ = [
    "BACKENDS",
    "Direction",
    "Job",
    "KVGeometry",
    "SlotLayout",
    "TransferEngine",
    "check_job",
    "kv_geometry",
    "make_engine",
    "page_addresses",
    "triton_available",
]
