"""Model families: one file per family in families/, each a few hooks over the base decoder (base.py) and its
tiny test config (family.py says what a file declares). Adding a Llama-like family is one file in families/ and
its line in FAMILIES.

    base.py      the base decoder (Llama's shape) and its hooks
    rope.py      RoPE tables from the model's own rotary modules
    config.py    the one reader of a checkpoint's config
    moe.py       mixture-of-experts blocks (`llmc::moe`) and the expert layouts
    families/    llama (+ mistral, qwen2, gemma), gpt2, qwen3, gemma2, gemma3, phi3, granite, olmo2, smollm3,
                 nemotron; mixtral, qwen3_moe, gpt_oss (mixtures of experts)
    parallel/    tensor parallelism: which heads a rank keeps (heads.py), a rank's share of a decoder (shard.py)
"""

from __future__ import annotations

from llmc.compiler.models.families import (gemma2, gemma3, gpt2, gpt_oss, granite, llama, mixtral, nemotron, olmo2,
                                           phi3, qwen3, qwen3_moe, smollm3)
from llmc.compiler.models.family import Family

FAMILIES: tuple[Family, ...] = tuple(m.FAMILY for m in (llama, gpt2, qwen3, gemma2, gemma3, phi3, granite, olmo2,
                                                       smollm3, nemotron, mixtral, qwen3_moe, gpt_oss))

#: HF `model_type` -> family name
SUPPORTED_MODEL_TYPES: dict[str, str] = {t: f.name for f in FAMILIES for t in f.model_types}
#: the model types that are mixtures of experts (compiler/models/moe.py)
MIXTURE_MODEL_TYPES: frozenset[str] = frozenset(t for f in FAMILIES if f.experts for t in f.model_types)


def family_of(model_type: str) -> Family:
    return next(f for f in FAMILIES if model_type in f.model_types)


def decoder_for(hf_model):
    """The llmc decoder for an HF model of a supported `model_type` (SUPPORTED_MODEL_TYPES)."""
    return family_of(hf_model.config.model_type).decoder(hf_model).eval()
