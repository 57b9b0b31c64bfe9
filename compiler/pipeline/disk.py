"""The disk a build writes, stage by stage, and the check that refuses a build its output's file system cannot hold.

A build writes into a staging folder beside its output and swaps it in at the end (compiler/output.py); every
stage's files, and quantize's scratch folder, are on the output's file system (calibration and verify's segments
hard-link the export's weights, moved beside the graph where the system temp folder is another file system). A
build that runs out of disk fails where it was, minutes or tens of minutes in (an 8B int4 build: in quantize, 25
minutes in), so the check comes first:
- a fresh output (none there yet: nothing can be reused) is refused before any work when the whole build's peak
  does not fit the file system's free space;
- a rebuild reuses unchanged stages by hard links, which take no space, and which stages run is known only as each
  is keyed; so each stage that runs is checked as it starts, against its own peak.

What a stage holds on disk (fp32 = 4 bytes a parameter of the checkpoint):
- export: its graph, the checkpoint's weights at fp32 (`model.onnx.data`);
- verify: nothing kept (its candidate and segments hard-link the export's weights); verify-adapters the same, its
  report and, while it runs, the LoRA graph beside a hard link of the export's weights;
- quantize, weight-only: its graph (the linear weights' codes, scales and zero points, the rest at fp32) and, while
  it runs, a scratch file of what it wrote: the codes and scales, a tied LM head's fp32 copy (untied to be
  quantized), and codes left dead there, counted as one embedding table's worth (measured: the scratch of a 4-layer
  random Llama of width 2048 held 676 MiB, 82 more than those tensors, about its gate and up projections' codes,
  which merging the two into one node adds again). `WeightFile.save` gives the scratch's blocks back as it copies
  them, dead ones first, so the stage's peak is the larger of the two, not their sum;
- package: hard links to the graph it serves, the runtime's code and the tokenizer (a few MB).
Measured with `python -m llmc.bench streamed`, which samples the file system's free space during each build.
Not estimated (a note says so): the static Q/DQ modes' ModelOpt graph (written to the system temp folder), a
TensorRT engine, a speculative draft's own stages, an execution_env's wheels.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from llmc.compiler.models.config import Dims
from llmc.compiler.spec import QuantizationSpec, QuantMode
from llmc.errors import ResourceError

GiB = 2**30
OVERRIDE_ENV = "LLMC_IGNORE_DISK_CHECK"  # or `llmc build --ignore-disk-check`
SMALL = 64 * 2**20  # records, the repository's code and tokenizer, calibration caches: what a stage adds beside
UNESTIMATED = ("draft", "tensorrt", "environment")


@dataclass(frozen=True)
class StageDisk:
    kept: int  # what the stage leaves in the output
    peak: int  # the most it holds at once while it runs, what it keeps included


@dataclass(frozen=True)
class DiskPlan:
    stages: dict[str, StageDisk]  # each estimated stage the build runs, in order
    folder: str  # where the output goes (its file system's free space is checked)
    free_bytes: int | None  # that file system's free space now; None: unknown
    fresh: bool  # no output there yet: every stage runs
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return need(self.stages)

    @property
    def kept_bytes(self) -> int:
        return sum(s.kept for s in self.stages.values())

    def rows(self) -> list[tuple[str, str]]:
        rows = [("build: disk (estimate)", f"{self.peak_bytes / GiB:.2f} GiB at the peak, "
                 f"{self.kept_bytes / GiB:.2f} GiB left in the output ("
                 + ", ".join(f"{name} {s.kept / GiB:.2f}" for name, s in self.stages.items() if s.kept) + ")"),
                ("build: free disk", "unknown" if self.free_bytes is None
                 else f"{self.free_bytes / GiB:.2f} GiB on {self.folder}'s file system")]
        return rows + [("note", n) for n in self.notes]


def linear_bytes(q: QuantizationSpec) -> float:
    """A quantized linear weight's bytes a parameter on disk: a weight-only mode's codes, its fp32 scale and its
    zero point per block; the static modes' int8 or fp8 codes (their scales are per channel: nothing)."""
    if q.weight_only:
        code = 0.5 if q.mode is QuantMode.int4_weight_only else 1.0
        return code + 4 / q.block + code / q.block
    return 1.0


