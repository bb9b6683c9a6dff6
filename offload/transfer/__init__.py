"""Per-rank transfer engine: moves KV blocks between GPU KV tensors and the host region
(DESIGN.md section 6).  `make_engine` picks the backend; `job_offsets` is the pure placement."""

from offload.transfer.base import Direction, TransferEngine
from offload.transfer.engine import BACKENDS, make_engine, triton_available
from offload.transfer.layout import SlotLayout, TensorCopies, job_offsets

__all__ = [
    "BACKENDS",
    "Direction",
    "SlotLayout",
    "TensorCopies",
    "TransferEngine",
    "job_offsets",
    "make_engine",
    "triton_available",
]
