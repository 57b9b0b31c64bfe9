"""What a build stage is: a declaration the pipeline runs, and what a stage's run receives.

A `Stage` declares:
- `takes`: the earlier stages whose artifact it reads, the first one present wins (the engine is
  built from the quantized graph when there is one, else from the export); `run` gets it with its
  folder as a `Located`;
- `section(spec)`: the part of the spec it reads, handed to `run`;
- `key(spec, ctx)`: what besides its input decides its output (spec fields, tool versions, the
  source of the modules that make it); with the input's files it makes the stage's cache key;
- `check(spec, source)`: its preconditions, checked for every stage of a build before any stage
  that does work runs;
- `applies(spec)`: whether the target has this stage at all; `skip(spec, done)`: why it does
  nothing in this build (None: it runs), from the spec and the stages done so far;
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
from llmc.compiler.source import SourceInfo
from llmc.compiler.spec import BuildSpec

A = TypeVar("A")
Progress = Callable[[int, int], None]


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
    source: SourceInfo | None  # None only while the source stage itself runs
    source_hash: str
    inputs_hash: str  # the stage's cache key, recorded in the artifact it makes
    model: Callable[[], tuple[Any, Any]]  # (PyTorch model, tokenizer), loaded on first call
    done: Mapping[str, Located] = field(default_factory=dict)  # the stages run so far
    progress: Progress = lambda done, total: None
    num_threads: int = 0
    external_threshold: int = 0  # graphs above this many bytes keep their weights as external data


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
    artifact: type[Artifact] | None = None  # a cached stage's record; None: runs on every build
    key: Callable[[BuildSpec, Context], dict] = lambda spec, ctx: {}
    check: Callable[[BuildSpec, SourceInfo], None] = _nothing
    applies: Callable[[BuildSpec], bool] = lambda spec: True
    skip: Callable[[BuildSpec, Mapping[str, Located]], str | None] = _nothing
    accept: Callable[[Any, BuildSpec], None] = _nothing
    folder: str = ""  # its folder in the output (default: its name)
    for_package: bool = False  # only builds that run the package stage run it

    def __post_init__(self) -> None:
        if not self.folder:
            object.__setattr__(self, "folder", self.name)

    def input(self, done: Mapping[str, Located]) -> Located | None:
        return next((done[name] for name in self.takes if name in done), None)
