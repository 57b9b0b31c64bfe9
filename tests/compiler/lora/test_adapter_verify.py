"""The build's adapter check (compiler/lora/verify.py, the verify-adapters stage): the export with a LoRA branch beside
each site against the checkpoint's own PyTorch model with PEFT's forward added by hooks (peft_forward.py).

The hooks equal PEFT itself (dense modules with rank and alpha patterns, an untied LM head, expert parameters in both
layouts); the check passes on the tiny families' adapters, whole and streamed (the candidate a segment at a time, the
reference a layer at a time), and fails where an adapter's arrays are not what PEFT computes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from lora_cases import family_adapters, make_adapter, peft_logits

PROMPT = [5, 17, 99, 3, 42, 200, 7]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _adapter_folders(family: str, checkpoint, root) -> dict:
    if family in ("llama", "phi3", "gpt2"):
        return dict(zip("ab", family_adapters(family, checkpoint, root)))
    a = make_adapter(checkpoint, root / "a", seed=1, r=4, lora_alpha=8,
                     target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS)
    b = make_adapter(checkpoint, root / "b", seed=2, r=8, lora_alpha=16, use_rslora=True,
                     target_modules=["o_proj"], target_parameters=EXPERTS)  # PEFT: one set of parameters for all
    return {"a": a, "b": b}


def _read(hf, folders: dict) -> list:
    from llmc.compiler.lora import BaseLinears, check_against, read_adapter
    from llmc.compiler.lora.experts import expert_params
    from llmc.compiler.lora.sites import module_members

    served = {m.module for members in module_members(hf).values() for m in members}
    served |= {p.key for listed in expert_params(hf).values() for p in listed}
    adapters = [read_adapter(name, folder, max_rank=16, experts=expert_params(hf)) for name, folder in folders.items()]
    for adapter in adapters:
        check_against(adapter, BaseLinears.of(hf), served)
    return adapters


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral", "gpt_oss"])
def test_peft_forward_hooks_equal_peft(family, tiny_checkpoints, tmp_path):
    """llama: an untied LM head and rank/alpha patterns; gpt2: Conv1D (fan_in_fan_out); mixtral: [E, out, in] experts;
    gpt_oss: [E, in, out] (is_transposed), biases and a clamped SwiGLU."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmc.compiler.lora.peft_forward import peft_forward

    checkpoint = tiny_checkpoints[family]
    folders = _adapter_folders(family, checkpoint, tmp_path)
    expected = peft_logits(checkpoint, folders, [(PROMPT, "a"), (PROMPT, "b")])
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        base = hf(torch.tensor([PROMPT])).logits[0].numpy()
        for adapter, want in zip(_read(hf, folders), expected):
            with peft_forward(hf, adapter):
                got = hf(torch.tensor([PROMPT])).logits[0].numpy()
            assert np.abs(got - want).max() < 1e-4, adapter.name
            assert np.abs(want - base).max() > 1e-2  # the adapter changes the logits: the comparison can fail
        after = hf(torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_array_equal(after, base)  # the hooks came off, and an expert weight is its own again


def _verify(family, paged_export, tiny_checkpoints, tmp_path, streamed: bool = False, steps: int = 10):
    from llmc.compiler.lora.sites import find_sites
    from llmc.compiler.lora.verify import verify_adapters
    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec
    from llmc.compiler.stream.model import StreamedModel

    folder, exported = paged_export(family)
    checkpoint = tiny_checkpoints[family]
    info = inspect_source(SourceSpec(path=checkpoint))
    model, tokenizer = load_model(info)
    adapters = _read(model, _adapter_folders(family, checkpoint, tmp_path / "adapters"))
    sites = find_sites(onnx.load(str(folder / exported.onnx), load_external_data=False), model)
    ticks = []
    report = verify_adapters(exported, folder, StreamedModel(info) if streamed else model, tokenizer, adapters, sites,
                             tmp_path / "out", inputs_hash="h", steps=steps,
                             progress=lambda done, total, *what: ticks.append((done, total)))
    assert ticks and ticks[-1][0] == ticks[-1][1]  # the progress total is what ran
    assert not list((tmp_path / "out").glob(".llmc-lora-*"))  # the LoRA graph and its link are gone
    return report


@pytest.mark.parametrize("family, streamed", [("llama", False), ("llama", True), ("mixtral", False),
                                              ("gpt_oss", True)])
def test_adapters_verify_like_the_base(family, streamed, paged_export, tiny_checkpoints, tmp_path):
    report = _verify(family, paged_export, tiny_checkpoints, tmp_path, streamed)
    assert report.passed, [(c.name, c.max_abs_logit_diff, c.first_divergence) for c in report.cases]
    assert [c.name for c in report.cases] == ["a: batch-3", "b: batch-3", "mixed: batch-3"]
    assert set(report.adapters) == {"a", "b"} and all(len(d) == 64 for d in report.adapters.values())
    assert all(c.token_agreement == 1.0 for c in report.cases)
    assert ("segment at a time" in report.candidate) == streamed
    assert ("streamed layer by layer" in report.reference) == streamed
    from llmc.compiler.artifacts import AdapterVerifyReport

    assert AdapterVerifyReport.load(tmp_path / "out") == report


def test_a_wrong_adapter_array_fails_the_check(paged_export, tiny_checkpoints, tmp_path, monkeypatch):
    """The candidate's arrays with one module's scaling doubled (what a wrong alpha_pattern would give): the check
    fails on that adapter's cases, and on the mixed case only where it runs."""
    from llmc.compiler.lora import verify as lora_verify
    from llmc.compiler.lora.adapter import Adapter, ModuleLora

    real = lora_verify.site_arrays

    def wrong(sites, adapter):
        if adapter.name != "b":
            return real(sites, adapter)
        modules = dict(adapter.modules)
        key = next(k for k in modules if "layers.1" in k and "down_proj" in k)
        m = modules[key]
        modules[key] = ModuleLora(m.module, m.a, m.b, 2 * m.scaling)
        return real(sites, Adapter(adapter.name, adapter.folder, adapter.digest, modules, adapter.copies))

    monkeypatch.setattr(lora_verify, "site_arrays", wrong)
    report = _verify("llama", paged_export, tiny_checkpoints, tmp_path)
    assert not report.passed
    verdicts = {c.name: c.passed for c in report.cases}
    assert verdicts == {"a: batch-3": True, "b: batch-3": False, "mixed: batch-3": False}
