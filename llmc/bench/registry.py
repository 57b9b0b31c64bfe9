"""Every benchmark, by name and group: what `python -m llmc.bench` runs and the smoke test smokes.

A benchmark is a module of this package that defines `add_arguments(parser)` (its command line) and
`run(args)` (the measurement); its docstring is its help. The table names modules rather than importing
them, so listing benchmarks imports none of their dependencies. A module added here without a smoke in
tests/benchmarks/test_bench_smoke.py fails that file's registry test.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

GROUPS = ("kernels", "engine", "serving", "peers", "sizes")


@dataclass(frozen=True)
class Benchmark:
    name: str
    group: str  # one of GROUPS
    module: str  # under llmc.bench: defines add_arguments(parser) and run(args)
    needs_gpu: bool = False

    def load(self) -> ModuleType:
        return importlib.import_module(f"llmc.bench.{self.module}")

    @property
    def summary(self) -> str:
        """The first line of the module's docstring (read without importing the module's dependencies)."""
        spec = importlib.util.find_spec(f"llmc.bench.{self.module}")
        with open(spec.origin, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        return doc.splitlines()[0] if doc else ""


BENCHMARKS = (
    Benchmark("cpu-kernels", "kernels", "kernels.cpu_kernels"),
    Benchmark("q4-stream", "kernels", "kernels.q4_stream"),
    Benchmark("paged-attention", "kernels", "kernels.paged_attention"),
    Benchmark("collective", "kernels", "kernels.collective"),
    Benchmark("sampling", "kernels", "kernels.sampling"),
    Benchmark("lora-delta", "kernels", "kernels.lora_delta"),
    Benchmark("gpu-kernels", "kernels", "kernels.gpu", needs_gpu=True),
    Benchmark("attention", "engine", "engine.attention"),
    Benchmark("paged-graph", "engine", "engine.paged_graph"),
    Benchmark("kv-cache-dtype", "engine", "engine.kv_cache_dtype"),
    Benchmark("beam", "engine", "engine.beam"),
    Benchmark("speculative", "engine", "engine.speculative"),
    Benchmark("draft", "engine", "engine.draft"),
    Benchmark("structured", "engine", "engine.structured"),
    Benchmark("lora", "engine", "engine.lora"),
    Benchmark("paged", "serving", "serving.paged"),
    Benchmark("triton", "serving", "serving.triton"),
    Benchmark("openai", "serving", "serving.openai"),
    Benchmark("peers", "peers", "compare.table"),
    Benchmark("quantization", "peers", "compare.quantization"),
    Benchmark("sizes", "sizes", "sizes.sizes"),
    Benchmark("moe", "sizes", "sizes.moe"),
    Benchmark("tensor-parallel", "sizes", "sizes.tensor_parallel"),
    Benchmark("streamed", "sizes", "sizes.streamed"),
)


def find(name: str) -> Benchmark:
    for bench in BENCHMARKS:
        if bench.name == name:
            return bench
    raise KeyError(f"no benchmark {name!r}; known: {', '.join(b.name for b in BENCHMARKS)}")


def parser(bench: Benchmark, module: ModuleType | None = None) -> argparse.ArgumentParser:
    """The benchmark's command line, its module's docstring as the description."""
    module = module or bench.load()
    p = argparse.ArgumentParser(prog=f"python -m llmc.bench {bench.name}", description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    return p


def listing() -> str:
    """The benchmarks by group, one line each: name and summary."""
    lines = []
    for group in GROUPS:
        lines.append(f"{group}:")
        for bench in (b for b in BENCHMARKS if b.group == group):
            gpu = " (GPU)" if bench.needs_gpu else ""
            lines.append(f"  {bench.name:<16} {bench.summary}{gpu}")
    return "\n".join(lines)
