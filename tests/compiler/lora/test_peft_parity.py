"""The LoRA branch on exported paged graphs against PEFT itself: adapters made by PEFT on the tiny checkpoints,
read by llmc, stacked into the flat slots of one step that mixes adapter A, adapter B (another rank, rsLoRA,
rank_pattern, alpha_pattern), and no adapter; every row's logits equal PEFT's for that row within fp32 tolerance, and equal the
row run alone. Llama (q/k/v fused by the exporter), Phi-3 (qkv_proj and gate_up_proj fused in the checkpoint) and
GPT-2 (Conv1D, weights transposed relative to nn.Linear)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from lora_cases import PagedSteps, family_adapters, peft_logits

PROMPT = [5, 17, 99, 3, 42, 200, 7]
OTHER = [11, 12, 13, 14]
TOL = 1e-4  # fp32: the graph and PyTorch sum in other orders (seen: up to 1e-5)


def _lora_graph(folder, exported, checkpoint, tmp_path, adapters):
    from transformers import AutoModelForCausalLM

    from llmc.compiler.lora import BaseLinears, add_lora_branches, check_against, find_sites, read_adapter

    hf = AutoModelForCausalLM.from_pretrained(checkpoint)
    model = onnx.load(str(folder / exported.onnx))
    sites = find_sites(model, hf)
    served = {m.module for s in sites for m in s.members}
    read = [read_adapter(name, path, max_rank=16) for name, path in adapters.items()]
    for adapter in read:
        check_against(adapter, BaseLinears.of(hf), served)
    add_lora_branches(model, sites)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(tmp_path / "lora.onnx"))
    return tmp_path / "lora.onnx", sites, read


@pytest.mark.parametrize("family", ["llama", "phi3", "gpt2"])
def test_mixed_step_equals_peft_and_each_row_alone(family, paged_export, tiny_checkpoints, tmp_path):
    from llmc.compiler.lora import step_inputs

    folder, exported = paged_export(family)
    checkpoint = tiny_checkpoints[family]
    paths = dict(zip("ab", family_adapters(family, checkpoint, tmp_path)))
    graph, sites, (a, b) = _lora_graph(folder, exported, checkpoint, tmp_path, paths)
    assert all(np.abs(m.b).max() > 0 for ad in (a, b) for m in ad.modules.values())  # adapters that do something
    assert {m.rank for m in b.modules.values()} == {8, 6, 2}  # B's ranks mix within itself and with A's 4

    # one step: the same prompt under A, B and none, and another prompt under B; then a decode step for each row
    rows = [(0, PROMPT, 0), (1, PROMPT, 1), (2, PROMPT, -1), (3, OTHER, 1)]
    steps = PagedSteps(graph, exported.kv_layout)
    mixed = steps.step([(r, ids) for r, ids, _ in rows],
                       step_inputs(sites, [a, b], [(len(ids), s) for _, ids, s in rows]))
    nxt = [[int(np.argmax(logits[-1]))] for logits in mixed]
    decode = steps.step([(r, t) for (r, _, _), t in zip(rows, nxt)],
                        step_inputs(sites, [a, b], [(1, s) for _, _, s in rows]))

    name = {0: "a", 1: "b", -1: None}
    want = peft_logits(checkpoint, paths, [(ids + t, name[s]) for (_, ids, s), t in zip(rows, nxt)])
    for got, got_next, ref, (r, ids, _) in zip(mixed, decode, want, rows):
        assert np.abs(got - ref[:len(ids)]).max() < TOL, f"row {r}: prefill logits differ from PEFT's"
        assert np.abs(got_next[0] - ref[-1]).max() < TOL, f"row {r}: decode logits differ from PEFT's"
    # the adapters change the logits, each its own way: the rows of one prompt differ pairwise
    for i, j in [(0, 1), (0, 2), (1, 2)]:
        assert np.abs(mixed[i] - mixed[j]).max() > 0.5, f"rows {i} and {j} are alike: an adapter did nothing"

    # each row alone: its adapter in slot 0 (the base row on the graph without the branch) gives the same logits
    for r, ids, s in rows:
        if s < 0:
            alone = PagedSteps(folder / exported.onnx, exported.kv_layout).step([(0, ids)])[0]
        else:
            alone = PagedSteps(graph, exported.kv_layout).step(
                [(0, ids)], step_inputs(sites, [(a, b)[s]], [(len(ids), 0)]))[0]
        assert np.abs(alone - mixed[r]).max() < 1e-5, f"row {r} run alone differs from its row in the mixed step"


def test_weight_only_graph_keeps_its_projections(tiny_checkpoints, tmp_path_factory, tmp_path):
    """The pass on an int4 weight-only graph (sites found on its fp32 export): every MatMulNBits node and weight
    is left as it was (gate/up merged into one node and split back: two sites on one Split), each branch reads
    the activation its MatMulNBits reads, a row without an adapter gets exactly the quantized graph's logits, and
    at every site the branch adds exactly the reference's delta (reference.py) on the graph's own activations.
    (PEFT over the dequantized weights: test_peft_dequantized.py.)"""
    import torch
    from shared_builds import build_reusing_export

    from llmc.compiler.lora import add_lora_branches, find_sites, read_adapter, step_inputs, token_slots
    from llmc.compiler.lora.graph import a_name, b_name
    from llmc.compiler.lora.reference import lora_delta
    from llmc.compiler.spec import parse_spec
    from transformers import AutoModelForCausalLM

    checkpoint = tiny_checkpoints["llama"]
    spec = parse_spec({"name": "q", "source": str(checkpoint),
                       "quantization": {"mode": "int4-weight-only", "algorithm": "rtn"}})
    exported = build_reusing_export(tmp_path_factory, spec, tmp_path / "q", until="quantize").exported
    quantized_path = tmp_path / "q" / "quantize" / "model.onnx"
    quantized = onnx.load(str(quantized_path))
    sites = find_sites(onnx.load(str(tmp_path / "q" / "export" / exported.onnx)),
                       AutoModelForCausalLM.from_pretrained(checkpoint))
    before = {n.name: n for n in quantized.graph.node if n.op_type == "MatMulNBits"}
    weights = {t.name: t.SerializeToString() for t in quantized.graph.initializer}
    assert {s.x for s in sites} == {n.input[0] for n in before.values()}  # every MatMulNBits, the LM head's too
    add_lora_branches(quantized, sites)
    after = {n.name: n for n in quantized.graph.node if n.op_type == "MatMulNBits"}
    assert len(before) == 9 and before.keys() == after.keys()
    for name, node in before.items():
        assert list(node.input) == list(after[name].input) and node.attribute == after[name].attribute
    assert all(t.SerializeToString() == weights[t.name] for t in quantized.graph.initializer if t.name in weights)
    probes = [n for s in sites for n in (s.x, f"lora/{s.name}/base", s.y)]
    quantized.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in probes)
    onnx.save(quantized, str(tmp_path / "lora_q.onnx"))

    adapter = read_adapter("a", family_adapters("llama", checkpoint, tmp_path)[0], max_rank=16)
    rows = [(len(PROMPT), 0), (len(PROMPT), -1)]
    stacks, slots = step_inputs(sites, [adapter], rows), token_slots(rows)
    steps = PagedSteps(tmp_path / "lora_q.onnx", exported.kv_layout)
    got = steps.step([(0, PROMPT), (1, PROMPT)], stacks)
    base_q = PagedSteps(quantized_path, exported.kv_layout).step([(0, PROMPT)])[0]
    assert np.abs(got[1] - base_q).max() < 1e-6
    assert np.abs(got[0] - base_q).max() > 0.5
    out = steps.outputs
    for site in sites:
        x = torch.from_numpy(out[site.x]).reshape(-1, site.in_features)
        want = lora_delta(x, torch.from_numpy(slots), torch.from_numpy(stacks[a_name(site)]),
                          torch.from_numpy(stacks[b_name(site)]), 1).numpy()
        delta = (out[site.y] - out[f"lora/{site.name}/base"]).reshape(want.shape)
        assert np.abs(delta - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), site.name
        assert np.abs(want[:len(PROMPT)]).max() > 0.1 and not want[len(PROMPT):].any()
