"""The build spec (`model.yaml`): one Pydantic model, unknown keys rejected, limits in the types.

The smallest valid spec is `name` and `source`; everything else has a default. Relative paths in
the file are resolved against the file's own folder; the default output is `build/<name>` under
the current directory (the CLI's `--output` overrides both).
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmc.errors import SpecError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class Target(str, enum.Enum):
    onnxruntime = "onnxruntime"
    tensorrt = "tensorrt"


class Precision(str, enum.Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


class QuantMode(str, enum.Enum):
    none = "none"
    int8 = "int8"
    fp8 = "fp8"
    int8_weight_only = "int8-weight-only"
    int4_weight_only = "int4-weight-only"


class CalibrationMethod(str, enum.Enum):
    max = "max"
    entropy = "entropy"
    percentile = "percentile"


class WeightOnlyAlgorithm(str, enum.Enum):
    rtn = "rtn"  # round to nearest
    awq = "awq"  # activation-aware scaling, then round to nearest


class AttentionLowering(str, enum.Enum):
    auto = "auto"  # fused for onnxruntime, plugin for tensorrt; reference under int8/fp8 quantization
    fused = "fused"  # com.microsoft.GroupQueryAttention, KV cache updated in place (ONNX Runtime)
    reference = "reference"  # standard opset-23 ops, for tools that need plain ONNX
    plugin = "plugin"  # the LlmcFusedAttention TensorRT plugin node


class SourceSpec(_Strict):
    """Where the checkpoint is: a HuggingFace checkpoint folder or a `.gguf` file."""

    path: Path
    allow_pickle: bool = Field(
        False,
        description="Allow pytorch_model.bin checkpoints (loaded with torch.load(weights_only=True)).",
    )


class CalibrationSpec(_Strict):
    data: str = Field("builtin", description="'builtin', or a .txt / .jsonl (field `text`) file.")
    num_samples: Annotated[int, Field(ge=1, le=4096)] = 128
    seq_len: Annotated[int, Field(ge=8, le=8192)] = 512
    method: CalibrationMethod = CalibrationMethod.max


DEFAULT_BLOCK = {QuantMode.int8_weight_only: 128, QuantMode.int4_weight_only: 32}


class QuantizationSpec(_Strict):
    mode: QuantMode = QuantMode.none
    calibration: CalibrationSpec = CalibrationSpec()
    max_perplexity_increase: Annotated[float, Field(ge=0.0, le=10.0)] = Field(
        0.05, description="Relative increase allowed over the unquantized model (0.05 = 5%)."
    )
    block_size: int | None = Field(
        None, description="Weights per scale in the weight-only modes (16, 32, 64, 128 or 256); unset: 128 for "
                          "int8-weight-only, 32 for int4-weight-only.")
    algorithm: WeightOnlyAlgorithm = Field(
        WeightOnlyAlgorithm.awq, description="Weight-only modes: awq (activation-aware scaling on calibration text, "
                                             "then round to nearest) or rtn (round to nearest, no calibration).")
    smoothquant: bool | None = Field(
        None, description="int8: migrate activation outliers into the weights (SmoothQuant); unset = on for int8.")
    smoothquant_alpha: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        0.8, description="SmoothQuant migration strength: 0 keeps activations as they are, 1 moves all into weights "
                         "(0.8 measured best on SmolLM2 among 0.5 / 0.8 / 0.9).")

    @field_validator("block_size")
    @classmethod
    def _block_is_a_kernel_size(cls, value: int | None) -> int | None:
        if value is not None and value not in (16, 32, 64, 128, 256):
            raise ValueError("must be 16, 32, 64, 128 or 256 (the block sizes MatMulNBits kernels take)")
        return value

    @model_validator(mode="after")
    def _smoothquant_is_for_int8(self) -> "QuantizationSpec":
        if self.smoothquant and self.mode is not QuantMode.int8:
            raise ValueError(f"smoothquant applies to mode int8 (per-tensor int8 activations), not {self.mode.value}")
        return self

    @property
    def weight_only(self) -> bool:
        return self.mode in (QuantMode.int8_weight_only, QuantMode.int4_weight_only)

    @property
    def block(self) -> int:
        """The weight-only block size: `block_size`, else the mode's default. 8-bit codes lose almost
        nothing to wide blocks and MatMulNBits runs them much faster (SmolLM2 int8 decode, blocks
        of 32 -> 128: 179 -> 216 tok/s, perplexity +0.05% -> +0.10%); 4-bit codes need narrow
        ones (blocks of 64: +20% perplexity against +11% with 32)."""
        return self.block_size or DEFAULT_BLOCK[self.mode]

    @property
    def smoothed(self) -> bool:
        """SmoothQuant is applied: int8, unless `smoothquant: false`."""
        return self.mode is QuantMode.int8 and self.smoothquant is not False

    @property
    def static(self) -> bool:
        """Q/DQ with calibrated activation scales (int8, fp8): the TensorRT modes."""
        return self.mode in (QuantMode.int8, QuantMode.fp8)


class ExportSpec(_Strict):
    attention: AttentionLowering = Field(
        AttentionLowering.auto,
        description="How llmc::attention is lowered to ONNX; auto picks the target's fused form.",
    )


DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_TOKENS = 2048, 256


class LimitsSpec(_Strict):
    max_batch_size: Annotated[int, Field(ge=1, le=1024)] = 8
    max_seq_len: Annotated[int, Field(ge=16, le=1_048_576)] | None = Field(
        None, description=f"Tokens per KV slot (prompt + output); unset: min({DEFAULT_MAX_SEQ_LEN}, the checkpoint's "
                          "max_position_embeddings).")
    max_num_tokens: Annotated[int, Field(ge=1, le=1_048_576)] = 8192

    @model_validator(mode="after")
    def _tokens_cover_batch(self) -> "LimitsSpec":
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be >= max_batch_size "
                f"({self.max_batch_size}): every running sequence needs one token per step"
            )
        return self


class ServingSpec(_Strict):
    max_queue_size: Annotated[int, Field(ge=1, le=100_000)] = 256
    default_max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description=f"max_tokens of a request that names none; unset: min({DEFAULT_MAX_TOKENS}, "
                          "limits.max_seq_len).")
    max_stop_words: Annotated[int, Field(ge=0, le=64)] = 8
    num_threads: Annotated[int, Field(ge=0, le=512)] = Field(0, description="0 = all cores")


class VerifySpec(_Strict):
    enabled: bool = True
    decode_steps: Annotated[int, Field(ge=1, le=1024)] = 32
    max_logit_diff: Annotated[float, Field(gt=0.0)] = Field(
        1e-3, description="Largest |logit difference| allowed between PyTorch and the artifact."
    )


_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class HardwareCompatibility(str, enum.Enum):
    none = "none"  # runs on GPUs of the build GPU's model only (fastest)
    same_compute_capability = "same_compute_capability"  # any GPU of the same compute capability
    ampere_plus = "ampere_plus"  # any GPU from Ampere on (sm_80+)


class TensorRTSpec(_Strict):
    workspace_gib: Annotated[float, Field(gt=0, le=1024)] = Field(
        4.0, description="Memory pool limit for the builder's tactics (and the engine's scratch space), GiB.")
    optimization_level: Annotated[int, Field(ge=0, le=5)] = Field(
        3, description="Builder optimization level: higher searches longer for faster kernels.")
    hardware_compatibility: HardwareCompatibility = HardwareCompatibility.none
    version_compatible: bool = Field(
        False, description="Engine loads on later TensorRT versions (embeds the lean runtime; a little slower).")
    timing_cache: bool = Field(True, description="Keep the tactic timings in <output>/engine/timing.cache and reuse them.")


class BuildSpec(_Strict):
    name: str
    source: SourceSpec
    target: Target = Target.onnxruntime
    precision: Precision = Precision.fp32
    export: ExportSpec = ExportSpec()
    quantization: QuantizationSpec = QuantizationSpec()
    limits: LimitsSpec = LimitsSpec()
    serving: ServingSpec = ServingSpec()
    verify: VerifySpec = VerifySpec()
    tensorrt: TensorRTSpec = TensorRTSpec()
    output: Path | None = None

    @field_validator("name")
    @classmethod
    def _name_is_a_model_name(cls, value: str) -> str:
        if not _NAME_RE.fullmatch(value):
            raise ValueError(
                "use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit "
                "(it becomes the Triton model name and the output folder)"
            )
        return value

    @field_validator("source", mode="before")
    @classmethod
    def _source_shorthand(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, (str, Path)) else value

    @model_validator(mode="after")
    def _cross_field(self) -> "BuildSpec":
        max_tokens, max_seq_len = self.serving.default_max_tokens, self.limits.max_seq_len
        if max_tokens is not None and max_seq_len is not None and max_tokens > max_seq_len:
            raise ValueError(
                f"serving.default_max_tokens ({self.serving.default_max_tokens}) must be <= "
                f"limits.max_seq_len ({self.limits.max_seq_len})"
            )
        if self.target is Target.onnxruntime and self.precision is not Precision.fp32:
            raise ValueError(
                f"precision {self.precision.value} needs target: tensorrt; target onnxruntime "
                "builds fp32 (use quantization.mode for smaller CPU models)"
            )
        if self.quantization.weight_only and self.target is not Target.onnxruntime:
            raise ValueError(f"quantization.mode: {self.quantization.mode.value} is ONNX Runtime's MatMulNBits and "
                             "needs target: onnxruntime; TensorRT takes int8 or fp8")
        attention = self.export.attention
        if (attention is AttentionLowering.fused and self.target is not Target.onnxruntime) or \
                (attention is AttentionLowering.plugin and self.target is not Target.tensorrt):
            runs_on = "onnxruntime" if attention is AttentionLowering.fused else "tensorrt"
            raise ValueError(f"export.attention: {attention.value} runs only with target: {runs_on} "
                             f"(target is {self.target.value}); use auto or reference")
        if self.quantization.static and attention in (AttentionLowering.fused, AttentionLowering.plugin):
            raise ValueError(f"quantization.mode: {self.quantization.mode.value} quantizes the reference attention "
                             f"lowering (plain ONNX, which ONNX Runtime calibrates and TensorRT reads), not "
                             f"export.attention: {attention.value}; use auto or reference")
        return self

    @property
    def attention_lowering(self) -> str:
        """The lowering `export.attention` resolves to for this target."""
        if self.export.attention is AttentionLowering.auto:
            if self.quantization.static:
                return "reference"
            return "fused" if self.target is Target.onnxruntime else "plugin"
        return self.export.attention.value

    def with_model_limits(self, max_position_embeddings: int | None) -> tuple["BuildSpec", list[str]]:
        """The spec with the limits the checkpoint decides filled in, and a note for each one filled:
        an unset `limits.max_seq_len` becomes min(2048, the model's max_position_embeddings), an unset
        `serving.default_max_tokens` min(256, that). A value set above the model's limit is an error."""
        model_limit = max_position_embeddings or DEFAULT_MAX_SEQ_LEN
        limits, serving, notes = self.limits, self.serving, []
        if limits.max_seq_len is None:
            limits = limits.model_copy(update={"max_seq_len": min(DEFAULT_MAX_SEQ_LEN, model_limit)})
            origin = (f"the model's max_position_embeddings is {max_position_embeddings}"
                      if max_position_embeddings is not None else "the model names no max_position_embeddings")
            notes.append(f"limits.max_seq_len {limits.max_seq_len} ({origin})")
        elif max_position_embeddings is not None and limits.max_seq_len > max_position_embeddings:
            raise SpecError(f"limits.max_seq_len ({limits.max_seq_len}) exceeds the model's max_position_embeddings "
                            f"({max_position_embeddings}); lower it to {max_position_embeddings} or less, or leave it "
                            "unset to take the model's limit")
        if serving.default_max_tokens is None:
            serving = serving.model_copy(update={"default_max_tokens": min(DEFAULT_MAX_TOKENS, limits.max_seq_len)})
            if serving.default_max_tokens < DEFAULT_MAX_TOKENS:
                notes.append(f"serving.default_max_tokens {serving.default_max_tokens} (limits.max_seq_len)")
        return self.model_copy(update={"limits": limits, "serving": serving}), notes

    @property
    def output_dir(self) -> Path:
        return self.output if self.output is not None else Path("build") / self.name

    def section_hash(self, *sections: str) -> str:
        """Hash of the named top-level sections: what a stage depends on, for the stage cache."""
        data = self.model_dump(mode="json", include=set(sections))
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _format_validation_error(err: ValidationError, origin: str) -> str:
    lines = [f"{origin}: invalid build spec ({err.error_count()} problem(s)):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif e["loc"] and e["type"] not in ("model_type", "dict_type"):
            msg += f" (got {e['input']!r})"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def parse_spec(data: Any, origin: str = "<spec>", base_dir: Path | None = None) -> BuildSpec:
    """Validate a spec mapping; relative paths are resolved against `base_dir`."""
    if not isinstance(data, dict):
        kind = "empty" if data is None else type(data).__name__
        raise SpecError(f"{origin}: a build spec must be a YAML mapping with at least `name` and `source` (got {kind})")
    try:
        spec = BuildSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_format_validation_error(err, origin)) from None
    if base_dir is not None:
        spec = _resolve_paths(spec, base_dir)
    return spec


def _resolve_paths(spec: BuildSpec, base_dir: Path) -> BuildSpec:
    source = spec.source.model_copy(update={"path": (base_dir / spec.source.path.expanduser()).resolve()})
    update: dict[str, Any] = {"source": source}
    if spec.output is not None:
        update["output"] = (base_dir / spec.output.expanduser()).resolve()
    calibration = spec.quantization.calibration
    if calibration.data != "builtin":
        data = str((base_dir / Path(calibration.data).expanduser()).resolve())
        update["quantization"] = spec.quantization.model_copy(
            update={"calibration": calibration.model_copy(update={"data": data})})
    return spec.model_copy(update=update)


def load_spec(path: str | Path) -> BuildSpec:
    """Read and validate a `model.yaml`. Every error names the file and the field at fault."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: spec file not found (pass the path to a model.yaml)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise SpecError(f"{path}: not valid YAML{at}: {getattr(err, 'problem', err)}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not a UTF-8 text file") from None
    return parse_spec(data, origin=str(path), base_dir=path.resolve().parent)
