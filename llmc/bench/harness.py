"""What every benchmark measures by: passes, turns, medians and medians of per-pass ratios, JSON out.

A pass measures every contender once; the contenders take turns within it, in an order that changes
pass by pass (`in_turn`), so a burst of load on a shared host falls on all of them alike. A figure is
the median over passes; a ratio is the median of the per-pass ratios (`median_ratio`), both sides
measured back to back, never a ratio of two medians taken minutes apart.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class UsageError(Exception):
    """An argument a benchmark refuses after parsing (a name it does not know, a count out of range):
    `python -m llmc.bench` reports it as argparse does its own errors (usage, exit 2)."""


class Runs(dict):
    """Each figure's value in every pass so far, by name (a dict of lists, as `medians` takes); `record` adds one
    and shows it on stderr as the run goes, in `spec` (a format spec: "8.1f") after the name padded to `width`."""

    def __init__(self, spec: str, width: int):
        super().__init__()
        self.spec, self.width = spec, width

    def record(self, name: str, value: float) -> None:
        self.setdefault(name, []).append(value)
        print(f"  {name:<{self.width}} {value:{self.spec}}", file=sys.stderr)


def median(values: Iterable[float]) -> float:
    return statistics.median(values)


def medians(runs: dict[str, Sequence[float]]) -> dict[str, float]:
    """Each contender's median over its passes."""
    return {name: statistics.median(values) for name, values in runs.items()}


def median_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median over passes of numerator / denominator, pass by pass (both measured in that pass)."""
    assert len(numerators) == len(denominators), "a ratio pairs the same passes"
    return statistics.median(a / b for a, b in zip(numerators, denominators))


def in_turn(items: Sequence, p: int) -> list:
    """Pass `p`'s order: `items` rotated by p, so each takes every place in turn (two alternate)."""
    items = list(items)
    if not items:
        return items
    k = p % len(items)
    return items[k:] + items[:k]


def passes(contenders: dict[str, Callable[[int], T]], count: int,
           show: Callable[[int, str, T], None] | None = None) -> dict[str, list[T]]:
    """`count` passes, each calling every contender once in pass p's turn (`contenders[name](p)`):
    {name: its result in every pass}. `show(p, name, result)` sees each result as it comes (progress)."""
    runs: dict[str, list[T]] = {name: [] for name in contenders}
    for p in range(count):
        for name in in_turn(contenders, p):
            runs[name].append(contenders[name](p))
            if show:
                show(p, name, runs[name][-1])
    return runs


def write_json(path: Path, data: dict, indent: int = 2) -> Path:
    """`data` as JSON at `path` (its folder made); what will not serialize (paths) is written as text."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str) + "\n")
    return path


def environment() -> str:
    """One line naming the host a run measured: its figures mean nothing without it."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return (f"host {platform.machine()} {platform.processor() or platform.system()}, {os.cpu_count()} CPUs, "
            f"load {load:.2f}, OMP_NUM_THREADS {threads}, Python {sys.version.split()[0]}")


def prompt_for(tokenizer, tokens: int, seed: int) -> tuple[int, list[int]]:
    """llmc bench's prompt `seed` (make_prompt: its first words spell the seed, so no two seeds share a
    KV block) in the fewest words that reach `tokens` tokens: (words, ids)."""
    from llmc.bench.load import make_prompt

    words = next(n for n in range(4, 4 * tokens + 8) if len(tokenizer.encode(make_prompt(n, seed)).ids) >= tokens)
    return words, tokenizer.encode(make_prompt(words, seed)).ids
