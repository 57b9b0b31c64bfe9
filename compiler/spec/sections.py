"""The build spec's sections: the enums and the Pydantic models of every top-level key but the
spec itself (spec.py). Each is strict (unknown keys rejected, frozen) with its limits in its types.
"""

from __future__ import annotations

import enum
import re
from pathlib import Path, PurePosixPath
from typing import Literal, Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


# a model's name and an adapter's: a path component, a Triton model name and an OpenAI `model` alike, quoted nowhere
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class StrictModel(BaseModel):
    """A spec section: unknown keys are errors, values are frozen."""

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
    auto = "auto"  # paged for onnxruntime, plugin for tensorrt; reference under int8/fp8 quantization
    fused = "fused"  # com.microsoft.GroupQueryAttention, KV cache updated in place (ONNX Runtime)
    reference = "reference"  # standard opset-23 ops, for tools that need plain ONNX
    plugin = "plugin"  # the LlmcFusedAttention TensorRT plugin node
    paged = "paged"  # llmc.PagedAttention over block pools (packed tokens, block tables), ONNX Runtime


class KVCacheDtype(str, enum.Enum):
    fp32 = "fp32"
    fp16 = "fp16"  # half the bytes, IEEE half rounding
    int8 = "int8"  # a quarter, symmetric codes with per-head-and-channel scales calibrated at export


class SourceLoad(str, enum.Enum):
    auto = "auto"
    whole = "whole"
    layers = "layers"


class SourceSpec(StrictModel):
    """Where the checkpoint is: a HuggingFace checkpoint folder or a `.gguf` file."""

    path: Path
    allow_pickle: bool = Field(
        False,
        description="Allow pytorch_model.bin checkpoints (loaded with torch.load(weights_only=True)).",
    )
    load: SourceLoad = Field(
        SourceLoad.auto,
        description="How export and verify read the checkpoint: `whole` loads the PyTorch model once (fastest "
                    "where it fits); `layers` reads one decoder layer at a time from the safetensors shards or "
                    "the GGUF file (a layer's memory, not the model's); `auto` picks `layers` when the whole "
                    "model's stages would not fit this machine's memory (`llmc build --dry-run` says which).",
    )


class CalibrationSpec(StrictModel):
    data: str = Field("builtin", description="'builtin', or a .txt / .jsonl (field `text`) file.")
    num_samples: Annotated[int, Field(ge=1, le=4096)] = 128
    seq_len: Annotated[int, Field(ge=8, le=8192)] = 512
    method: CalibrationMethod = CalibrationMethod.max


DEFAULT_BLOCK = {QuantMode.int8_weight_only: 128, QuantMode.int4_weight_only: 32}


class QuantizationSpec(StrictModel):
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


class ExportSpec(StrictModel):
    attention: AttentionLowering = Field(
        AttentionLowering.auto,
        description="How llmc::attention is lowered to ONNX; auto: paged for onnxruntime (block pools, mixed "
                    "prefill/decode steps, prefix caching), plugin for tensorrt, reference under int8/fp8.",
    )
    kv_cache_dtype: KVCacheDtype = Field(
        KVCacheDtype.fp32,
        description="The paged graph's KV block pools (attention: paged): fp32, fp16 (half the bytes) or int8 "
                    "(a quarter; scales per KV head and channel, calibrated on the built-in text at export).",
    )


DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_TOKENS = 2048, 256
# tokens per step: the slot graph prefills one prompt a step in chunks this long; the paged graph
# mixes every decoding row with prompt chunks up to this budget, and a few hundred keeps a step
# that carries a prompt chunk within a few decode steps' time on a CPU
SLOT_MAX_NUM_TOKENS, PAGED_MAX_NUM_TOKENS = 8192, 256


class LimitsSpec(StrictModel):
    max_batch_size: Annotated[int, Field(ge=1, le=1024)] = 8
    max_seq_len: Annotated[int, Field(ge=16, le=1_048_576)] | None = Field(
        None, description=f"Tokens per KV slot (prompt + output); unset: min({DEFAULT_MAX_SEQ_LEN}, the checkpoint's "
                          "max_position_embeddings).")
    max_num_tokens: Annotated[int, Field(ge=1, le=1_048_576)] | None = Field(
        None, description=f"Tokens one step computes; unset: {PAGED_MAX_NUM_TOKENS} for the paged graph (decode rows + "
                          f"prompt chunks), {SLOT_MAX_NUM_TOKENS} for the slot graph (a prompt chunk).")
    kv_cache_tokens: Annotated[int, Field(ge=16, le=1 << 32)] | None = Field(
        None, description="Tokens the paged KV pool holds, all requests together; unset: max_batch_size x "
                          "max_seq_len (the slot graph's memory).")

    @model_validator(mode="after")
    def _tokens_cover_batch(self) -> "LimitsSpec":
        if self.max_num_tokens is not None and self.max_num_tokens < self.max_batch_size:
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be >= max_batch_size "
                f"({self.max_batch_size}): every running sequence needs one token per step"
            )
        return self


