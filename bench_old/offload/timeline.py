"""Per-rank start-up timeline as a PNG: one row per rank, one bar per phase.

The picture users want when eight ranks start unevenly: which rank waited, and in which phase.
Phases run in order inside `HostTier.create` (plan -> create -> pre-fault -> the part of pinning
not hidden behind pre-fault), so each bar starts where the previous one ended.  With background
set-up (DESIGN.md section 3.9) `create` returns after plan and files, and one more bar runs from
there until the rank's rows were all set up, while jobs already run: a line marks the first job
decided successfully.  matplotlib is an optional extra (``pip install offload[plot]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from offload.errors import OffloadError

PHASES = (("plan", "#9e9e9e"), ("create", "#4c72b0"), ("prefault", "#55a868"),
          ("pin", "#c44e52"))
BACKGROUND = ("set-up behind create", "#dd8452")


def phase_spans(rank: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(phase, start, duration) of one report row's phases, laid end to end from 0; a rank
    whose set-up ran in the background has plan and create, then its set-up from ``create``'s
    return (``timings_s["total"]``) until its rows were all set up (``ready_s``)."""
    timings = rank["timings_s"]
    phases = ("plan", "create") if rank.get("background") else [p for p, _ in PHASES]
    spans, start = [], 0.0
    for phase in phases:
        duration = float(timings.get(phase, 0.0))
        spans.append((phase, start, duration))
        start += duration
    if rank.get("background") and rank.get("ready_s") is not None:
        returned = float(timings.get("total", start))
        spans.append((BACKGROUND[0], returned, max(0.0, rank["ready_s"] - returned)))
    return spans


def draw_timeline(ranks: Sequence[dict[str, Any]], path: str, title: str = "",
                  first_job_s: float | None = None) -> None:
    """Write the timeline of the report's ``ranks`` rows to ``path`` (PNG); ``first_job_s``
    (the report's ``readiness``) marks the first job decided successfully."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OffloadError(f"--timeline {path!r} needs matplotlib; pip install matplotlib "
                           "(the 'plot' extra) or drop the flag") from None
    colors = dict((*PHASES, BACKGROUND))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(ranks) + 1.4))
    for row, rank in enumerate(ranks):
        for phase, start, duration in phase_spans(rank):
            ax.barh(row, duration, left=start, color=colors[phase],
                    label=phase if row == 0 else None)
    if first_job_s is not None:
        ax.axvline(first_job_s, color="black", linestyle="--", label="first job decided")
    ax.set_yticks(range(len(ranks)), [f"rank {r['rank']} ({r['node_id']})" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since HostTier.create")
    ax.set_title(title or "offload start-up per rank")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
