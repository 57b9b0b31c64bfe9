"""The SmolLM2 builds scripts/bench_paged.py compares: the slot graph (`export.attention: fused`)
and the paged graph (`export.attention: paged`), fp32 or int4-weight-only, each packaged under
several limits.

Every variant of one graph is built into the same work folder, so the export (and quantize) stage
is reused and only the package stage reruns (limits and serving settings are not part of those
stages' keys); each variant's repository is then kept as hard links under build/bench/paged/<name>.
Verification is off: both graphs are checked against PyTorch by their own tests and builds.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "build" / "bench" / "paged"
# the limits both graphs serve under (the example's): 16 rows a step, 2048 tokens a request; the
# paged pool defaults to the slot graph's memory, 16 x 2048 tokens
LIMITS = {"max_batch_size": 16, "max_seq_len": 2048}
POOL = 16 * 2048


def spec_data(attention: str, *, quant: str = "none", threads: int = 2, limits: dict | None = None,
              serving: dict | None = None) -> dict:
    from llmc.compiler import load_spec

    data = load_spec(REPO / "examples" / "smollm2.yaml").model_dump(mode="json", exclude={"output"})
    data["limits"] = {**LIMITS, **(limits or {})}
    data["serving"] = {**data["serving"], "num_threads": threads, **(serving or {})}
    data["verify"]["enabled"] = False
    data["export"] = {"attention": attention}
    if quant != "none":  # round to nearest (SmolLM2 int4: +33% perplexity, hence the raised gate): the decode
        # kernel is what is timed here, not the codes' quality
        data["quantization"] = {"mode": quant, "algorithm": "rtn", "max_perplexity_increase": 1.0}
    return data


def build_variant(name: str, attention: str, *, quant: str = "none", threads: int = 2, limits: dict | None = None,
                  serving: dict | None = None, log=print) -> Path:
    """Build (or reuse) one variant; returns a folder holding its model_repository/."""
    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec

    target = ROOT / name
    data = spec_data(attention, quant=quant, threads=threads, limits=limits, serving=serving)
    stamp = repr(sorted(_flatten(data)))
    if (target / "spec.txt").is_file() and (target / "spec.txt").read_text() == stamp:
        return target
    work = ROOT / "work" / f"{attention}-{quant}"
    log(f"building {name} ({attention}, {quant}) in {work.relative_to(REPO)}")
    result = build(parse_spec({**data, "name": "smollm2"}), output=work)
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(result.output / "model_repository", target / "model_repository", copy_function=os.link)
    (target / "spec.txt").write_text(stamp)
    return target


def work_graph(attention: str, quant: str = "none") -> tuple[Path, object]:
    """The graph a variant runs (its folder and export/quantize artifact), for in-process drivers."""
    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec

    work = ROOT / "work" / f"{attention}-{quant}"
    data = {**spec_data(attention, quant=quant), "name": "smollm2"}
    until = "quantize" if quant != "none" else "export"
    result = build(parse_spec(data), output=work, until=until)
    return result.output / until, result.artifacts[until].artifact


def _flatten(data: dict, prefix: str = "") -> list[tuple[str, str]]:
    items = []
    for key, value in data.items():
        if isinstance(value, dict):
            items += _flatten(value, f"{prefix}{key}.")
        else:
            items.append((f"{prefix}{key}", repr(value)))
    return items
