#!/usr/bin/env bash
# Issue 55's GPU figures in one run: the `cuda`-marked kernel tests (tests/gpu: every kernel against the op's
# reference, the plugins' PTX launched through the CUDA driver), then the GPU kernels' benchmark at the issue's
# shapes (decode 32 x 4k, 8 x 32k, 64 x 8k, 1 x 128k at head_dim 128 and 256; prefill 2k/8k/32k fresh and after
# cached tokens), its JSON and both logs in $OUT (default build/gpu-check). The JSON is written after every shape
# ("complete": false until the last), so a run cut short by the lease's time limit still returns what it measured.
#
# Needs an NVIDIA GPU that PyTorch sees, Triton (the `kernels` extra), pytest, and llmc importable. On a machine
# without network (the device machines), llmc travels as a wheel:
#
#     here:   .venv/bin/pip wheel --no-deps -w .whl .          # .whl/ ignored (.git/info/exclude), carried
#             .venv/bin/pip download --no-deps -d .whl allpairspy       # the tests' pairwise sweeps
#             python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#               --platform manylinux_2_17_x86_64 -d .whl pydantic pydantic-core annotated-types typing-inspection
#             (llmc's own requirements that machine lacks: tests/conftest.py imports the spec's models)
#     there:  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
#               && PYTHONPATH=/tmp/site bash scripts/gpu_check.sh
#
# Exits 2 at once without a GPU; otherwise non-zero when the tests or the benchmark failed (both always run). The
# tests get GPU_CHECK_TESTS_S seconds (240) and the benchmark GPU_CHECK_BENCH_S (300): together within a device
# call's 600; a part cut short exits 124 (its timeout's status).
set -uo pipefail

# Python puts the working folder first on sys.path, where the checkout's llmc/ (without compiler/, runtime/ and
# plugins/, which pyproject maps into the package) would hide the installed wheel: no llmc.plugins. Safe-path mode
# (Python 3.11+) leaves it out, for the tests' child processes too.
export PYTHONSAFEPATH=1
out=${OUT:-build/gpu-check}
python=${PYTHON:-python3}
mkdir -p "$out"

if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: needs an NVIDIA GPU that PyTorch sees (torch.cuda.is_available() is false here)" >&2
    exit 2
fi
"$python" -c 'import torch, triton; print("gpu_check:", torch.cuda.get_device_name(), "torch", torch.__version__,
      "CUDA", torch.version.cuda, "triton", triton.__version__)'
nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv 2>&1 \
    | tee "$out/nvidia_smi.csv"

# the tests run their kernels in child processes, each compiling its own: several at once where pytest-xdist is
# there (the device machines have it), one after another where it is not
workers=()
"$python" -c 'import xdist' 2>/dev/null && workers=(-n "${GPU_CHECK_WORKERS:-4}")

# each part within its own time (SIGINT at the end: pytest writes its report of the tests that ran, the bench keeps
# the JSON of the shapes it finished), so one part running long cannot take the other's
PYTHONUNBUFFERED=1 timeout -s INT -k 20 "${GPU_CHECK_TESTS_S:-240}" "$python" -m pytest -m cuda tests/gpu -q \
    "${workers[@]}" -p no:cacheprovider --junitxml "$out/cuda_tests.xml" 2>&1 | tee "$out/cuda_tests.log"
tests=$?

PYTHONUNBUFFERED=1 timeout -s INT -k 20 "${GPU_CHECK_BENCH_S:-300}" "$python" -m llmc.bench gpu-kernels --kind all \
    --sweep --out "$out/gpu_kernels.json" 2>&1 | tee "$out/gpu_kernels.log"
bench=$?

echo "gpu_check: cuda tests exit $tests, benchmark exit $bench; figures in $out/gpu_kernels.json"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
