"""The spec's LoRA adapters (issue 54, docs/lora.md): `adapters:` names PEFT adapter folders served on the base
model, `lora:` the limits they are served under. Apart from sections.py, which holds the other sections, to keep
each module readable; BuildSpec (spec/__init__.py) carries both and resolves the folders against the spec file.

    adapters:                     # name -> a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)
      fr: ../adapters/fr
      sql: ../adapters/sql
    lora:
      max_slots: 4                # distinct adapters one batched step carries
      max_rank: 64                # the highest rank an adapter may have (rank_pattern included)
      max_host_adapters: 32       # adapters held in host memory, an LRU feeding the slots
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, model_validator

from llmc.compiler.spec.sections import NAME_RE, StrictModel


class LoraSpec(StrictModel):
    """The limits adapters are served under; each has a default, so `adapters:` alone is a whole spec."""

    max_slots: Annotated[int, Field(ge=1, le=64)] = Field(
        4, description="Distinct adapters one batched step carries (vLLM's max_loras): the slots of the graph's "
                       "stacked LoRA inputs. Requests for more adapters than this wait for a later step.")
    max_rank: Annotated[int, Field(ge=1, le=512)] = Field(
        64, description="The highest rank an adapter may have, rank_pattern included (vLLM's max_lora_rank); an "
                        "adapter above it is refused when it is loaded.")
    max_host_adapters: Annotated[int, Field(ge=1, le=4096)] = Field(
        32, description="Adapters held in host memory at once (vLLM's max_cpu_loras): an LRU that feeds the "
                        "slots; an adapter in use by a running request is never evicted.")

    @model_validator(mode="after")
    def _host_holds_the_slots(self) -> "LoraSpec":
        if self.max_host_adapters < self.max_slots:
            raise ValueError(f"max_host_adapters ({self.max_host_adapters}) must be >= max_slots ({self.max_slots}): "
                             f"the slots of a step are filled from the adapters held in host memory")
        return self


def check_adapters(adapters: dict[str, Path], model_name: str | None) -> None:
    """Refuse an adapter name a request could not name it by, or one that is the base model's own name (the
    OpenAI `model` field names either, so they must differ). Raises ValueError naming the entry."""
    for name in adapters:
        if not NAME_RE.fullmatch(name):
            raise ValueError(f"{name!r}: an adapter name is 1-64 letters, digits, '_', '.' or '-', starting "
                             f"with a letter or digit (requests name it: lora_name, the OpenAI model field)")
        if name == model_name:
            raise ValueError(f"{name!r}: an adapter cannot take the model's own name ({model_name!r}); a "
                             f"request naming {model_name!r} gets the base model")
