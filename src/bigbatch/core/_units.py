"""Byte sizes for people: ``format_bytes(1.5 * 2**30) == "1.50 GiB"`` and ``parse_bytes("6GiB")``.

One place for the units every report, log and error message of bigbatch uses.
"""

from __future__ import annotations

import math
import re

_BINARY = {u + b: 2 ** (10 * i) for i, u in enumerate("kmgt", 1) for b in ("", "ib")}  # k, KiB
_UNITS = {"": 1, "b": 1, **_BINARY} | {u + "b": 10 ** (3 * i) for i, u in enumerate("kmgt", 1)}


def parse_bytes(value: object, name: str = "memory_budget") -> int | None:
    """Parse ``"6GiB"``, ``"512MB"``, ``"1.5G"`` or a number of bytes into bytes (``None`` stays).

    Args:
        value: the size; ``None`` means "no size given".
        name: the setting's name, for the error message.

    Raises:
        ValueError: not a positive finite size.

    Example:
        >>> parse_bytes("1.5KiB")
        1536
    """
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size: write a number with a unit, e.g. "
                f'{name}="6GiB", "512MiB", "8GB", or a number of bytes.'
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(number) or number * _UNITS[unit] < 1:
        raise ValueError(f'{name}={value!r} is not a positive finite size: e.g. {name}="6GiB".')
    return int(number * _UNITS[unit])


def format_bytes(n: float) -> str:
    """``1536 * 2**20`` -> ``"1.50 GiB"``.

    >>> format_bytes(1536 * 2**20)
    '1.50 GiB'
    """
    k = next((k for k in range(3) if abs(n) < 1024 ** (k + 1)), 3)
    return f"{n / 1024**k:.{2 if k else 0}f} {('B', 'KiB', 'MiB', 'GiB')[k]}"
