"""The tensorrt stage over artifacts: the exported (or quantized) model in, an EngineModel out.

    prepare (prep.py: AutoCast to the spec's precision) -> build (engine.py) -> compare with ONNX
    Runtime (verify_engine.py) -> <out_dir>/model.plan + engine.json

A split model (parallel.tensor: N) gives N engines, <out_dir>/rank{r}/model.plan, one per rank graph, built one
after another; the check runs them together (one GPU each, NCCL) against the whole model's fused export.

`check(spec)` refuses, before any work, a TensorRT build on a machine that lacks what it needs;
`cache_key_parts(spec)` is what the stage's cache key holds besides its inputs' files and its code
(derived from its imports): the spec sections, TensorRT's version, the GPU; `summary(engine)` is its line in the
build report; `TENSORRT` declares the stage with them. The pipeline decides the folders and when to reuse.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Callable

from llmc.compiler.artifacts import EngineModel, ExportedModel, QuantizedModel, hash_outputs
from llmc.compiler.lora.adapter import adapter_files
from llmc.compiler.spec import BuildSpec, Target
from llmc.compiler.stage import Context, Located, Stage
from llmc.errors import UnsupportedError

LAYOUT_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# what the build imports besides TensorRT, and the llmc extra that installs it
NEEDED_MODULES = (("modelopt.onnx.autocast", "quantize"), ("polygraphy", "quantize"), ("triton", "kernels"),
                  ("cuda", "tensorrt"))


def tensorrt_missing() -> str | None:
    """What this machine lacks to build TensorRT engines (None: TensorRT and a CUDA GPU are here)."""
    import importlib.util

    missing = []
    if importlib.util.find_spec("tensorrt") is None:
        missing.append("TensorRT (the `tensorrt` Python package)")
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if not gpu:
        missing.append("an NVIDIA GPU")
    return " and ".join(missing) or None


def check(spec: BuildSpec) -> None:
    """Refuse a TensorRT build this machine cannot make, before any work (nothing to check for
    other targets)."""
    if spec.target is not Target.tensorrt:
        return
    missing = tensorrt_missing()
    if missing:
        raise UnsupportedError(
            f"target: tensorrt needs {missing}, which this machine lacks; build with target: onnxruntime "
            "here (`llmc build --dry-run` shows what a TensorRT build would make; `llmc export` writes its ONNX)")
    for module, extra in NEEDED_MODULES:
        try:
            __import__(module)
        except ImportError:
            raise UnsupportedError(f"target: tensorrt needs {module}; install llmc with the `{extra}` "
                                   "extra") from None
    ranks = spec.parallel.tensor
    if ranks > 1 and spec.verify.enabled:
        import torch

        gpus = torch.cuda.device_count()
        if gpus < ranks:
            raise UnsupportedError(
                f"parallel.tensor: {ranks}: the tensorrt stage's check runs the {ranks} rank engines together, one GPU "
                f"each, and this machine has {gpus}; build where {ranks} GPUs are visible, or set verify.enabled: "
                "false (the rank engines are then built one after another and not run)")


def cache_key_parts(spec: BuildSpec) -> dict:
    """The engine's cache key besides its inputs' files and its code: precision, the spec sections the
    stage reads, TensorRT's version and the GPU (an engine runs on the GPU it was built for)."""
    import tensorrt

    from llmc.runtime.runners.trt import gpu_identity

    return {"precision": spec.precision.value, "spec": spec.section_hash("tensorrt", "limits", "verify", "lora"),
            "adapters": adapter_files(spec), "tensorrt": tensorrt.__version__, "gpu": gpu_identity()}


