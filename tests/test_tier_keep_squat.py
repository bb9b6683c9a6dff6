# SPDX-License-Identifier: Apache-2.0
"""Another user who squats the keeper's (predictable) name may cost us retention on that node,
never the tier: docs/KEEP.md promises "no retention on that node, with a warning".  A squatter
whose listen backlog is full makes our connect fail with EAGAIN (an OSError, not a
`KeeperError`), which `claim_node_keeper` lets escape, and the whole tier fails to start."""

from __future__ import annotations

import os
import signal

from offload.region import kept
from offload.region.keeper import keeper_name
from tests.other_user import as_root, listener, other_process
from tests.region.test_keeper import wait_gone
from tests.test_tier_keep import _keepers, _node, _run


@as_root
def test_a_squatter_with_a_full_backlog_costs_retention_only() -> None:
    node, ns = _node(), "model-q"
    name = keeper_name(os.geteuid(), node, ns)

    # listen(0) and one connection never accepted: the backlog is full
    with other_process(listener(name.encode(), backlog=0, fill=True), timeout_s=1) as child:
        assert child.read() == b"r"
        try:
            adopted, log, _ = _run(node, "s0 l0", 1.5, ns)
        finally:
            os.kill(child.pid, signal.SIGKILL)
        assert adopted is None and log == ["hit"]  # served, unkept
    assert _keepers(node) == {}


@as_root
def test_another_users_socket_name_with_a_newline_breaks_no_tier() -> None:
    """``/proc/net/unix`` prints abstract names raw, newlines included, so another user's name
    can forge a line whose flags field is not hex; `listening_names` then raises ValueError,
    and with it `kept.drop_idle` inside `claim_node_keeper` (and ``python -m offload.keep
    list``): every tier with keep_s on this host fails to start."""
    node, ns = _node(), "model-n"

    forged = b"x\n0: 1 2 NOTHEX 4 5 6 @offload-keep/forged"
    with other_process(listener(forged, backlog=1), timeout_s=1) as child:
        assert child.read() == b"r"
        try:
            adopted, log, _ = _run(node, "s0 l0", 1.5, ns)
        finally:
            os.kill(child.pid, signal.SIGKILL)
        assert adopted == 0 and log == ["hit"]  # kept as usual
    found = _keepers(node)
    kept.drop_idle(node)
    for info in found.values():
        wait_gone(info["pid"], timeout_s=15)
