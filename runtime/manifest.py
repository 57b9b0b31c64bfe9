"""The repository manifest: everything the served model needs to know, written by the build's
package stage next to the model file (`<repo>/<name>/1/manifest.json`) and read by the runtime.

Nothing is encoded in file names: the model file, tokenizer, KV layout and serving limits are all here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmc.runtime.layout import KVLayout
from llmc.runtime.lora.sites import Site


def rank_folder(rank: int, ranks: int) -> str:
    """Where rank `rank` of a model split `ranks` ways keeps its graph, relative to the folder of an export or a
    version: that folder itself without a split (""), `rank{rank}` with one (tensor parallelism)."""
    return "" if ranks == 1 else f"rank{rank}"


class ManifestError(RuntimeError):
    """A repository without a readable manifest (not a finished llmc build, or another version's)."""


class ServingLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int = Field(ge=1)  # KV slots (paged: rows per step): sequences decoded together
    max_seq_len: int = Field(ge=2)  # the longest sequence: prompt + generated tokens
    max_num_tokens: int = Field(ge=1)  # tokens per step (slots: a prompt chunk; paged: decode rows + prompt chunks)
    max_queue_size: int = Field(ge=1)
    default_max_tokens: int = Field(ge=1)
    max_stop_words: int = Field(ge=0)
    num_threads: int = Field(0, ge=0)  # 0 = all cores
    kv_cache_tokens: int | None = Field(None, ge=1)  # the paged KV pool, all requests together (paged graphs only)
    prefix_caching: bool = True  # paged graphs: reuse the blocks of prompt prefixes seen before
    itl_ratio: float | None = None  # paged graphs: a step's cost cap in decode steps (runtime/engine/step_cost.py); None: none
    max_beam_width: int = Field(1, ge=1)  # paged graphs: the widest beam search a request may ask (runtime/engine/beam.py)


class DraftModel(BaseModel):
    """The draft graph a `speculative.method: draft` build packages beside the target (runtime/engine/speculation/draft.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # its graph, relative to the version folder (draft/model.onnx); `engine` in manifests written before the rename
    model_file: str = Field(validation_alias=AliasChoices("model_file", "engine"))
    kv_layout: KVLayout  # paged, the target's block size; pools of the target's num_blocks
    source: str  # "self" (the target quantized) or the checkpoint folder's name
    source_hash: str
    quantization: str  # its quantization.mode ("none" for a separate checkpoint kept as exported)


class SpeculativeConfig(BaseModel):
    """Speculative decoding in the paged engine (runtime/engine/speculation/speculator.py): up to `num_tokens` proposed
    tokens, for at most `max_batch` rows a step, from prompt lookup (n-grams of `min_n`..`max_n`
    tokens, engine/speculation/ngram.py) or from the `draft` model (engine/speculation/draft.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft"]
    num_tokens: int = Field(ge=1)
    max_batch: int = Field(ge=1)
    min_n: int = Field(ge=1)
    max_n: int = Field(ge=1)
    disable_batch_size: int | None = Field(None, ge=1)  # more requests: no speculation; unset: engine/speculation/speculator.py
    draft: DraftModel | None = None  # method draft only

    @model_validator(mode="after")
    def _n_range(self) -> "SpeculativeConfig":
        if self.min_n > self.max_n:
            raise ValueError(f"speculative.min_n ({self.min_n}) must be <= speculative.max_n ({self.max_n})")
        if (self.draft is not None) != (self.method == "draft"):
            raise ValueError(f"speculative.draft names the draft model exactly when method is draft (method is "
                             f"{self.method}, draft is {'set' if self.draft else 'missing'})")
        if self.draft is not None and not self.draft.kv_layout.paged:
            raise ValueError("speculative.draft.kv_layout must be paged (the draft shares the target's block tables)")
        return self


class TensorRTInfo(BaseModel):
    """Where a TensorRT engine was built and what it accepts: checked before the engine is loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str  # TensorRT that built it
    gpu: str
    compute_capability: str  # "9.0"
    hardware_compatibility: str  # none | same_compute_capability | ampere_plus
    version_compatible: bool
    precision: str
    profiles: dict[str, dict[str, list[list[int]]]]  # profile -> input -> [min, opt, max]
    # the attention plugin's PTX: its ISA version ("8.0": the oldest driver that reads it) and target ("sm_90": the
    # oldest GPU; an "a" target runs on that one only); None for engines built before they were recorded
    plugin_ptx_isa: str | None = None
    plugin_ptx_target: str | None = None


class ChatTemplate(BaseModel):
    """The chat template (jinja2) the build found in the checkpoint or the spec's `serving.chat_template`,
    with the special tokens a template may name (`bos_token`, ...). The served model does not render
    it: the OpenAI frontend and `llmc generate --chat` do (llmc/chat_template.py), reading it from
    config.pbtxt's `chat_template` parameter over gRPC."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    template: str
    special_tokens: dict[str, str] = {}
    source: str  # where it came from: the checkpoint's file, or the spec's path
    tool_call_format: str | None = None  # serving.tool_call_format; None: the one the template teaches


class ExecutionEnvInfo(BaseModel):
    """The serving packages packed in the version folder for a container's Python (config.pbtxt's
    EXECUTION_ENV_PATH; the build's execution_env section)."""

    archive: str  # in the version folder
    python: str  # X.Y, the container's
    interpreter: str  # the container's path the archive's bin/python3 links to


class AdapterInfo(BaseModel):
    """One LoRA adapter the build packaged: its identity and its file (runtime/lora/files.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    digest: str  # sha256 over its PEFT config and tensors: with the name, its identity
    file: str  # in the version folder (adapters/<name>.safetensors)
    rank: int = Field(ge=1)  # its highest rank


class LoraConfig(BaseModel):
    """The LoRA graph beside the base graph, its sites, the adapters and their limits (docs/lora.md). A step with no
    adapter token runs `model_file`; one with any runs `lora_file` (the same weights file, more inputs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lora_file: str  # the graph with a branch beside each site, in the version folder (TensorRT: the engine, built so)
    sites: list[Site]
    adapters: list[AdapterInfo]
    max_slots: int = Field(ge=1)  # distinct adapters a step carries
    max_rank: int = Field(ge=1)
    max_host_adapters: int = Field(ge=1)  # adapters held in host memory: an LRU feeding the slots
    # a base AWQ scaled: per site, what an adapter's arrays are multiplied by (compiler/lora/fold.py), in the
    # version folder; the files in adapters/ have it folded in already, an adapter loaded at run time gets it then
    scales_file: str | None = None
    # the untied LM head's weight digest (compiler/lora/adapter.py: weight_digest), which an adapter's saved copy of
    # the head must match to be served (None: no untied head)
    head_digest: str | None = None


class RepositoryManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    filename: ClassVar[str] = "manifest.json"

    name: str
    llmc_version: str
    target: str  # "onnxruntime" | "tensorrt"
    # the model file the runner loads, in the version folder (model.onnx, or a TensorRT plan: model.plan); `engine` in
    # manifests written before the rename (one word, one meaning: the engine is runtime/engine)
    model_file: str = Field(validation_alias=AliasChoices("model_file", "engine"))
    tokenizer: str  # tokenizer.json (HuggingFace `tokenizers` format)
    kv_layout: KVLayout
    vocab_size: int
    end_ids: list[int]
    limits: ServingLimits
    source_hash: str
    tensorrt: TensorRTInfo | None = None  # target tensorrt only
    chat_template: ChatTemplate | None = None  # none: the model serves completions only
    speculative: SpeculativeConfig | None = None  # paged graphs only; none: every row decodes one token a step
    execution_env: ExecutionEnvInfo | None = None  # none: the serving Python has the requirements installed
    tensor_parallel: int = Field(1, ge=1)  # ranks the model is split over: each rank's graph is rank{r}/<model_file>
    lora: LoraConfig | None = None  # LoRA adapters served (paged graphs; docs/lora.md); none: the base model alone

    def graphs(self, folder: Path) -> list[Path]:
        """Each rank's graph in the version folder `folder`, in rank order (one without a split)."""
        return [Path(folder) / rank_folder(r, self.tensor_parallel) / self.model_file for r in range(self.tensor_parallel)]

    @model_validator(mode="after")
    def _speculation_is_paged(self) -> "RepositoryManifest":
        if self.speculative is not None and not self.kv_layout.paged:
            raise ValueError("speculative: needs a paged graph (kv_layout.paged); this graph is the slot form")
        draft = self.speculative.draft if self.speculative is not None else None
        if draft is not None and draft.kv_layout.block_size != self.kv_layout.block_size:
            raise ValueError(f"speculative.draft.kv_layout.block_size ({draft.kv_layout.block_size}) must be the "
                             f"target's ({self.kv_layout.block_size}): the draft reads the target's block tables")
        return self

    @model_validator(mode="after")
    def _beams_are_paged(self) -> "RepositoryManifest":
        if self.limits.max_beam_width > 1 and not self.kv_layout.paged:
            raise ValueError(f"limits.max_beam_width: {self.limits.max_beam_width} needs a paged graph "
                             "(kv_layout.paged); this graph is the slot form, which runs no beams")
        return self

    def save(self, folder: Path) -> Path:
        path = folder / self.filename
        path.write_text(self.model_dump_json(indent=2) + "\n")
        return path

    @classmethod
    def load(cls, folder: Path) -> "RepositoryManifest":
        path = Path(folder) / cls.filename
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except FileNotFoundError:
            raise ManifestError(f"{path}: missing (is {folder} a model version built by `llmc build`?)") from None
        except (ValueError, ValidationError) as err:
            raise ManifestError(f"{path}: unreadable manifest ({err}); rebuild with this llmc version") from None
