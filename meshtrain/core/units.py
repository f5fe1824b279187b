"""Quantities typed by people: sizes ("80GB"), bandwidths ("600GB/s", "200Gb/s") and
compute rates ("312TFLOPS"), parsed to plain numbers (bytes, bytes/s, FLOP/s).

Decimal prefixes (k, M, G, T, P = 10^3k) as GPU and network vendors quote them; binary
ones (KiB, MiB, GiB, TiB) where written. In bandwidths a capital B is bytes and a small b is
bits ("200Gb/s" = 25 GB/s, "100Gbps" = 12.5 GB/s). A number with no unit is refused: "80"
could be GB or GiB or bytes, and guessing is how plans go wrong.
"""
from __future__ import annotations

import re


class UnitError(ValueError):
    """A quantity that cannot be read: the message names the text and shows a valid form."""


_DECIMAL = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40, "PI": 2**50}
_NUMBER = r"([-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|[-+]?\.\d+)"


def _scale(prefix: str) -> float:
    key = prefix.upper()
    if key in _BINARY:
        return _BINARY[key]
    if key in _DECIMAL:
        return _DECIMAL[key]
    raise KeyError(prefix)


def _split(text: object, what: str, example: str) -> tuple[float, str]:
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise UnitError(f"{what} {text!r}: expected text such as {example!r}")
    raw = str(text).strip()
    m = re.fullmatch(_NUMBER + r"\s*(.*)", raw)
    if not m:
        raise UnitError(f"{what} {raw!r} does not start with a number; write it like {example!r}")
    value, unit = float(m.group(1)), m.group(2).strip()
    if not unit:
        raise UnitError(f"{what} {raw!r} has no unit; write it with one, e.g. {example!r}")
    if value < 0:
        raise UnitError(f"{what} {raw!r} is negative; it must be a positive amount, e.g. {example!r}")
    if value == 0:
        raise UnitError(f"{what} {raw!r} is zero; it must be a positive amount, e.g. {example!r}")
    return value, unit


def parse_bytes(text: object) -> float:
    """'80GB' -> 8e10, '40 GiB' -> 40 * 2**30, '512MB' -> 5.12e8 (bytes)."""
    value, unit = _split(text, "size", "80GB")
    m = re.fullmatch(r"([kKmMgGtTpP]i?)?B", unit)
    if not m:
        raise UnitError(f"size {text!r}: unit {unit!r} is not a size; use B, KB, MB, GB, TB "
                        f"(or KiB, MiB, GiB, TiB), e.g. '80GB'")
    return value * _scale(m.group(1) or "")


def parse_bandwidth(text: object) -> float:
    """'600GB/s' -> 6e11, '200Gb/s' or '200Gbps' -> 2.5e10 (bytes per second)."""
    value, unit = _split(text, "bandwidth", "600GB/s")
    m = re.fullmatch(r"([kKmMgGtTpP]i?)?(B|b)(?:/s|ps)", unit)
    if not m:
        raise UnitError(f"bandwidth {text!r}: unit {unit!r} is not a rate; use e.g. '600GB/s' "
                        f"(bytes) or '200Gb/s' / '200Gbps' (bits)")
    per_second = value * _scale(m.group(1) or "")
    return per_second / 8 if m.group(2) == "b" else per_second


def parse_flops(text: object) -> float:
    """'312TFLOPS', '312 TFLOP/s', '1.2PFLOPs' -> FLOP per second."""
    value, unit = _split(text, "compute rate", "312TFLOPS")
    m = re.fullmatch(r"([kKmMgGtTpP])?FLOP(?:S|s|/s)", unit)
    if not m:
        raise UnitError(f"compute rate {text!r}: unit {unit!r} is not a FLOP rate; use e.g. "
                        f"'312TFLOPS' or '19.5TFLOP/s'")
    return value * _scale(m.group(1) or "")


def fmt_bytes(n: float) -> str:
    """Bytes in decimal units as papers quote them: 1.88e9 -> '1.88 GB'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_rate(n: float, unit: str) -> str:
    """1.5e11, 'B/s' -> '150 GB/s'; 3.1e14, 'FLOP/s' -> '310 TFLOP/s'."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}"


def fmt_seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


def fmt_duration(t: float) -> str:
    """A wait in the unit a person reads it in: seconds, minutes or hours."""
    if t >= 3600:
        return f"{t / 3600:.1f} h"
    return f"{t / 60:.0f} min" if t >= 60 else f"{t:.0f} s"
