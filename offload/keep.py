# SPDX-License-Identifier: Apache-2.0
"""List and free what this user's tiers keep on this host (docs/KEEP.md).

``python -m offload.keep list`` shows each keeper (node, namespace, geometry, bytes, attached
or idle with the seconds left); ``python -m offload.keep drop --all`` or ``drop NAME`` makes
idle keepers exit, which frees their memory at once.  A keeper attached to a live tier is
never dropped.  Keepers are found in ``/proc/net/unix`` under this user's name prefix and each
is asked itself (`offload.region.keeper`), so only keepers of this user are listed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

from offload.region.keeper import KeeperError, KeeperLink, listening_names, node_prefix

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
            info, _ = link.request("info")
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


def _format(name: str, info: dict[str, Any]) -> str:
    state = (f"attached ({info.get('owner')})" if info.get("attached") else
             f"idle, {info.get('left_s') or 0:.1f} s left")
    return (f"{name}  node={info.get('node')!r} namespace={info.get('namespace')!r} "
            f"geometry={info.get('geometry')} bytes={info.get('bytes')} pid={info.get('pid')} "
            f"{state}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m offload.keep",
                                description="List or free the host tiers this user keeps "
                                            "on this host (TierConfig.keep_s, --keep).")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="show this user's keepers on this host")
    d = sub.add_parser("drop", help="free idle keepers (an attached one is never dropped)")
    which = d.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="every idle keeper of this user")
    which.add_argument("name", nargs="?", help="one keeper, as `list` names it")
    args = p.parse_args(argv)
    if args.command == "list":
        found = keepers()
        for name, info in found:
            print(_format(name, info))
        if not found:
            print("no keepers of this user on this host")
        return 0
    names = [n for n, _ in keepers()] if args.all else [args.name]
    status = 0
    for name in names:
        why = drop(name)
        print(f"{name}: " + ("dropped" if why is None else f"not dropped: {why}"))
        status |= why is not None
    return status


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
