"""LoRA on a mixture's experts (PEFT's `target_parameters` over transformers 5's fused 3-D expert weights) against
PEFT itself, on the three mixture families' tiny checkpoints: Qwen3-MoE (a dense layer among the sparse ones),
Mixtral (gate and up concatenated, interleaved for the op) and gpt-oss (transposed, already interleaved, biases and a
clamped SwiGLU the tiny activations reach). Adapter A targets the attention projections and both expert parameters;
adapter B, down_proj alone, with another rank, rsLoRA and a rank_pattern for one layer. One step mixes A, B and no
adapter; every row's logits equal PEFT's, and a step without an adapter token equals the base graph's: with the branch
fused into llmc.MoeLora and as stored."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from lora_cases import PagedSteps, make_adapter, peft_logits

PROMPT = [5, 17, 99, 3, 42, 200, 7]
OTHER = [11, 12, 13, 14]
TOL = 1e-4
BOTH = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _adapters(checkpoint, root):
    a = make_adapter(checkpoint, root / "a", seed=1, r=4, lora_alpha=8,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=BOTH)
    b = make_adapter(checkpoint, root / "b", seed=2, r=8, lora_alpha=16, use_rslora=True,
                     target_parameters=["mlp.experts.down_proj"],
                     rank_pattern={r"layers\.0\.mlp\.experts\.down_proj": 2})
    return {"a": a, "b": b}


@pytest.mark.parametrize("family, fusion", [("qwen3_moe", "1"), ("mixtral", "1"), ("gpt_oss", "1"), ("gpt_oss", "0")])
def test_expert_lora_mixed_step_equals_peft(family, fusion, paged_export, tiny_checkpoints, tmp_path, monkeypatch):
    """fusion "1": where llmc's kernels load, each layer's branch runs as llmc.MoeLora (runtime/kernels/
    moe_lora_fusion.py); "0": the branch as stored, every expert for each adapter token."""
    from transformers import AutoModelForCausalLM

    from llmc.compiler.lora import BaseLinears, add_lora_branches, check_against, find_sites, read_adapter, step_inputs
    from llmc.compiler.lora.experts import expert_params

    monkeypatch.setenv("LLMC_LORA_FUSION", fusion)
    folder, exported = paged_export(family)
    checkpoint = tiny_checkpoints[family]
    paths = _adapters(checkpoint, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint)
    model = onnx.load(str(folder / exported.onnx))
    sites = find_sites(model, hf)
    expert_sites = [s for s in sites if s.experts]
    assert expert_sites and {s.name.rpartition(".")[2] for s in expert_sites} == {"fc1", "fc2"}
    adapters = [read_adapter(n, p, max_rank=16, experts=expert_params(hf)) for n, p in paths.items()]
    for adapter in adapters:
        check_against(adapter, BaseLinears.of(hf), {m.module for s in sites for m in s.members})
    a, b = adapters
    assert {m.rank for k, m in b.modules.items() if "layers.0." in k} == {2} and b.max_rank == 8
    assert all(m.a.ndim == 3 for m in b.modules.values())  # B is experts only
    add_lora_branches(model, sites)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(tmp_path / "lora.onnx"))

    rows = [(0, PROMPT, 0), (1, PROMPT, 1), (2, PROMPT, -1), (3, OTHER, 1)]
    steps = PagedSteps(tmp_path / "lora.onnx", exported.kv_layout)
    mixed = steps.step([(r, ids) for r, ids, _ in rows],
                       step_inputs(sites, [a, b], [(len(ids), s) for _, ids, s in rows]))
    nxt = [[int(np.argmax(logits[-1]))] for logits in mixed]
    decode = steps.step([(r, t) for (r, _, _), t in zip(rows, nxt)],
                        step_inputs(sites, [a, b], [(1, s) for _, _, s in rows]))
    # PEFT loads adapters with target_parameters side by side only when they target the same parameters: one
    # PeftModel per adapter here (llmc serves them together)
    name = {0: "a", 1: "b", -1: "a"}
    want = [peft_logits(checkpoint, {name[s]: paths[name[s]]}, [(ids + t, name[s] if s >= 0 else None)])[0]
            for (_, ids, s), t in zip(rows, nxt)]
    for got, got_next, ref, (r, ids, _) in zip(mixed, decode, want, rows):
        assert np.abs(got - ref[:len(ids)]).max() < TOL, f"row {r}: prefill logits differ from PEFT's"
        assert np.abs(got_next[0] - ref[-1]).max() < TOL, f"row {r}: decode logits differ from PEFT's"
    for i, j in [(0, 1), (0, 2), (1, 2)]:  # B touches the experts only: row 1 differs from the base by them alone
        assert np.abs(mixed[i] - mixed[j]).max() > 0.1, f"rows {i} and {j} are alike: an adapter did nothing"

    # a step with no adapter token through the LoRA graph (zero-width stacks, every mask row 0) is the base graph's
    base = PagedSteps(folder / exported.onnx, exported.kv_layout).step([(0, PROMPT)])[0]
    empty = {k: v[..., :0] if k.endswith(".a") else v[..., :0, :] for k, v in
             step_inputs(sites, [a], [(len(PROMPT), -1)]).items() if k.startswith("lora.")}
    empty.update({k: np.zeros((len(PROMPT), 0), np.float32) for k in step_inputs(sites, [a], [(1, -1)])
                  if k.startswith("lora_mask")})
    alone = PagedSteps(tmp_path / "lora.onnx", exported.kv_layout).step([(0, PROMPT)], empty)[0]
    assert np.array_equal(alone, base)


def test_expert_pairs_the_config_does_not_account_for_are_refused(tiny_checkpoints, tmp_path):
    """Two pairs nested on each experts module, and target_parameters naming one parameter: refused, naming both."""
    import json

    from transformers import AutoModelForCausalLM

    from llmc.compiler.lora import AdapterError, read_adapter
    from llmc.compiler.lora.experts import expert_params

    checkpoint = tiny_checkpoints["qwen3_moe"]
    hf = AutoModelForCausalLM.from_pretrained(checkpoint)
    folder = make_adapter(checkpoint, tmp_path / "a", r=4, lora_alpha=8, target_parameters=BOTH)
    assert len(read_adapter("a", folder, max_rank=16, experts=expert_params(hf)).modules) == 4  # 2 layers x 2
    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_parameters"] = ["mlp.experts.down_proj"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="2 wrapped LoRA pairs, but target_parameters .* match "
                                           r"\['model.layers.0.mlp.experts.down_proj'\]"):
        read_adapter("a", folder, max_rank=16, experts=expert_params(hf))


def test_an_adapter_on_a_routers_weight_is_refused_naming_it(tiny_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    from llmc.compiler.lora import AdapterError, BaseLinears, check_against, read_adapter
    from llmc.compiler.lora.experts import expert_params

    checkpoint = tiny_checkpoints["qwen3_moe"]
    hf = AutoModelForCausalLM.from_pretrained(checkpoint)
    folder = make_adapter(checkpoint, tmp_path / "r", r=2, lora_alpha=4, target_parameters=["mlp.gate.weight"])
    adapter = read_adapter("r", folder, max_rank=16, experts=expert_params(hf))
    with pytest.raises(AdapterError, match=r"model.layers.0.mlp.gate is no linear layer .* target_parameters name a "
                                           r"parameter llmc serves no LoRA on \(a router's weight\)"):
        check_against(adapter, BaseLinears.of(hf), set())
