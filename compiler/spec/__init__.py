"""The build spec (`model.yaml`): one Pydantic model, unknown keys rejected, limits in the types.

The smallest valid spec is `name` and `source`; everything else has a default. Relative paths in
the file are resolved against the file's own folder; the default output is `build/<name>` under
the current directory (the CLI's `--output` overrides both). The sections (limits, quantization,
...) and their enums are in sections.py (speculative's in speculative_sections.py, the LoRA adapters' limits
in adapters.py); they are imported from here too.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError, ValidationInfo, field_validator, model_validator

from llmc.compiler.spec.sections import (
    DEFAULT_BLOCK, DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_TOKENS, PAGED_MAX_NUM_TOKENS, SLOT_MAX_NUM_TOKENS, Arch,
    AttentionLowering, CalibrationMethod, CalibrationSpec, ExecutionEnvSpec, ExportSpec, HardwareCompatibility,
    KVCacheDtype, LimitsSpec, NAME_RE, ParallelSpec, Precision, QuantizationSpec, QuantMode, ServingSpec, SourceLoad,
    SourceSpec, StrictModel, Target, TensorRTSpec, VerifySpec, WeightOnlyAlgorithm)
from llmc.compiler.spec.adapters import LoraSpec, check_adapters
from llmc.compiler.spec.speculative import DraftSpec, SpeculativeMethod, SpeculativeSpec
from llmc.errors import SpecError

# the spec's vocabulary, importable from here as from sections.py
__all__ = ["BuildSpec", "load_spec", "parse_spec", "DEFAULT_BLOCK", "DEFAULT_MAX_SEQ_LEN", "DEFAULT_MAX_TOKENS",
           "Arch", "AttentionLowering", "CalibrationMethod", "CalibrationSpec", "DraftSpec", "ExecutionEnvSpec",
           "ExportSpec", "HardwareCompatibility", "LimitsSpec", "LoraSpec", "ParallelSpec", "Precision",
           "QuantizationSpec", "QuantMode", "ServingSpec", "SourceSpec", "SpeculativeMethod", "SpeculativeSpec",
           "Target", "TensorRTSpec", "VerifySpec", "WeightOnlyAlgorithm"]



class BuildSpec(StrictModel):
    name: str
    source: SourceSpec
    target: Target = Target.onnxruntime
    precision: Precision = Precision.fp32
    export: ExportSpec = ExportSpec()
    quantization: QuantizationSpec = QuantizationSpec()
    limits: LimitsSpec = LimitsSpec()
    serving: ServingSpec = ServingSpec()
    speculative: SpeculativeSpec | None = None
    parallel: ParallelSpec = ParallelSpec()
    verify: VerifySpec = VerifySpec()
    tensorrt: TensorRTSpec = TensorRTSpec()
    execution_env: ExecutionEnvSpec | None = None
    adapters: dict[str, Path] = {}  # name -> PEFT adapter folder (spec/adapters.py, docs/lora.md)
    lora: LoraSpec = LoraSpec()  # the limits the adapters are served under
    output: Path | None = None

    @field_validator("name")
    @classmethod
    def _name_is_a_model_name(cls, value: str) -> str:
        if not NAME_RE.fullmatch(value):
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
        ort_only = attention in (AttentionLowering.fused, AttentionLowering.paged)
        if (ort_only and self.target is not Target.onnxruntime) or \
                (attention is AttentionLowering.plugin and self.target is not Target.tensorrt):
            runs_on = "onnxruntime" if ort_only else "tensorrt"
            raise ValueError(f"export.attention: {attention.value} runs only with target: {runs_on} "
                             f"(target is {self.target.value}); use auto or reference")
        paged = self.attention_lowering == AttentionLowering.paged.value  # auto resolves to paged on onnxruntime
        if self.export.kv_cache_dtype is not KVCacheDtype.fp32 and not paged:
            raise ValueError(f"export.kv_cache_dtype: {self.export.kv_cache_dtype.value} is the paged graph's block "
                             f"pools; it needs export.attention: paged or auto (which gives "
                             f"{self.attention_lowering} here), or kv_cache_dtype: fp32")
        if self.quantization.static and attention in (AttentionLowering.fused, AttentionLowering.plugin,
                                                      AttentionLowering.paged):
            raise ValueError(f"quantization.mode: {self.quantization.mode.value} quantizes the reference attention "
                             f"lowering (plain ONNX, which ONNX Runtime calibrates and TensorRT reads), not "
                             f"export.attention: {attention.value}; use auto or reference")
        if self.speculative is not None and not paged:
            raise ValueError(f"speculative: needs the paged graph, export.attention: paged or auto (a step verifies "
                             f"several tokens per row with a past, which only the paged graph runs in in-flight "
                             f"batching); export.attention: {attention.value} gives {self.attention_lowering} here")
        if self.parallel.tensor > 1 and self.quantization.static:
            raise ValueError(f"parallel.tensor: {self.parallel.tensor} with quantization.mode: "
                             f"{self.quantization.mode.value}: a split model takes the weight-only modes "
                             f"(int8-weight-only, int4-weight-only) on its paged graph; "
                             f"{self.quantization.mode.value} quantizes the reference graph")
        if self.parallel.tensor > 1 and self.target is Target.tensorrt and self.attention_lowering != "plugin":
            raise ValueError(f"parallel.tensor: {self.parallel.tensor} with target: tensorrt splits the plugin "
                             f"lowering (export.attention: plugin or auto; one engine per rank, its collectives "
                             f"TensorRT's DistCollective layers); export.attention: {attention.value} gives "
                             f"{self.attention_lowering} here")
        if self.parallel.tensor > 1 and self.target is not Target.tensorrt and not paged:
            raise ValueError(f"parallel.tensor: {self.parallel.tensor} splits the paged graph (its ranks' collectives "
                             f"run on llmc's CPU kernels), export.attention: paged or auto; export.attention: "
                             f"{attention.value} with target: {self.target.value} gives {self.attention_lowering}")
        return self

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, value: dict[str, Path], info: ValidationInfo) -> dict[str, Path]:
        check_adapters(value, info.data.get("name"))
        return value

    @model_validator(mode="after")
    def _beams_need_paged(self) -> "BuildSpec":
        width = self.serving.max_beam_width
        if width > 1 and self.attention_lowering != AttentionLowering.paged.value:
            raise ValueError(f"serving.max_beam_width: {width} needs the paged graph, export.attention: paged or auto "
                             f"(beams share KV blocks copy-on-write); export.attention: {self.export.attention.value} "
                             f"gives {self.attention_lowering} here, which runs no beams: leave max_beam_width 1")
        if width > self.limits.max_batch_size:
            raise ValueError(f"serving.max_beam_width ({width}) must be <= limits.max_batch_size "
                             f"({self.limits.max_batch_size}): a beam request's beams are rows of the same step")
        return self

    @property
    def attention_lowering(self) -> str:
        """The lowering `export.attention` resolves to for this target."""
        if self.export.attention is AttentionLowering.auto:
            if self.quantization.static:
                return "reference"
            return "paged" if self.target is Target.onnxruntime else "plugin"
        return self.export.attention.value

    def with_model_limits(self, max_position_embeddings: int | None) -> tuple["BuildSpec", list[str]]:
        """The spec with the limits the checkpoint decides filled in, and a note for each one filled:
        an unset `limits.max_seq_len` becomes min(2048, the model's max_position_embeddings), an unset
        `serving.default_max_tokens` min(256, that), an unset `limits.max_num_tokens` the lowering's
        default (sections.py). A value set above the model's limit is an error."""
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
        if limits.max_num_tokens is None:
            budget = PAGED_MAX_NUM_TOKENS if self.attention_lowering == "paged" else SLOT_MAX_NUM_TOKENS
            limits = limits.model_copy(update={"max_num_tokens": max(budget, limits.max_batch_size)})
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
    if spec.serving.chat_template is not None:
        template = (base_dir / spec.serving.chat_template.expanduser()).resolve()
        update["serving"] = spec.serving.model_copy(update={"chat_template": template})
    update["quantization"] = _resolve_calibration(spec.quantization, base_dir)
    if spec.adapters:
        update["adapters"] = {name: (base_dir / folder.expanduser()).resolve()
                              for name, folder in spec.adapters.items()}
    draft = spec.speculative.draft if spec.speculative is not None else None
    if draft is not None:
        source = draft.source.model_copy(update={"path": (base_dir / draft.source.path.expanduser()).resolve()}) \
            if draft.source is not None else None
        draft = draft.model_copy(update={"source": source,
                                         "quantization": _resolve_calibration(draft.quantization, base_dir)})
        update["speculative"] = spec.speculative.model_copy(update={"draft": draft})
    return spec.model_copy(update=update)


def _resolve_calibration(quantization: QuantizationSpec, base_dir: Path) -> QuantizationSpec:
    calibration = quantization.calibration
    if calibration.data == "builtin":
        return quantization
    data = str((base_dir / Path(calibration.data).expanduser()).resolve())
    return quantization.model_copy(update={"calibration": calibration.model_copy(update={"data": data})})


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
