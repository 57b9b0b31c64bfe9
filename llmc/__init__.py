"""llmc: compile HuggingFace causal LMs into verified inference artifacts and serve them on Triton.

The import root stays light (no torch, no onnx): the compiler lives in `llmc.compiler`, the
serving runtime in `llmc.runtime`, the fused attention op in `llmc.plugins`.
"""

__version__ = "0.1.0"
