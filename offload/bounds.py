# SPDX-License-Identifier: Apache-2.0
"""The limits every setting and flag is checked against, in one place.

Pure checks, no I/O, importable from any process (no torch).  A value that passes them is one
the platform can act on: a timeout every wait below accepts, a size a C ``off_t`` holds, a
value of the type its field declares.  Each refusal is one `OffloadError` line naming the
value, the limit and the fix.

Primitives:

* `MAX_WAIT_S`, `MAX_INT`, `MAX_PORT` -- the longest wait, the largest whole number and the
  last TCP port accepted;
* `check_seconds` -- a timeout: a real number of seconds in ``(0, MAX_WAIT_S]``;
* `check_int` -- a whole number (never a bool) in ``[minimum, maximum]``;
* `check_type` -- a value against its annotation (``int``, ``float``, ``bool``, ``str``,
  ``Literal[...]``, ``X | None``);
* `bounded_wait` -- a computed wait (a timeout times a count) cut to `MAX_WAIT_S`;
* `parse_seconds`, `flag_type` -- the same checks for command-line flags (argparse ``type=``).
"""

from __future__ import annotations

import argparse
import math
import threading
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from offload.errors import OffloadError

T = TypeVar("T")

# NOTE: every wait ends as a deadline ``now + timeout`` in int64 nanoseconds of a monotonic
# clock whose ``now`` is the host's uptime: CPython's lock, event and future timeouts (refused
# past `threading.TIMEOUT_MAX` with OverflowError), socket timeouts, torch's TCPStore and gloo
# (``std::chrono::steady_clock``: past it the store fails to connect, DistNetworkError), which
# get the timeout as a ``timedelta`` turned into int64 milliseconds.  ``time_t`` is 64-bit on
# the Linux hosts the tier runs on, so the nanosecond deadline binds first: about 292 years
# minus the uptime.  A billion seconds (32 years) leaves 260 years of uptime, and no wait a job
# means is longer.
MAX_WAIT_S = min(1e9, threading.TIMEOUT_MAX / 2)
# The largest whole number a setting may hold: what an int64 holds (a C off_t or ssize_t, a
# numpy index), so a size reaches mmap, ftruncate and pwritev without OverflowError.
MAX_INT = (1 << 63) - 1
MAX_PORT = 65535  # the last TCP port

_YEAR_S = 365.25 * 86400


def _named(what: str, value: object) -> str:
    """``what = value`` for a setting, ``--flag value`` for a flag (as the user wrote it)."""
    return f"{what} {_show(value)}" if what.startswith("--") else f"{what} = {_show(value)}"


def _show(value: object) -> str:
    """A value as the user wrote it: numbers plainly, anything else as its repr."""
    if type(value) is float:
        return f"{value:g}"
    return repr(value)


def check_seconds(value: object, what: str, fix: str) -> float:
    """``value`` as a float, when it is a real number of seconds (int or float, never a
    bool), positive, finite and at most `MAX_WAIT_S`.

    Args:
        value: the timeout as given.
        what: how the user knows it, e.g. ``"timeout_s (--timeout)"``.
        fix: what to give instead, e.g. ``"give the seconds a rank may wait, such as 300"``.

    Returns:
        The seconds as a float.

    Raises:
        OffloadError: one line naming ``what``, the value, the limit and ``fix``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OffloadError(f"{_named(what, value)} is {_kind(value)}, not a number of seconds; "
                           f"{fix}")
    if math.isnan(value) or value <= 0:
        raise OffloadError(f"{_named(what, value)} must be positive; {fix}")
    if value > MAX_WAIT_S:
        raise OffloadError(f"{_named(what, value)} is past the longest wait the platform "
                           f"allows, {MAX_WAIT_S:g} s ({MAX_WAIT_S / _YEAR_S:.0f} years); {fix}")
    return float(value)


def check_int(value: object, what: str, minimum: int, maximum: int = MAX_INT,
              fix: str = "") -> int:
    """``value`` when it is a whole number (an int, never a bool) in ``[minimum, maximum]``.

    Raises:
        OffloadError: one line naming ``what``, the value and the limit it breaks.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise OffloadError(f"{_named(what, value)} is {_kind(value)}, not a whole number; "
                           f"{fix or f'give an int of at least {minimum}'}")
    if value < minimum:
        raise OffloadError(f"{_named(what, value)} is below its minimum {minimum}; "
                           f"{fix or f'give at least {minimum}'}")
    if value > maximum:
        raise OffloadError(f"{_named(what, value)} is above its maximum {maximum}; "
                           f"{fix or f'give at most {maximum}'}")
    return value


def check_type(value: object, hint: Any, what: str, fix: str = "") -> None:
    """Refuse ``value`` unless it is of the annotated type ``hint`` (``int`` takes no bool,
    ``float`` takes an int too, ``Literal`` only its own values, ``X | None`` None too).

    Raises:
        OffloadError: one line naming ``what``, the value, what it is, what is wanted and
        ``fix`` (default: give what is wanted).
    """
    if _matches(value, hint):
        return
    choices = _literal(hint)
    if choices and isinstance(value, str):
        shown = ", ".join(choices)
        raise OffloadError(f"{what} = {value!r} is unknown; {fix or f'choose one of {shown}'}")
    wanted = _describe_type(hint)
    raise OffloadError(f"{what} = {value!r} is {_kind(value)}, not {wanted}; "
                       f"{fix or f'give {wanted}'}")


def _kind(value: object) -> str:
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _literal(hint: Any) -> list[str]:
    """The choices of a ``Literal`` (inside ``X | None`` too), as text."""
    if typing.get_origin(hint) is typing.Literal:
        return [str(arg) for arg in typing.get_args(hint)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [c for arg in typing.get_args(hint) for c in _literal(arg)]
    return []


def _matches(value: object, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return any(type(value) is type(arg) and value == arg for arg in typing.get_args(hint))
    if hint is None or hint is type(None):
        return value is None
    if hint is bool:
        return type(value) is bool
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe_type(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe_type(arg) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return "one of " + ", ".join(str(arg) for arg in typing.get_args(hint))
    if hint is None or hint is type(None):
        return "None"
    return {int: "an int", float: "a number", bool: "True or False",
            str: "a str"}.get(hint, getattr(hint, "__name__", str(hint)))


def bounded_wait(seconds: float) -> float:
    """A wait computed from checked ones (a deadline's remainder, a timeout times a count),
    cut to what every wait accepts."""
    return min(seconds, MAX_WAIT_S)


# ---------------------------------------------------------------------- flags


def parse_seconds(text: str, what: str, fix: str = "give a number of seconds such as 300"
                  ) -> float:
    """A flag's text as checked seconds (`check_seconds`)."""
    try:
        value: object = float(text)
    except ValueError:
        value = text
    return check_seconds(value, what, fix)


def flag_type(parse: Callable[[str, str], T], flag: str) -> Callable[[str], T]:
    """An argparse ``type=`` for ``flag`` that parses with ``parse(text, flag)`` (e.g.
    `parse_size`, `parse_seconds`): its one-line `OffloadError` becomes argparse's error, so
    a script exits 2 with that line instead of a traceback."""
    def convert(text: str) -> T:
        try:
            return parse(text, flag)
        except OffloadError as exc:  # argparse names the flag itself
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag} ")) from None

    convert.__name__ = flag  # argparse names the type in some errors
    return convert
