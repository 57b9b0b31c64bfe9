"""What a build stage is: a declaration the pipeline runs, and what a stage's run receives.

Each stage is declared beside the library function that does its work (source.py, graph/export.py,
graph/verify.py, quantize/, draft.py, tensorrt/stage.py, repository/environment.py and package.py);
pipeline/stages.py only puts them in order. A `Stage` declares:
- `takes`: the earlier stages whose artifact is its input, the first one present wins (the engine is
  built from the quantized graph when there is one, else from the export); `run` gets it with its
  folder as a `Located`;
- `reads`: the other earlier stages whose results it reads. `ctx.done` holds the results of the
  stages named in `takes` and `reads`, and nothing else, and all of them enter its cache key;
- `section(spec)`: the part of the spec it reads, handed to `run`;
- its code, derived, never listed: the modules that define its functions (`run`, `key`, `check`, ...)
  and every llmc module they import, with the C sources and text those load (code_closure.py); their
  content is part of its cache key (hashing.code_hash);
- `key(spec, ctx)`: what else decides its output (spec fields, tool versions); with its inputs'
  files and its code it makes the stage's cache key;
- `opens`: its result is the `FoundSource` the build runs on (the source stage): the completed
  spec, and the checkpoint each later stage's context carries; the checks of every later stage run
  as soon as it is done;
- `check(spec, source)`: its preconditions, checked for every stage of a build before any stage
  that does work runs;
- `applies(spec)`: whether the target has this stage at all; `skip(spec, done)`: why it does
  nothing in this build (None: it runs), from the spec and the results it declared;
- `for_package`: made for the last stage only, so a build that stops earlier (`llmc export`)
  leaves it out wherever it sits in the table;
- `run(input, section, ctx) -> artifact`: the design's `stage(artifact, section) -> artifact`; `ctx`
  carries what is not an artifact (the stage's folder, the PyTorch model loaded on first use,
  progress);
- `accept(artifact, spec)`: a gate checked on the artifact whether it ran or was reused;
- `summary(located)`: its line in the build report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Mapping, TypeVar

from llmc.compiler.artifacts import Artifact
from llmc.compiler.spec import BuildSpec

A = TypeVar("A")
# progress(done, total[, what]): `what` says what is counted and how fast, in words ("layers written",
# "calibration windows, 812 tok/s"); the build's reporter shows it beside the bar
Progress = Callable[..., None]


def ticker(progress: Progress | None, total: int, what: str | None = None) -> Callable[[], None]:
    """A tick for work counted in `total` units: each call reports one more done, as `what` (None: `progress` is
    told the counts alone)."""
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total) if what is None else progress(done, total, what)

    return tick


@dataclass(frozen=True)
class Located(Generic[A]):
    """An artifact and the folder its files are in."""

    artifact: A
    folder: Path


@dataclass(frozen=True)
class Context:
    """What a stage's run may use besides its input and its section."""

    out: Path  # the stage's folder in the staging output (created by the stage)
    previous: Path  # the stage's folder in the last published output (may not exist)
    # the checkpoint the source stage found (a source.SourceInfo; not imported here, source.py declares its
    # stage with this module), None only while the source stage itself runs
    source: Any
    source_hash: str
    inputs_hash: str  # the stage's cache key, recorded in the artifact it makes
    model: Callable[[], tuple[Any, Any]]  # (PyTorch model, tokenizer), loaded on first call
    done: Mapping[str, Located] = field(default_factory=dict)  # the results of the stages it takes and reads
    progress: Progress = lambda done, total: None
    num_threads: int = 0
    external_threshold: int = 0  # graphs above this many bytes keep their weights as external data
    # the build reads the checkpoint a layer at a time (source.load): its passes over the unquantized graph run
    # a segment of weights at a time too (compiler/graph/segments.py)
    streamed: bool = False


def _nothing(*args: Any) -> None:
    return None


@dataclass(frozen=True)
class Stage:
    name: str
    describe: Callable[[BuildSpec], str]
    run: Callable[[Located, Any, Context], Any]
    summary: Callable[[Located], str]
    section: Callable[[BuildSpec], Any] = lambda spec: spec
    takes: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    artifact: type[Artifact] | None = None  # a cached stage's record; None: runs on every build
    key: Callable[[BuildSpec, Context], dict] = lambda spec, ctx: {}
    check: Callable[[BuildSpec, Any], None] = _nothing  # (spec, the found source.SourceInfo)
    applies: Callable[[BuildSpec], bool] = lambda spec: True
    skip: Callable[[BuildSpec, Mapping[str, Located]], str | None] = _nothing
    accept: Callable[[Any, BuildSpec], None] = _nothing
    folder: str = ""  # its folder in the output (default: its name)
    for_package: bool = False  # only builds that run the package stage run it
    opens: bool = False
    loads_model: bool = False  # runs the PyTorch model (ctx.model): the build frees it after the last such stage

    def __post_init__(self) -> None:
        if not self.folder:
            object.__setattr__(self, "folder", self.name)

    @property
    def code(self) -> tuple[str, ...]:
        """The modules its declaration's functions are defined in: the roots of its code (code_closure.py)."""
        functions = (self.run, self.key, self.check, self.section, self.applies, self.skip, self.accept)
        return tuple(sorted({f.__module__ for f in functions}))

    def input(self, done: Mapping[str, Located]) -> Located | None:
        return next((done[name] for name in self.takes if name in done), None)

    def declared(self, done: Mapping[str, Located]) -> dict[str, Located]:
        """The results in `done` it declared it reads (`takes` and `reads`), in the order it names them."""
        return {name: done[name] for name in (*self.takes, *self.reads) if name in done}
