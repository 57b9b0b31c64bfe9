"""Model sources: find, check and load a HuggingFace checkpoint folder or a GGUF file.

Safetensors is the default; pickle checkpoints (`pytorch_model*.bin`) load only with
`source.allow_pickle: true`, and then through `torch.load(weights_only=True)`. Remote code is never
run and nothing is downloaded: transformers is used with `local_files_only` in offline mode.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmc.compiler.gguf_reader import one_parse
from llmc.compiler.hashing import sha256_files
from llmc.compiler.models.config import TEXT_PARTS, check_rope
from llmc.compiler.spec import BuildSpec, SourceSpec
from llmc.compiler.stage import Located, Stage
from llmc.errors import SourceError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "merges.txt", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class SourceInfo:
    """What a source is, found without loading any weights."""

    path: Path
    kind: str  # "hf" | "gguf"
    model_type: str
    weight_files: tuple[Path, ...]
    hashed_files: tuple[Path, ...]
    uses_pickle: bool
    max_position_embeddings: int | None  # the longest context the model was made for, from its config
    quant_method: str | None = None  # the config's `quantization_config.quant_method` (mxfp4: gpt-oss's experts)

    @property
    def root(self) -> Path:
        return self.path if self.kind == "hf" else self.path.parent

    def content_hash(self) -> str:
        return sha256_files(self.hashed_files, self.root)


def _check_model_type(model_type: Any, where: Path) -> str:
    from llmc.compiler.models import FAMILIES, SUPPORTED_MODEL_TYPES  # the decoders: torch, imported when needed

    if model_type not in SUPPORTED_MODEL_TYPES and model_type not in TEXT_PARTS:
        families = "; ".join([f"{f.name}: {', '.join(f.model_types)}" for f in FAMILIES]
                             + [f"{t} (multimodal: its {text} text model)" for t, text in TEXT_PARTS.items()])
        raise SourceError(f"{where}: model_type {model_type!r} is not supported; supported families ({families})")
    return model_type


def _gguf_info(path: Path) -> SourceInfo:
    """A GGUF file of a family llmc runs and transformers' GGUF loader reads (compiler/gguf.py)."""
    from llmc.compiler.gguf import read_header

    model_type, context = read_header(path)
    return SourceInfo(path, "gguf", _check_model_type(model_type, path), (path,), (path,), False, context)


def _hf_info(path: Path, allow_pickle: bool) -> SourceInfo:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise SourceError(
            f"{path}: no config.json; point `source` at a HuggingFace checkpoint folder "
            "(config.json + *.safetensors) or at a .gguf file"
        )
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise SourceError(f"{config_path}: not valid JSON ({err})") from None
    model_type = _check_model_type(config.get("model_type"), config_path)
    text = config.get("text_config") or {} if model_type in TEXT_PARTS else config
    check_rope(text, config_path)
    weights = tuple(sorted(path.glob("*.safetensors")))
    uses_pickle = False
    if not weights:
        weights = tuple(sorted(path.glob("pytorch_model*.bin")))
        if not weights:
            raise SourceError(f"{path}: no weights found (expected *.safetensors or pytorch_model*.bin)")
        if not allow_pickle:
            raise SourceError(
                f"{path}: only pickle weights ({weights[0].name}); convert them to safetensors, "
                "or set `source.allow_pickle: true` to load them with torch.load(weights_only=True)"
            )
        uses_pickle = True
    extras = [path / n for n in ("config.json", "generation_config.json", *_TOKENIZER_FILES)]
    hashed = tuple(weights) + tuple(p for p in extras if p.is_file())
    positions = text.get("max_position_embeddings") or text.get("n_positions")  # GPT-2 names it n_positions
    quant_method = (config.get("quantization_config") or {}).get("quant_method")
    return SourceInfo(path, "hf", model_type, weights, hashed, uses_pickle, positions, quant_method)


