"""Every new family builds from a minimal spec (`name` + `source`) and its export verifies against
the checkpoint's own PyTorch model (32 greedy steps, batch 1 and batch 3 at different positions, prompts
longer than the windows), in the paged graph (the default) and, in the slow sweep, in the fused graph
(and the reference graph for one family per feature); a lowering that cannot express a family says
which feature forces `paged`."""

import pytest

from llmc.compiler import build
from llmc.compiler.spec import parse_spec
from llmc.errors import UnsupportedError

NEW = ("qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "granite", "olmo2", "smollm3", "nemotron", "mixtral", "qwen3_moe",
       "gpt_oss")


def _verified(checkpoint, folder, **spec):
    report = build(parse_spec({"name": "t", "source": str(checkpoint), **spec}), output=folder, until="verify").verify
    assert report.passed and [c.batch for c in report.cases] == [1, 3], report
    assert all(c.token_agreement == 1.0 for c in report.cases), report  # tiny models: no near ties to excuse
    return report


@pytest.mark.parametrize("model_type", NEW)
def test_minimal_spec_builds_the_paged_graph_and_verifies(tiny_checkpoints, tmp_path, tmp_path_factory, model_type):
    from shared_builds import offer_export

    report = _verified(tiny_checkpoints[model_type], tmp_path / "out")
    assert "paged attention" in report.candidate and max(report.cases[1].prompt_lengths) > 8  # past every window
    # the verified export, for the run's later builds of the same graph (tests/e2e/test_families_serving.py)
    offer_export(tmp_path_factory, parse_spec({"name": "t", "source": str(tiny_checkpoints[model_type])}),
                 tmp_path / "out" / "export")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", NEW)
def test_the_fused_graph_verifies(tiny_checkpoints, tmp_path, model_type):
    _verified(tiny_checkpoints[model_type], tmp_path / "out", export={"attention": "fused"})


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gemma2", "phi3", "nemotron"])  # window mask + softcap, LongRoPE, partial
def test_the_reference_graph_verifies(tiny_checkpoints, tmp_path, model_type):
    _verified(tiny_checkpoints[model_type], tmp_path / "out", export={"attention": "reference"})


def test_a_lowering_that_cannot_express_the_model_names_what_forces_paged(tmp_path):
    from checkpoints import make_checkpoint

    ckpt = make_checkpoint("qwen3", tmp_path / "q", head_dim=24)  # GQA's CPU kernel wants multiples of 16
    spec = parse_spec({"name": "t", "source": str(ckpt), "export": {"attention": "fused"}})
    with pytest.raises(UnsupportedError, match=r"export.attention: fused cannot export qwen3: .*multiple of 16.*24"):
        build(spec, output=tmp_path / "out", until="export")
    assert not (tmp_path / "out" / "export" / "model.onnx").exists()


def test_a_multimodal_gemma3_checkpoint_builds_its_text_model(tiny_checkpoints, tmp_path):
    """A `gemma3` checkpoint (Gemma 3 4B and up: a vision tower beside the language model) exports the
    language model it nests, verified against that model."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3Config, PreTrainedTokenizerFast

    from checkpoints import TINY, byte_tokenizer

    torch.manual_seed(0)
    config = Gemma3Config(text_config=TINY["gemma3_text"], vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14))
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer()).save_pretrained(tmp_path / "ckpt")
    report = _verified(tmp_path / "ckpt", tmp_path / "out")
    assert "gemma3_text" in report.reference


@pytest.mark.parametrize("spec, field", [({"target": "tensorrt", "precision": "fp16"}, "target: tensorrt"),
                                         ({"export": {"attention": "reference"}}, "export.attention: reference")])
def test_a_mixture_on_a_lowering_without_an_expert_op_is_refused_before_export(tiny_checkpoints, tmp_path, spec, field):
    built = parse_spec({"name": "t", "source": str(tiny_checkpoints["mixtral"]), **spec})
    with pytest.raises(UnsupportedError, match=rf"{field} cannot build mixtral, a mixture of experts: .*MoE"):
        build(built, output=tmp_path / "out", until="export")
    assert not (tmp_path / "out" / "export").exists()


def _mxfp4(w):
    """gpt-oss's MXFP4 layout of w [E, N, K]: E2M1 codes two a byte (low nibble first) in blocks of 32 along K,
    [E, N, K / 32, 16], and a power-of-two scale per block as a biased exponent, [E, N, K / 32]; and the
    values those codes hold."""
    import torch

    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    groups = w.reshape(*w.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scale = torch.exp2(exponent)[..., None]
    codes = (groups[..., None] / scale[..., None] - values).abs().argmin(-1).to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8),
            (values[codes.long()] * scale).reshape(w.shape))


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_is_read_dequantized_and_verifies(tiny_checkpoints, tmp_path):
    """Real gpt-oss checkpoints ship MXFP4 experts: they are read dequantized at load (the exact values their
    codes hold), exported in fp32 and verified against the checkpoint's own PyTorch model."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec

    folder = tmp_path / "mxfp4"
    shutil.copytree(tiny_checkpoints["gpt_oss"], folder)
    state, held = load_file(folder / "model.safetensors"), {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, held[name] = _mxfp4(state.pop(name).transpose(1, 2).contiguous())
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    model = load_model(inspect_source(SourceSpec(path=folder)))[0]
    loaded = dict(model.named_parameters())
    assert len(held) == 2 * config["num_hidden_layers"]
    for name, values in held.items():
        assert loaded[name].dtype == values.dtype and bool((loaded[name].transpose(1, 2) == values).all()), name
    _verified(folder, tmp_path / "out")
