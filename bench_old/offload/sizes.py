"""Parsing and printing byte sizes such as ``4096``, ``64KiB``, ``256MiB``, ``4GiB``."""

from __future__ import annotations

import re
from fractions import Fraction

from offload.errors import OffloadError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """Return the number of bytes ``text`` denotes; binary units (KiB, MiB, GiB, TiB) and
    decimal ones (KB, MB, GB, TB) are accepted, case-insensitively."""
    if isinstance(text, int):
        if text < 0:
            raise OffloadError(f"{what} {text} is negative; give a byte count such as 64KiB")
        return text
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise OffloadError(
            f"{what} {text!r} is not a size; write a byte count such as 4096, 64KiB, 256MiB or 4GiB"
        )
    value = Fraction(match.group(1)) * _UNITS[unit]
    if value.denominator != 1:
        raise OffloadError(f"{what} {text!r} is not a whole number of bytes; round it")
    return int(value)


def format_size(n: int | float) -> str:
    """Human-readable binary size with three significant digits, e.g. ``1.50 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple
