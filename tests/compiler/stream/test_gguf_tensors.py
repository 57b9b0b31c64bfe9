"""A GGUF source read a tensor at a time (compiler/stream/gguf_tensors.py): every tensor under the name and with the
values transformers' whole-file GGUF load gives it, each dequantized alone, quantized ones included; names
transformers assembles from several GGUF tensors are refused naming them."""

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from checkpoints import TINY
from llmc.compiler.stream.gguf_tensors import GGUFTensors
from llmc.compiler.stream.tensors import checkpoint_tensors, layer_of
from llmc.errors import SourceError

# tests/compiler: its GGUF writer (test_gguf.py), imported under the name pytest collects it by
if str(Path(__file__).parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parents[1]))
from test_gguf import GGUF_TINY, write_gguf  # noqa: E402

# GGUF architecture -> (model type, config overrides); llama's q/k are reverse-permuted on load, Gemma's norms offset
ARCHS = {"llama": ("llama", {}), **GGUF_TINY}


def _model(model_type: str, **config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**TINY[model_type], **config}))
    with torch.no_grad():  # norms off their initial values, so that an offset left out shows
        for name, param in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                param.add_(torch.randn_like(param) * 0.3)
    return model.eval()


def _write_gpt2(model, path: Path) -> Path:
    """`model` as llama.cpp writes GPT-2: its Conv1D weights transposed to (out, in), a separate output.weight."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_context_length(c.n_positions)
    writer.add_embedding_length(c.n_embd)
    writer.add_feed_forward_length(4 * c.n_embd)
    writer.add_block_count(c.n_layer)
    writer.add_head_count(c.n_head)
    writer.add_layer_norm_eps(c.layer_norm_epsilon)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<{i}>" for i in range(c.vocab_size)])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, c.n_layer)
    for name, tensor in model.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        value = tensor.numpy().astype(np.float32)
        if suffix == "weight" and any(part in name for part in ("c_attn", "c_proj", "c_fc")):
            value = np.ascontiguousarray(value.T)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """arch -> (the GGUF file, the HF model it was written from)."""
    root = tmp_path_factory.mktemp("gguf_tensors")
    made = {}
    for arch, (model_type, config) in ARCHS.items():
        model = _model(model_type, **config)
        extra = {"rope_freqs.weight": np.ones(8, dtype=np.float32)} if arch == "llama" else None  # transformers drops it
        made[arch] = write_gguf(model, root / f"{arch}.gguf", arch, tensors=extra), model
    model = _model("gpt2", tie_word_embeddings=False)
    made["gpt2"] = _write_gpt2(model, root / "gpt2.gguf"), model
    return made


def _whole_load(path: Path, model) -> dict:
    """transformers' whole-file load: its tensors by name (`model` only gives the names)."""
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


def _raw(path: Path) -> dict:
    """The file's tensors as stored (dequantized, no processing), by GGUF name."""
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors}


# per arch: how many tensors the processor changes (llama: q and k per layer; Gemma: its norms; GPT-2: 4 Conv1D
# weights per layer transposed). qwen3's q/k are stored as HF has them: its processor is transformers' default.
CHANGED = {"llama": 2 * 2, "qwen3": 0, "phi3": 0, "gemma2": 2 * 4 + 1, "gemma3": 6 * 6 + 1, "gpt2": 2 * 4}


@pytest.mark.parametrize("arch", [*ARCHS, "gpt2"])
def test_every_tensor_loads_as_the_whole_file_load_gives_it(gguf_files, arch):
    path, model = gguf_files[arch]
    whole = _whole_load(path, model)
    tensors = GGUFTensors(path)
    assert sorted(tensors.keys()) == sorted(whole) and len(set(tensors.keys())) == len(whole)
    assert not any("rope_freqs" in key for key in tensors.keys())
    for key in tensors.keys():
        value = tensors.load(key)
        assert value.dtype == torch.float32 and value.shape == whole[key].shape, key
        assert torch.equal(value, whole[key]), key
    # the processing matters: as many tensors differ from every stored one as the processor changes
    raw = list(_raw(path).values())
    changed = sum(not any(v.shape == tensors.load(key).shape and np.array_equal(v, tensors.load(key).numpy())
                          for v in raw) for key in tensors.keys())
    assert changed == CHANGED[arch]
    assert {layer_of(key) for key in tensors.keys()} == {None, *range(model.config.num_hidden_layers)}


def test_gpt2_lm_head_comes_from_what_its_processor_stores(gguf_files):
    # transformers' GPT-2 processor stores output.weight as lm_head.weight itself, outside the name map
    path, model = gguf_files["gpt2"]
    tensors = GGUFTensors(path)
    assert "lm_head.weight" in tensors.keys()
    torch.testing.assert_close(tensors.load("lm_head.weight"), model.state_dict()["lm_head.weight"], rtol=0, atol=0)
    torch.testing.assert_close(tensors.load("transformer.h.0.attn.c_attn.weight"),
                               model.state_dict()["transformer.h.0.attn.c_attn.weight"], rtol=0, atol=0)


