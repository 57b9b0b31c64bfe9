"""The build plan (`llmc build --dry-run`): what a build of a spec would make, worked out from the
spec and the checkpoint's config alone — no weights loaded, no TensorRT or GPU needed.

For `target: tensorrt` it lists the optimization profiles the engine gets from `limits`
(tensorrt/profiles.py: a prefill profile and a decode profile over the same KV-cache inputs), the
precision plan (fp16/bf16 through ModelOpt AutoCast, int8/fp8 Q/DQ from the quantize stage), the
attention nodes, and a memory estimate: weights at their stored precision, the KV cache at the
serving limits, and the largest activations of a prefill chunk (the logits of every prefilled
token dominate). For every target, the build's own peak memory (BUILD_PEAK: by stage, measured at
0.5B and 1B), stage by stage, beside this machine's available memory: `check_plan_memory` refuses (the dry
run and a real build alike) a build whose largest stage cannot fit (memory.py). And each stage's time, estimated
from the config's sizes, the spec and this machine's cores (timing.py, fitted to the build times llmc measured).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmc.compiler.draft import inspect_draft
from llmc.compiler.graph.kv_cache import ELEMENT
from llmc.compiler.pipeline import memory, timing
from llmc.compiler.pipeline.disk import DiskPlan, plan_disk
from llmc.compiler.pipeline.disk import linear_bytes as disk_linear_bytes
from llmc.compiler.pipeline.stages import STAGES
from llmc.compiler.models.config import Dims, read_dims
from llmc.compiler.models.parallel.heads import tensor_split
from llmc.compiler.source import inspect_source
from llmc.compiler.spec import BuildSpec, QuantMode, Target
from llmc.compiler.tensorrt.profiles import Profile, profiles
from llmc.errors import UnsupportedError
from llmc.runtime.layout import ITEMSIZE

BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
# A build's peak resident memory, per stage (mapped weight files included): a fixed cost (the interpreter, torch,
# onnx: BASE) and multiples of the checkpoint's weights at fp32 (W), of the LM head a quantized build unties (U)
# and of a mixture's experts (X, at fp32). Each stage's own peak is the build process's high-water mark while it
# runs (`python -m llmc.bench streamed` resets it as each stage starts), so memory a stage leaves to the next counts
# in the next. Reading the checkpoint whole (BUILD_PEAK, (W, U, X)): export holds the PyTorch model and the traced
# graph's weights; verify the model and ONNX Runtime's session, which reads the graph's mapped weights without
# prepacking a copy; weight-only quantize reads and writes the weights a tensor at a time (weight_file.py), and
# its calibration and quality sessions read mapped weights, but it starts where the whole model left the process.
# Reading it a layer at a time (STREAM_PEAK): with R the embedding table(s) the streamed model keeps at fp32
# (embeddings and an untied LM head), L one decoder layer and W the whole, at fp32: export holds R, the traced period
# and a layer: (1.2, 1.0, 0.04) of (R, L, W). Verify and quantize run the fp32 graph a segment of weights at a time
# (graph/segments.py): verify's candidate holds its largest segment (SEGMENT_BYTES, or the LM head's: a tied head is
# the table and ONNX Runtime's transposed copy of it) where the export's R is still in the heap, then its reference
# R and a layer; quantize reads, searches and packs the largest weight (the LM head) one at a time, about three tables
# at once (HEAD_COPIES; a tied head, copied out of the embedding first, four and a half), beside the quantized
# graph's session and a segment; or, where more, the quality report's session over the quantized graph, whose
# kernels pack its codes and scales again in memory (PACKED times their bytes on disk: fitted to the 8B int8 build,
# 12.1 GiB; int4's head tables stay larger). Both grow a little with depth (STREAM_DEPTH of W). Fitted to the streamed
# benchmark's int4 AWQ builds (random Llamas: hidden 2048 at 4 and 16 layers, Llama-3.2-1B, Llama-3.1-8B at 4 and
# 32 layers), each stage within 20%. A split (parallel.tensor: N) read a layer at a time exports once per rank: the
# above, plus the rank's LM head slice (1/N of a table) and a layer's slice; its verify and quantize run every rank's
# session at once (a process each), so together they hold the whole fp32 graph's weights on this host, however the
# checkpoint is read: SPLIT_VERIFY and SPLIT_QUANTIZE of W (prepacked sessions; quantize beside N processes' BASE,
# verify beside half a BASE and its streamed reference, R and a layer). Fitted to two int4 AWQ builds of 2 ranks
# (random Llamas, hidden 1024, vocabulary 32,000, at 8 and 24 layers; every rank's process summed): each stage within
# 3% of both, no other size measured.
BASE = 2**30
# verify-adapters (compiler/lora/verify.py) runs verify's model and sessions again with a LoRA branch beside each
# projection, whose adapters' arrays are a few MB: verify's peak, not measured apart
BUILD_PEAK = {"export": (2.08, 0.0, 1.7), "verify": (2.07, 0.0, 0.0), "verify-adapters": (2.07, 0.0, 0.0),
              "quantize": (2.25, 1.23, 2.6)}
STREAM_PEAK = ("export", "verify", "verify-adapters", "quantize")  # the stages whose peak streamed is their own
STREAM_EXPORT = (1.2, 1.0, 0.04)  # export's multiples of (R, L, W)
STREAM_DEPTH, STREAM_MISC = 0.05, 0.4 * 2**30
HEAD_COPIES = {False: 3.0, True: 4.5}  # quantize's tables at once, by tied embeddings
PACKED = 1.27  # the quality report's quantized session: its packed weights, multiples of their bytes on disk
SPLIT_VERIFY, SPLIT_QUANTIZE = 1.8, 1.7  # a streamed split's ranks together, multiples of W
LINEAR_BYTES = {QuantMode.int8: 1.0, QuantMode.fp8: 1.0, QuantMode.int8_weight_only: 1.0,
                QuantMode.int4_weight_only: 0.5}


@dataclass(frozen=True)
class BuildPlan:
    target: str
    stages: list[str]
    precision: str
    attention: str
    attention_nodes: int
    quantization: str
    profiles: list[Profile] = field(default_factory=list)
    weights_bytes: int = 0
    kv_cache_bytes: int = 0
    activation_bytes: int = 0
    load: str = "whole"  # how export and verify read the checkpoint (source.load): "whole" or "layers"
    load_reason: str = ""  # why, for `auto`
    layers_peak_bytes: int = 0  # the build's peak reading the checkpoint a layer at a time
    build_peak_bytes: int = 0  # the largest of stage_peak_bytes
    stage_peak_bytes: dict[str, int] = field(default_factory=dict)  # each stage of BUILD_PEAK the build runs
    available_bytes: int | None = None  # this machine's (memory.available_bytes); None: unknown
    stage_seconds: dict[str, float] = field(default_factory=dict)  # each stage of timing.TIMED the build runs
    build_threads: int = 0  # the threads those estimates assume (timing.threads)
    total_params: int = 0
    active_params: int = 0  # what one token reads: a mixture's routed experts only
    expert_bytes: int = 0  # a mixture's experts, of weights_bytes
    ranks: int = 1  # parallel.tensor
    rank_weights_bytes: int = 0  # what each rank holds (its slices, the replicated embeddings and norms)
    rank_kv_cache_bytes: int = 0  # each rank's pools: its KV heads
    split: str = ""  # how the heads split
    disk: DiskPlan | None = None  # what the build writes, beside the output's free disk (disk.py)
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[tuple[str, str]]:
        def gib(n: int) -> str:
            return f"{n / 2**30:.2f} GiB"

        rows = [("target", self.target), ("stages", " -> ".join(self.stages)), ("precision", self.precision),
                ("attention", f"{self.attention} ({self.attention_nodes} nodes)"), ("quantization", self.quantization)]
        for p in self.profiles:
            rows.append((f"profile {p.name}", "; ".join(
                f"{name} min {list(lo)} opt {list(opt)} max {list(hi)}" for name, (lo, opt, hi) in p.shapes.items())))
        rows.append(("parameters", f"{self.total_params:,}" + (
            f" total, {self.active_params:,} active per token" if self.active_params != self.total_params else "")))
        rows.append(("memory: weights", gib(self.weights_bytes) + (
            f" (experts {gib(self.expert_bytes)}, the rest {gib(self.weights_bytes - self.expert_bytes)})"
            if self.expert_bytes else "")))
        rows += [("memory: KV cache", gib(self.kv_cache_bytes)),
                 ("memory: activations (peak prefill, estimate)", gib(self.activation_bytes)),
                 ("memory: total (estimate)", gib(self.weights_bytes + self.kv_cache_bytes + self.activation_bytes)),
                 ("build: checkpoint read", f"{self.load}" + (f" ({self.load_reason})" if self.load_reason else "")),
                 ("build: peak memory (estimate)", gib(self.build_peak_bytes))]
        rows += [(f"build: {stage} peak (estimate)", gib(peak)) for stage, peak in self.stage_peak_bytes.items()]
        rows.append(("build: this machine's available memory",
                     "unknown" if self.available_bytes is None else gib(self.available_bytes)))
        rows += [(f"build: {stage} time (estimate)", f"{s:.0f} s") for stage, s in self.stage_seconds.items()]
        if self.stage_seconds:
            untimed = [s for s in self.stages if s not in self.stage_seconds]
            rows.append(("build: total time (estimate)", f"{sum(self.stage_seconds.values()):.0f} s on "
                         f"{self.build_threads} threads" + (f", without {', '.join(untimed)} (not estimated)"
                                                            if untimed else "")))
        rows += self.disk.rows() if self.disk is not None else []
        if self.ranks > 1:
            rows.append(("tensor parallelism", f"{self.ranks} ranks, {self.split}; each rank: weights "
                                               f"{gib(self.rank_weights_bytes)}, KV cache {gib(self.rank_kv_cache_bytes)}"))
        rows += [("note", n) for n in self.notes]
        return rows


def stage_peaks(dims: Dims, stages: list[str], untied: int, load: str, weight_only: bool = True,
                ranks: int = 1, packed: float = 0.0) -> dict[str, int]:
    """Each stage's peak memory for `load` ("whole" or "layers"), of the stages in BUILD_PEAK that run;
    `weight_only`: the quantize stage's mode is a weight-only one (the static Q/DQ modes' calibration and ModelOpt
    run the whole graph, streamed or not); `ranks`: parallel.tensor (read a layer at a time: every rank's process
    on this host counted); `packed`: a quantized linear weight's bytes a parameter on disk (disk.linear_bytes)."""
    fp32 = 4 * (dims.linear_params + dims.other_params)
    peaks = {stage: int(BASE + w * fp32 + u * 4 * untied + x * 4 * dims.expert_params)
             for stage, (w, u, x) in BUILD_PEAK.items() if stage in stages}
    if load == "layers":
        from llmc.compiler.graph.segments import SEGMENT_BYTES

        table = 4 * dims.vocab_size * dims.hidden_size
        resident = table * (1 if dims.tied_embeddings else 2)
        layer = max(fp32 - resident, 0) // max(dims.num_layers, 1)
        segment = max(min(SEGMENT_BYTES, fp32), table * (2 if dims.tied_embeddings else 1))
        r, l, w = STREAM_EXPORT
        grown = STREAM_DEPTH * fp32 + STREAM_MISC
        streamed = {"export": BASE + r * resident + l * layer + w * fp32,
                    "verify": BASE + resident + max(segment, layer) + grown,
                    "verify-adapters": BASE + resident + max(segment, layer) + grown,
                    "quantize": BASE + grown + max(HEAD_COPIES[dims.tied_embeddings] * table,
                                                   PACKED * packed * (dims.linear_params + untied))}
        if ranks > 1:  # the export once per rank; verify's and quantize's sessions every rank's at once
            streamed = {"export": streamed["export"] + table / ranks + l * layer / ranks,
                        "verify": BASE / 2 + SPLIT_VERIFY * fp32 + resident + layer,
                        "quantize": ranks * BASE + SPLIT_QUANTIZE * fp32 + BUILD_PEAK["quantize"][1] * 4 * untied}
        streamed = {stage: int(peak) for stage, peak in streamed.items() if stage in stages}
        if dims.expert_params or not weight_only:  # a mixture's quantizer and the Q/DQ modes read the graph whole
            streamed.pop("quantize", None)
        peaks.update(streamed)
    return peaks


