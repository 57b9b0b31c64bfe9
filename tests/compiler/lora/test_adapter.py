"""Reading a PEFT adapter: PEFT's own rank, alpha and scaling per module (rank_pattern / alpha_pattern keys as
regexes on module names, rsLoRA), its tensors, its identity, and every refusal naming the field at fault."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lora_cases import ADAPTERS, RANK_A, RANK_B, make_adapter


def _peft_layers(checkpoint, config):
    """PEFT's LoRA layers for `config` on the checkpoint: module name -> (r, scaling, A, B)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(checkpoint)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config))
    layers = {name.removeprefix("base_model.model."): m for name, m in model.named_modules()
              if isinstance(m, LoraLayer)}
    return model, {name: (m.r["default"], m.scaling["default"], m.lora_A["default"].weight.detach().numpy(),
                          m.lora_B["default"].weight.detach().numpy()) for name, m in layers.items()}


@pytest.mark.parametrize("which", ["a", "b"])
def test_rank_alpha_and_scaling_are_peft_s(which, tiny_checkpoints, tmp_path):
    from llmc.compiler.lora import read_adapter

    config = {**(RANK_A if which == "a" else RANK_B), **ADAPTERS["llama"][which == "b"]}
    model, layers = _peft_layers(tiny_checkpoints["llama"], config)
    model.save_pretrained(tmp_path)
    adapter = read_adapter(which, tmp_path, max_rank=16)
    assert adapter.modules.keys() == layers.keys()
    for name, (r, scaling, a, b) in layers.items():
        got = adapter.modules[name]
        assert (got.rank, got.scaling) == (r, pytest.approx(scaling, rel=1e-12)), name
        assert np.array_equal(got.a, a) and np.array_equal(got.b, b) and np.abs(got.b).max() > 0
    if which == "b":  # the regex key took layer 1's q_proj only; rsLoRA: alpha / sqrt(r)
        ranks = {n: m.rank for n, m in adapter.modules.items()}
        assert ranks["model.layers.1.self_attn.q_proj"] == 6 and ranks["model.layers.0.self_attn.q_proj"] == 8
        assert ranks["model.layers.0.mlp.down_proj"] == 2 and ranks["model.layers.0.mlp.up_proj"] == 8
        assert adapter.modules["model.layers.0.self_attn.v_proj"].scaling == pytest.approx(4 / math.sqrt(8))
        assert adapter.modules["model.layers.1.self_attn.q_proj"].scaling == pytest.approx(16 / math.sqrt(6))


def test_identity_is_name_and_content(tiny_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from llmc.compiler.lora import read_adapter

    folder = make_adapter(tiny_checkpoints["llama"], tmp_path / "a", **RANK_A, **ADAPTERS["llama"][0])
    first, again = read_adapter("a", folder, max_rank=16), read_adapter("a", folder, max_rank=16)
    assert first.identity == again.identity == ("a", first.digest)
    assert read_adapter("other", folder, max_rank=16).digest == first.digest  # the same adapter under another name

    tensors = load_file(folder / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] += 1e-3
    save_file(tensors, folder / "adapter_model.safetensors")
    reloaded = read_adapter("a", folder, max_rank=16)  # reloaded under the same name with other weights
    assert reloaded.name == first.name and reloaded.digest != first.digest

    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 9}))
    assert read_adapter("a", folder, max_rank=16).digest not in (first.digest, reloaded.digest)


def _edit_config(folder, **fields):
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **fields}))


def _scale_tensor(folder, suffix, factor):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith(suffix))
    save_file({**tensors, key: tensors[key] * factor}, folder / "adapter_model.safetensors")


def _drop_tensor(folder, suffix):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "adapter_model.safetensors")
    key = sorted(k for k in tensors if k.endswith(suffix))[0]
    save_file({k: v for k, v in tensors.items() if k != key}, folder / "adapter_model.safetensors")
    return key


