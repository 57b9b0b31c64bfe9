"""Export stage: a HuggingFace causal LM -> an ONNX graph with explicit KV-cache inputs and outputs.

The HF model is first rebuilt around `llmc::attention` (decoder.py), so what is exported is our
forward, not transformers' attention code; the op is then lowered to the form the target runs
(plugins/op/lowering.py: ONNX Runtime's fused GroupQueryAttention, opset-23 reference ops, or a
TensorRT plugin node), and the graph must pass `onnx.checker` with full shape inference.

Graph I/O (optimum / onnxruntime-genai names where they exist): `input_ids [batch, sequence_length]`,
`cache_position [batch]`, `past_key_values.{i}.key|value [batch, kv_heads, kv_capacity, head_dim]`
-> `logits`, `present.{i}.key|value` (same shape; see runtime/layout.py for the semantics). A LongRoPE
model's graph (either form) takes `sequence_lengths [batch]` last (runtime/layout.py).
Exported with `torch.onnx.export(dynamo=True)` at opset 23, tracing only the first period of a decoder's
repeating layers and stamping the rest into the graph (stamp.py; the whole decoder is traced when its graph
is not a chain of self-contained layers). Weights go to external data only when the model is too big for one
protobuf (2 GB).
"""

from __future__ import annotations

from pathlib import Path

from llmc.compiler.artifacts import ExportedModel, ModelInfo, hash_outputs, tensor_infos, tool_versions
from llmc.compiler.graph import stamp
from llmc.compiler.graph.files import EXTERNAL_DATA_NAME, EXTERNAL_THRESHOLD, ONNX_NAME, save_model
from llmc.compiler.graph.passes import fuse_skip_rms_norm, simplify
from llmc.compiler.graph.streamed_export import export_streamed
from llmc.compiler.graph.tracing import quiet, trace, trace_stamped, traced
from llmc.compiler.models import MIXTURE_MODEL_TYPES, SUPPORTED_MODEL_TYPES, moe
from llmc.compiler.models.config import attention_shape
from llmc.compiler.models.parallel.heads import tensor_split
from llmc.compiler.source import FoundSource
from llmc.compiler.spec import BuildSpec, Target
from llmc.compiler.spec.sections import KVCacheDtype
from llmc.compiler.stage import Context, Located, Stage
from llmc.compiler.stream.model import StreamedModel
from llmc.errors import ExportError, UnsupportedError
from llmc.plugins.op.lowering import MICROSOFT_DOMAIN, Heads, Lowering, translation_table, trim_unused_outputs
from llmc.runtime.layout import KVLayout
from llmc.runtime.manifest import rank_folder

OPSET = 23


def model_info(model, tokenizer) -> ModelInfo:
    c = model.config
    num_heads, num_kv_heads, head_dim = attention_shape(c)
    eos = c.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return ModelInfo(
        model_type=c.model_type,
        family=SUPPORTED_MODEL_TYPES[c.model_type],
        vocab_size=c.vocab_size,
        num_layers=c.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=c.hidden_size,
        max_position_embeddings=c.max_position_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_ids=eos_ids,
        has_tokenizer=tokenizer is not None,
    )


def kv_layout(info: ModelInfo, lowering: Lowering, kv_cache_dtype: KVCacheDtype = KVCacheDtype.fp32,
              longrope_switch: int | None = None) -> KVLayout:
    """The graph's layout; `longrope_switch`: the decoder's (compiler/models/rope.py), None without LongRoPE."""
    from llmc.compiler.graph.kv_cache import ELEMENT

    if lowering is Lowering.paged:
        layout = KVLayout.paged_layout(info.num_layers, info.num_kv_heads, info.head_dim, dtype=ELEMENT[kv_cache_dtype])
    else:
        assert kv_cache_dtype is KVCacheDtype.fp32, "the spec admits other cache types for the paged lowering only"
        fused = lowering is Lowering.fused
        layout = KVLayout(num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                          in_place=fused, max_prefill_rows=1 if fused else None)
    return layout.model_copy(update={"longrope_switch": longrope_switch}) if longrope_switch is not None else layout