def choose_load(spec: BuildSpec, whole: dict[str, int], available: int | None,
                refusal: str | None) -> tuple[str, str]:
    """("whole" or "layers", why): source.load, or for `auto` the whole model where its stages (`whole`: their
    peaks reading it whole) fit."""
    from llmc.compiler.spec import SourceLoad

    if spec.source.load is not SourceLoad.auto:
        return spec.source.load.value, ""
    if refusal is not None:
        return "whole", f"auto: cannot stream, {refusal}"
    model_stages = {s: p for s, p in whole.items() if s in STREAM_PEAK}
    if not model_stages or available is None or max(model_stages.values()) <= available:
        return "whole", "auto: the model fits in memory"
    return "layers", "auto: the whole model's stages would not fit in memory"


def build_plan(spec: BuildSpec, dims: Dims, info=None, output=None) -> BuildPlan:
    """The plan of `spec` for a checkpoint of `dims` (`info`: its files), built into `output` (default: the
    spec's output_dir)."""
    spec, notes = spec.with_model_limits(dims.max_position_embeddings)
    q = spec.quantization
    tensorrt = spec.target is Target.tensorrt
    dtype_bytes = BYTES[spec.precision.value]
    linear_bytes = LINEAR_BYTES.get(q.mode, dtype_bytes)
    # untie_lm_head: a quantized build gives a tied LM head its own copy
    untied = dims.vocab_size * dims.hidden_size if q.mode is not QuantMode.none and dims.tied_embeddings else 0
    weights = int(dims.linear_params * linear_bytes + dims.other_params * dtype_bytes + untied * linear_bytes)
    kv_tokens, kv_element = spec.limits.max_seq_len * spec.limits.max_batch_size, dtype_bytes
    if spec.attention_lowering == "paged":  # the block pool, in export.kv_cache_dtype
        kv_tokens = spec.limits.kv_cache_tokens or kv_tokens
        kv_element = ITEMSIZE[ELEMENT[spec.export.kv_cache_dtype]]

    def pool_bytes(d: Dims) -> int:  # keys and values of every layer for kv_tokens tokens
        return 2 * d.num_layers * d.num_kv_heads * d.head_dim * kv_tokens * kv_element

    kv_bytes = pool_bytes(dims)
    ranks, split = spec.parallel.tensor, None
    if ranks > 1:
        try:
            split = tensor_split(dims.num_heads, dims.num_kv_heads, ranks)
        except ValueError as err:
            raise UnsupportedError(str(err)) from None
        # the projections and the LM head split, embeddings and norms replicated; a tied head is a rank's own slice
        head = dims.vocab_size * dims.hidden_size * linear_bytes if dims.tied_embeddings and not untied else 0
        rank_weights = int((weights - dims.other_params * dtype_bytes + head) / ranks + dims.other_params * dtype_bytes)
        rank_kv = 2 * dims.num_layers * split.kv_heads * dims.head_dim * kv_tokens * kv_element
    tokens = spec.limits.max_num_tokens
    activations = tokens * (dims.vocab_size * 4 + 4 * max(dims.intermediate_size, 3 * dims.hidden_size) * dtype_bytes)
    stages = [s.name for s in STAGES if s.applies(spec) and s.skip(spec, {}) is None]  # what a build would run
    available = memory.available_bytes()
    refusal = checkpoint_bytes = None
    if info is not None:
        from llmc.compiler.stream.model import refusal as stream_refusal

        refusal = stream_refusal(info)
        try:
            checkpoint_bytes = sum(f.stat().st_size for f in info.hashed_files) or None
        except OSError:
            pass
    weight_only = q.mode in (QuantMode.int8_weight_only, QuantMode.int4_weight_only)
    packed = disk_linear_bytes(q) if q.mode is not QuantMode.none else 0.0
    whole, streamed = (stage_peaks(dims, stages, untied, load, weight_only, ranks, packed)
                       for load in ("whole", "layers"))
    load, load_reason = choose_load(spec, whole, available, refusal)
    if ranks > 1 and load == "layers":
        notes.append(f"parallel.tensor {ranks}, read a layer at a time: the export reads the checkpoint once per "
                     "rank, a layer and its slice at a time; verify and quantize run every rank's session at once on "
                     "this host, together holding the whole fp32 graph's weights (their peaks count every rank's "
                     "process): checking a split on one machine runs all of its ranks")
    peaks = streamed if load == "layers" else whole
    seconds = timing.stage_seconds(spec, dims, stages, load, checkpoint_bytes)
    draft = spec.speculative.draft if spec.speculative is not None else None
    if draft is not None:  # its pools: the target's blocks again, at the draft's layers and heads
        d = read_dims(inspect_draft(draft)) if draft.source is not None else dims
        draft_kv = pool_bytes(d)
        notes.append(f"speculative draft: {draft.source.path.name if draft.source else 'the target'} "
                     f"({draft.quantization.mode.value}), {d.num_layers} layers; its KV pools "
                     f"{draft_kv / 2**30:.2f} GiB beside the target's (the same blocks); k "
                     f"{spec.speculative.num_tokens}, up to {spec.speculative.max_batch} rows a step")
    if spec.execution_env is not None:
        env = spec.execution_env
        notes.append(f"execution_env: pip fetches the serving packages' wheels for CPython {env.python} "
                     f"({env.arch.value}, manylinux up to glibc {env.glibc}) into the repository's "
                     f"1/serving_env.tar.gz, run by {env.interpreter_path} in the container")
    lowering = spec.attention_lowering
    if tensorrt:
        precision = (f"{spec.precision.value} through ModelOpt AutoCast (strongly typed network)"
                     if spec.precision.value != "fp32" else "fp32 (strongly typed network)")
        if spec.attention_lowering == "plugin":
            notes.append("the engine is verified against ONNX Runtime running the same checkpoint's fused export")
    else:
        precision = "fp32 (ONNX Runtime CPU)"
    quant = q.mode.value if q.mode is QuantMode.none else (
        f"{q.mode.value} ({'Q/DQ' if q.static else 'MatMulNBits'}; calibration {q.calibration.method.value} on "
        f"{q.calibration.data}, up to {q.calibration.num_samples} x {q.calibration.seq_len} tokens)")
    return BuildPlan(target=spec.target.value, stages=stages, precision=precision,
                     attention={"fused": "com.microsoft.GroupQueryAttention", "reference": "opset-23 Attention",
                                "plugin": "LlmcFusedAttention plugin", "paged": "llmc.PagedAttention"}[lowering],
                     attention_nodes=dims.num_layers, quantization=quant,
                     profiles=profiles(spec.limits, dims.num_kv_heads, dims.head_dim) if tensorrt else [],
                     weights_bytes=weights, kv_cache_bytes=kv_bytes, activation_bytes=activations,
                     load=load, load_reason=load_reason,
                     layers_peak_bytes=0 if refusal else max(streamed.values(), default=0),
                     build_peak_bytes=max(peaks.values(), default=0), stage_peak_bytes=peaks,
                     available_bytes=available, stage_seconds=seconds, build_threads=timing.threads(spec),
                     total_params=dims.total_params, active_params=dims.active_params,
                     expert_bytes=int(dims.expert_params * linear_bytes), notes=notes,
                     disk=plan_disk(dims, stages, q, output or spec.output_dir),
                     **({} if split is None else dict(
                         ranks=ranks, rank_weights_bytes=rank_weights, rank_kv_cache_bytes=rank_kv,
                         split=f"{split.heads} query and {split.kv_heads} KV heads each"
                               + (f" (each KV head kept by {split.kv_replicas} ranks)" if split.kv_replicas > 1
                                  else ""))))


def plan_build(spec: BuildSpec, output=None) -> BuildPlan:
    """The plan for `spec` built into `output` (default: its output_dir); reads the checkpoint's config only."""
    info = inspect_source(spec.source)
    return build_plan(spec, read_dims(info), info, output)


def check_plan_memory(plan: BuildPlan, stages: list[str] | None = None, *, ignore: bool = False) -> None:
    """Refuse (ResourceError) a build whose largest stage, of `stages` (default: all the plan's), exceeds
    this machine's available memory; `ignore`: --ignore-memory-check."""
    peaks = {s: p for s, p in plan.stage_peak_bytes.items() if stages is None or s in stages}
    fixes = ()
    if plan.load == "whole" and plan.layers_peak_bytes and plan.available_bytes is not None \
            and plan.layers_peak_bytes <= plan.available_bytes:
        fixes = (f"source.load: layers (the build then peaks at {plan.layers_peak_bytes / memory.GiB:.1f} GiB)",)
    memory.check_memory(peaks, plan.available_bytes, ignore=ignore, other_fixes=fixes)
