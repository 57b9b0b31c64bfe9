"""PEFT itself, as the LoRA tests' oracle (tests/compiler/lora, tests/e2e/lora): adapters it makes and saves, and
the PEFT model that loads them back."""

from __future__ import annotations

from pathlib import Path


def make_adapter(checkpoint: Path, folder: Path, seed: int = 1, base=None, **config) -> Path:
    """A PEFT LoRA adapter on `checkpoint` (or on the model `base`), saved into `folder`: PEFT's
    `init_lora_weights=False` leaves A and B at nn.Linear's random init, so B is not zero and the adapter visibly
    changes the tiny model's logits and greedy tokens."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = base if base is not None else AutoModelForCausalLM.from_pretrained(checkpoint)
    get_peft_model(model, LoraConfig(init_lora_weights=False, **config)).save_pretrained(folder)
    return folder


def peft_model(checkpoint: Path, adapters: dict[str, Path], base=None):
    """`checkpoint`'s model (or the model `base`) with every adapter loaded by PEFT from its folder, under its name,
    in eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    names = list(adapters)
    base = base if base is not None else AutoModelForCausalLM.from_pretrained(checkpoint)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()
