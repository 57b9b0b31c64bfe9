"""The streamed model (compiler/stream/model.py): the checkpoint's own PyTorch model run layer by layer from its
safetensors shards equals the model loaded whole, and holds one decoder layer at a time."""

import pytest
import torch

from llmc.compiler.source import inspect_source, load_model
from llmc.compiler.spec import SourceSpec
from llmc.compiler.stream.model import StreamedModel
from llmc.errors import SourceError, UnsupportedError

FAMILIES = ["llama", "gpt2", "gemma3_text", "phi3", "mixtral", "qwen3_moe", "olmo2"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_streamed_forward_equals_the_whole_model(tiny_checkpoints, model_type):
    info = inspect_source(SourceSpec(path=tiny_checkpoints[model_type]))
    whole, _ = load_model(info)
    streamed = StreamedModel(info)
    assert not streamed.loaded
    held = []
    ids = torch.tensor([[3, 17, 99, 4, 250, 8, 61, 7, 9, 30, 2, 5, 77]])  # longer than the tiny sliding windows
    with torch.no_grad(), streamed.streaming():
        for layer in streamed.layers:  # what is loaded while each layer runs (after streaming()'s own hooks)
            layer.register_forward_pre_hook(lambda module, args: held.append(sorted(streamed.loaded)))
        got = streamed.model(ids).logits
    want = whole(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    assert got[0].argmax(-1).unique().numel() > 1  # not one repeated token: a wrong model could not pass
    assert held == [[i] for i in range(streamed.num_layers)] and not streamed.loaded
    assert all(p.device.type == "meta" for layer in streamed.layers for p in layer.parameters())


def test_a_layer_loads_and_releases(tiny_checkpoints):
    info = inspect_source(SourceSpec(path=tiny_checkpoints["llama"]))
    whole, _ = load_model(info)
    streamed = StreamedModel(info)
    streamed.load_layer(1)
    for (name, got), want in zip(streamed.layers[1].named_parameters(), whole.model.layers[1].parameters()):
        assert torch.equal(got, want), name
    streamed.release_layer(1)
    assert all(p.device.type == "meta" for p in streamed.layers[1].parameters())


def test_a_missing_tensor_is_named(tiny_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    folder.mkdir()
    for f in tiny_checkpoints["llama"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    shard = next(folder.glob("*.safetensors"))
    state = load_file(shard)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, shard, metadata={"format": "pt"})
    streamed = StreamedModel(inspect_source(SourceSpec(path=folder)))
    with pytest.raises(SourceError, match="layer 1 has no mlp.up_proj.weight"):
        streamed.load_layer(1)
    assert not streamed.loaded


def test_pickle_checkpoints_are_refused_naming_the_setting(tiny_checkpoints, tmp_path):
    from checkpoints import make_checkpoint

    folder = make_checkpoint("llama", tmp_path / "pickle", safe=False)
    info = inspect_source(SourceSpec(path=folder, allow_pickle=True))
    with pytest.raises(UnsupportedError, match="pickle.*source.load: whole"):
        StreamedModel(info)
