"""llmc: compile HuggingFace causal LMs into verified inference artifacts and serve them on Triton.

The import root stays light (no torch, no onnx): the compiler lives in `llmc.compiler`, what a
served model runs in `llmc.runtime`, the fused attention op in `llmc.plugins`, and the operator
tools (client, Triton server and supervisor, deploy, bench, soak) beside the CLI in `llmc`.
"""

__version__ = "0.1.0"
