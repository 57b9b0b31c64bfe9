"""The served tokenizer (compiler/repository/tokenizer.py) is the one transformers' AutoTokenizer uses,
and the check (compiler/repository/tokenizer_check.py) compares it with transformers on encode, decode and
the chat template, failing the package stage at the first difference that remains."""

import json

import pytest

from llmc.compiler.repository.tokenizer_check import check_tokenizer, sample_texts
from llmc.compiler.repository.package import package
from llmc.compiler.source import SourceInfo
from llmc.errors import VerifyError
from llmc.runtime.decoding.tokenizer import encode, load
from tokenizer_cases import FAMILIES, qwen2_bytelevel


def _source(folder) -> SourceInfo:
    return SourceInfo(path=folder, kind="hf", model_type="qwen2", weight_files=(), hashed_files=(), uses_pickle=False,
                      max_position_embeddings=None)


def _package(tiny_build, folder, out, **spec_fields):
    """The package stage over the tiny build's graph, with `folder`'s tokenizer as the checkpoint's."""
    spec = tiny_build.spec.model_copy(update=spec_fields)
    return package(spec, tiny_build.exported, tiny_build.exported, tiny_build.output / "export", _source(folder), out)


def test_the_repository_serves_autotokenizers_pipeline_not_the_file_as_shipped(tiny_build, tmp_path):
    """Qwen2Tokenizer rebuilds a plain byte-level tokenizer.json with Qwen2's own split and NFC: the
    repository's tokenizer.json must encode as it does (a copy of the shipped file does not)."""
    from transformers import AutoTokenizer

    folder = qwen2_bytelevel(tmp_path / "qwen2")
    hf = AutoTokenizer.from_pretrained(folder)
    assert type(hf).__name__ == "Qwen2Tokenizer"
    text = "def f(x):\n    return x ** 12345  # café, cafe\u0301 🎉"
    shipped = load(folder / "tokenizer.json")
    assert encode(shipped, text) != hf(text)["input_ids"]  # the case: the file as shipped tokenizes differently
    _package(tiny_build, folder, tmp_path / "repo")
    served = load(tmp_path / "repo" / "tiny" / "1" / "tokenizer.json")
    for sample in (text, *sample_texts(hf)):
        assert encode(served, sample) == hf(sample)["input_ids"], sample


@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_the_check_names_the_class_and_the_first_differing_text(family, tmp_path):
    """The shipped files of these two encode differently from their AutoTokenizer classes (Qwen2's
    split; LlamaTokenizer's Metaspace against Phi-3's prepending normalizer): checked as if served,
    the check fails naming both."""
    from transformers import AutoTokenizer

    folder = FAMILIES[family](tmp_path / family)
    hf = AutoTokenizer.from_pretrained(folder)
    with pytest.raises(VerifyError) as err:
        check_tokenizer(hf, folder / "tokenizer.json", None, origin=str(folder))
    message = str(err.value)
    assert message.startswith(f"{folder}: ") and type(hf).__name__ in message
    first = next(t for t in sample_texts(hf) if encode(load(folder / "tokenizer.json"), t) != hf(t)["input_ids"])
    assert f"first differing text {first!r}" in message


def test_a_difference_the_file_cannot_carry_fails_the_build_and_leaves_no_tokenizer(tiny_build, tmp_path):
    """`split_special_tokens` lives in transformers, not in tokenizer.json: the served tokenizer reads
    `<|im_end|>` as one token where transformers splits it, so packaging fails and writes nothing;
    with verify.enabled false the check is skipped."""
    folder = qwen2_bytelevel(tmp_path / "qwen2")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    with pytest.raises(VerifyError, match=r"Qwen2Tokenizer .* first differing text '<\|"):
        _package(tiny_build, folder, tmp_path / "repo")
    assert not any(p.name.startswith("tokenizer.json") for p in (tmp_path / "repo" / "tiny" / "1").iterdir())
    off = tiny_build.spec.verify.model_copy(update={"enabled": False})
    _package(tiny_build, folder, tmp_path / "unchecked", verify=off)
    assert (tmp_path / "unchecked" / "tiny" / "1" / "tokenizer.json").is_file()


def test_the_chat_check_compares_the_served_prompts_ids_with_apply_chat_template(tmp_path):
    """Gemma's template writes `{{ bos_token }}` and its tokenizer adds one: rendered by llmc and
    encoded as a chat prompt is served (no added special tokens), the ids are apply_chat_template's.
    A recorded template whose rendering differs from transformers' (here: no BOS text) fails, naming
    the class and the prompt."""
    from transformers import AutoTokenizer

    folder = FAMILIES["gemma"](tmp_path / "gemma")
    hf = AutoTokenizer.from_pretrained(folder)
    special = {k: v for k, v in hf.special_tokens_map.items() if isinstance(v, str)}
    served = tmp_path / "served.json"
    served.write_text(hf.backend_tokenizer.to_str())
    assert check_tokenizer(hf, served, {"template": hf.chat_template, "special_tokens": special},
                           origin="x") == len(sample_texts(hf)) + 3
    with pytest.raises(VerifyError, match="GemmaTokenizer .*first differing chat prompt '<start_of_turn>user"):
        check_tokenizer(hf, served, {"template": hf.chat_template, "special_tokens": {**special, "bos_token": ""}},
                        origin="x")


def test_smollm2s_packaged_tokenizer_is_its_shipped_pipeline(smollm2, tmp_path):
    """The example's tokenizer.json is already what AutoTokenizer runs: re-serialized, every part of
    the pipeline is the shipped one's, and it passes the check (with its chat template)."""
    from transformers import AutoTokenizer

    from llmc.compiler.repository.tokenizer import write_tokenizer

    hf = AutoTokenizer.from_pretrained(smollm2)
    chat = {"template": hf.chat_template,
            "special_tokens": {k: v for k, v in hf.special_tokens_map.items() if isinstance(v, str)}}
    assert write_tokenizer(hf, tmp_path / "tokenizer.json", origin=str(smollm2), chat_template=chat) > 10
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == json.loads((smollm2 / "tokenizer.json").read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]