def lowering_refusal(decoder, lowering: Lowering) -> str | None:
    """Why `lowering` cannot express this decoder's attention (None when it can): the build then says
    which feature forces another `export.attention`."""
    sinks = decoder.sinks is not None
    mixture = moe.refusal(lowering.value) if getattr(decoder, "experts", None) else None
    if mixture is not None:
        return f"a mixture of experts: {mixture}"
    if lowering is Lowering.reference and sinks:
        return "attention sinks: opset 23's Attention has no sink input; use `paged` (the default) or `fused`"
    if lowering is Lowering.fused and decoder.head_dim % 16:
        return (f"ONNX Runtime's CPU GroupQueryAttention needs a head size that is a multiple of 16, and this "
                f"model's is {decoder.head_dim}; use `paged` (the default)")
    rotary = decoder.rope.rotary_dim if decoder.rope.fixed else 0  # the tables the op applies
    if lowering is Lowering.fused and rotary % 16:
        return (f"ONNX Runtime's CPU GroupQueryAttention rotates a multiple of 16 channels, and this model rotates "
                f"{rotary} (partial rotary); use `paged` (the default)")
    return None


def export_onnx(model, info: ModelInfo, lowering: Lowering, out_dir: Path,
                external_threshold: int = EXTERNAL_THRESHOLD, kv_cache_dtype: KVCacheDtype = KVCacheDtype.fp32,
                tokenizer=None, rank: int = 0, ranks: int = 1, kv_scales=None,
                progress=None) -> tuple[bool, KVLayout, int]:
    """Write `out_dir/model.onnx` (+ `model.onnx.data` when over the threshold) with attention in
    `lowering`'s form and the paged pools in `kv_cache_dtype` (int8 scales calibrated with `tokenizer`'s
    tokens, compiler/graph/kv_cache.py, unless `kv_scales` gives them); with `ranks` > 1, rank `rank`'s share of
    the model (compiler/models/parallel/shard.py), its pools holding its KV heads. Returns whether weights went
    to external data, the layout, and how many layers were stamped from traced ones (stamp.py)."""
    import onnx

    from llmc.compiler.models import decoder_for
    from llmc.compiler.models.parallel import shard

    streamed = model if isinstance(model, StreamedModel) else None
    decoder = decoder_for(streamed.model if streamed else model)
    refusal = lowering_refusal(decoder, lowering)
    if refusal is not None:
        raise UnsupportedError(f"export.attention: {lowering.value} cannot export {info.model_type}: {refusal}")
    if streamed is not None:
        return _export_streamed(streamed, decoder, info, lowering, out_dir, kv_cache_dtype, rank, ranks, progress)
    if ranks > 1:
        decoder = shard.shard(decoder, rank, ranks)
        info = info.model_copy(update={"num_heads": decoder.num_heads, "num_kv_heads": decoder.num_kv_heads})
    layout = kv_layout(info, lowering, kv_cache_dtype, decoder.rope.switch)
    traced_layout = layout.model_copy(update={"dtype": "float32"})
    module, inputs, shapes, in_names = traced(decoder, info, traced_layout)
    out_names = ["logits", *layout.present_names()]
    table = translation_table(lowering, Heads(info.num_heads, info.num_kv_heads, info.head_dim))
    period = stamp.layer_period(decoder)
    program = stamped = None
    if period is not None:
        program, stamped = trace_stamped(decoder, period, module, info, traced_layout, table, in_names, out_names,
                                         OPSET)
    if program is None:
        program = trace(info, module, inputs, shapes, in_names, out_names, table, OPSET, optimize=True)
    with quiet()[0]:
        simplify(program.model)  # onnx_ir passes: quiet too
    proto = program.model_proto
    _fuse(proto, lowering)
    if layout.paged and layout.dtype != "float32":
        _retype_pools(proto, decoder, info, layout, tokenizer, kv_scales)
    external = save_model(proto, out_dir, external_threshold)
    _check_graph(out_dir / ONNX_NAME)
    return external, layout, stamped or 0


def _fuse(proto, lowering: Lowering) -> None:
    """What runs on the proto before it is saved: unused outputs trimmed, norms fused with their residual add."""
    trim_unused_outputs(proto.graph)
    if lowering in (Lowering.fused, Lowering.paged):  # both run on ONNX Runtime, which has the fused op
        if fuse_skip_rms_norm(proto.graph) and not any(o.domain == MICROSOFT_DOMAIN for o in proto.opset_import):
            proto.opset_import.add(domain=MICROSOFT_DOMAIN, version=1)


