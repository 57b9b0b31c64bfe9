"""The one reader of a checkpoint's config: every fact the compiler takes from `config.json` (or a
GGUF header) is read here, so source, plan, export and the KV cache agree on it.

    read_config(info)        the transformers config, without loading weights
    attention_shape(config)  (query heads, KV heads, head dim)
    rope_parameters(config)  the RoPE settings (transformers 5 keeps them in `rope_parameters`,
                             nested per layer type for Gemma 3)
    GGUF_ARCHITECTURES       GGUF architecture names -> HF model types
    read_dims(info)          Dims: sizes and parameter counts for the plan
"""

from __future__ import annotations

from dataclasses import dataclass

from llmc.errors import SourceError


#: multimodal model types -> the model type of the text model llmc exports from them (source.text_part)
TEXT_PARTS = {"gemma3": "gemma3_text"}


def read_config(info):
    """The checkpoint's transformers config (`info`: a compiler.source.SourceInfo); a multimodal
    checkpoint's text config."""
    from transformers import AutoConfig

    if info.kind == "gguf":
        from llmc.compiler.gguf_reader import one_parse

        with one_parse():
            return AutoConfig.from_pretrained(str(info.path.parent), gguf_file=info.path.name, local_files_only=True)
    config = AutoConfig.from_pretrained(str(info.path), local_files_only=True, trust_remote_code=False)
    return config.get_text_config() if config.model_type in TEXT_PARTS else config


def attention_shape(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a HF config: GPT-2 and MHA configs name no KV heads,
    most name no head dim (Qwen3 and Gemma do, and theirs is not hidden / heads)."""
    heads = config.num_attention_heads
    return (heads, getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads)


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The RoPE settings of a config, or of one layer type where the config nests them per type."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    return dict(params)


def longrope_switch(config) -> int | None:
    """LongRoPE's `original_max_position_embeddings`, None for another RoPE: a sequence longer than it
    takes the long factors (compiler/models/rope.py), and Phi-3's generate() recomputes its cache there."""
    params = rope_parameters(config)
    nested = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    originals = [int(p["original_max_position_embeddings"]) for p in nested if p.get("rope_type") == "longrope"]
    return originals[0] if originals else None


#: GGUF `general.architecture` (llama.cpp's names) -> the HF `model_type` of the family that runs it. A
#: name is accepted only where the installed transformers' GGUF loader reads it too (compiler/source.py);
#: llama.cpp writes Mistral as `llama` (transformers tells them apart by the file's name)
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2",
                      "gemma3": "gemma3_text", "phi3": "phi3", "gpt2": "gpt2", "granite": "granite", "olmo2": "olmo2",
                      "smollm3": "smollm3"}


#: RoPE types with a fixed table per position, and LongRoPE (compiler/models/rope.py)
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "longrope")


def check_rope(config: dict, where) -> None:
    """Refuse, naming the field, a RoPE type whose frequencies change with the sequence length
    (`dynamic`) or that llmc does not know: read from config.json before anything loads."""
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key) or {}
        nested = params if all(isinstance(v, dict) for v in params.values()) and params else {"": params}
        for layer_type, p in nested.items():
            rope_type = (p or {}).get("rope_type", (p or {}).get("type", "default"))
            if rope_type not in SUPPORTED_ROPE:
                field = key + (f".{layer_type}" if layer_type else "") + ".rope_type"
                raise SourceError(f"{where}: {field} {rope_type!r} is not supported (no fixed table per position "
                                  f"reproduces it); supported: {', '.join(SUPPORTED_ROPE)}")


@dataclass(frozen=True)
class Dims:
    """Config facts the plan needs, parameter counts included (no weights read)."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    max_position_embeddings: int
    linear_params: int  # weights of matrices (what quantization shrinks), the LM head included when untied
    other_params: int  # embeddings, norms, biases
    expert_params: int = 0  # of those, a mixture's experts (weights and biases)
    experts_per_token: float = 1.0  # the share of the experts a token routes to (top-k / experts)

    @property
    def total_params(self) -> int:
        return self.linear_params + self.other_params

    @property
    def active_params(self) -> int:
        """What one token's step reads: everything but the experts it does not route to."""
        return self.total_params - round(self.expert_params * (1 - self.experts_per_token))


def parameter_counts(config) -> tuple[int, int, int]:
    """(matrix weights, everything else, experts) of the model `config` describes, counted on the meta
    device: the family's own modules decide, so no family needs a formula. A matrix is any parameter of
    two or more dims outside an embedding (linear and Conv1D weights, fused experts); a tied LM head is
    the embedding. Experts: the parameters of a mixture's `experts` modules (transformers 5's fused
    3-D experts), of either kind."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    experts = sum(p.numel() for name, m in model.named_modules() if name.endswith(".experts") for p in m.parameters())
    linear = other = 0
    for p in model.parameters():  # tied parameters once
        if p.dim() >= 2 and id(p) not in embeddings:
            linear += p.numel()
        else:
            other += p.numel()
    return linear, other, experts


def read_dims(info) -> Dims:
    c = read_config(info)
    heads, kv_heads, head_dim = attention_shape(c)
    linear, other, experts = parameter_counts(c)
    num_experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    return Dims(model_type=c.model_type, num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                intermediate_size=getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None)
                or 4 * c.hidden_size,
                num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=c.vocab_size,
                tied_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
                max_position_embeddings=c.max_position_embeddings, linear_params=linear, other_params=other,
                expert_params=experts,
                experts_per_token=c.num_experts_per_tok / num_experts if experts and num_experts else 1.0)
