"""The spec's adapters into the model repository (the package stage, compiler/repository/package.py): checked against
the base before any stage works (`check_adapters_spec`), then packaged (`package_adapters`):

    <version>/model_lora.onnx               the served graph with a branch beside each site (graph.py): the same
                                            initializers as the base graph, whose weights file it names, so both
                                            sessions map one data file
    <version>/adapters/<name>.safetensors   each adapter per site, ready to stack (stacks.py, runtime/lora/files.py),
                                            its name and digest in the header
    manifest.json `lora`                    the LoRA graph, the site table, each adapter's identity and file, the limits

Both steps read the base model's modules from a model built from the checkpoint's config on the meta device (no
weights: the package stage runs after the PyTorch weights have left, and a streamed build never held them whole).
The sites come from the fp32 export's graph (its node scopes); the branch goes into the graph that is served (the
export, or its weight-only form: quantization keeps the sites' tensor names).

    <version>/lora_scales.safetensors       a base AWQ scaled (weight-only modes' default): per site, what an adapter's
                                            arrays are multiplied by (fold.py), folded into the files above already

What is not served yet is refused here, naming the field: Q/DQ graphs (SmoothQuant's int8, fp8), speculative
decoding, tensor parallelism. A TensorRT engine is built with the branch (compiler/tensorrt/stage.py), so it is the
manifest's LoRA graph and no model_lora.onnx is written. The slot lowerings (export.attention: fused or reference)
are served by the slot engine, the paged graph by the paged engine.
"""

from __future__ import annotations

from pathlib import Path

from llmc.compiler.lora.adapter import Adapter, read_adapter, weight_digest
from llmc.compiler.lora.base import BaseLinears, check_against, tied_head
from llmc.compiler.lora.experts import expert_params
from llmc.compiler.lora.fold import FILENAME as FOLD_FILE
from llmc.compiler.lora.fold import Fold
from llmc.compiler.lora.graph import add_lora_branches
from llmc.compiler.lora.sites import HEAD, find_sites, module_members
from llmc.compiler.lora.stacks import site_arrays
from llmc.compiler.quantize.channel_scales import ChannelScales
from llmc.errors import UnsupportedError
from llmc.runtime.lora.files import write_adapter_file
from llmc.runtime.manifest import AdapterInfo, LoraConfig

ADAPTERS_DIR = "adapters"  # in the version folder


def lora_file(model_file: str) -> str:
    """The LoRA graph's file beside the base graph's: model.onnx -> model_lora.onnx."""
    path = Path(model_file)
    return str(path.with_name(f"{path.stem}_lora{path.suffix}"))


def refusal(spec) -> str | None:
    """Why `spec`'s adapters cannot be served by this llmc (None: they can), naming the field."""
    from llmc.compiler.spec.sections import QuantMode

    q = spec.quantization
    if q.mode in (QuantMode.int8, QuantMode.fp8):  # before the lowering: these modes need the reference one
        return (f"quantization.mode: {q.mode.value}: adapters are not served on Q/DQ graphs yet; use mode none, "
                f"int8-weight-only or int4-weight-only")
    if spec.speculative is not None:
        return "speculative: speculative decoding is not served with adapters yet; remove `speculative:`"
    if spec.parallel.tensor > 1:
        return "parallel.tensor: tensor parallelism is not served with adapters yet; set parallel.tensor: 1"
    return None


def meta_model(source):
    """The checkpoint's transformers model built from its config on the meta device: its modules, no weights."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from llmc.compiler.models.config import read_config

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(read_config(source), dtype=torch.float32)


def head_digest(source, hf_model) -> str | None:
    """The weight_digest of the checkpoint's untied LM head (None: tied, or no head), read from its files alone."""
    from llmc.compiler.stream.tensors import checkpoint_tensors

    head = hf_model.get_output_embeddings()
    if head is None or tied_head(hf_model):
        return None
    name = next(n for n, m in hf_model.named_modules() if m is head)
    tensors = checkpoint_tensors(source)
    keys = [k for k in tensors.keys() if k == f"{name}.weight" or k.endswith(f".{name}.weight")]
    if len(keys) != 1:
        raise UnsupportedError(f"{source.path}: no single tensor {name}.weight for the untied LM head "
                               f"(found {keys or 'none'}); adapters on it cannot be checked")
    return weight_digest(tensors.load(keys[0]))


