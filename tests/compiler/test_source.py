"""Loading sources: supported architectures only, safetensors by default, pickle only when asked."""

import json

import pytest

from llmc.compiler.models import SUPPORTED_MODEL_TYPES
from llmc.compiler.source import inspect_source, load_model
from llmc.compiler.spec import SourceSpec
from llmc.errors import SourceError

from checkpoints import make_checkpoint


def test_unsupported_architecture_lists_the_supported_ones(tmp_path, tiny_llama):
    ckpt = tmp_path / "bert"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(SourceError) as err:
        inspect_source(SourceSpec(path=ckpt))
    assert "'bert' is not supported" in str(err.value)
    for name in SUPPORTED_MODEL_TYPES:
        assert name in str(err.value)


@pytest.mark.parametrize("layout, message", [
    ("missing", "does not exist"),
    ("no_config", "no config.json"),
    ("bad_config", "not valid JSON"),
    ("no_weights", "no weights found"),
    ("text_file", "not a .gguf"),
    ("bad_gguf", "not a readable GGUF file"),
])
def test_bad_sources_are_named(tmp_path, layout, message):
    path = tmp_path / "src"
    if layout == "no_config":
        path.mkdir()
    elif layout in ("bad_config", "no_weights"):
        path.mkdir()
        (path / "config.json").write_text("{" if layout == "bad_config" else '{"model_type": "llama"}')
    elif layout == "text_file":
        path = tmp_path / "weights.txt"
        path.write_text("hello")
    elif layout == "bad_gguf":
        path = tmp_path / "model.gguf"
        path.write_bytes(b"not a gguf at all")
    with pytest.raises(SourceError, match=message) as err:
        inspect_source(SourceSpec(path=path))
    assert str(path) in str(err.value)


def test_pickle_checkpoint_needs_opt_in(tmp_path):
    ckpt = make_checkpoint("llama", tmp_path / "pickled", safe=False, tokenizer=False)
    with pytest.raises(SourceError, match="allow_pickle: true"):
        inspect_source(SourceSpec(path=ckpt))
    info = inspect_source(SourceSpec(path=ckpt, allow_pickle=True))
    assert info.uses_pickle
    model, tokenizer = load_model(info)
    assert tokenizer is None and model.config.model_type == "llama"


def test_pickle_loader_uses_weights_only(tmp_path, monkeypatch):
    import torch

    ckpt = make_checkpoint("gpt2", tmp_path / "pickled", safe=False)
    seen = []
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    load_model(inspect_source(SourceSpec(path=ckpt, allow_pickle=True)))
    assert seen == [True]


def test_content_hash_follows_the_weights(tmp_path):
    a = make_checkpoint("llama", tmp_path / "a", seed=0)
    b = make_checkpoint("llama", tmp_path / "b", seed=0)
    c = make_checkpoint("llama", tmp_path / "c", seed=1)
    ha, hb, hc = (inspect_source(SourceSpec(path=p)).content_hash() for p in (a, b, c))
    assert ha == hb != hc


def test_remote_code_is_never_run(tmp_path):
    ckpt = make_checkpoint("llama", tmp_path / "rc")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    model, _ = load_model(inspect_source(SourceSpec(path=ckpt)))
    assert type(model).__name__ == "LlamaForCausalLM"


def test_the_tokenizer_is_loaded_once_until_a_file_beside_the_weights_changes(tmp_path, tiny_llama):
    import os
    import shutil

    from llmc.compiler.source import load_tokenizer

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    first = load_tokenizer(inspect_source(SourceSpec(path=ckpt)))
    assert first is not None and load_tokenizer(inspect_source(SourceSpec(path=ckpt))) is first
    config = ckpt / "tokenizer_config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    again = load_tokenizer(inspect_source(SourceSpec(path=ckpt)))
    assert again is not first and again.get_vocab() == first.get_vocab()
