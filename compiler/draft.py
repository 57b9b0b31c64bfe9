"""The draft stage (`speculative.method: draft`): the draft model, as a paged graph beside the target's.

    separate checkpoint (draft.source):  check its tokenizer against the target's -> export (the paged
                                         lowering, the target's block size and kv_cache_dtype) -> verify
                                         (the build's verify section) -> quantize (draft.quantization, if any)
    self-draft (no draft.source):        the target's paged export quantized with draft.quantization; a split
                                         target's (parallel.tensor) checkpoint is exported whole first, and
                                         verified: the draft runs unsplit, in the leader's process

Each step is the library function the target's stages use (export.export, verify.verify,
quantize.quantize); the stage writes them under its folder (`export/`, `verify/`, the quantized graph
at its top) and records the graph the runtime loads in a `DraftArtifact`; `DRAFT` declares the stage. The package stage copies
that graph into the version folder's `draft/` and names it in the manifest (runtime/manifest.py
DraftModel). The draft's quality report (perplexity, agreement, speed against its unquantized form)
is measured and reported, not gated: a worse draft costs acceptance, never correctness.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from llmc.compiler import quantize
from llmc.compiler.artifacts import DraftArtifact, ExportedModel
from llmc.compiler.graph import export, files, verify
from llmc.compiler.models.config import read_config
from llmc.compiler.source import SourceInfo, inspect_source, load_model, load_tokenizer
from llmc.compiler.spec import BuildSpec, DraftSpec, QuantMode, SpeculativeMethod
from llmc.compiler.stage import Context, Located, Stage
from llmc.errors import SourceError, VerifyError
from llmc.plugins.op.lowering import Lowering

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def tokenizer_file(info: SourceInfo) -> Path:
    """The file a checkpoint's tokenizer comes from (what a mismatch names)."""
    if info.kind == "gguf":
        return info.path
    return next((info.path / n for n in TOKENIZER_FILES if (info.path / n).is_file()), info.path / TOKENIZER_FILES[0])


def check(spec: BuildSpec, target: SourceInfo) -> None:
    """Before any work: the draft checkpoint exists and has the target's vocabulary (the same token
    ids for the same strings, the same end ids, the same model vocabulary size), and the draft's
    quantization can run."""
    section = spec.speculative.draft
    if section.source is None:
        quantize.check(section.quantization, target)
        return
    info = inspect_draft(section)
    check_same_vocabulary(target, info)
    quantize.check(section.quantization, info)


def inspect_draft(section: DraftSpec) -> SourceInfo:
    """The separate draft checkpoint, found; a problem with it names the field (speculative.draft.source...)."""
    try:
        return inspect_source(section.source)
    except SourceError as err:
        raise SourceError(f"speculative.draft.{err}") from None


def check_same_vocabulary(target: SourceInfo, draft: SourceInfo) -> None:
    """Refuse a draft whose tokenizer or vocabulary differs from the target's, naming both files."""
    target_tok, draft_tok = load_tokenizer(target), load_tokenizer(draft)
    where = f"{tokenizer_file(draft)} (draft) and {tokenizer_file(target)} (target)"
    if target_tok is None or draft_tok is None:
        raise SourceError(f"{where}: both checkpoints need a tokenizer to compare (the draft must share the "
                          f"target's); {'the draft' if draft_tok is None else 'the target'} has none")
    ours, theirs = draft_tok.get_vocab(), target_tok.get_vocab()
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
        raise SourceError(f"{where}: the draft's vocabulary differs from the target's ({len(ours)} vs {len(theirs)} "
                          f"tokens; first differences {differ}); a draft must use the target's tokenizer")
    ends = (draft_tok.eos_token_id, target_tok.eos_token_id)
    if ends[0] != ends[1]:
        raise SourceError(f"{where}: the end-of-sequence ids differ (draft {ends[0]}, target {ends[1]})")
    sizes = (read_config(draft).vocab_size, read_config(target).vocab_size)
    if sizes[0] != sizes[1]:
        raise SourceError(f"{draft.path} (draft) and {target.path} (target): the models' vocab_size differ "
                          f"({sizes[0]} vs {sizes[1]}); the rejection rule compares their distributions id by id")


def cache_key_parts(spec: BuildSpec, export_key: dict, verify_key: dict) -> dict:
    """What keys the draft besides the target's export and the code: its section, its
    checkpoint's content hash (a separate draft), what keys an export and a verify, and the quantize
    stage's tools."""
    section = spec.speculative.draft
    key = {"draft": section.model_dump(mode="json", exclude={"quantization": {"max_perplexity_increase"}}),
           "quantize": quantize.cache_key_parts(section.quantization)
           if section.quantization.mode is not QuantMode.none else None}
    if section.source is not None:
        key.update(source_hash=inspect_source(section.source).content_hash(), export=export_key,
                   verify=verify_key if spec.verify.enabled else None)
    return key


