"""Commands over a build spec: build, export, verify, inspect."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmc.cli.app import OutputOpt, SpecArg, app, friendly

IgnoreDiskOpt = Annotated[bool, typer.Option("--ignore-disk-check", help="Build even when the output's file system has less free space than the build is estimated to write (the export's fp32 graph, quantize's scratch and graph: --dry-run shows them); without it a fresh output is refused before any work, and in a rebuild each stage that runs is refused as it starts (exit code 12). LLMC_IGNORE_DISK_CHECK=1 does the same.")]
IgnoreMemoryOpt = Annotated[bool, typer.Option("--ignore-memory-check", help="Build (or plan) even when a stage's estimated peak memory exceeds this machine's available memory (MemAvailable, capped by the cgroup limit); without it such a build is refused before any work (exit code 12). LLMC_IGNORE_MEMORY_CHECK=1 does the same.")]


def _run_build(spec_path: Path, output: Optional[Path], until: str, force: set[str],
               ignore_memory_check: bool = False, ignore_disk_check: bool = False) -> None:
    from llmc.compiler import build, load_spec
    from llmc.console import RichReporter, out, summary_table

    spec = load_spec(spec_path)
    with RichReporter() as reporter:
        result = build(spec, output=output, until=until, force=force, reporter=reporter,
                       ignore_memory_check=ignore_memory_check, ignore_disk_check=ignore_disk_check)
    out.print(summary_table(result))


@app.command()
@friendly
def build(
    spec: SpecArg,
    output: OutputOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Run every stage, even unchanged ones.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the build plan (stages, precision, attention, TensorRT profiles, serving memory, the build's own peak memory, time and disk, stage by stage) from the spec and the checkpoint's config, and exit; needs no GPU.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="With --dry-run: print the plan as JSON (byte counts).")] = False,
    ignore_memory_check: IgnoreMemoryOpt = False,
    ignore_disk_check: IgnoreDiskOpt = False,
) -> None:
    """Build a spec: load the checkpoint, export to ONNX, verify against PyTorch, quantize (quantization.mode), build the TensorRT engine (target: tensorrt), package a Triton model repository.

    With an execution_env section the repository also carries the serving Python's packages, fetched by pip as wheels for the Triton container's Python (default 3.12, /usr/bin/python3.12: NGC's stock tritonserver from 24.12 on), so that container serves it with nothing installed (docs/scaling.md).

A TensorRT build needs TensorRT and an NVIDIA GPU: the engine gets a prefill and a decode optimization profile from `limits`, the `tensorrt:` options (workspace, optimization level, hardware/version compatibility, timing cache in <output>/engine/timing.cache), and is compared with ONNX Runtime (Polygraphy) before it is packaged with KIND_GPU instances.

    A quantized build measures perplexity (held-out text), greedy agreement, size and decode speed against the unquantized graph and fails (exit code 9) when perplexity rises more than quantization.max_perplexity_increase; `llmc inspect` shows that report.

    A build whose largest stage (export, verify, quantize; export and verify read the checkpoint whole or a layer at a time, source.load) is estimated to need more memory than this machine has available is refused before any work (exit code 12), naming the stage and what would make it fit; --ignore-memory-check builds anyway. So is one whose files would not fit the output's file system (an 8B int4 build writes about 39 GB: the export's fp32 graph and quantize's); --ignore-disk-check builds anyway.

    Unchanged stages are reused from the previous output; the output folder is replaced atomically, so a failed or interrupted build leaves the previous one intact.
    """
    if dry_run:
        from llmc.compiler import load_spec, plan_build
        from llmc.compiler.inspect import Section
        from llmc.compiler.pipeline.disk import check_disk
        from llmc.compiler.pipeline.plan import check_plan_memory
        from llmc.console import out, sections_table

        plan = plan_build(load_spec(spec), output)
        if as_json:
            import dataclasses
            import json

            print(json.dumps(dataclasses.asdict(plan), indent=2))
        else:
            for table in sections_table([Section(f"build plan: {spec}", plan.rows())]):
                out.print(table)
        check_plan_memory(plan, ignore=ignore_memory_check)  # after the plan: it shows what each stage needs
        if plan.disk.fresh:  # a rebuild's stages may be reused: checked as each runs
            check_disk(plan.disk.stages, plan.disk.folder, ignore=ignore_disk_check)
        return
    if as_json:
        raise typer.BadParameter("--json prints the plan: use it with --dry-run", param_hint="--json")
    _run_build(spec, output, "package", {"export", "verify", "verify-adapters", "quantize", "draft", "tensorrt", "environment"} if force else set(),
               ignore_memory_check, ignore_disk_check)


@app.command()
@friendly
def export(spec: SpecArg, output: OutputOpt = None,
           force: Annotated[bool, typer.Option("--force", help="Export even if unchanged.")] = False,
           ignore_memory_check: IgnoreMemoryOpt = False, ignore_disk_check: IgnoreDiskOpt = False) -> None:
    """Export only: checkpoint -> ONNX with explicit KV cache (no verification).

    Attention is lowered as `export.attention` says: `fused` (ONNX Runtime GroupQueryAttention, in-place KV), `reference` (plain opset-23 ops), `plugin` (TensorRT LlmcFusedAttention node, target: tensorrt) or `paged` (llmc.PagedAttention over block pools, packed tokens).
    """
    _run_build(spec, output, "export", {"export"} if force else set(), ignore_memory_check, ignore_disk_check)


@app.command()
@friendly
def verify(spec: SpecArg, output: OutputOpt = None, ignore_memory_check: IgnoreMemoryOpt = False,
           ignore_disk_check: IgnoreDiskOpt = False) -> None:
    """Verify the spec's ONNX export against PyTorch (exports first if needed); for target: tensorrt, the engine against ONNX Runtime.

    The HF model runs each prompt alone; the graph runs as serving runs it: each prompt prefilled into its own KV slot, then all rows decoding side by side at their own positions. Prefill plus `verify.decode_steps` greedy steps at batch 1 and for a batch of 3 prompts of different lengths; fails (exit code 5) if |Δlogit| exceeds `verify.max_logit_diff` (unset: by the KV cache type) or a greedy token differs where the reference had no near tie (docs/build.md).

    With `adapters:`, each LoRA adapter is verified the same way (the verify-adapters stage): the export with a LoRA branch beside each projection, rows under each adapter alone and then mixed with the base in one batch, against the PyTorch model with PEFT's forward of the row's adapter.

    A TensorRT build (re)builds its engine and compares it with ONNX Runtime driven the same way, by Polygraphy's comparator at the precision's tolerance (fp16: atol 0.25, rtol 0.02).
    """
    from llmc.compiler import load_spec
    from llmc.compiler.spec import Target

    loaded = load_spec(spec)
    tensorrt = loaded.target is Target.tensorrt
    until = "tensorrt" if tensorrt else "verify-adapters" if loaded.adapters else "verify"
    _run_build(spec, output, until, {"verify", "verify-adapters", "tensorrt"}, ignore_memory_check, ignore_disk_check)


@app.command()
@friendly
def inspect(path: Annotated[Path, typer.Argument(help="A build folder, a stage folder (export/, verify/) or an .onnx file.", show_default=False)]) -> None:
    """Show what an artifact holds: IO names and shapes, opset, KV layout, hashes, verify results, the quantization quality report."""
    from llmc.compiler import inspect_path
    from llmc.console import out, sections_table

    for table in sections_table(inspect_path(path)):
        out.print(table)
