"""The builds benchmarks measure, each made once and reused while its spec is unchanged: the one build
cache every benchmark goes through.

- SmolLM2 from the example's spec (examples/smollm2.yaml) with one change: `export_smollm2` (export only,
  one lowering), `served_smollm2` (the whole build, serving threads set);
- the paged benchmarks' variants (`build_variant`): the slot graph (`export.attention: fused`) and the paged
  graph (`export.attention: paged`), fp32 or int4-weight-only, each packaged under several limits. Every
  variant of one graph is built into the same work folder, so the export (and quantize) stage is reused and
  only the package stage reruns (limits and serving settings are not part of those stages' keys); each
  variant's repository is then kept as hard links under build/bench/paged/<name>, stamped with its spec.
  Verification is off: both graphs are checked against PyTorch by their own tests and builds;
- a checkpoint at a mode (`sized_build`: `llmc build` in a process of its own, timed with its peak memory
  beside the dry run's estimate of it), for the size benchmarks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # llmc/bench/builds.py: the checkout the benchmarks run in
BENCH = REPO / "build" / "bench"
SMOLLM2 = REPO / "models" / "smollm2"
EXAMPLE = REPO / "examples" / "smollm2.yaml"
ROOT = BENCH / "paged"
# the limits both paged-benchmark graphs serve under (the example's): 16 rows a step, 2048 tokens a request;
# the paged pool defaults to the slot graph's memory, 16 x 2048 tokens
LIMITS = {"max_batch_size": 16, "max_seq_len": 2048}
POOL = 16 * 2048
MODES = ("fp32", "int8", "int4")
LLMC_MODE = {"fp32": None, "int8": "int8-weight-only", "int4": "int4-weight-only"}
STREAM_ROWS = 16  # llmc's rows a step (limits.max_batch_size, as the example's): --streams' most (sizes)


def example_data(**changes) -> dict:
    """The example's spec as data (its output left to the caller), `changes` over its top-level fields."""
    from llmc.compiler import load_spec

    return {**load_spec(EXAMPLE).model_dump(mode="json", exclude={"output"}), **changes}


def export_smollm2(attention: str, threads: int, source: Path = SMOLLM2, out: Path = BENCH):
    """Export SmolLM2 (or `source`, with the example's settings) with the given lowering into `out`
    (reused while the source and llmc are unchanged): (the graph's path, its KV layout)."""
    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec

    data = example_data(name=f"smollm2-{attention}", source=str(source), export={"attention": attention})
    data["serving"]["num_threads"] = threads
    result = build(parse_spec(data), output=out / f"smollm2-{attention}", until="export")
    return out / f"smollm2-{attention}" / "export" / result.exported.onnx, result.exported.kv_layout


def served_smollm2(threads: int) -> Path:
    """The example's whole build with `threads` serving threads, verification off (the example build
    verifies; this one only changes the thread count): its output folder."""
    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec

    data = example_data(name="smollm2")
    data["serving"]["num_threads"] = threads
    data["verify"]["enabled"] = False
    return build(parse_spec(data), output=BENCH / "smollm2-serve").output


def spec_data(attention: str, *, quant: str = "none", threads: int = 2, limits: dict | None = None,
              serving: dict | None = None) -> dict:
    data = example_data()
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


class PeakMemory:
    """The largest resident set of a process and its children, sampled every `interval` seconds: in all
    (`peak`), and its anonymous part (`peak_anonymous`: the resident set less the file-backed and shared
    pages, such as a session's mapped weights file, which the kernel can drop and read again)."""

    def __init__(self, pid: int, interval: float = 0.05):
        import psutil

        self.peak = self.peak_anonymous = 0
        self._stop = threading.Event()
        self._root = psutil.Process(pid)
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
        self._thread.start()

    def _sample(self, interval: float) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                infos = [p.memory_info() for p in (self._root, *self._root.children(recursive=True))]
                self.peak = max(self.peak, sum(i.rss for i in infos))
                self.peak_anonymous = max(self.peak_anonymous, sum(i.rss - i.shared for i in infos))
            except psutil.Error:
                pass
            self._stop.wait(interval)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak, self.peak_anonymous


def timed_build(cmd: list[str], log: Path) -> tuple[float, int, int]:
    """Run a build command: (wall seconds, peak resident bytes of its process tree, peak anonymous bytes);
    its output to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        memory = PeakMemory(proc.pid)
        code = proc.wait()
        wall, (peak, anonymous) = time.perf_counter() - start, memory.stop()
    if code:
        raise RuntimeError(f"{cmd[0]} ... failed (exit {code}); see {log}")
    return wall, peak, anonymous


def sized_spec(checkpoint: Path, mode: str, block: int | None = None) -> str:
    """The spec (YAML) sized_build builds `checkpoint` with in `mode`, int4 and int8 in blocks of `block`."""
    lines = [f"name: {checkpoint.name}-{mode}", f"source: {checkpoint}", "target: onnxruntime", "precision: fp32",
             "limits:", f"  max_batch_size: {STREAM_ROWS}"]
    if LLMC_MODE[mode]:
        lines += ["quantization:", f"  mode: {LLMC_MODE[mode]}"] + ([f"  block_size: {block}"] if block else [])
    return "\n".join(lines) + "\n"


def sized_build(checkpoint: Path, mode: str, root: Path, block: int | None = None) -> dict:
    """An llmc build of `checkpoint` in `mode` (made once): its version folder, build time, peak memory
    and the dry run's estimate of that memory. `block`: the weight-only modes' `quantization.block_size` (unset:
    the mode's default), in the build's name when set."""
    name = f"llmc-{mode}" + (f"-b{block}" if block else "")
    out = root / name
    spec = root / f"{name}.yaml"
    root.mkdir(parents=True, exist_ok=True)
    spec.write_text(sized_spec(checkpoint, mode, block))
    record = root / f"{name}.json"
    if not record.is_file():
        from llmc.compiler import load_spec, plan_build

        llmc = [sys.executable, "-m", "llmc.cli"]
        estimate = plan_build(load_spec(spec)).build_peak_bytes  # what `llmc build --dry-run` says
        wall, peak, anonymous = timed_build([*llmc, "build", str(spec), "-o", str(out)], root / f"{name}.log")
        record.write_text(json.dumps({"build_s": wall, "peak_bytes": peak, "peak_anonymous_bytes": anonymous,
                                      "estimate_bytes": estimate}))
    return {**json.loads(record.read_text()), "version": next((out / "model_repository").glob("*/[0-9]*"))}
