"""Stage artifacts: small frozen records written as JSON next to the files they describe.

Each carries `inputs_hash`, the hash of everything that made it (inputs, spec section, tool
versions); the stage cache reuses an artifact when that hash matches and its files are intact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from llmc.compiler.hashing import sha256_file
from llmc.compiler.spec import QuantMode
from llmc.errors import ArtifactError
from llmc.plugins.op.lowering import Lowering
from llmc.runtime.layout import KVLayout
from llmc.runtime.manifest import TensorRTInfo, rank_folder

A = TypeVar("A", bound="Artifact")


class Artifact(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    filename: ClassVar[str]
    inputs_hash: str
    files: dict[str, str] = {}  # file name (relative to the artifact's folder) -> sha256

    def save(self, folder: Path) -> Path:
        path = folder / self.filename
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.model_dump_json(indent=2) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls: type[A], folder: Path) -> A:
        path = folder / cls.filename
        if not path.is_file():
            raise ArtifactError(f"{path}: missing (is {folder} a finished llmc build?)")
        try:
            return cls.model_validate_json(path.read_text())
        except ValidationError as err:
            raise ArtifactError(f"{path}: unreadable {cls.__name__} record ({err.error_count()} problem(s)); rebuild") from None

    @classmethod
    def load_cached(cls: type[A], folder: Path, inputs_hash: str) -> A | None:
        """The artifact in `folder` if it was made from the same inputs and its files are intact."""
        try:
            art = cls.load(folder)
        except ArtifactError:
            return None
        if art.inputs_hash != inputs_hash or not art.files_intact(folder):
            return None
        return art

    def files_intact(self, folder: Path) -> bool:
        return all((folder / n).is_file() and sha256_file(folder / n) == h for n, h in self.files.items())


def hash_outputs(folder: Path, names: list[str]) -> dict[str, str]:
    return {n: sha256_file(folder / n) for n in names}


class TensorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    dtype: str
    shape: list[int | str]


class ModelInfo(BaseModel):
    """Facts about the source model that later stages and the runtime need."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_type: str
    family: str
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: list[int] = []
    has_tokenizer: bool


class ExportedModel(Artifact):
    filename: ClassVar[str] = "exported.json"

    onnx: str
    opset: int
    source_hash: str
    model: ModelInfo
    lowering: Lowering
    kv_layout: KVLayout
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    external_data: bool
    versions: dict[str, str]
    tensor_parallel: int = 1  # ranks the model is split over: one graph each, in rank{r}/ (compiler/graph/files.py)
    stamped_layers: int = 0  # layers copied in the graph from the traced ones (compiler/graph/stamp.py)

    @property
    def model_file(self) -> str:
        return self.onnx

    def graphs(self, folder: Path) -> list[Path]:
        """Each rank's graph in `folder`, in rank order (one without a split)."""
        return [folder / rank_folder(r, self.tensor_parallel) / self.onnx for r in range(self.tensor_parallel)]


class QualityReport(BaseModel):
    """A quantized graph measured against the unquantized one (compiler/quantize/quality.py measures it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    eval_text: str
    eval_tokens: int
    perplexity_reference: float
    perplexity_quantized: float
    perplexity_increase: float  # relative: 0.03 = 3% higher
    token_agreement: float  # teacher-forced greedy agreement over the verify prompts
    agreement_tokens: int
    size_reference_mib: float
    size_quantized_mib: float
    # None: the reference ran a segment of weights at a time (a streamed build's quality report), not as served
    decode_tok_s_reference: float | None
    decode_tok_s_quantized: float
    runtime: str

    def decode_speedup(self) -> str:
        """Batch-1 decode in words: the quantized graph's speed over the reference's, or its own where the
        reference was not run as served."""
        if self.decode_tok_s_reference is None:
            return f"{self.decode_tok_s_quantized:.1f} tok/s (reference not run as served)"
        return f"{self.decode_tok_s_quantized / self.decode_tok_s_reference:.2f}x"


class QuantizedModel(Artifact):
    filename: ClassVar[str] = "quantized.json"

    onnx: str
    mode: QuantMode
    bits: int
    method: str
    calibration: str
    kv_layout: KVLayout
    report: QualityReport
    versions: dict[str, str]
    # what AWQ's scaling did to the activations (quantize/channel_scales.py), for the adapters' branches; None: no
    # scaling, or one no branch can be served on (SmoothQuant's Q/DQ graphs)
    channel_scales: str | None = None

    @property
    def model_file(self) -> str:
        return self.onnx


class DraftArtifact(Artifact):
    """The draft stage's graph (compiler/draft.py): a paged graph the package stage copies into `draft/`."""

    filename: ClassVar[str] = "draft.json"

    onnx: str  # relative to the stage folder
    kv_layout: KVLayout
    source: str  # "self" (the target quantized) or the draft checkpoint folder's name
    source_hash: str
    quantization: QuantMode
    verified: str  # the verify summary of a separate checkpoint's export ("" for a self-draft, or verify off)
    quality: QualityReport | None = None  # a quantized draft's report against its unquantized form


