"""Every new model family served by a real Triton server equals its checkpoint's own PyTorch model, on
prompts longer than its windows, each attention feature at least once: Gemma 2 (windows, attention and
final logit softcap, query_pre_attn_scalar, sandwich norms), Phi-3 (fused projections, partial rotary,
a LongRoPE switch crossed while decoding), SmolLM3 (no-RoPE layers beside sliding ones), Gemma 3 (q/k
norms, a local and a global RoPE), Qwen3 (per-head q/k norms, a sliding layer), Gemma, Granite
(multipliers), OLMo 2 (post-norm) and Nemotron (partial rotary in the op's tables), and the mixtures of
experts: Mixtral, Qwen3-MoE (a dense layer between sparse ones) and gpt-oss (attention sinks, YaRN, biased
and clamped experts). One server holds all twelve models."""

import shutil

import pytest

from checkpoints import byte_tokenizer
from checkpoints import TINY_SERVING_SPEC
from serving_rig import greedy_reference, serving_env
from shared_builds import build_reusing_export

pytestmark = [pytest.mark.triton, pytest.mark.slow]
FAMILIES = ("gemma2", "phi3", "smollm3", "gemma3_text", "qwen3", "gemma", "granite", "olmo2", "nemotron", "mixtral",
            "qwen3_moe", "gpt_oss")
PROMPTS = ("The capital of France is, as everyone knows,",  # 44 tokens: past every window (8)
           "Once upon a time, in a small village by the sea, there lived an old fisherman called")  # 85


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    from llmc.compiler.spec import parse_spec
    from llmc.triton_server import TritonServer, assemble

    env = serving_env()  # skips without .venv-serving
    root = tmp_path_factory.mktemp("families")
    repository = root / "repository"
    limits = {**TINY_SERVING_SPEC["limits"], "max_seq_len": 160, "max_num_tokens": 96}
    for model_type in FAMILIES:  # verified elsewhere (tests/compiler/models): packaged here without it
        name = model_type.replace("_", "-")
        spec = parse_spec({"name": name, "source": str(tiny_checkpoints[model_type]), **TINY_SERVING_SPEC,
                           "limits": limits, "verify": {"enabled": False}})
        # the export test_family_builds.py made and verified, when it ran first in this run (else made here)
        built = build_reusing_export(tmp_path_factory, spec, root / name)
        shutil.copytree(built.repository / name, repository / name)
    with TritonServer(repository, server_dir=assemble(root / "server"), serving_env=env,
                      log_path=root / "server.log") as server:
        yield server


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_output_equals_the_checkpoints_own_model(served, tiny_checkpoints, model_type):
    from llmc.client import Client
    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec

    model = load_model(inspect_source(SourceSpec(path=tiny_checkpoints[model_type])))[0]
    eos = model.config.eos_token_id
    client = Client(served.grpc_url, model_type.replace("_", "-"))
    for prompt in PROMPTS:  # phi3: 85 + 30 tokens cross its LongRoPE switch (88) while decoding
        ids = byte_tokenizer().encode(prompt).ids
        want = greedy_reference(model, ids, 30, end_ids=(eos,) if isinstance(eos, int) else tuple(eos or ()))
        assert client.complete(prompt, max_tokens=30).output_ids == want
        assert len(set(want)) > 2, f"{model_type}: degenerate output {want}"  # not one token repeated


def test_the_openai_api_serves_the_mixtures_unchanged(served, tiny_checkpoints):
    """The OpenAI frontend in front of the same server: a completion through the openai SDK is each mixture's
    own greedy continuation."""
    import openai

    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec
    from llmc.openai.server import OpenAIServer
    from llmc.triton_server import free_port

    ids = byte_tokenizer().encode(PROMPTS[0]).ids
    with OpenAIServer([served.grpc_url], port=free_port()) as api:
        client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0)
        for model_type in ("mixtral", "qwen3_moe", "gpt_oss"):
            model = load_model(inspect_source(SourceSpec(path=tiny_checkpoints[model_type])))[0]
            want = byte_tokenizer().decode(greedy_reference(model, ids, 16, end_ids=()))
            got = client.completions.create(model=model_type.replace("_", "-"), prompt=PROMPTS[0], max_tokens=16,
                                            temperature=0)
            assert got.choices[0].text == want, model_type