def stage_disk(dims: Dims, stages: list[str], q: QuantizationSpec) -> dict[str, StageDisk]:
    """What each estimated stage of `stages` keeps and peaks at on disk (module docstring)."""
    fp32 = 4 * (dims.linear_params + dims.other_params)
    table = dims.vocab_size * dims.hidden_size
    found = {"export": StageDisk(fp32, fp32), "verify": StageDisk(0, 0), "verify-adapters": StageDisk(SMALL, SMALL),
             "package": StageDisk(SMALL, SMALL)}
    if q.mode is not QuantMode.none:
        untied = table if dims.tied_embeddings else 0
        codes = (dims.linear_params + untied) * linear_bytes(q)
        graph = int(codes + 4 * dims.other_params)
        scratch = int(codes + table * linear_bytes(q) + 4 * untied) if q.weight_only else 0  # static: ModelOpt's
        found["quantize"] = StageDisk(graph + SMALL, max(graph, scratch) + SMALL)  # Q/DQ graph is in the temp folder
    return {name: found[name] for name in stages if name in found}


def need(stages: dict[str, StageDisk]) -> int:
    """The most the stages hold at once, run in order: what the earlier ones kept, and the running one's peak."""
    kept, most = 0, 0
    for s in stages.values():
        most = max(most, kept + s.peak)
        kept += s.kept
    return most


def free_bytes(folder: Path) -> int | None:
    """The free space (to this user) of the file system `folder` is on, or would be on (its nearest existing
    parent); None when it cannot be read."""
    folder = Path(folder).absolute()
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def plan_disk(dims: Dims, stages: list[str], q: QuantizationSpec, output: Path) -> DiskPlan:
    output = Path(output).absolute()
    unestimated = [s for s in stages if s in UNESTIMATED]
    notes = [f"disk: {', '.join(unestimated)} not estimated"] if unestimated else []
    fresh = not output.exists()
    if not fresh:
        notes.append(f"disk: {output} exists: the stages a rebuild reuses from it take no space (hard links); each "
                     "stage that runs is checked as it starts")
    return DiskPlan(stage_disk(dims, stages, q), str(output.parent), free_bytes(output.parent), fresh, notes)


def disk_refusal(stages: dict[str, StageDisk], free: int | None, folder: str) -> str | None:
    """Why `stages`, run in order from now, cannot fit `free` bytes on `folder`'s file system, or None."""
    needed = need(stages)
    if free is None or needed <= free:
        return None
    kept = 0
    for name, s in stages.items():  # the stage at whose peak the disk runs out
        if kept + s.peak > free:
            break
        kept += s.kept
    return (f"the build would run out of disk in its {name} stage: it needs about {needed / GiB:.1f} GiB "
            f"(estimate: " + ", ".join(f"{n} keeps {s.kept / GiB:.1f}, peaks at {s.peak / GiB:.1f}"
                                       for n, s in stages.items() if s.peak) +
            f" GiB), but {folder}'s file system has {free / GiB:.1f} GiB free; it would fit with "
            f"{math.ceil((needed - free) / GiB)} GiB more freed there, or with the output (-o) on a file system with "
            f"at least {math.ceil(needed / GiB)} GiB free. To build anyway: --ignore-disk-check (or {OVERRIDE_ENV}=1)")


def check_disk(stages: dict[str, StageDisk], folder: str, *, ignore: bool = False) -> None:
    """Raise ResourceError when `stages` cannot fit the free space of `folder`'s file system now, unless `ignore`d
    (the flag, or LLMC_IGNORE_DISK_CHECK set to anything but empty or 0)."""
    if ignore or os.environ.get(OVERRIDE_ENV, "") not in ("", "0"):
        return
    reason = disk_refusal(stages, free_bytes(Path(folder)), folder)
    if reason is not None:
        raise ResourceError(reason)