def make_draft(target: ExportedModel, target_dir: Path, target_source: SourceInfo, spec: BuildSpec, out: Path, *,
               inputs_hash: str, num_threads: int = 0, external_threshold: int = files.EXTERNAL_THRESHOLD,
               progress: Callable[[int, int], None] | None = None) -> DraftArtifact:
    """Make the draft graph in `out` (the stage's folder) and describe it."""
    section: DraftSpec = spec.speculative.draft
    out.mkdir(parents=True, exist_ok=True)
    verified = ""
    if section.source is None and target.tensor_parallel == 1:
        graph, graph_dir, tokenizer, name, source_hash = target, target_dir, load_tokenizer(target_source), "self", \
            target.source_hash
    else:  # a separate checkpoint, or a split target's own checkpoint exported whole: the draft runs unsplit
        info = inspect_source(section.source) if section.source is not None else target_source
        model, tokenizer = load_model(info)
        name = info.path.name if section.source is not None else "self"
        source_hash, graph_dir = info.content_hash(), out / "export"
        graph = export.export(model, tokenizer, graph_dir, lowering=Lowering.paged, source_hash=source_hash,
                              inputs_hash=inputs_hash, external_threshold=external_threshold,
                              kv_cache_dtype=spec.export.kv_cache_dtype)
        if spec.verify.enabled:
            report = verify.verify(graph, graph_dir, model, tokenizer, out / "verify", inputs_hash=inputs_hash,
                                   steps=spec.verify.decode_steps, tolerance=spec.verify.max_logit_diff,
                                   num_threads=num_threads, progress=progress)
            if not report:
                raise VerifyError(f"speculative.draft ({info.path}): verification failed: {verify.summary(report)}")
            verified = verify.summary(report)
        del model
    if graph.kv_layout.block_size != target.kv_layout.block_size:
        raise VerifyError(f"speculative.draft: its KV blocks hold {graph.kv_layout.block_size} tokens and the "
                          f"target's {target.kv_layout.block_size}; the draft reads the target's block tables")
    quality = None
    if section.quantization.mode is not QuantMode.none:
        quantized = quantize.quantize(graph, graph_dir, out, section.quantization, tokenizer, inputs_hash=inputs_hash,
                                      num_threads=num_threads, external_threshold=external_threshold,
                                      progress=progress)
        onnx, files, layout, quality = quantized.onnx, quantized.files, quantized.kv_layout, quantized.report
    else:  # a separate checkpoint kept as exported (in export/)
        onnx, layout = f"export/{graph.onnx}", graph.kv_layout
        files = {f"export/{n}": h for n, h in graph.files.items()}
    art = DraftArtifact(inputs_hash=inputs_hash, files=files, onnx=onnx, kv_layout=layout, source=name,
                        source_hash=source_hash, quantization=section.quantization.mode, verified=verified,
                        quality=quality)
    art.save(out)
    return art


def summary(art: DraftArtifact) -> str:
    what = "the target" if art.source == "self" else art.source
    parts = [f"{what}, {art.quantization.value}" if art.quantization is not QuantMode.none else what]
    if art.verified:
        parts.append(art.verified)
    if art.quality is not None:
        r = art.quality
        parts.append(f"perplexity {r.perplexity_reference:.2f} -> {r.perplexity_quantized:.2f} "
                     f"({r.perplexity_increase:+.1%}), greedy agreement {r.token_agreement:.0%}, decode "
                     f"{r.decode_speedup()}" + (" its unquantized form" if r.decode_tok_s_reference else ""))
    return "; ".join(parts)


# the draft stage: reads speculative.draft, and export.kv_cache_dtype and verify for a separate checkpoint

def _drafts(spec: BuildSpec) -> bool:
    return spec.speculative is not None and spec.speculative.method is SpeculativeMethod.draft


def _run(exported: Located[ExportedModel], spec: BuildSpec, ctx: Context) -> DraftArtifact:
    return make_draft(exported.artifact, exported.folder, ctx.source, spec, ctx.out, inputs_hash=ctx.inputs_hash,
                      num_threads=ctx.num_threads, external_threshold=ctx.external_threshold, progress=ctx.progress)


def _describe(spec: BuildSpec) -> str:
    d = spec.speculative.draft
    what = f"exporting {d.source.path.name}" if d.source is not None else "the target"
    return what + (f", quantizing ({d.quantization.mode.value})" if d.quantization.mode is not QuantMode.none else "")


# what makes a draft: this module and what the export, verify and quantize stages run
DRAFT = Stage("draft", describe=_describe, takes=("export",), artifact=DraftArtifact, applies=_drafts,
              key=lambda spec, ctx: cache_key_parts(spec, export.export_key(spec, ctx), verify.verify_key(spec, ctx)),
              check=check, run=_run, summary=lambda done: summary(done.artifact))
