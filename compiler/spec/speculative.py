"""The spec's `speculative` section (runtime/engine/speculation/speculator.py, runtime/engine/speculation/draft.py): its method and its draft
model. Apart from sections.py, which holds the other sections, to keep each module readable."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from llmc.compiler.spec.sections import QuantizationSpec, QuantMode, SourceSpec, StrictModel


class SpeculativeMethod(str, enum.Enum):
    ngram = "ngram"  # prompt lookup: proposals from the request's own prompt and output
    draft = "draft"  # a draft model built by the same build (speculative.draft)


class DraftSpec(StrictModel):
    """The draft model of `speculative.method: draft`: a separate checkpoint with the target's
    tokenizer (`source`, exported and verified like the target, then quantized if asked), or without
    a source the target itself quantized with `quantization` (a self-speculative draft). Its quality
    is measured but not gated (`max_perplexity_increase` is not applied): a worse draft costs
    acceptance, never correctness."""

    source: SourceSpec | None = None
    quantization: QuantizationSpec = QuantizationSpec()

    @field_validator("source", mode="before")
    @classmethod
    def _source_shorthand(cls, value):
        return {"path": value} if isinstance(value, (str, Path)) else value

    @model_validator(mode="after")
    def _a_draft(self) -> "DraftSpec":
        if self.source is None and self.quantization.mode is QuantMode.none:
            raise ValueError("a draft without a source is the target itself quantized: set "
                             "quantization.mode (int4-weight-only or int8-weight-only), or source: a smaller "
                             "checkpoint with the target's tokenizer")
        if self.quantization.mode is not QuantMode.none and not self.quantization.weight_only:
            raise ValueError(f"quantization.mode: {self.quantization.mode.value} quantizes the reference graph for "
                             "TensorRT; the draft is a paged graph on ONNX Runtime: use int4-weight-only or "
                             "int8-weight-only")
        return self


class SpeculativeSpec(StrictModel):
    """Speculative decoding in the paged engine (runtime/engine/speculation/speculator.py)."""

    method: SpeculativeMethod
    num_tokens: Annotated[int, Field(ge=1, le=16)] = Field(
        4, description="Proposed tokens a row verifies per step at most (k).")
    max_batch: Annotated[int, Field(ge=1, le=1024)] = Field(
        4, description="Rows a step that may speculate; the rows beyond decode normally (speculation costs "
                       "throughput at high batch).")
    min_n: Annotated[int, Field(ge=1, le=16)] = Field(
        2, description="ngram: shortest n-gram looked up (1-grams match almost anywhere in prose and their "
                       "proposals are mostly rejected: `python -m llmc.bench speculative`).")
    max_n: Annotated[int, Field(ge=1, le=16)] = Field(3, description="ngram: longest n-gram looked up (tried first).")
    disable_batch_size: Annotated[int, Field(ge=1, le=1024)] | None = Field(
        None, description="No row speculates while more requests than this are running or waiting (vLLM's "
                          "speculative_disable_by_batch_size): a full batch is compute-bound, and a draft's calls "
                          "(and its catching up on prompts) only slow it. Unset: max_batch for method draft (its k "
                          "calls a step cost the same however few rows speculate), never for ngram (its proposals "
                          "cost no model call).")
    draft: DraftSpec | None = Field(None, description="method draft: the draft model (a checkpoint, or the target "
                                                      "quantized).")

    @model_validator(mode="after")
    def _buildable(self) -> "SpeculativeSpec":
        if (self.method is SpeculativeMethod.draft) != (self.draft is not None):
            raise ValueError("method: draft needs a draft section (draft: {source: ...} or draft: {quantization: "
                             "{mode: int4-weight-only}})" if self.draft is None else
                             f"draft: is the draft model of method: draft; method is {self.method.value}")
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must be <= max_n ({self.max_n})")
        if self.disable_batch_size is not None and self.disable_batch_size < self.max_batch:
            raise ValueError(f"disable_batch_size ({self.disable_batch_size}) must be >= max_batch ({self.max_batch}): "
                             f"below it max_batch rows could never speculate")
        return self
