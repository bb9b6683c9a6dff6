"""The start-up timeline's phases: blocking set-up end to end, background set-up as a bar from
`create`'s return to the rank's last row (the picture is drawn when matplotlib is present)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from offload.observe.timeline import BACKGROUND, draw_timeline, phase_spans

BLOCKING = {"rank": 0, "node_id": "n0", "background": False, "ready_s": 3.0,
            "timings_s": {"plan": 0.5, "create": 1.0, "prefault": 1.0, "pin": 0.5,
                          "total": 3.0}}
BEHIND = {"rank": 1, "node_id": "n0", "background": True, "ready_s": 4.0,
          "timings_s": {"plan": 0.25, "create": 0.25, "prefault": 2.0, "pin_busy": 3.0,
                        "total": 0.75}}


def test_blocking_phases_lie_end_to_end() -> None:
    assert phase_spans(BLOCKING) == [("plan", 0.0, 0.5), ("create", 0.5, 1.0),
                                     ("prefault", 1.5, 1.0), ("pin", 2.5, 0.5)]


def test_background_set_up_runs_from_create_returning_to_the_last_row() -> None:
    assert phase_spans(BEHIND) == [("plan", 0.0, 0.25), ("create", 0.25, 0.25),
                                   (BACKGROUND[0], 0.75, 3.25)]
    unfinished = {**BEHIND, "ready_s": None}  # set-up stopped: no bar claims an end
    assert [p for p, _, _ in phase_spans(unfinished)] == ["plan", "create"]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_the_picture_is_drawn_with_the_first_job_marked(tmp_path: Path) -> None:
    path = tmp_path / "t.png"
    draw_timeline([BLOCKING, BEHIND], str(path), "test", first_job_s=1.2)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