def checked_adapters(spec, source, hf_model, for_manifest: bool = False) -> tuple[list[Adapter], str | None]:
    """Each adapter of `spec` read (PEFT's semantics, lora.max_rank) and checked against the base `hf_model`, and
    the untied LM head's weight digest, read from `source` when an adapter's copy of the head is checked against it
    or, `for_manifest`, for the manifest to keep for adapters loaded at run time (None when not read)."""
    if refusal(spec) is not None:
        raise UnsupportedError(f"adapters: {', '.join(spec.adapters)}: {refusal(spec)}")
    experts = expert_params(hf_model)
    served = {m.module for members in module_members(hf_model).values() for m in members}
    served |= {p.key for listed in experts.values() for p in listed}
    adapters = [read_adapter(name, folder, max_rank=spec.lora.max_rank, experts=experts)
                for name, folder in spec.adapters.items()]
    wanted = any(a.copies for a in adapters) or (for_manifest and HEAD in served)
    digest = head_digest(source, hf_model) if wanted else None
    base = BaseLinears.of(hf_model, digest)
    for adapter in adapters:
        check_against(adapter, base, served)
    return adapters, digest


def check_adapters_spec(spec, source) -> None:
    """The package stage's precondition, checked before any stage works: the spec's adapters can be served."""
    if spec.adapters:
        checked_adapters(spec, source, meta_model(source))


def package_adapters(spec, source, export_graph: Path, served_graph: Path, model_file: str,
                     version_dir: Path, channel_scales: Path | None = None) -> LoraConfig:
    """The LoRA graph, the adapters' files and the manifest's `lora` section for `spec`'s adapters; `export_graph`:
    the fp32 export (where the sites are found), `served_graph`: the graph the base serves (its `model_file`),
    `channel_scales`: what AWQ's scaling did to the served graph's activations (quantize/channel_scales.py)."""
    import onnx

    hf_model = meta_model(source)
    adapters, digest = checked_adapters(spec, source, hf_model, for_manifest=True)
    sites = find_sites(onnx.load(str(export_graph), load_external_data=False), hf_model)
    fold = Fold.of(sites, ChannelScales.load(channel_scales)) if channel_scales is not None else Fold()
    scales_file = None
    if fold:
        scales_file = FOLD_FILE
        (version_dir / scales_file).write_bytes(fold.to_bytes())
    from llmc.compiler.spec.sections import Target

    name = model_file  # a TensorRT engine was built with the branch (compiler/tensorrt/stage.py): it is the LoRA graph
    if spec.target is not Target.tensorrt:
        graph = onnx.load(str(served_graph), load_external_data=False)  # its weights stay in the data file it names
        add_lora_branches(graph, sites)
        name = lora_file(model_file)
        onnx.save(graph, str(version_dir / name))
    (version_dir / ADAPTERS_DIR).mkdir()
    infos = []
    for adapter in adapters:
        file = f"{ADAPTERS_DIR}/{adapter.name}.safetensors"
        write_adapter_file(version_dir / file, site_arrays(sites, adapter, fold))
        infos.append(AdapterInfo(name=adapter.name, digest=adapter.digest, file=file, rank=adapter.max_rank))
    return LoraConfig(lora_file=name, sites=sites, adapters=infos, max_slots=spec.lora.max_slots,
                      max_rank=spec.lora.max_rank, max_host_adapters=spec.lora.max_host_adapters,
                      scales_file=scales_file, head_digest=digest)
