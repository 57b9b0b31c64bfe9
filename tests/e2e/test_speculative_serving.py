"""Speculative decoding from the spec to the served model: `speculative:` is carried into the
manifest, the served model builds its engine from it, serves the same tokens as without it and
reports TensorRT-LLM's speculative-decoding figures as llmc_spec_decode_* metrics."""

import pytest
from pydantic import ValidationError

from checkpoints import TINY_SERVING_SPEC
from serving_rig import complete_on_triton
from shared_builds import build_reusing_export
from helpers import serve_prompts, served_with_and_without_speculation
from llmc.compiler.spec import parse_spec
from llmc.runtime.manifest import RepositoryManifest, SpeculativeConfig

SECTION = {"method": "ngram", "num_tokens": 3, "max_batch": 2, "min_n": 1, "max_n": 2}
PROMPTS = ["the cat sat on the mat; the cat sat on the mat; the cat", "abcdefabcdefabcdef", "x"]


@pytest.fixture(scope="module")
def speculative_build(tiny_checkpoints, tmp_path_factory):
    spec = parse_spec({"name": "tiny", "source": str(tiny_checkpoints["llama"]), "export": {"attention": "paged"},
                       "verify": {"enabled": False}, "speculative": SECTION, **TINY_SERVING_SPEC})
    return build_reusing_export(tmp_path_factory, spec, tmp_path_factory.mktemp("speculative_build") / "tiny")


def test_the_served_model_speculates_as_the_manifest_says_and_serves_the_same_tokens(speculative_build, tmp_path):
    version = speculative_build.repository / "tiny" / "1"
    manifest = RepositoryManifest.load(version)
    assert manifest.speculative == SpeculativeConfig(**SECTION)
    package = next(s for s in speculative_build.stages if s.name == "package")
    assert package.summary.endswith(", speculative ngram (k 3, up to 2 rows)")
    ids, engine, values = served_with_and_without_speculation(version, tmp_path, PROMPTS)  # 2 rows speculate
    assert engine.speculator.max_batch == 2 and engine.speculator.proposer.num_tokens == 3
    drafted, accepted = values["llmc_spec_decode_draft_tokens_total"], values["llmc_spec_decode_accepted_tokens_total"]
    assert values["llmc_spec_decode_acceptance_rate"] == pytest.approx(accepted / drafted)
    # one inter-token latency per token after each request's first; several tokens of one step share its
    # wait, so a request's latencies add up to no more than its whole time
    assert len(values["llmc_inter_token_latency_seconds"]) == sum(len(i) for i in ids) - len(ids)
    assert sum(values["llmc_inter_token_latency_seconds"]) <= sum(values["llmc_request_latency_seconds"])


def test_a_manifest_refuses_speculation_on_the_slot_graph(tiny_slot_build):
    data = RepositoryManifest.load(tiny_slot_build.repository / "tiny" / "1").model_dump(mode="json")
    with pytest.raises(ValidationError, match="speculative: needs a paged graph"):
        RepositoryManifest.model_validate({**data, "speculative": SECTION})


@pytest.mark.triton
def test_on_a_real_triton_server_speculation_serves_the_same_tokens_and_exports_its_metrics(speculative_build,
                                                                                            tmp_path):
    expected, engine = serve_prompts(speculative_build.repository / "tiny" / "1", PROMPTS)
    got, metrics = complete_on_triton(speculative_build.repository, tmp_path, PROMPTS, 20)
    assert got == expected
    drafted, accepted = metrics["llmc_spec_decode_draft_tokens_total"], metrics["llmc_spec_decode_accepted_tokens_total"]
    assert 0 < accepted <= drafted
    assert metrics["llmc_spec_decode_acceptance_rate"] == pytest.approx(accepted / drafted, rel=1e-6)
