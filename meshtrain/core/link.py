"""Emulated slow links: price each accounted collective on an axis at a modelled bandwidth
and latency, and sleep that long, so one machine shows the wall-clock cost of a slow axis.

This is emulation, not measurement: the sleep is added on top of the real (fast, local)
collective. The bytes are the per-rank wire bytes the Comm already accounts (ring factor
included: 2(N-1)/N*S for an all-reduce), so the modelled time of one call is
    steps * latency + max(sent, received) / bandwidth
with steps = 2(N-1) for a ring all-reduce, N-1 for a reduce-scatter or all-gather, 1 otherwise.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from meshtrain.core.units import UnitError, parse_bandwidth

EMULATION_LABEL = "EMULATED LINK"
_AXES = ("dp", "pp", "tp")
_EXAMPLE = "dp=1Gb/s,5ms"


class LinkSpecError(ValueError):
    """A --link spec that cannot be read: the message names the part and shows a valid form."""


@dataclass(frozen=True)
class Link:
    bandwidth: float   # bytes per second
    latency: float     # seconds per message step


def _parse_latency(text: str, spec: str) -> float:
    raw = text.strip()
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if raw.endswith(unit):
            try:
                value = float(raw[:-len(unit)])
            except ValueError:
                break
            if value < 0:
                break
            return value * scale
    raise LinkSpecError(f"--link {spec!r}: latency {raw!r} is not a time; write it like "
                        f"'5ms', '200us' or '0.01s', e.g. {_EXAMPLE!r}")


def parse_link_spec(spec: str) -> dict[str, Link]:
    """'dp=1Gb/s,5ms' (several axes joined by ';') -> {"dp": Link(1.25e8, 0.005)}."""
    if not isinstance(spec, str) or not spec.strip():
        raise LinkSpecError(f"--link {spec!r} is empty; write AXIS=BANDWIDTH[,LATENCY], "
                            f"e.g. {_EXAMPLE!r}")
    links: dict[str, Link] = {}
    for part in spec.split(";"):
        axis, eq, rest = part.partition("=")
        axis = axis.strip()
        if not eq:
            raise LinkSpecError(f"--link {spec!r}: {part.strip()!r} has no '='; write "
                                f"AXIS=BANDWIDTH[,LATENCY], e.g. {_EXAMPLE!r}")
        if axis not in _AXES:
            raise LinkSpecError(f"--link {spec!r}: unknown axis {axis!r}; use one of "
                                f"{', '.join(_AXES)}, e.g. {_EXAMPLE!r}")
        if axis in links:
            raise LinkSpecError(f"--link {spec!r}: axis {axis!r} is given twice; give it once")
        bw_text, _, lat_text = rest.partition(",")
        try:
            bandwidth = parse_bandwidth(bw_text.strip())
        except UnitError as e:
            raise LinkSpecError(f"--link {spec!r}: {e}") from None
        latency = _parse_latency(lat_text, spec) if lat_text.strip() else 0.0
        links[axis] = Link(bandwidth, latency)
    return links


def collective_steps(op: str, n: int) -> int:
    """Sequential message steps of one call on a ring of n members."""
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("reduce_scatter", "all_gather"):
        return n - 1
    return 1


@dataclass
class LinkModel:
    """Prices and sleeps each accounted call on the axes it holds a Link for."""
    links: dict[str, Link]
    sleep: Callable[[float], None] = time.sleep   # injectable, for tests
    charged: dict[str, float] = field(default_factory=dict)   # seconds slept per axis

    @classmethod
    def from_spec(cls, spec: str, **kw) -> "LinkModel":
        return cls(parse_link_spec(spec), **kw)

    def seconds(self, axis: str, op: str, sent: int, received: int, n: int) -> float:
        link = self.links.get(axis)
        if link is None:
            return 0.0
        return collective_steps(op, n) * link.latency + max(sent, received) / link.bandwidth

    def charge(self, axis: str, op: str, sent: int, received: int, n: int) -> None:
        t = self.seconds(axis, op, sent, received, n)
        if t > 0:
            self.charged[axis] = self.charged.get(axis, 0.0) + t
            self.sleep(t)

    def describe(self) -> str:
        parts = [f"{a}={l.bandwidth * 8 / 1e9:g}Gb/s,{l.latency * 1e3:g}ms"
                 for a, l in self.links.items()]
        return f"{EMULATION_LABEL} ({'; '.join(parts)}): times include modelled sleeps"