def _check_graph(path: Path) -> None:
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as err:
        raise ExportError(f"{path}: the exported graph fails onnx.checker: {err}") from err


def _export_streamed(streamed: StreamedModel, decoder, info: ModelInfo, lowering: Lowering, out_dir: Path,
                     kv_cache_dtype: KVCacheDtype, rank: int, ranks: int, progress) -> tuple[bool, KVLayout, int]:
    """export_onnx for a streamed model (graph/streamed_export.py): the first period of layers loaded and traced,
    every later layer read from the checkpoint as the graph's weights are written; split, rank `rank`'s share."""
    import onnx

    if kv_cache_dtype is KVCacheDtype.int8:
        raise UnsupportedError("export.kv_cache_dtype: int8 (its scales run the whole model) cannot be built layer "
                               "by layer yet; set `source.load: whole`")
    if ranks > 1:  # the rank's heads (shard.shard's split; the shard itself is cut in export_streamed)
        split = tensor_split(info.num_heads, info.num_kv_heads, ranks)
        info = info.model_copy(update={"num_heads": split.heads, "num_kv_heads": split.kv_heads})
    layout = kv_layout(info, lowering, kv_cache_dtype, decoder.rope.switch)
    table = translation_table(lowering, Heads(info.num_heads, info.num_kv_heads, info.head_dim))
    proto, stamped = export_streamed(streamed, decoder, info, layout, table, OPSET, out_dir, progress, rank, ranks)
    _fuse(proto, lowering)
    onnx.save_model(proto, out_dir / ONNX_NAME)
    _check_graph(out_dir / ONNX_NAME)
    return True, layout, stamped


def _retype_pools(proto, decoder, info: ModelInfo, layout: KVLayout, tokenizer, scales=None) -> None:
    """The exported float32 pools given `layout.dtype` (and, for int8, `scales` or scales measured on
    calibration text)."""
    from llmc.compiler.graph import kv_cache

    if layout.dtype == "int8" and scales is None:
        scales = int8_scales(decoder, layout, tokenizer, info.vocab_size)
    kv_cache.retype_pools(proto, layout, scales if layout.dtype == "int8" else None)


def int8_scales(decoder, layout: KVLayout, tokenizer, vocab_size: int):
    """int8 pools' scales [layers, 2, kv_heads, 1, head_dim], measured by running `decoder` on calibration text."""
    from llmc.compiler.graph import kv_cache

    windows = kv_cache.calibration_windows(tokenizer, vocab_size)
    return kv_cache.pool_scales(decoder, layout, windows, decoder.rope.rotary_dim)


def _split_int8_scales(model, info: ModelInfo, lowering: Lowering, tokenizer, ranks: int) -> list:
    """Each rank's int8 pool scales: the whole model's, measured once, cut to the rank's KV heads."""
    from llmc.compiler.models import decoder_for

    decoder = decoder_for(model)
    scales = int8_scales(decoder, kv_layout(info, lowering, KVCacheDtype.int8, decoder.rope.switch), tokenizer,
                         info.vocab_size)
    split = tensor_split(info.num_heads, info.num_kv_heads, ranks)
    return [scales[:, :, list(split.kv_range(r))] for r in range(ranks)]


