# SPDX-License-Identifier: Apache-2.0
"""Adoption across two nodes must never pair one life's index with another life's region.

Life 1 (nodes A, B) stores keys 0-2 and is kept.  Life 2 starts while node B's keeper is still
claimed by someone else (a rank of life 1 still exiting, say): node B keeps nothing, so life 2
starts fresh -- node A's keeper is reset and gets life 2's index, but node B's keeper still
holds life 1's region, untouched.  Life 2 stores keys 3-5 into the same chunks, with the same
generations (a fresh index starts at epoch 0 again, and job sequence numbers start at 0 in every
life).  Life 3 then finds both keepers of its plan: node A's index names keys 3-5, node B's
region holds keys 0-2 under the very same (chunk, position, generation), so node B's page
checksums would pass and its rank would load key 0's bytes as key 3's.  The keepers name
different lives, so life 3 adopts nothing."""

from __future__ import annotations

import os
import uuid
from typing import Any

from offload.region import kept
from offload.region.keeper import KeeperLink, keeper_name
from tests.harness import run_group
from tests.region.test_keeper import wait_gone
from tests.test_tier_keep import _keepers, tier_body


def _run(nodes: list[str], *args: Any) -> list[list[str]]:
    """`tier_body` on one rank per node, two chunks: each rank's log."""
    out = run_group(tier_body, 2, args=(*args, 2), nodes=nodes, timeout=60)
    errors = [o.error for o in out if o.error]
    assert not errors, errors
    return [o.value[1] for o in out]


def test_a_node_kept_from_an_older_life_is_never_adopted_with_a_newer_index() -> None:
    tag = uuid.uuid4().hex[:10]
    nodes, ns = [f"keep-a-{tag}", f"keep-b-{tag}"], "model-m"
    try:
        _run(nodes, "s0 s1 s2", 30, ns)  # life 1: both nodes keep
        # node B's keeper is still claimed by another tier while life 2 starts
        other = KeeperLink.connect(keeper_name(os.geteuid(), nodes[1], ns), 5)
        assert other is not None
        other.request("claim", owner="a-tier-still-exiting")
        try:
            _run(nodes, "s3 s4 s5", 30, ns)  # life 2: node B keeps nothing, A starts anew
        finally:
            other.close()
        logs = _run(nodes, "l3 l4 l5", 1.5, ns)  # life 3: two lives kept, none adopted
        assert logs == [["miss"] * 3] * 2, logs
    finally:
        for node in nodes:
            for name, info in _keepers(node).items():
                kept.drop(name)
                wait_gone(info["pid"], timeout_s=15)
