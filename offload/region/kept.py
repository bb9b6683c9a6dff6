# SPDX-License-Identifier: Apache-2.0
"""This user's keepers on this host (`offload.region.keeper`): find them, ask each for its
state, make idle ones exit.  Keepers are found in ``/proc/net/unix`` under this user's name
prefix and each is asked itself, so only keepers of this user are listed.  Used by adoption
(`offload.region.retain`: idle keepers of other namespaces go before the memory check) and by
``python -m offload.keep``."""

from __future__ import annotations

import os
from typing import Any

from offload.region.keeper import KeeperError, KeeperLink, listening_names, node_prefix
from offload.system.shm import close_fds

_TIMEOUT_S = 5.0


def keepers(node_id: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(name, info) of this user's keepers on this host (on one node where given)."""
    found = []
    for name in listening_names(node_prefix(os.geteuid(), node_id)):
        try:
            link = KeeperLink.connect(name, _TIMEOUT_S)
        except (KeeperError, OSError):
            continue
        if link is None:
            continue
        try:
            info, fds = link.request("info")
            close_fds(fds)  # an answer to info carries none; a keeper that sends some keeps them
        except KeeperError:
            continue
        finally:
            link.close()
        found.append((name, info))
    return found


def drop(name: str) -> str | None:
    """Ask the keeper ``name`` to exit; None when it did (or was gone), else why not."""
    try:
        link = KeeperLink.connect(name, _TIMEOUT_S)
    except (KeeperError, OSError) as exc:
        return str(exc)
    if link is None:
        return None
    try:
        link.request("drop")
    except KeeperError as exc:
        return str(exc)
    finally:
        link.close()
    return None


def drop_idle(node_id: str | None = None, spare: str | None = None) -> list[str]:
    """Drop every idle keeper of this user (on one node where given) but ``spare``; returns
    the names dropped."""
    dropped = []
    for name, info in keepers(node_id):
        if name != spare and not info.get("attached") and drop(name) is None:
            dropped.append(name)
    return dropped
