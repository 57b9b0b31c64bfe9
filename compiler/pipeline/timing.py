"""Each stage's time, estimated for the build plan (`llmc build --dry-run`) from the spec, the config's sizes and
this machine's cores; no weights read.

The model: a stage's seconds are a serial part (Python, the export's trace and serialization, hashing, writing)
plus a parallel part (ONNX Runtime sessions, PyTorch and numpy GEMMs) scaled by REF_THREADS / threads, threads
being serving.num_threads (what the build's sessions use; 0: every core) capped by this machine's cores, and its
gain capped at MAX_THREADS (decoding is bound by memory bandwidth, not cores). Each part is a fixed cost plus
seconds per billion parameters (P), fp32 weights the stages read at once:

- source: the process's start, and the checkpoint's files hashed (seconds per GB on disk);
- export: a fixed cost, a little per decoder layer (the period traced, the rest stamped), and per P the model's
  load and the graph's serialization; `source.load: layers` reads each layer's tensors as the graph is written;
- verify: ONNX Runtime's candidate decoding verify.decode_steps steps (batch 1, then 3 prompts), and, reading the
  model whole, PyTorch's greedy reference decoding each prompt alone; reading it a layer at a time, one
  teacher-forced forward with each layer read once instead;
- quantize: the codes (untie, block search, writing: per quantized weight), the quality report (perplexity,
  greedy agreement, decode speed: per P), AWQ's scale search (per quantized weight) and the calibration pass
  (per P and calibration token: num_samples x seq_len, or as many windows of seq_len as `builtin`'s ~1,250
  calibration tokens hold);
- package: a fixed cost and the tokenizer's checks (per 100k vocabulary).

Fitted to the build times llmc measured on the shared 2-core AVX512-VNNI host (docs/changelog.md, every figure
after the export began stamping layers; tests/compiler/pipeline/test_plan_time.py holds the fit): estimate against
measured, each build with verify and the spec's defaults (`llmc.bench sizes`: fp32 safetensors):

    Qwen2.5-0.5B fp32 50-58 s: 51 (within); int4 AWQ 137-155: 140 (within); int8-weight-only 155: 140 (-10%)
    Llama-3.2-1B fp32 102 s: 102 (0%); int4 304-355: 323 (within)
    SmolLM2-135M fp32 cold ~25 s: 25 (+1%; its export ~15: 12, -18%; verify ~8: 8, -4%)
    Qwen2.5-0.5B's stages: export 17-19 s: 19 (within); verify 18-22: 24 (+10%); int4 quantize 75-85: 90 (+5%)
    Llama-3.2-1B's int4 quantize stage 245 s (before the stamping, which changed only the export): 221 (-10%)
    llmc.bench streamed (hidden 2048, vocabulary 49,152, bf16 shards, fp32): 4 layers whole 32 s: 36 (+11%),
    layers 28: 32 (+13%); 16 layers whole 117: 88 (-25%), layers 77: 76 (-2%; export ~35: 35, verify ~35: 34)

Worst: -25% (16 layers read whole, measured on a slower day than the larger 1B fp32 build). Not measured: other
core counts (the scaling is an assumption), static int8/fp8 (the codes and the calibration pass, no AWQ search),
TensorRT's engine, the draft and environment stages (no estimate: plan.py names them).
"""

from __future__ import annotations

import os

from llmc.compiler.models.config import Dims
from llmc.compiler.spec import BuildSpec, QuantMode, WeightOnlyAlgorithm

