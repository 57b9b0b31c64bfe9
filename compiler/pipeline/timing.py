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
- quantize: the codes (untie, round, pack, write: per quantized weight, what `algorithm: rtn` pays alone), AWQ's
  search (its scales and each block's searched codes: per quantized weight), the quality report (perplexity,
  greedy agreement, decode speed: per P, by source.load: read whole, its fp32 reference decodes and times its
  decode too; a layer at a time, the reference runs a graph segment at a time over the windows and prompts only)
  and the calibration pass (per P and calibration token: num_samples x seq_len, or as many windows of seq_len as
  `builtin`'s ~1,250 calibration tokens hold);
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
    layers 28: 30 (+6%); 16 layers whole 117: 88 (-25%), layers 77: 69 (-10%; export ~35: 35, verify ~35: 27,
    -22%, where the 16-layer int4 builds' logs read 19-30 s)
    llmc.bench streamed --shape llama-3.1-8b, 32 layers, `layers` (docs/build.md; held within 20%, a quiet host):
    int4 round to nearest 708 s (11.8 min): 730 (+3%; export 192: 216, verify 176: 194, quantize 298: 299);
    int8-weight-only AWQ 1218 (20.3 min): 1192 (-2%; export 231: 216, verify 187: 194, quantize 761: 761)
    The same, int4 AWQ, on a host shared with test runs: 32 layers 1410 s (23.5 min): 1192 (-15%); 4 layers
    346: 271 (-22%)

The 8B builds set these terms (the estimate was 1304 s for round to nearest, +84%, and 1856 for int8, +52%; its
quantize +176% and +80%, verify +31-39%). Round to nearest's quantize, 298 s, is the codes and the report read a
layer at a time alone, so the codes no longer hold the block search (16 s per quantized P: 120 s) and the streamed
report is the rest (22 s per P: 177 s). AWQ's search is int8's 761 s less that and its calibration pass (131 s):
44 s per quantized P with the block search, where the scale search alone was fitted at 56. The builds read whole
keep the sum they were fitted to (codes, search and report: 36 s serial + 125 parallel per P), the report
taking what the codes and search gave up: read whole, its fp32 reference decodes (greedy, then timed) in one
session, where the segments run the windows and prompts once (a calibration pass over the 16-layer export: 20 s
in segments, 41 in one session). Verify's reference a layer at a time: 6 s per P (was 12.3), fitted to the 8B
verify, 176-187 s. The streamed report's rate rests on the 8B builds alone: the 1B int4 build read a layer at a
time, 303 s on a host at load 2-4 (where the 16-layer streamed int4 build took 341 s against 209-229 on quieter
ones), estimates at 202 (-33%), not fitted.

Worst fitted: -25% (16 layers read whole, measured on a slower day than the larger 1B fp32 build). Not measured:
other core counts (the scaling is an assumption), round to nearest read whole, static int8/fp8 (the codes and
the calibration pass, no AWQ search), TensorRT's engine, the draft and environment stages (no estimate: plan.py
names them).
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
# parallel part scaled by threads: verify's at 32 decode steps, the calibration pass's per 1,000 tokens; verify's
# "layers" and quantize's "report_layers" replace "reference" and "report" when source.load is `layers`.
STARTUP = 3.0  # the process's start: Python, torch, the spec and the checkpoint's config
HASH_PER_GB = 1.0  # the checkpoint's files, sha256
EXPORT = {"fixed": 5.0, "per_layer": 0.15, "whole": 21.0, "layers": 25.7}
VERIFY = {"fixed": 1.5, "candidate": (6.0, 12.0), "reference": (0.0, 28.0), "layers": (2.0, 4.0)}
QUANTIZE = {"fixed": 2.0, "codes": (8.0, 8.0), "search": (8.0, 36.0), "report": (20.0, 81.0),
            "report_layers": (4.0, 18.0), "calibration": (0.0, 16.0)}
PACKAGE = {"fixed": 1.5, "per_100k_vocab": 0.5}
# the adapters read and checked, the LoRA graph written and opened; the branch beside every projection and PEFT's
# hooks slow both sides' steps: fitted to SmolLM2 with two rank-16 adapters on every projection (29.8 s: 26)
LORA_VERIFY = {"fixed": 3.5, "scale": 1.5}
TIMED = ("source", "export", "verify", "verify-adapters", "quantize", "package")


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
    # verify-adapters (compiler/lora/verify.py) at verify's rates times LORA_VERIFY: for n adapters, 3 candidate
    # rows each and 3 mixed (verify: 4 rows); whole, 3 reference decodes each and the mixed case's base rows
    # (verify: 3); streamed, a pass over the layers each and one for the base rows (verify: one)
    n = len(spec.adapters)
    candidate = cost(VERIFY["candidate"], p * steps) * (3 * n + 3) / 4
    ref_scale = (3 * n + 2) / 3 if load == "whole" else n + 1
    seconds["verify-adapters"] = LORA_VERIFY["fixed"] + LORA_VERIFY["scale"] * (candidate + reference * ref_scale)
    report = QUANTIZE["report"] if load == "whole" else QUANTIZE["report_layers"]
    quantize = QUANTIZE["fixed"] + cost(QUANTIZE["codes"], pq) + cost(report, p)
    if q.weight_only and q.algorithm is WeightOnlyAlgorithm.awq:
        quantize += cost(QUANTIZE["search"], pq)
    if q.static or (q.weight_only and q.algorithm is WeightOnlyAlgorithm.awq):
        quantize += cost(QUANTIZE["calibration"], p * calibration_tokens(spec) / 1000)
    seconds["quantize"] = quantize
    seconds["package"] = PACKAGE["fixed"] + PACKAGE["per_100k_vocab"] * dims.vocab_size / 1e5
    return {stage: round(seconds[stage], 1) for stage in TIMED if stage in stages}