class ServingSpec(StrictModel):
    max_queue_size: Annotated[int, Field(ge=1, le=100_000)] = 256
    default_max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description=f"max_tokens of a request that names none; unset: min({DEFAULT_MAX_TOKENS}, "
                          "limits.max_seq_len).")
    max_stop_words: Annotated[int, Field(ge=0, le=64)] = 8
    num_threads: Annotated[int, Field(ge=0, le=512)] = Field(0, description="0 = all cores")
    chat_template: Path | None = Field(
        None, description="A jinja2 chat template file (relative to the spec's folder) that replaces the "
                          "checkpoint's; unset: the checkpoint's own, if it has one.")
    tool_call_format: Literal["hermes", "mistral", "llama3_json", "pythonic", "json"] | None = Field(
        None, description="The tool-call format the OpenAI API parses under tool_choice auto (llmc/openai/"
                          "tool_parsers.py); unset: the one the chat template teaches (json: llmc's own, for a "
                          "template with none).")
    prefix_caching: bool = Field(True, description="Paged graph: reuse the KV blocks of prompt prefixes seen before.")
    itl_ratio: Annotated[float, Field(gt=1.0, le=100.0)] | None = Field(
        2.5, description="Paged graph: a step carries prompt tokens only while its cost, learned from the steps run, "
                         "stays within this many decode steps of the same rows, so a joining prompt stretches the "
                         "inter-token latency at most this much (it costs TTFT); null: up to limits.max_num_tokens.")
    max_beam_width: Annotated[int, Field(ge=1, le=64)] = Field(
        1, description="Paged graph: the widest beam search a request may ask (its beam_width input); each beam is a "
                       "row of limits.max_batch_size. 1: no beam search (requests asking for it are refused).")


class ParallelSpec(StrictModel):
    tensor: Annotated[int, Field(ge=1, le=64)] = Field(
        1, description="Ranks one model is split over (tensor parallelism, Megatron style; on CPU, processes of one "
                       "machine summing through shared memory). It must divide the attention heads, and divide the KV "
                       "heads or be a multiple of them (each KV head then kept by several ranks). 1: no split.")


class VerifySpec(StrictModel):
    enabled: bool = True
    decode_steps: Annotated[int, Field(ge=1, le=1024)] = 32
    max_logit_diff: Annotated[float, Field(gt=0.0)] | None = Field(
        None, description="Largest |logit difference| allowed between PyTorch and the artifact; unset: by the KV "
                          "cache's type, 1e-3 fp32, 0.05 fp16, 0.25 int8 (export.kv_cache_dtype).")



class HardwareCompatibility(str, enum.Enum):
    none = "none"  # runs on GPUs of the build GPU's model only (fastest)
    same_compute_capability = "same_compute_capability"  # any GPU of the same compute capability
    ampere_plus = "ampere_plus"  # any GPU from Ampere on (sm_80+)


class TensorRTSpec(StrictModel):
    workspace_gib: Annotated[float, Field(gt=0, le=1024)] = Field(
        4.0, description="Memory pool limit for the builder's tactics (and the engine's scratch space), GiB.")
    optimization_level: Annotated[int, Field(ge=0, le=5)] = Field(
        3, description="Builder optimization level: higher searches longer for faster kernels.")
    hardware_compatibility: HardwareCompatibility = HardwareCompatibility.none
    version_compatible: bool = Field(
        False, description="Engine loads on later TensorRT versions (embeds the lean runtime; a little slower).")
    timing_cache: bool = Field(True, description="Keep the tactic timings in <output>/engine/timing.cache and reuse them.")


class Arch(str, enum.Enum):
    x86_64 = "x86_64"
    aarch64 = "aarch64"


class ExecutionEnvSpec(StrictModel):
    """The serving Python's packages packed into the repository for the Triton container that serves it
    (Triton's EXECUTION_ENV_PATH; compiler/repository/environment.py), so a stock container needs nothing installed."""

    python: str = Field(
        "3.12", description="The container's Python, X.Y: 3.12 in Triton's containers from 24.12 on (Ubuntu 24.04); "
                            "3.10 before, which no longer has wheels of the runtime's onnxruntime.")
    interpreter: str | None = Field(
        None, description="The container's interpreter, an absolute path; unset: /usr/bin/pythonX.Y.")
    glibc: str = Field(
        "2.35", description="The newest glibc whose manylinux wheels are taken: the container's or older (Triton's "
                            "Python 3.12 containers are Ubuntu 24.04, glibc 2.39; 2.35 also suits an Ubuntu 22.04 "
                            "image; llguidance has no wheel below 2.31).")
    arch: Arch = Arch.x86_64

    @field_validator("python")
    @classmethod
    def _python(cls, value: str) -> str:
        if not re.fullmatch(r"3\.\d{1,2}", value):
            raise ValueError("give the container's Python as major.minor, e.g. '3.12' (quote it in YAML)")
        return value

    @field_validator("glibc")
    @classmethod
    def _glibc(cls, value: str) -> str:
        match = re.fullmatch(r"2\.(\d{1,2})", value)
        if not match or int(match.group(1)) < 17:
            raise ValueError("give the container's glibc as 2.N with N >= 17, e.g. '2.28' (quote it in YAML)")
        return value

    @field_validator("interpreter")
    @classmethod
    def _interpreter(cls, value: str | None) -> str | None:
        if value is not None and not PurePosixPath(value).is_absolute():
            raise ValueError("the interpreter's absolute path in the container, e.g. /usr/bin/python3.12")
        return value

    @property
    def interpreter_path(self) -> str:
        return self.interpreter or f"/usr/bin/python{self.python}"
