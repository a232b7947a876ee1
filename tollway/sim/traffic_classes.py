"""Classes of traffic, the advisor's workload: each a name, a request rate, prompt and output
lengths, SLOs (TTFT and TPOT at a percentile) and the lanes it may be served in.

From a TOML file:

    percentile = 99                      # the default for every class
    [classes.chat]
    rate = 2.0                           # requests per second
    prompt_tokens = "mean=512,stdev=128,min=64,max=1024"   # or a plain count
    output_tokens = 128
    slo = "ttft=500ms,tpot=40ms"
    lanes = ["fast", "standard"]         # optional: default all three
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from tollway.config import TIERS
from tollway.traffic.stats import SLO
from tollway.traffic.workload import Lengths

_CLASS_KEYS = {"rate", "prompt_tokens", "output_tokens", "slo", "percentile", "lanes"}


@dataclass
class TrafficClass:
    name: str
    rate: float  # requests per second
    prompt: Lengths
    output: Lengths
    slo: dict[str, float]  # "ttft" / "tpot" -> seconds
    percentile: float = 0.99  # the share of requests that must be within each limit
    lanes: tuple[str, ...] = TIERS

    def to_dict(self) -> dict:
        return {"name": self.name, "rate": self.rate, "prompt": vars(self.prompt), "output": vars(self.output),
                "slo": self.slo, "percentile": self.percentile, "lanes": list(self.lanes)}


def slo_limits(text: str, where: str) -> dict[str, float]:
    """'ttft=500ms,tpot=40ms' -> {'ttft': 0.5, 'tpot': 0.04}, by the bench's SLO syntax."""
    try:
        limits = SLO.parse(text).limits
    except ValueError as e:
        raise ValueError(f"{where}: {str(e).removeprefix('--slo: ')}") from None
    if set(limits) != {"*"} or not set(limits["*"]) <= {"ttft", "tpot"}:
        raise ValueError(f"{where}: expected ttft=... and/or tpot=... (no tier prefix), got {text!r}")
    return limits["*"]


def check_percentile(value, where: str) -> float:
    """A percentile given as 99 or 0.99 -> 0.99."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 100:
        raise ValueError(f"{where}: a percentile must be a number in (0, 100), got {value!r}")
    return value / 100 if value > 1 else float(value)


def make_class(name: str, rate, prompt, output, slo: str, percentile, lanes, where: str) -> TrafficClass:
    if not name or name != name.strip() or name == "*" or ":" in name:
        raise ValueError(f"{where}: a class name must be non-empty, without ':' or surrounding spaces, got {name!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
        raise ValueError(f"{where}.rate: requests per second must be a number > 0, got {rate!r}")
    lengths = []
    for what, value in (("prompt_tokens", prompt), ("output_tokens", output)):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"{where}.{what}: expected a token count or 'mean=N,stdev=S,min=A,max=B', got {value!r}")
        lengths.append(Lengths.parse(str(value), f"{where}.{what}"))
    if not isinstance(slo, str):
        raise ValueError(f"{where}.slo: expected a string like 'ttft=500ms,tpot=40ms', got {slo!r}")
    limits = slo_limits(slo, f"{where}.slo")
    if not limits:
        raise ValueError(f"{where}.slo: give ttft and/or tpot limits")
    if not isinstance(lanes, (list, tuple)) or not lanes or any(lane not in TIERS for lane in lanes):
        raise ValueError(f"{where}.lanes: expected a non-empty list of {', '.join(TIERS)}, got {lanes!r}")
    return TrafficClass(name, float(rate), lengths[0], lengths[1], limits, check_percentile(percentile, f"{where}.percentile"),
                        tuple(dict.fromkeys(lanes)))


def load_classes(path: str | Path) -> list[TrafficClass]:
    """The classes of a TOML file; a ValueError of one line naming the bad field otherwise."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path} is not TOML: {e}") from None
    unknown = set(data) - {"percentile", "classes"}
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {', '.join(sorted(unknown))} (expected percentile, classes)")
    default_percentile = data.get("percentile", 99)
    classes = data.get("classes")
    if not isinstance(classes, dict) or not classes:
        raise ValueError(f"{path}: no [classes.<name>] tables")
    out = []
    for name, table in classes.items():
        where = f"{path}: classes.{name}"
        if not isinstance(table, dict):
            raise ValueError(f"{where}: expected a table")
        missing = {"rate", "prompt_tokens", "output_tokens", "slo"} - set(table)
        if missing:
            raise ValueError(f"{where}: missing {', '.join(sorted(missing))}")
        unknown = set(table) - _CLASS_KEYS
        if unknown:
            raise ValueError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
        out.append(make_class(name, table["rate"], table["prompt_tokens"], table["output_tokens"], table["slo"],
                              table.get("percentile", default_percentile), table.get("lanes", list(TIERS)), where))
    return out