@pytest.mark.parametrize("case, message", [
    ("dora", "use_dora is set"),
    ("modules_to_save", "modules_to_save is set"),
    ("bias", "bias is 'all'"),
    ("rank", "rank 4 (r), above lora.max_rank (2)"),
    ("rank_pattern", "rank 8 (rank_pattern), above lora.max_rank (6)"),
    ("missing_b", "lora_B.weight is missing"),
    ("missing_file", "adapter_model.safetensors is missing"),
    ("not_lora", "is not a LORA"),
])
def test_refused_at_load_naming_the_field(case, message, tiny_checkpoints, tmp_path):
    from llmc.compiler.lora import AdapterError, read_adapter

    checkpoint, folder = tiny_checkpoints["llama"], tmp_path / "ad"
    targets, max_rank = dict(target_modules=["q_proj", "v_proj"]), 16
    if case == "dora":
        make_adapter(checkpoint, folder, r=4, use_dora=True, **targets)
    elif case == "modules_to_save":
        make_adapter(checkpoint, folder, r=4, modules_to_save=["lm_head"], **targets)
    elif case == "bias":
        make_adapter(checkpoint, folder, r=4, bias="all", **targets)
    elif case == "rank":
        make_adapter(checkpoint, folder, r=4, **targets)
        max_rank = 2
    elif case == "rank_pattern":
        make_adapter(checkpoint, folder, r=4, rank_pattern={"v_proj": 8}, **targets)
        max_rank = 6
    elif case == "missing_b":
        make_adapter(checkpoint, folder, r=4, **targets)
        dropped = _drop_tensor(folder, "lora_B.weight")
        message = f"{dropped} is missing"
    elif case == "missing_file":
        make_adapter(checkpoint, folder, r=4, **targets)
        (folder / "adapter_model.safetensors").unlink()
    elif case == "not_lora":
        make_adapter(checkpoint, folder, r=4, **targets)
        _edit_config(folder, peft_type="IA3", feedforward_modules=[])
        message = "peft_type is IA3"
    with pytest.raises(AdapterError, match="adapter 'ad'") as err:
        read_adapter("ad", folder, max_rank=max_rank)
    assert message in str(err.value)


def test_refused_against_the_base(tiny_checkpoints, tmp_path):
    """Another base's adapter (a shape, a module it lacks), an adapter on a tied LM head, and one on a module
    the graph has no site for are refused by check_against, naming the module."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmc.compiler.lora import AdapterError, BaseLinears, check_against, read_adapter

    llama = tiny_checkpoints["llama"]
    base = AutoModelForCausalLM.from_pretrained(llama)
    linears = BaseLinears.of(base)
    served = set(linears.shapes) - {"lm_head"}
    assert linears.tied_head is None and linears.shapes["model.layers.0.mlp.gate_proj"] == (64, 128)

    wider = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama, intermediate_size=96))
    make_adapter(llama, tmp_path / "other", base=wider, r=4, target_modules=["gate_proj"])
    with pytest.raises(AdapterError, match=r"model.layers.0.mlp.gate_proj maps 64 -> 96 .* made for another base"):
        check_against(read_adapter("other", tmp_path / "other", max_rank=16), linears, served)

    gpt2 = tiny_checkpoints["gpt2"]  # the tiny GPT-2 ties its LM head to the embeddings
    make_adapter(gpt2, tmp_path / "gpt2", r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    with pytest.raises(AdapterError, match="no linear layer of this base model"):
        check_against(read_adapter("gpt2", tmp_path / "gpt2", max_rank=16), linears, served)
    # a LoRA on the LM head: PEFT saves the head's weight beside it. A tied head is refused, with or without the copy
    gpt2_linears = BaseLinears.of(AutoModelForCausalLM.from_pretrained(gpt2))
    assert gpt2_linears.tied_head == "lm_head" and gpt2_linears.head_digest is None
    make_adapter(gpt2, tmp_path / "head", r=4, target_modules=["c_attn", "lm_head"])
    assert set(read_adapter("head", tmp_path / "head", max_rank=16).copies) == {"lm_head"}
    for copy in (True, False):
        if not copy:
            _drop_tensor(tmp_path / "head", "base_layer.weight")
        with pytest.raises(AdapterError, match="lm_head, the LM head, which this model ties"):
            check_against(read_adapter("head", tmp_path / "head", max_rank=16), gpt2_linears, set(gpt2_linears.shapes))

    # Llama's head is untied: served where the graph has its site, its copy checked against the base's weight
    make_adapter(llama, tmp_path / "untied_head", r=4, target_modules=["q_proj", "lm_head"])
    head = read_adapter("untied_head", tmp_path / "untied_head", max_rank=16)
    assert head.copies == {"lm_head": linears.head_digest} and linears.head_digest is not None
    check_against(head, linears, served | {"lm_head"})
    with pytest.raises(AdapterError, match="target module lm_head has no LoRA site"):
        check_against(head, linears, served)
    _scale_tensor(tmp_path / "untied_head", "lm_head.base_layer.weight", 1.001)
    with pytest.raises(AdapterError, match=r"copy of lm_head's weight \(base_layer.weight\) differs from this base's"):
        check_against(read_adapter("untied_head", tmp_path / "untied_head", max_rank=16), linears, served | {"lm_head"})
    with pytest.raises(AdapterError, match="no untied LM head to check it against"):
        check_against(read_adapter("untied_head", tmp_path / "untied_head", max_rank=16),
                      BaseLinears(linears.shapes, None), served | {"lm_head"})
    for which in "AB":
        _drop_tensor(tmp_path / "untied_head", f"lm_head.lora_{which}.weight")
    with pytest.raises(AdapterError, match="lm_head.base_layer.weight is a copy of the base's lm_head weight, which "
                                           "has no LoRA pair"):
        read_adapter("untied_head", tmp_path / "untied_head", max_rank=16)
