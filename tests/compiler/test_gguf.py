"""GGUF sources of the new families: tiny GGUF files written here (as llama.cpp's converter lays them
out) load to the model they were written from and export; architectures transformers cannot read,
and files it would read as a different model, are refused naming what is at fault."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from checkpoints import make_checkpoint
from llmc.compiler.models import SUPPORTED_MODEL_TYPES
from llmc.compiler.models.config import GGUF_ARCHITECTURES
from llmc.compiler.source import inspect_source, load_model
from llmc.compiler.spec import SourceSpec
from llmc.errors import SourceError

# Tiny configs a GGUF can state in full under transformers' GGUF reader: fields it does not read
# (Qwen3's sliding layers, Gemma 3's query_pre_attn_scalar and local RoPE base) are at its defaults
GGUF_TINY = {
    "qwen3": ("qwen3", dict(head_dim=128, use_sliding_window=False, tie_word_embeddings=True)),
    "gemma3": ("gemma3_text", dict(query_pre_attn_scalar=256, tie_word_embeddings=True, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              tie_word_embeddings=True)),
    "phi3": ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)),
}


def write_gguf(model, path: Path, arch: str, tensors: dict | None = None, **extra) -> Path:
    """`model`'s weights (fp32) and config as a GGUF of `arch`, with the 256-token byte-level vocabulary
    of conftest's tokenizer; `tensors`: more tensors by GGUF name; `extra`: GGUFWriter `add_<name>`
    calls (e.g. rope_scaling_type=...)."""
    from tokenizers.pre_tokenizers import ByteLevel

    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    params = c.rope_parameters
    writer.add_rope_freq_base(params.get("full_attention", params)["rope_theta"])
    if getattr(c, "sliding_window", None) and arch.startswith("gemma"):
        writer.add_sliding_window(c.sliding_window)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(c, cap, None):
            getattr(writer, f"add_{cap}")(getattr(c, cap))
    for name, value in extra.items():
        getattr(writer, f"add_{name}")(value)
    tokens = sorted(ByteLevel.alphabet())
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))  # NORMAL
    for token in ("bos", "eos", "pad"):
        if isinstance(getattr(c, f"{token}_token_id", None), int):
            getattr(writer, f"add_{token}_token_id")(getattr(c, f"{token}_token_id"))
    writer.add_token_scores([0.0] * len(tokens))  # no merges: transformers derives none from single characters
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        if base == "lm_head" and c.tie_word_embeddings:
            continue  # llama.cpp writes no output tensor for a tied head
        value = tensor.numpy().astype(np.float32)
        if arch.startswith("gemma") and base.endswith("norm"):
            value = value + 1  # llama.cpp stores Gemma's (1 + w) norms as 1 + w
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", value)
    for name, value in (tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _hf(model_type: str, folder: Path, **config):
    from transformers import AutoModelForCausalLM

    checkpoint = make_checkpoint(model_type, folder, **config)
    return checkpoint, AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """arch -> (the GGUF file, the HF checkpoint folder it was written from, that HF model)."""
    root = tmp_path_factory.mktemp("gguf")
    made = {}
    for arch, (model_type, config) in GGUF_TINY.items():
        checkpoint, model = _hf(model_type, root / model_type, **config)
        made[arch] = write_gguf(model, root / f"{arch}.gguf", arch), checkpoint, model
    return made


def test_the_gguf_table_names_supported_model_types():
    assert set(GGUF_ARCHITECTURES.values()) <= set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("arch", sorted(GGUF_TINY))
def test_a_new_family_gguf_loads_as_the_model_it_was_written_from(gguf_files, arch):
    path, _, reference = gguf_files[arch]
    info = inspect_source(SourceSpec(path=path))
    assert (info.kind, info.model_type) == ("gguf", GGUF_ARCHITECTURES[arch])
    model, tokenizer = load_model(info)
    ids = torch.tensor([tokenizer("gguf hello")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_qwen3_gguf_exports_and_verifies(gguf_files, tmp_path):
    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec

    path, _, _ = gguf_files["qwen3"]
    result = build(parse_spec({"name": "g", "source": str(path)}), output=tmp_path / "g", until="verify")
    assert result.exported.model.model_type == "qwen3" and result.verify.passed


def test_a_gguf_is_parsed_once_for_its_config_weights_and_tokenizer(gguf_files, tmp_path, monkeypatch):
    # 6 parses here without the shared reader (header, configs, weights, tokenizer): seconds each for a
    # real vocabulary. A file changed on disk is parsed again.
    import shutil

    from gguf.gguf_reader import GGUFReader

    from llmc.compiler.models.config import read_config

    parses = []
    real_init = GGUFReader.__init__

    def counted(self, path, *args, **kwargs):
        parses.append(path)
        real_init(self, path, *args, **kwargs)

    monkeypatch.setattr(GGUFReader, "__init__", counted)
    path = shutil.copy(gguf_files["phi3"][0], tmp_path / "copy.gguf")
    info = inspect_source(SourceSpec(path=path))
    model, tokenizer = load_model(info)
    assert read_config(info).model_type == "phi3" and tokenizer is not None
    assert len(parses) == 1
    write_gguf(model, path, "phi3")  # the same bytes again, written anew: another mtime
    load_model(info)
    assert len(parses) == 2
    assert gguf.GGUFReader is GGUFReader  # nothing left replaced


@pytest.mark.parametrize("arch", ["gemma", "granite", "olmo2", "smollm3"])
def test_a_family_transformers_cannot_read_as_gguf_is_refused_naming_it(tmp_path, arch):

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(SourceError, match=rf"general.architecture '{arch}' \(model_type {GGUF_ARCHITECTURES[arch]}\) "
                                          r"is a supported family, but transformers [\d.]+'s GGUF loader cannot read "
                                          r"it; point source.path at the HF checkpoint folder.*accepted: .*qwen3"):
        inspect_source(SourceSpec(path=path))


def test_an_architecture_of_no_family_is_refused(tmp_path):

    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(SourceError, match=r"bert.gguf: general.architecture 'bert' is not a supported family; "
                                          r"GGUF architectures accepted: llama, qwen2, qwen3, gemma2, gemma3, phi3, gpt2"):
        inspect_source(SourceSpec(path=path))


def test_fields_transformers_would_drop_are_refused_naming_them(gguf_files, tmp_path):
    """transformers' qwen3 reader ignores `attention.key_length` (the config keeps head_dim 128), none
    of its readers takes llama.cpp's frequency-factor tensors, and its gemma3 reader ignores RoPE
    scaling: a file stating any of them would load as another model."""
    _, model = _hf("qwen3", tmp_path / "qwen3", head_dim=32, use_sliding_window=False, tie_word_embeddings=True)
    path = write_gguf(model, tmp_path / "qwen3.gguf", "qwen3")
    with pytest.raises(SourceError, match=r"qwen3.gguf: transformers [\d.]+ would load a different model than this "
                                          r"GGUF describes: qwen3.attention.key_length is 32 but transformers reads 128"):
        inspect_source(SourceSpec(path=path))
    _, model = _hf("qwen3", tmp_path / "qwen3_128", **GGUF_TINY["qwen3"][1])
    path = write_gguf(model, tmp_path / "llama3_freqs.gguf", "qwen3",
                      tensors={"rope_freqs.weight": np.ones(64, dtype=np.float32)})  # as llama.cpp writes Llama 3.1
    with pytest.raises(SourceError, match=r"rope_freqs / rope_factors tensors .* are not read by transformers"):
        inspect_source(SourceSpec(path=path))
    _, _, gemma3 = gguf_files["gemma3"]
    path = write_gguf(gemma3, tmp_path / "gemma3.gguf", "gemma3", rope_scaling_type=gguf.RopeScalingType.LINEAR,
                      rope_scaling_factor=8.0)
    with pytest.raises(SourceError, match=r"gemma3.rope.scaling.type is 'linear' but transformers reads no RoPE scaling"):
        inspect_source(SourceSpec(path=path))