def test_one_tensor_read_dequantizes_only_it(gguf_files, monkeypatch):
    path, model = gguf_files["llama"]
    real, calls = gguf.dequantize, []

    def counted(data, qtype):
        calls.append(data.shape)
        return real(data, qtype)

    monkeypatch.setattr(gguf, "dequantize", counted)  # as transformers calls it
    tensors = GGUFTensors(path)
    assert calls == []  # naming the tensors reads none
    value = tensors.load("model.layers.1.self_attn.k_proj.weight")
    assert calls == [value.shape]
    _whole_load(path, model)  # the counter sees transformers' reads too: one per tensor of the file
    assert len(calls) == 1 + len(gguf.GGUFReader(str(path)).tensors)


def test_quantized_tensors_dequantize_as_transformers_does(tmp_path, monkeypatch):
    """Q8_0 matrices and F16 vectors, as a quantized llama.cpp file stores them."""
    model = _model("llama")
    real_add = gguf.GGUFWriter.add_tensor

    def add_quantized(self, name, tensor, *args, **kwargs):
        if tensor.ndim == 2:
            return real_add(self, name, gguf.quants.quantize(tensor, gguf.GGMLQuantizationType.Q8_0),
                            raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        return real_add(self, name, tensor.astype(np.float16), *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_quantized)
    path = write_gguf(model, tmp_path / "q8.gguf", "llama")
    monkeypatch.undo()
    types = {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types == {gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16}
    whole = _whole_load(path, model)
    tensors = GGUFTensors(path)
    assert sorted(tensors.keys()) == sorted(whole)
    for key in tensors.keys():
        value = tensors.load(key)
        assert value.dtype == torch.float32 and torch.equal(value, whole[key]), key
    embed = tensors.load("model.embed_tokens.weight")  # quantized: near the fp32 weights, not equal
    reference = model.state_dict()["model.embed_tokens.weight"]
    assert not torch.equal(embed, reference)
    torch.testing.assert_close(embed, reference, rtol=0, atol=reference.abs().max().item() / 100)


def test_a_name_made_from_several_tensors_is_refused_naming_them(gguf_files, monkeypatch):
    # as transformers' MoE processors do (gate and up experts into one gate_up_proj); none of llmc's GGUF families
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    class Merging(gguf_utils.TensorProcessor):
        def process(self, weights, name, **kwargs):
            if ".attn_q." in name or ".attn_k." in name:
                kwargs["parsed_parameters"]["tensors"]["model.layers.0.self_attn.qk"] = torch.zeros(1)
                return gguf_utils.GGUFTensor(weights, None, {})
            return gguf_utils.GGUFTensor(weights, name, {})

    monkeypatch.setitem(gguf_utils.TENSOR_PROCESSORS, "llama", Merging)
    with pytest.raises(SourceError, match=r"llama.gguf: transformers' Merging builds model.layers.0.self_attn.qk from "
                                          r"several GGUF tensors \(blk.0.attn_q.weight, blk.0.attn_k.weight, \.\.\.\)"):
        GGUFTensors(gguf_files["llama"][0])


def test_a_source_gguf_is_read_through_gguf_tensors(gguf_files):
    from llmc.compiler.source import inspect_source
    from llmc.compiler.spec import SourceSpec

    tensors = checkpoint_tensors(inspect_source(SourceSpec(path=gguf_files["qwen3"][0])))
    assert isinstance(tensors, GGUFTensors) and "model.layers.1.mlp.down_proj.weight" in tensors.keys()


def test_an_unreadable_file_is_refused(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"not a gguf at all")
    with pytest.raises(SourceError, match=r"bad.gguf: transformers could not read this GGUF file"):
        GGUFTensors(path)



def _present_pages(address: int, length: int) -> int:
    """How many of the pages holding [address, address + length) are mapped into this process now
    (/proc/self/pagemap: bit 63 of a page's entry)."""
    import mmap
    import struct

    first, last = address // mmap.PAGESIZE, (address + length - 1) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = struct.unpack(f"{last - first + 1}Q", f.read(8 * (last - first + 1)))
    return sum(entry >> 63 for entry in entries)


@pytest.mark.skipif(not Path("/proc/self/pagemap").is_file(), reason="reads Linux's /proc/self/pagemap")
def test_a_read_tensor_leaves_none_of_its_pages_mapped(gguf_files, tmp_path):
    """The reader maps the whole file for the whole build: a tensor's pages leave the process once it is read (at 8B
    a Q8_0 file's 8.5 GB stayed resident), while every value still reads as before."""
    import shutil

    path = shutil.copy(gguf_files["llama"][0], tmp_path / "fresh.gguf")  # a map of its own, untouched by others
    tensors = GGUFTensors(path)
    base = tensors._reader.data.ctypes.data
    values = {}
    for key in tensors.keys():
        tensor = tensors._where[key][0]
        values[key] = tensors.load(key)
        assert _present_pages(base + tensor.data_offset, tensor.n_bytes) == 0, key
    tensor = tensors._where["model.embed_tokens.weight"][0]
    np.asarray(tensor.data).sum()  # read again: the pages fault back in, so the check above can fail
    assert _present_pages(base + tensor.data_offset, tensor.n_bytes) > 0
    assert all(torch.equal(tensors.load(key), value) for key, value in values.items())