def carry_timing_cache(spec: BuildSpec, previous: Path, staging: Path) -> Path | None:
    """The timing cache the build reads and writes back (None: tensorrt.timing_cache is off): the
    last build's engine folder `previous` keeps it; it is copied into the new one, `staging`, and
    rides along with the engine from there (a reused engine's folder is linked whole)."""
    from llmc.compiler.tensorrt.engine import TIMING_CACHE

    if not spec.tensorrt.timing_cache:
        return None
    staging.mkdir(parents=True, exist_ok=True)
    if (previous / TIMING_CACHE).is_file():
        shutil.copyfile(previous / TIMING_CACHE, staging / TIMING_CACHE)
    return staging / TIMING_CACHE


def engine_lora(spec: BuildSpec, source_info, exported: ExportedModel, export_dir: Path):
    """The spec's adapters as the engine takes them (verify_engine.EngineLora), or None without adapters: read and
    checked against the base (compiler/lora/package.py), the sites found on the export's graph."""
    if not spec.adapters:
        return None
    import onnx

    from llmc.compiler.lora.package import checked_adapters, meta_model
    from llmc.compiler.lora.sites import find_sites
    from llmc.compiler.lora.stacks import site_arrays
    from llmc.compiler.tensorrt.verify_engine import EngineLora

    hf = meta_model(source_info)
    adapters, _ = checked_adapters(spec, source_info, hf)
    sites = find_sites(onnx.load(str(export_dir / exported.onnx), load_external_data=False), hf)
    return EngineLora(sites, spec.lora.max_slots, spec.lora.max_rank, {a.name: site_arrays(sites, a) for a in adapters})


def make_engine(source: ExportedModel | QuantizedModel, source_dir: Path, exported: ExportedModel, spec: BuildSpec,
                out_dir: Path, *, inputs_hash: str, load_model: Callable[[], tuple], source_hash: str,
                timing_cache: Path | None = None, progress: Callable[[int, int], None] | None = None,
                lora=None) -> EngineModel:
    """Build `out_dir/model.plan` from `source` (in `source_dir`; `exported` is the export it
    comes from) and, when verify is enabled, compare it with ONNX Runtime. `load_model` returns
    (torch model, tokenizer) and is called only for that comparison. A split export (parallel.tensor > 1;
    the spec admits the plain export only) gives one engine per rank graph, `out_dir/rank{r}/model.plan`, each
    with the rank's KV heads in its profiles and its collectives checked; the verify runs them together. `lora`
    (engine_lora): the engine is built with the LoRA branch beside each site, its inputs in the profiles, and the
    check compares each adapter too."""
    from llmc.compiler.tensorrt.collectives import expected_collectives
    from llmc.compiler.tensorrt.engine import ENGINE_NAME, build_engine
    from llmc.compiler.tensorrt.prep import prepare_for_tensorrt
    from llmc.compiler.tensorrt.profiles import profiles
    from llmc.compiler.tensorrt.split_kv import SplitBuffers, build_gpu_sms
    from llmc.runtime.manifest import rank_folder

    ranks = exported.tensor_parallel
    assert ranks == 1 or isinstance(source, ExportedModel), "a split model reaches the engine unquantized (the spec)"
    graphs = exported.graphs(source_dir) if ranks > 1 else [source_dir / source.onnx]
    precision = spec.precision.value
    kv_heads = source.kv_layout.num_kv_heads if ranks > 1 else exported.model.num_kv_heads  # a rank's share
    split = SplitBuffers(spec.limits.max_seq_len, exported.model.head_dim, build_gpu_sms()) \
        if exported.lowering.value == "plugin" else None  # the attention plugins' key-split buffers
    shapes = profiles(spec.limits, kv_heads, exported.model.head_dim, source.kv_layout.step_inputs,
                      lora.runner if lora else None, split.shapes() if split else None)
    plans, info = [], None
    for rank, graph in enumerate(graphs):
        folder = out_dir / rank_folder(rank, ranks)
        prepared = prepare_for_tensorrt(graph, precision, folder / "prepared", lora.sites if lora else None, split)
        info = build_engine(prepared, shapes, spec.tensorrt, precision, folder, timing_cache, progress=progress,
                            collectives=expected_collectives(prepared))
        shutil.rmtree(folder / "prepared")  # the engine holds the weights
        plans.append(str(Path(rank_folder(rank, ranks)) / ENGINE_NAME))
    layout = source.kv_layout.model_copy(update={"dtype": LAYOUT_DTYPES[precision], "max_prefill_rows": 1,
                                                 "in_place": exported.lowering.value == "plugin"})
    verified = ""
    if spec.verify.enabled:
        from llmc.compiler.tensorrt.verify_engine import reference_graph, verify_engine

        torch_model, tokenizer = load_model()
        scratch = out_dir / "reference"
        reference = reference_graph(source, source_dir, exported, torch_model, tokenizer, scratch, source_hash)
        with _lora_reference(reference, lora, torch_model, out_dir) as (reference, lora):
            verified = verify_engine([out_dir / plan for plan in plans], layout, info, reference, tokenizer,
                                     exported.model.vocab_size, spec, progress, lora)
        if scratch.is_dir():  # the plugin lowering's fused stand-in
            shutil.rmtree(scratch)
    engine = EngineModel(inputs_hash=inputs_hash, files=hash_outputs(out_dir, plans), plan=ENGINE_NAME,
                         kv_layout=layout, tensorrt=info, verified=verified, tensor_parallel=ranks)
    engine.save(out_dir)
    return engine