REF_THREADS = 2  # the host the coefficients were fitted on
MAX_THREADS = 8  # past this, more cores are taken to gain nothing
BUILTIN_CALIBRATION_TOKENS = 1250  # compiler/textdata/corpus.txt's calibration half, in SmolLM2's tokens
# Seconds on the 2-core host. Fixed costs, the source's hash and the export are serial (the export: fixed, per
# decoder layer, per P by source.load); verify's and quantize's parts are (serial, parallel) seconds per P, the
# parallel part scaled by threads: verify's at 32 decode steps, the calibration pass's per 1,000 tokens.
STARTUP = 3.0  # the process's start: Python, torch, the spec and the checkpoint's config
HASH_PER_GB = 1.0  # the checkpoint's files, sha256
EXPORT = {"fixed": 5.0, "per_layer": 0.15, "whole": 21.0, "layers": 25.7}
VERIFY = {"fixed": 1.5, "candidate": (6.0, 12.0), "reference": (0.0, 28.0), "layers": (4.3, 8.0)}
QUANTIZE = {"fixed": 2.0, "codes": (20.0, 25.0), "report": (10.0, 50.0), "search": (6.0, 50.0),
            "calibration": (0.0, 16.0)}
PACKAGE = {"fixed": 1.5, "per_100k_vocab": 0.5}
TIMED = ("source", "export", "verify", "quantize", "package")


def cores() -> int:
    """This machine's cores for this process (its CPU affinity, else the CPU count)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads(spec: BuildSpec, machine_cores: int | None = None) -> int:
    """The threads the build's sessions run: serving.num_threads (0: every core), at most the machine's cores."""
    available = machine_cores or cores()
    return min(spec.serving.num_threads or available, available)


def calibration_tokens(spec: BuildSpec) -> int:
    """The tokens the calibration pass runs: num_samples x seq_len, `builtin`'s windows capped by its text."""
    cal = spec.quantization.calibration
    samples = cal.num_samples
    if cal.data == "builtin":
        samples = min(samples, max(BUILTIN_CALIBRATION_TOKENS // cal.seq_len, 1))
    return samples * cal.seq_len


def stage_seconds(spec: BuildSpec, dims: Dims, stages: list[str], load: str = "whole",
                  checkpoint_bytes: int | None = None, machine_cores: int | None = None) -> dict[str, float]:
    """Each stage of TIMED that `stages` runs: its estimated seconds. `checkpoint_bytes`: the checkpoint's files
    (unknown: 2 bytes a parameter, bf16); `machine_cores`: unknown, this machine's."""
    scale = REF_THREADS / min(threads(spec, machine_cores), MAX_THREADS)
    p = dims.total_params / 1e9
    q = spec.quantization
    untied = dims.vocab_size * dims.hidden_size if q.mode is not QuantMode.none and dims.tied_embeddings else 0
    pq = (dims.linear_params + untied) / 1e9  # the weights quantize codes
    steps = spec.verify.decode_steps / 32

    def cost(per: tuple[float, float], amount: float) -> float:
        return (per[0] + per[1] * scale) * amount

    nbytes = 2 * dims.total_params if checkpoint_bytes is None else checkpoint_bytes
    seconds = {"source": STARTUP + HASH_PER_GB * nbytes / 1e9,
               "export": EXPORT["fixed"] + EXPORT["per_layer"] * dims.num_layers + EXPORT[load] * p}
    reference = cost(VERIFY["reference"], p * steps) if load == "whole" else cost(VERIFY["layers"], p)
    seconds["verify"] = VERIFY["fixed"] + cost(VERIFY["candidate"], p * steps) + reference
    quantize = QUANTIZE["fixed"] + cost(QUANTIZE["codes"], pq) + cost(QUANTIZE["report"], p)
    if q.weight_only and q.algorithm is WeightOnlyAlgorithm.awq:
        quantize += cost(QUANTIZE["search"], pq)
    if q.static or (q.weight_only and q.algorithm is WeightOnlyAlgorithm.awq):
        quantize += cost(QUANTIZE["calibration"], p * calibration_tokens(spec) / 1000)
    seconds["quantize"] = quantize
    seconds["package"] = PACKAGE["fixed"] + PACKAGE["per_100k_vocab"] * dims.vocab_size / 1e5
    return {stage: round(seconds[stage], 1) for stage in TIMED if stage in stages}
