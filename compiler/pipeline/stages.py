"""The build's stages in the order they run (stage.py says what a stage declares; run.py runs them):

    source -> environment -> export -> verify -> verify-adapters -> quantize -> draft -> tensorrt -> package

Each stage is declared beside the library function that does its work, with what it takes and reads,
what keys it, what it checks first and how it reports; this table only orders them. `tensorrt` (the TensorRT engine) belongs
to target: tensorrt only; `verify` does nothing for the plugin lowering, which only TensorRT runs
(the tensorrt stage compares the engine with ONNX Runtime instead); `quantize` does nothing when
quantization.mode is none; `draft` belongs to speculative.method: draft only; `environment` to specs
with an execution_env section only, and runs first: it needs only the spec, and a Python without the
wheels fails before the export; `verify-adapters` to specs with `adapters:` only (compiler/lora/verify.py).
"""

from __future__ import annotations

from llmc.compiler.draft import DRAFT
from llmc.compiler.graph.export import EXPORT
from llmc.compiler.graph.verify import VERIFY
from llmc.compiler.lora.verify import VERIFY_ADAPTERS
from llmc.compiler.quantize import QUANTIZE
from llmc.compiler.repository.environment import ENVIRONMENT
from llmc.compiler.repository.package import PACKAGE
from llmc.compiler.source import SOURCE
from llmc.compiler.stage import Stage
from llmc.compiler.tensorrt.stage import TENSORRT

STAGES: tuple[Stage, ...] = (SOURCE, ENVIRONMENT, EXPORT, VERIFY, VERIFY_ADAPTERS, QUANTIZE, DRAFT, TENSORRT, PACKAGE)