class ExecutionEnvironment(Artifact):
    """The environment stage's archive (compiler/repository/environment.py): the serving packages for the container's
    Python, which the package stage links into the version folder as Triton's EXECUTION_ENV_PATH."""

    filename: ClassVar[str] = "environment.json"

    archive: str
    python: str  # X.Y
    interpreter: str  # the container's, which the archive's bin/python3 links to
    platform: str  # the newest wheel platform tag taken
    packages: dict[str, str]  # name -> version, as installed


class EngineModel(Artifact):
    """A TensorRT engine (`plan`) built from the export or its Q/DQ form, checked against ONNX Runtime."""

    filename: ClassVar[str] = "engine.json"

    plan: str
    kv_layout: KVLayout  # the engine's: caches in its precision, updated in place by the plugin
    tensorrt: TensorRTInfo
    verified: str  # the comparison's summary ("" when verify.enabled is false)
    tensor_parallel: int = 1  # ranks: one engine each, rank{r}/<plan> (the manifest's rank_folder), built alike

    @property
    def model_file(self) -> str:
        return self.plan

    def plans(self, folder: Path) -> list[Path]:
        """Each rank's engine in `folder`, in rank order (one without a split)."""
        return [folder / rank_folder(r, self.tensor_parallel) / self.plan for r in range(self.tensor_parallel)]


class VerifyCase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    batch: int
    prompt_lengths: list[int]
    decode_steps: int
    max_abs_logit_diff: float
    token_agreement: float  # fraction of generated tokens equal to PyTorch's
    first_divergence: list[int | None]  # per row: first step whose token differs, or None
    passed: bool
    # a mixture, per row: the first position where the reference's router had a near tie between its k-th and
    # (k+1)-th expert (graph/routing.py); logits are compared before it only. None: no mixture
    routing_ties: list[int | None] | None = None


class VerifyReport(Artifact):
    filename: ClassVar[str] = "verify.json"

    reference: str
    candidate: str
    tolerance: float
    max_abs_logit_diff: float
    cases: list[VerifyCase]
    passed: bool

    def __bool__(self) -> bool:
        return self.passed


class AdapterVerifyReport(VerifyReport):
    """The spec's LoRA adapters verified as the base is (compiler/lora/verify.py): its cases are named after the
    adapters their rows run under."""

    filename: ClassVar[str] = "adapters_verify.json"

    adapters: dict[str, str]  # each adapter's name -> its digest (its identity with the name)


def tensor_infos(values) -> list[TensorInfo]:
    """The name, dtype and shape (symbolic dims by name) of ONNX value infos: a graph's inputs or outputs."""
    from onnx import helper

    infos = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
        infos.append(TensorInfo(name=v.name, dtype=helper.tensor_dtype_to_np_dtype(t.elem_type).name, shape=dims))
    return infos


def tool_versions() -> dict[str, str]:
    """The versions of the tools a graph was made with, as the artifacts record them."""
    import onnx
    import onnxscript
    import torch
    import transformers

    import llmc

    return {"llmc": llmc.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "onnx": onnx.__version__, "onnxscript": onnxscript.__version__}
