"""What a model family file declares (compiler/models/<family>.py): its `model_type`s, its decoder
class, the features it uses (for the README's table and `llmc inspect`), and one tiny random config
per model type, which the parity tests build (tests/conftest.py) — nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str
    decoder: type  # a compiler.models.base.Decoder (or GPT-2's)
    features: str  # a line for the README's family table
    tiny: dict[str, dict[str, Any]]  # model_type -> tiny config fields (its keys are the model types claimed)
    fused: bool = True  # whether ONNX Runtime's CPU GroupQueryAttention can run it (else `paged` is forced)
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.tiny)
