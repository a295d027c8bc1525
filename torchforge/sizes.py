"""The one parser for sizes given as options (``shard_size``, ``size_limit``, ``max_shard_size``, ...).

One meaning everywhere, the SI/IEC one (and Hugging Face's ``max_shard_size``): ``KB``/``MB``/``GB``/``TB``
are powers of 1000, ``KiB``/``MiB``/``GiB``/``TiB`` powers of 1024; units are case-insensitive
(``"64mb"`` is 64,000,000 bytes, ``"64MiB"`` is 67,108,864), a space may separate number and unit, and
the number may have a fraction (``"1.5GB"``). An int is a number of bytes.

Note for MosaicML Streaming users: Streaming's ``bytes_to_int`` reads ``"64mb"`` as 2**26; write
``"64MiB"`` for the same shards.
"""
from __future__ import annotations

import re

__all__ = ["UNITS", "parse_size"]

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(size: int | str, *, option: str = "size", allow_zero: bool = False) -> int:
    """Bytes in ``size``: an int, or a string such as ``"256MB"``, ``"64MiB"``, ``"1.5 GB"``.

    Args:
        size: the value given.
        option: the option's name, for the error message.
        allow_zero: whether 0 is a valid size (it is not, unless the option says so).

    Raises:
        TypeError: neither an int nor a string.
        ValueError: not a size, an unknown unit, negative, or zero when not allowed.

    >>> parse_size("64MiB"), parse_size("64mb")
    (67108864, 64000000)
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"{option}={size!r} is not a size: give bytes as an int or a string such as "
                         "'256MB' or '64MiB'")
    if isinstance(size, int):
        n = size
    else:
        m = _SIZE.fullmatch(size)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in UNITS:
            raise ValueError(f"{option}={size!r} is not a size such as '256MB' (10**6) or '64MiB' (2**20); "
                             f"units: {', '.join(u for u in UNITS if u)}")
        n = int(float(m.group(1)) * UNITS[unit])
    if n < 0 or (n == 0 and not allow_zero):
        raise ValueError(f"{option}={size!r} must be {'non-negative' if allow_zero else 'positive'}")
    return n
