"""`build`: run the table of stages (stages.py) over a spec, reuse what is unchanged, publish the
output atomically (compiler/output.py).

One loop: the stage that opens the build (the source stage) finds the checkpoint and fills the limits
it decides into the spec; every stage of the build then checks its preconditions, before any stage
that does work runs; then each stage runs through `_cached_run`, which keys it (`cache_key`: the
files of the results it takes and reads, what it declared decides its output, its code), reuses the
last output's artifact when the key matches and its files are intact (hard links), runs it
otherwise, applies its gate, and reports it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from llmc.compiler import output as out
from llmc.compiler.artifacts import Artifact
from llmc.compiler.graph.files import EXTERNAL_THRESHOLD
from llmc.compiler.hashing import code_hash, hash_json
from llmc.compiler.pipeline.disk import DiskPlan, check_disk
from llmc.compiler.pipeline.memory import TRIM_FLOOR, return_freed_memory
from llmc.compiler.pipeline.plan import BUILD_PEAK, check_plan_memory, plan_build
from llmc.compiler.pipeline.stages import STAGES
from llmc.compiler.repository.package import REPOSITORY_DIR
from llmc.compiler.source import FoundSource, SourceInfo, load_model, load_tokenizer
from llmc.compiler.spec import BuildSpec, SourceLoad
from llmc.compiler.stage import Context, Located, Stage

STAGE_NAMES = tuple(s.name for s in STAGES)
BUILD_RECORD = "build.json"


class Reporter(Protocol):
    def stage_started(self, name: str, description: str) -> None: ...
    def stage_progress(self, done: int, total: int, what: str = "") -> None: ...
    def stage_finished(self, result: "StageResult") -> None: ...


class NullReporter:
    def stage_started(self, name: str, description: str) -> None: ...
    def stage_progress(self, done: int, total: int, what: str = "") -> None: ...
    def stage_finished(self, result: "StageResult") -> None: ...


@dataclass(frozen=True)
class StageResult:
    name: str
    status: str  # "ran" | "cached" | "skipped"
    seconds: float
    summary: str


@dataclass
class BuildResult:
    output: Path
    spec: BuildSpec
    stages: list[StageResult] = field(default_factory=list)
    artifacts: dict[str, Located] = field(default_factory=dict)  # stage name -> its artifact, in the output

    def _get(self, name: str) -> Any:
        done = self.artifacts.get(name)
        return done.artifact if done is not None else None

    exported = property(lambda self: self._get("export"))
    verify = property(lambda self: self._get("verify"))
    quantized = property(lambda self: self._get("quantize"))
    tensorrt = property(lambda self: self._get("tensorrt"))  # the TensorRT engine (target: tensorrt)
    manifest = property(lambda self: self._get("package"))

    @property
    def repository(self) -> Path | None:
        return self.output / REPOSITORY_DIR if self.manifest is not None else None


class _Model:
    """The PyTorch model and tokenizer, loaded on first use (cached stages never load them): the whole model, or
    with `layers` a stream.model.StreamedModel that reads one decoder layer at a time (source.load)."""

    def __init__(self, layers: bool = False) -> None:
        self.info: SourceInfo | None = None
        self.layers = layers
        self._loaded = None

    def __call__(self) -> tuple[Any, Any]:
        if self._loaded is None:
            if self.layers:
                from llmc.compiler.stream.model import StreamedModel

                self._loaded = StreamedModel(self.info), load_tokenizer(self.info)
            else:
                self._loaded = load_model(self.info)
        return self._loaded

    def release(self) -> None:
        self._loaded = None


def build(spec: BuildSpec, *, output: Path | None = None, until: str = "package", force: set[str] | None = None,
          reporter: Reporter | None = None, external_threshold: int | None = None,
          ignore_memory_check: bool = False, ignore_disk_check: bool = False) -> BuildResult:
    """Build `spec` into `output` (default: the spec's). Stages after `until` are not run; stages
    named in `force` run even when cached. A build whose largest stage cannot fit this machine's memory
    is refused before any work (ResourceError) unless `ignore_memory_check`; one that cannot fit the output's
    file system (disk.py: a fresh output before any work, else each stage that runs as it starts) unless
    `ignore_disk_check`."""
    assert until in STAGE_NAMES, until
    output = Path(output or spec.output_dir).absolute()
    stages = [s for s in STAGES[:STAGE_NAMES.index(until) + 1]
              if s.applies(spec) and (until == STAGE_NAMES[-1] or not s.for_package)]
    names = [s.name for s in stages]
    layers, disk, trim = spec.source.load is SourceLoad.layers, None, False
    if any(name in BUILD_PEAK for name in names):  # from the config alone: before hashing or loading weights
        plan = plan_build(spec, output)
        trim = plan.weights_bytes >= TRIM_FLOOR
        check_plan_memory(plan, names, ignore=ignore_memory_check)
        layers = plan.load == "layers"
        disk = None if ignore_disk_check else replace(plan.disk, stages={
            name: s for name, s in plan.disk.stages.items() if name in names})
        if disk is not None and disk.fresh:
            check_disk(disk.stages, disk.folder)
    run = _Run(spec, output, reporter or NullReporter(), set(force or ()), external_threshold or EXTERNAL_THRESHOLD,
               layers, disk)
    try:
        for i, stage in enumerate(stages):
            run.stage(stage)
            if not any(later.loads_model for later in stages[i + 1:]):
                run.model.release()  # the PyTorch weights (as large as the graph's) leave before quantize
            if trim and run.result.stages[-1].status == "ran":
                return_freed_memory()  # what the stage freed leaves the process before the next one's peak
            if stage.opens:  # the checkpoint is known: the limits it decides, then every later check
                run.source_found(run.result.artifacts[stage.name].artifact, stages[i + 1:])
        run.write_record()
        out.publish(run.staging, output)
    except BaseException:
        out.discard(run.staging)
        raise
    run.result.artifacts = {name: Located(done.artifact, output / done.folder.relative_to(run.staging))
                            for name, done in run.result.artifacts.items()}  # where the files are now
    return run.result


class _Run:
    """One build in progress: the staging folder, the stages done so far and their report."""

    def __init__(self, spec: BuildSpec, output: Path, reporter: Reporter, force: set[str], external_threshold: int,
                 layers: bool = False, disk: DiskPlan | None = None):
        self.output, self.reporter, self.force, self.disk = output, reporter, force, disk
        self.external_threshold = external_threshold
        self.model = _Model(layers)
        self.found: FoundSource | None = None
        self.result = BuildResult(output=output, spec=spec)
        self.staging = out.make_staging(output)

    @property
    def spec(self) -> BuildSpec:
        return self.result.spec

    def source_found(self, found: FoundSource, later: list[Stage]) -> None:
        """Build with the spec the checkpoint completed; check what every later stage needs."""
        self.found = found
        self.result.spec, self.model.info = found.spec, found.info
        for stage in later:
            stage.check(self.spec, found.info)

    def stage(self, stage: Stage) -> None:
        self.reporter.stage_started(stage.name, stage.describe(self.spec))
        start = time.perf_counter()
        reason = stage.skip(self.spec, stage.declared(self.result.artifacts))
        if reason is None:
            status, done = self._cached_run(stage)
            self.result.artifacts[stage.name] = done
            summary = stage.summary(done)
        else:
            status, summary = "skipped", reason
        finished = StageResult(stage.name, status, time.perf_counter() - start, summary)
        self.result.stages.append(finished)
        self.reporter.stage_finished(finished)

    def _cached_run(self, stage: Stage) -> tuple[str, Located]:
        """(status, artifact): the last output's artifact when its key matches and its files are
        intact, linked into the staging output; else the stage's run."""
        found = self.found
        ctx = Context(out=self.staging / stage.folder, previous=self.output / stage.folder,
                      source=found.info if found else None, source_hash=found.hash if found else "",
                      inputs_hash="", model=self.model, done=stage.declared(self.result.artifacts),
                      progress=self.reporter.stage_progress, num_threads=self.spec.serving.num_threads,
                      external_threshold=self.external_threshold, streamed=self.model.layers)
        taken = stage.input(ctx.done)
        status, art = "ran", None
        if stage.artifact is not None:
            ctx = replace(ctx, inputs_hash=cache_key(stage, self.spec, ctx))
            if stage.name not in self.force:
                art = stage.artifact.load_cached(ctx.previous, ctx.inputs_hash)
            if art is not None:
                out.link_tree(ctx.previous, ctx.out)
                status = "cached"
        if art is None:
            if self.disk is not None and stage.name in self.disk.stages:  # its own peak, on the disk as it is now
                check_disk({stage.name: self.disk.stages[stage.name]}, self.disk.folder)
            art = stage.run(taken, stage.section(self.spec), ctx)
        stage.accept(art, self.spec)
        return status, Located(art, ctx.out)

    def write_record(self) -> None:
        import json

        import llmc

        record = {
            "name": self.spec.name, "llmc": llmc.__version__,
            "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "spec": self.spec.model_dump(mode="json"),
            "stages": [{"name": s.name, "status": s.status, "seconds": round(s.seconds, 3), "summary": s.summary}
                       for s in self.result.stages],
        }
        (self.staging / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def cache_key(stage: Stage, spec: BuildSpec, ctx: Context) -> str:
    """A cached stage's key: its name, the identity of every earlier result it takes or reads (ctx.done),
    the content of the code it declared (whole folders, C sources included) and what its `key` adds."""
    return hash_json({"stage": stage.name, "inputs": {name: _identity(done) for name, done in ctx.done.items()},
                      "code": code_hash(*stage.code), **stage.key(spec, ctx)})


def _identity(done: Located) -> Any:
    """What identifies an earlier result in a key: an artifact's file hashes, the checkpoint's hash."""
    art = done.artifact
    return art.files if isinstance(art, Artifact) else art.hash
