# SPDX-License-Identifier: Apache-2.0
"""List and free what this user's tiers keep on this host (docs/KEEP.md).

``python -m offload.keep list`` shows each keeper (node, namespace, geometry, bytes, attached
or idle with the seconds left); ``python -m offload.keep drop --all`` or ``drop NAME`` makes
idle keepers exit, which frees their memory at once.  A keeper attached to a live tier is
never dropped.  Only keepers of this user are listed (`offload.region.kept`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from offload.region.kept import drop, keepers


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
