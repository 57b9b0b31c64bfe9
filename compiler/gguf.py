"""GGUF sources: which files llmc accepts, read without loading weights.

A `.gguf` loads through transformers' GGUF reader (weights dequantized to fp32; compiler/source.py).
Accepted are the architectures of a supported family that the installed transformers reads
(compiler/models/config.py's `GGUF_ARCHITECTURES`); a file whose stated head size, rotary width,
softcaps or RoPE scaling the reader would drop is refused naming the field, since it would load as a
different model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmc.compiler.gguf_reader import one_parse
from llmc.errors import SourceError


def read_header(path: Path) -> tuple[str, int | None]:
    """(the HF model_type transformers builds, the context length the file states), refused (naming the
    field) where transformers' loader would build a different model than the file describes."""
    with one_parse():
        return _read_header(path)


def _read_header(path: Path) -> tuple[str, int | None]:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
        arch = fields["general.architecture"]
        tensors = [t.name for t in reader.tensors]
    except Exception as err:  # gguf raises ValueError/KeyError/struct errors on bad files
        raise SourceError(f"{path}: not a readable GGUF file ({err})") from None
    _gguf_model_type(arch, path)
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as err:
        raise SourceError(f"{path}: transformers could not read the GGUF config ({err})") from None
    _check_gguf_config(fields, tensors, config, path)
    context = fields.get(f"{arch}.context_length")
    return config.model_type, int(context) if context is not None else None


def _gguf_model_type(arch: Any, path: Path) -> str:
    """The HF model type of GGUF architecture `arch` (compiler/models/config.py's table), if the
    installed transformers reads that architecture."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from llmc.compiler.models.config import GGUF_ARCHITECTURES

    try:
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    except ImportError:  # older transformers: one reader
        GGUF_CONFIG_ARCHS = {}
    readable = set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_CONFIG_ARCHS)
    accepted = ", ".join(a for a in GGUF_ARCHITECTURES if a in readable)
    if arch not in GGUF_ARCHITECTURES:
        raise SourceError(f"{path}: general.architecture {arch!r} is not a supported family; GGUF architectures "
                          f"accepted: {accepted}")
    if arch not in readable:
        raise SourceError(
            f"{path}: general.architecture {arch!r} (model_type {GGUF_ARCHITECTURES[arch]}) is a supported family, "
            f"but transformers {transformers.__version__}'s GGUF loader cannot read it; point source.path at the "
            f"HF checkpoint folder instead. GGUF architectures accepted: {accepted}")
    return GGUF_ARCHITECTURES[arch]


def _check_gguf_config(fields: dict, tensors: list[str], config, path: Path) -> None:
    """Refuse a file whose stated head size, rotary width, softcaps or RoPE scaling the transformers
    config built from it does not carry (its GGUF readers skip some keys, leaving the config class's
    defaults: e.g. Qwen3's `attention.key_length`, Phi-4-mini's partial rotary, Gemma 3's RoPE scaling,
    Llama 3's and Phi-3-128k's frequency factors, which llama.cpp stores as tensors)."""
    import math

    import transformers

    from llmc.compiler.models.config import attention_shape, rope_parameters

    arch = fields["general.architecture"]
    head_dim = attention_shape(config)[2]
    params = rope_parameters(config)
    kinds = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    partial = kinds[0].get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
    read = {"attention.key_length": head_dim, "rope.dimension_count": int(head_dim * partial),
            "attn_logit_softcapping": getattr(config, "attn_logit_softcapping", None),
            "final_logit_softcapping": getattr(config, "final_logit_softcapping", None)}
    problems = [f"{arch}.{key} is {fields[f'{arch}.{key}']} but transformers reads {value}"
                for key, value in read.items() if f"{arch}.{key}" in fields
                and (value is None or not math.isclose(float(fields[f"{arch}.{key}"]), float(value), rel_tol=1e-6))]
    types = {k.get("rope_type", k.get("type", "default")) for k in kinds}
    scaling = fields.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") and types <= {"default"}:
        problems.append(f"{arch}.rope.scaling.type is {scaling!r} but transformers reads no RoPE scaling")
    if any(t.startswith(("rope_freqs", "rope_factors")) for t in tensors) and types <= {"default"}:
        problems.append("its rope_freqs / rope_factors tensors (Llama 3's or LongRoPE's RoPE scaling) are not "
                        "read by transformers")
    if problems:
        raise SourceError(f"{path}: transformers {transformers.__version__} would load a different model than this "
                          f"GGUF describes: {'; '.join(problems)}; point source.path at the HF checkpoint folder instead")
