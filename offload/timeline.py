"""Per-rank start-up timeline as a PNG: one row per rank, one bar per phase.

The picture users want when eight ranks start unevenly: which rank waited, and in which phase.
Phases run in order inside `HostTier.create` (plan -> create -> pre-fault -> the part of pinning
not hidden behind pre-fault), so each bar starts where the previous one ended.  matplotlib is an
optional extra (``pip install offload[plot]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from offload.errors import OffloadError

PHASES = (("plan", "#9e9e9e"), ("create", "#4c72b0"), ("prefault", "#55a868"),
          ("pin", "#c44e52"))


def phase_spans(timings: dict[str, float]) -> list[tuple[str, float, float]]:
    """(phase, start, duration) for each phase present, laid end to end from 0."""
    spans, start = [], 0.0
    for phase, _ in PHASES:
        duration = float(timings.get(phase, 0.0))
        spans.append((phase, start, duration))
        start += duration
    return spans


def draw_timeline(ranks: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """Write the timeline of the report's ``ranks`` rows to ``path`` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OffloadError(f"--timeline {path!r} needs matplotlib; pip install matplotlib "
                           "(the 'plot' extra) or drop the flag") from None
    colors = dict(PHASES)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(ranks) + 1.4))
    for row, rank in enumerate(ranks):
        for phase, start, duration in phase_spans(rank["timings_s"]):
            ax.barh(row, duration, left=start, color=colors[phase],
                    label=phase if row == 0 else None)
    ax.set_yticks(range(len(ranks)), [f"rank {r['rank']} ({r['node_id']})" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since HostTier.create")
    ax.set_title(title or "offload start-up per rank")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
