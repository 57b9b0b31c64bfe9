"""Random-weight checkpoints with the exact shapes of real models, for benchmarks at real sizes:

    .venv/bin/python -m llmc.bench.checkpoints qwen2.5-0.5b [--out build/bench/sizes/checkpoints]

A decode step reads every weight once whatever its values, so seeded random weights measure speed
as well as trained ones and need no download. Each entry of SHAPES is the model's own config.json
(its sizes, heads, vocabulary, tied embeddings, RoPE); the checkpoint is written in fp32 safetensors
with SmolLM2's tokenizer (the example's, models/smollm2) grown to the model's vocabulary by filler
tokens past its own 49,152, so that every id a random model emits decodes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from llmc.bench.builds import BENCH, SMOLLM2

TOKENIZER = SMOLLM2
OUT = BENCH / "sizes" / "checkpoints"

# The configs' shape fields, from each model's published config.json; PARAMETERS: its published count.
SHAPES = {
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": True, "hidden_act": "silu"},
    "qwen3-0.6b": {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                   "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False},
    "llama-3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "llama-3.1-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    # Llama 3.1's shape before its RoPE scaling: the 8B a GGUF source can be (llama.cpp stores 3.1's scaling as a
    # rope_freqs tensor, which transformers' GGUF reader drops, so compiler/gguf.py refuses such a file)
    "llama-3-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                   "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
}
PARAMETERS = {"qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920, "llama-3.2-1b": 1_235_814_400,
              "llama-3.1-8b": 8_030_261_248, "llama-3-8b": 8_030_261_248}


def config(shape: str, fields: dict | None = None):
    """The transformers config of `shape` (or of `fields`, a config of the same form)."""
    import transformers

    fields = dict(fields or SHAPES[shape])
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def grown_tokenizer(vocab_size: int) -> dict:
    """SmolLM2's tokenizer.json with filler tokens `<|filler_i|>` up to `vocab_size` ids, in its BPE vocabulary
    (no merge makes them: encoding never does, decoding does), as a real model's vocabulary is. As added tokens
    instead, 100,000 of them cost a build ~40 s that a real tokenizer does not: transformers copies each added
    token when it loads a tokenizer, and the package stage checks each one's text."""
    tok = json.loads((TOKENIZER / "tokenizer.json").read_text())
    used = max(len(tok["model"]["vocab"]), 1 + max(t["id"] for t in tok["added_tokens"]))
    tok["model"]["vocab"].update({f"<|filler_{i}|>": i for i in range(used, vocab_size)})
    return tok


def checkpoint(shape: str, root: Path = OUT, fields: dict | None = None) -> Path:
    """The checkpoint folder of `shape` under `root`, written once (seed 0); `fields`: its config fields
    when `shape` is not one of SHAPES (a benchmark's own shape)."""
    out = root / shape
    if (out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file():
        return out
    import torch
    import transformers

    cfg = config(shape, fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms away from 1, so a graph that dropped one would not match the checkpoint
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    partial = root / f".{shape}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    (partial / "tokenizer.json").write_text(json.dumps(grown_tokenizer(cfg.vocab_size)))
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(TOKENIZER / name, partial / name)
    partial.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    print(checkpoint(args.shape, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