def inspect_source(source: SourceSpec) -> SourceInfo:
    path = source.path
    if not path.exists():
        raise SourceError(f"source.path: {path} does not exist (a checkpoint folder or a .gguf file)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise SourceError(f"source.path: {path} is a file but not a .gguf; use a checkpoint folder or a GGUF file")
        return _gguf_info(path)
    return _hf_info(path, source.allow_pickle)


def load_model(info: SourceInfo):
    """The model in fp32 eval mode, and its tokenizer (None when the source has none)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    common = dict(dtype=torch.float32, trust_remote_code=False, local_files_only=True)
    try:
        if info.kind == "gguf":
            with one_parse():
                model = _load_gguf(info, common)
        elif info.uses_pickle:
            model = _load_pickle_checkpoint(info)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(info.path), use_safetensors=True, **common,
                                                         **_dequantized(info))
        if info.model_type in TEXT_PARTS:
            model = text_part(model)
    except SourceError:
        raise
    except Exception as err:
        raise SourceError(f"{info.path}: could not load the checkpoint: {err}") from err
    return model.eval(), load_tokenizer(info)


def _dequantized(info: SourceInfo) -> dict[str, Any]:
    """gpt-oss checkpoints ship their experts in MXFP4 (`quantization_config.quant_method: mxfp4`): read them
    dequantized at load, always (transformers otherwise keeps packed MXFP4 modules wherever its Triton kernels
    are installed). Dequantized, because no ONNX Runtime CPU kernel takes the checkpoint's codes: 1.32's CPU QMoE
    fails at initialization on `quant_type=fp4` with E8M0 scales (probed), and its integer codes cannot hold E2M1's
    uneven steps. The experts are exported in fp32, and `int4-weight-only` re-quantizes them into QMoE's codes."""
    if info.quant_method != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def text_part(model):
    """The causal LM inside a multimodal checkpoint (Gemma 3 4B and up): its text config's own model
    class, given the language model's weights and the LM head. The vision tower is left behind."""
    import torch
    from transformers import AutoModelForCausalLM

    text = AutoModelForCausalLM.from_config(model.config.get_text_config(), dtype=torch.float32)
    text.model.load_state_dict(model.model.language_model.state_dict())
    text.lm_head.load_state_dict(model.lm_head.state_dict())
    return text


def _load_gguf(info: SourceInfo, common: dict[str, Any]):
    """transformers dequantizes GGUF weights on load but marks the model as gguf-quantized (and so
    unsaveable); rebuild a plain fp32 model from the config and move the weights over."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(info.path.parent), gguf_file=info.path.name, **common)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=common["dtype"])
    model.load_state_dict(loaded.state_dict())
    return model


def _load_pickle_checkpoint(info: SourceInfo):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(info.path), trust_remote_code=False, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state: dict[str, Any] = {}
    for f in info.weight_files:
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise SourceError(
            f"{info.path}: weights do not match the config (missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    model.tie_weights()
    return model


def load_tokenizer(info: SourceInfo):
    """The checkpoint's tokenizer (None when it has none). A build asks for it up to four times (the quantize
    stage's check and run, the PyTorch model's loader, the package stage): at Qwen2.5's 151,665 tokens a load
    took ~1 s, so the last one is kept while the files beside the weights (a GGUF: the file) keep their sizes
    and mtimes. Callers only read it."""
    files = [f for f in info.hashed_files if f not in info.weight_files] if info.kind == "hf" else [info.path]
    return _tokenizer(info, tuple((f, s.st_size, s.st_mtime_ns) if (s := _stat(f)) else (f,) for f in files))


@functools.lru_cache(maxsize=1)  # keyed like gguf_reader._parsed: the files' stat, not read again
def _tokenizer(info: SourceInfo, stamp: tuple):
    return _load_tokenizer(info)


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


def _load_tokenizer(info: SourceInfo):
    from transformers import AutoTokenizer

    try:
        if info.kind == "gguf":
            with one_parse():
                return AutoTokenizer.from_pretrained(str(info.path.parent), gguf_file=info.path.name,
                                                     local_files_only=True)
        if any((info.path / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            return AutoTokenizer.from_pretrained(str(info.path), trust_remote_code=False, local_files_only=True)
    except Exception as err:
        raise SourceError(f"{info.path}: could not load the tokenizer: {err}") from err
    return None


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write a GGUF model as a plain safetensors checkpoint folder (weights dequantized to fp32)."""
    info = _gguf_info(Path(gguf_path))
    model, tokenizer = load_model(info)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


# the source stage: the checkpoint, found and hashed without loading weights, and the limits it decides

@dataclass(frozen=True)
class FoundSource:
    info: SourceInfo
    hash: str  # of the weights, config and tokenizer files
    spec: BuildSpec  # the build's spec with the limits left unset filled in from the checkpoint
    notes: tuple[str, ...]  # what was filled in


def find_source(spec: BuildSpec) -> FoundSource:
    info = inspect_source(spec.source)
    resolved, notes = spec.with_model_limits(info.max_position_embeddings)
    return FoundSource(info, info.content_hash(), resolved, tuple(notes))


def _summary(done: Located[FoundSource]) -> str:
    info = done.artifact.info
    return "; ".join((f"{info.kind} {info.model_type}, {len(info.weight_files)} weight file(s)", *done.artifact.notes))


SOURCE = Stage("source", describe=lambda spec: f"hashing {spec.source.path.name}", opens=True,
               run=lambda _, spec, ctx: find_source(spec), summary=_summary)
