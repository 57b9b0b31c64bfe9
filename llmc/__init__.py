"""llmc: compile HuggingFace causal LMs into verified inference artifacts and serve them on Triton.

The import root stays light (no torch, no onnx): the compiler lives in `llmc.compiler`, what a
served model runs in `llmc.runtime`, the fused attention op in `llmc.plugins`, the client
services import in `llmc.client`, the scale-out tools (object-store repository, deploy, rollout,
k8s) in `llmc.fleet`, the OpenAI frontend in `llmc.openai`, and the other operator tools (Triton
server and supervisor, serve, bench, soak) beside the CLI in `llmc`.
"""

__version__ = "0.1.0"