@contextlib.contextmanager
def _lora_reference(reference: tuple[Path, object], lora, torch_model, folder: Path):
    """(`reference`, `lora`) as the engine check takes them: with adapters, the reference graph with the same branch
    (compiler/lora/graph.py: lora_graph; its sites found on it, the engine's by name) for the block's length."""
    if lora is None:
        yield reference, None
        return
    import dataclasses

    import onnx

    from llmc.compiler.lora.sites import find_sites
    from llmc.compiler.lora.graph import lora_graph

    sites = find_sites(onnx.load(str(reference[0]), load_external_data=False), torch_model)
    if {(s.name, s.in_features, s.out_features, s.members) for s in sites} != \
            {(s.name, s.in_features, s.out_features, s.members) for s in lora.sites}:
        raise UnsupportedError(f"the ONNX Runtime reference graph {reference[0].name} has other LoRA sites than the "
                               f"engine's graph; its adapters cannot be compared")
    with lora_graph(reference[0], sites, folder) as graph:
        yield (graph, reference[1]), dataclasses.replace(lora, reference_sites=sites)


def summary(engine: EngineModel) -> str:
    """The tensorrt stage's line in the build report."""
    t = engine.tensorrt
    ranks = f" x {engine.tensor_parallel} ranks (rank{{r}}/)" if engine.tensor_parallel > 1 else ""
    return (f"{engine.plan}{ranks}: TensorRT {t.version}, {t.gpu} (sm {t.compute_capability}), {t.precision}, "
            f"profiles {', '.join(t.profiles)}" + (f"; {engine.verified}" if engine.verified else ""))


def _run(source: Located, spec: BuildSpec, ctx: Context) -> EngineModel:
    """From the quantized graph when there is one, else the export; the export's model (declared in `takes`)
    either way."""
    exported = ctx.done["export"]
    return make_engine(source.artifact, source.folder, exported.artifact, spec, ctx.out,
                       inputs_hash=ctx.inputs_hash, load_model=ctx.model, source_hash=ctx.source_hash,
                       timing_cache=carry_timing_cache(spec, ctx.previous, ctx.out), progress=ctx.progress,
                       lora=engine_lora(spec, ctx.source, exported.artifact, exported.folder))


TENSORRT = Stage("tensorrt", describe=lambda spec: f"building the TensorRT engine ({spec.precision.value})",
               takes=("quantize", "export"), artifact=EngineModel, applies=lambda spec: spec.target is Target.tensorrt,
               key=lambda spec, ctx: cache_key_parts(spec), check=lambda spec, source: check(spec),
               run=_run, summary=lambda done: summary(done.artifact), loads_model=True)
