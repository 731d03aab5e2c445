"""Byte sizes written the way people write them: 1073741824, "64MiB", "1.5GB", "141GiB"."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: float | str) -> int:
    """Return a byte count from an int or a string such as "64MiB"; raise ValueError if malformed."""
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")  # noqa: TRY004  (the documented contract: ValueError)
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"byte size must be >= 0, got {value}")
        return int(value)
    match = _PATTERN.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"not a byte size: {value!r} (use a number of bytes or a number with a unit: "
            "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(num_bytes: float) -> str:
    """Human form with binary units, e.g. 1.50 GiB."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