def export(model, tokenizer, out_dir: Path, *, lowering: Lowering, source_hash: str, inputs_hash: str,
           external_threshold: int = EXTERNAL_THRESHOLD, kv_cache_dtype: KVCacheDtype = KVCacheDtype.fp32,
           ranks: int = 1, progress=None) -> ExportedModel:
    """Export `model` (a PyTorch model, or a stream.model.StreamedModel read layer by layer) into `out_dir` with
    attention lowered as `lowering` (split over `ranks`: one graph per rank, in rank{r}/; a streamed model's stream
    read once per rank), and describe the result. `progress(done, total, what)`: a streamed export's layers read
    and written."""
    import onnx

    info = model_info(model, tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    files, scales, stamped = [], None, 0
    if ranks > 1 and kv_cache_dtype is KVCacheDtype.int8 and not isinstance(model, StreamedModel):
        # measured once on the whole model, each rank's heads cut (a streamed model's export refuses int8)
        scales = _split_int8_scales(model, info, lowering, tokenizer, ranks)
    for rank in range(ranks):
        folder = rank_folder(rank, ranks)
        (out_dir / folder).mkdir(exist_ok=True)
        external, layout, stamped = export_onnx(model, info, lowering, out_dir / folder, external_threshold,
                                                kv_cache_dtype, tokenizer, rank, ranks,
                                                None if scales is None else scales[rank], progress)
        files += [str(Path(folder) / n) for n in [ONNX_NAME] + ([EXTERNAL_DATA_NAME] if external else [])]
    graph = onnx.load(str(out_dir / rank_folder(0, ranks) / ONNX_NAME), load_external_data=False).graph
    artifact = ExportedModel(
        inputs_hash=inputs_hash, files=hash_outputs(out_dir, files), onnx=ONNX_NAME, opset=OPSET,
        source_hash=source_hash, model=info, lowering=lowering, kv_layout=layout,
        inputs=tensor_infos(graph.input), outputs=tensor_infos(graph.output), external_data=external,
        versions=tool_versions(), tensor_parallel=ranks, stamped_layers=stamped,
    )
    artifact.save(out_dir)
    return artifact


# the export stage: the found checkpoint -> ONNX with an explicit KV cache

def export_key(spec: BuildSpec, ctx: Context) -> dict:
    """What keys an export besides the checkpoint and the code (the draft stage's key holds it too)."""
    return {"lowering": spec.attention_lowering, "precision": spec.precision.value,
            "kv_cache_dtype": spec.export.kv_cache_dtype.value,
            "versions": tool_versions(), "opset": OPSET, "external_threshold": ctx.external_threshold,
            **({"tensor_parallel": spec.parallel.tensor} if spec.parallel.tensor > 1 else {})}


def _run(source: Located[FoundSource], section: tuple[Lowering, KVCacheDtype, int], ctx: Context) -> ExportedModel:
    model, tokenizer = ctx.model()
    lowering, kv_cache_dtype, ranks = section
    return export(model, tokenizer, ctx.out, lowering=lowering, source_hash=ctx.source_hash,
                  inputs_hash=ctx.inputs_hash, external_threshold=ctx.external_threshold, kv_cache_dtype=kv_cache_dtype,
                  ranks=ranks, progress=ctx.progress)


def _summary(done: Located[ExportedModel]) -> str:
    art = done.artifact
    size = sum((done.folder / f).stat().st_size for f in art.files) / 2**20
    pools = f", {art.kv_layout.dtype} KV pools" if art.kv_layout.paged else ""
    split = f", split over {art.tensor_parallel} ranks" if art.tensor_parallel > 1 else ""
    layers = f"{art.model.num_layers} layers" + (f" ({art.stamped_layers} stamped)" if art.stamped_layers else "")
    return (f"{art.onnx}, opset {art.opset}, {layers}, {art.lowering.value} attention{pools}"
            f"{split}, {size:.1f} MiB")


def _check(spec: BuildSpec, source) -> None:
    """A mixture of experts on a lowering without an expert op and a split the model's heads do not allow are refused
    before anything loads (adapters are checked by the package stage's check: compiler/lora/package.py)."""
    if spec.parallel.tensor > 1:
        from llmc.compiler.models.config import read_config
        from llmc.compiler.models.parallel.heads import check_split

        try:
            check_split(read_config(source), spec.parallel.tensor)
        except ValueError as err:
            raise UnsupportedError(str(err)) from None
    reason = moe.refusal(spec.attention_lowering) if source.model_type in MIXTURE_MODEL_TYPES else None
    if reason is not None:
        field = "target: tensorrt" if spec.target is Target.tensorrt else f"export.attention: {spec.attention_lowering}"
        raise UnsupportedError(f"{field} cannot build {source.model_type}, a mixture of experts: {reason}")


EXPORT = Stage("export", describe=lambda spec: "exporting to ONNX", takes=("source",), artifact=ExportedModel,
               section=lambda spec: (Lowering(spec.attention_lowering), spec.export.kv_cache_dtype,
                                     spec.parallel.tensor),
               key=export_key, check=_check, run=_run, summary=_summary, loads_model=True)
