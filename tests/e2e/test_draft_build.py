"""The draft model in the build (compiler/draft.py, the draft stage): a separate checkpoint is exported,
verified and packaged into `1/draft/`, the target quantized makes a self-draft, the manifest names the
draft and the served model speculates with it, serving the same greedy tokens as without and counting
its proposals in the llmc_spec_decode_* metrics. A draft with another vocabulary is refused before any
work, naming both tokenizer files; the spec refuses a draft section that makes no draft."""

import json
import shutil

import pytest
from transformers import PreTrainedTokenizerFast

from checkpoints import byte_tokenizer, write_spec
from checkpoints import TINY_SERVING_SPEC
from serving_rig import complete_on_triton
from llmc.compiler import build
from llmc.compiler.pipeline.plan import plan_build
from llmc.compiler.spec import load_spec, parse_spec
from llmc.errors import SourceError, SpecError
from llmc.runtime.manifest import RepositoryManifest
from helpers import truncated
from helpers import serve_prompts, served_with_and_without_speculation

PROMPTS = ["the cat sat on the mat; the cat sat on the mat; the cat", "abcdefabcdefabcdef", "x", "hello there"]
SELF = {"quantization": {"mode": "int4-weight-only", "algorithm": "rtn"}}


def _spec(target, draft, **extra):
    return parse_spec({"name": "tiny", "source": str(target), "verify": {"enabled": False},
                       "speculative": {"method": "draft", "num_tokens": 3, "max_batch": 2, "draft": draft,
                                       "disable_batch_size": len(PROMPTS)},
                       **TINY_SERVING_SPEC, **extra})


@pytest.fixture(scope="module")
def small(tiny_checkpoints, tmp_path_factory):
    return truncated(tiny_checkpoints["llama"], tmp_path_factory.mktemp("small") / "small")


@pytest.fixture(scope="module")
def separate(tiny_checkpoints, small, tmp_path_factory):
    spec = _spec(tiny_checkpoints["llama"], {"source": str(small)}, verify={"enabled": True, "decode_steps": 8})
    return build(spec, output=tmp_path_factory.mktemp("separate") / "tiny")


@pytest.fixture(scope="module")
def self_draft(tiny_checkpoints, tmp_path_factory):
    return build(_spec(tiny_checkpoints["llama"], SELF), output=tmp_path_factory.mktemp("self") / "tiny")


@pytest.mark.parametrize("which", ["separate", "self_draft"])
def test_the_built_draft_is_packaged_named_and_served_with_the_same_greedy_tokens(which, request, tmp_path):
    result = request.getfixturevalue(which)
    version = result.repository / "tiny" / "1"
    manifest = RepositoryManifest.load(version)
    draft = manifest.speculative.draft
    assert manifest.speculative.method == "draft" and draft.model_file == "draft/model.onnx"
    assert (version / draft.model_file).is_file() and draft.kv_layout.block_size == manifest.kv_layout.block_size
    stage = next(s for s in result.stages if s.name == "draft")
    if which == "separate":
        assert (draft.source, draft.quantization, draft.kv_layout.num_layers) == ("small", "none", 1)
        assert draft.source_hash != manifest.source_hash and "greedy tokens equal" in stage.summary
    else:
        assert (draft.source, draft.quantization) == ("self", "int4-weight-only")
        assert draft.source_hash == manifest.source_hash and "perplexity" in stage.summary
    _, engine, _ = served_with_and_without_speculation(version, tmp_path, PROMPTS)  # 2 of 4 speculate
    assert engine.drafter is not None and engine.speculator.num_tokens == 3


def test_a_rebuild_reuses_the_draft_and_a_changed_draft_section_reruns_it(tiny_checkpoints, self_draft):
    again = build(_spec(tiny_checkpoints["llama"], SELF), output=self_draft.output)
    assert next(s for s in again.stages if s.name == "draft").status == "cached"
    changed = {"quantization": {**SELF["quantization"], "mode": "int8-weight-only"}}
    rebuilt = build(_spec(tiny_checkpoints["llama"], changed), output=self_draft.output)
    assert next(s for s in rebuilt.stages if s.name == "draft").status == "ran"
    assert RepositoryManifest.load(rebuilt.repository / "tiny" / "1").speculative.draft.quantization == \
        "int8-weight-only"


def test_a_draft_with_another_vocabulary_is_refused_naming_both_tokenizers(tiny_checkpoints, small, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(small, other)
    tok = byte_tokenizer()
    vocab = tok.get_vocab()
    swapped = {t: (255 - i) for t, i in vocab.items()}  # the same strings under other ids
    data = json.loads(tok.to_str())
    data["model"]["vocab"] = swapped
    (other / "tokenizer.json").write_text(json.dumps(data))
    PreTrainedTokenizerFast(tokenizer_file=str(other / "tokenizer.json")).save_pretrained(other)
    output = tmp_path / "out"
    with pytest.raises(SourceError) as err:
        build(_spec(tiny_checkpoints["llama"], {"source": str(other)}), output=output)
    assert str(other / "tokenizer.json") in str(err.value) and str(tiny_checkpoints["llama"] / "tokenizer.json") \
        in str(err.value) and "vocabulary differs" in str(err.value)
    assert not output.exists() and not list(tmp_path.glob(".out*"))  # nothing half-written


def test_a_draft_with_the_same_tokenizer_but_another_vocab_size_is_refused(tiny_checkpoints, tmp_path):
    from checkpoints import make_checkpoint

    wide = make_checkpoint("llama", tmp_path / "wide", vocab_size=300, num_hidden_layers=1)  # the byte tokenizer
    with pytest.raises(SourceError, match=r"the models' vocab_size differ \(300 vs 256\)"):
        build(_spec(tiny_checkpoints["llama"], {"source": str(wide)}), output=tmp_path / "out")


def test_the_spec_refuses_draft_sections_that_make_no_draft(tiny_llama, tmp_path):
    base = {"name": "t", "source": str(tiny_llama)}
    cases = [({"method": "draft"}, "method: draft needs a draft section"),
             ({"method": "ngram", "draft": {"source": "x"}}, "draft: is the draft model of method: draft"),
             ({"method": "draft", "draft": {}}, "a draft without a source is the target itself quantized"),
             ({"method": "draft", "draft": {"quantization": {"mode": "int8"}}}, "use int4-weight-only or")]
    for section, message in cases:
        with pytest.raises(SpecError, match=message):
            parse_spec({**base, "speculative": section})
    path = write_spec(tmp_path / "spec", {**base, "speculative": {"method": "draft", "draft": {"source": "../small"}}})
    assert load_spec(path).speculative.draft.source.path == (tmp_path / "small").resolve()


def test_the_plan_lists_the_draft(tiny_checkpoints, small):
    planned = plan_build(_spec(tiny_checkpoints["llama"], {"source": str(small)}))
    assert "draft" in planned.stages and planned.stages.index("draft") < planned.stages.index("package")
    assert any("draft" in note and "KV pools" in note for note in planned.notes)


@pytest.mark.triton
def test_on_a_real_triton_server_the_draft_serves_the_same_tokens_and_counts_its_proposals(self_draft, tmp_path):
    expected, _ = serve_prompts(self_draft.repository / "tiny" / "1", PROMPTS)
    got, metrics = complete_on_triton(self_draft.repository, tmp_path, PROMPTS, 20)
    assert got == expected
    drafted, accepted = metrics["llmc_spec_decode_draft_tokens_total"], metrics["llmc_spec_decode_accepted_tokens_total"]
    assert 0 < accepted <= drafted
