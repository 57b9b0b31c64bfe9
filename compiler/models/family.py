"""What a model family file declares (compiler/models/families/<family>.py): its decoder class and one tiny
random config per `model_type` it claims, which the parity tests build (tests/conftest.py). The
README's family table says what each family adds (tests/compiler/models/test_readme_families.py keeps
it in step with this registry)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str
    decoder: type  # a compiler.models.base.Decoder
    tiny: dict[str, dict[str, Any]]  # model_type -> tiny config fields (its keys are the model types claimed)
    experts: bool = False  # a mixture of experts (compiler/models/moe.py): ONNX Runtime lowerings only

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.tiny)
