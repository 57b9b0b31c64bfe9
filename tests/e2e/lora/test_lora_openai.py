"""LoRA adapters served by a real Triton server (the tiny Llama built with two adapters, lora_build.py), through
tritonclient's `lora_name` and through the OpenAI API with the `openai` SDK (an adapter's name as `model`): each
adapter's greedy text equals PEFT's generate, `/v1/models` lists the adapters with their parent, and an unknown
adapter is a 4xx that names it (OpenAI: 404 model_not_found; Triton: an error naming lora_name)."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from lora_build import lora_build, peft_greedy
from serving_rig import SERVING_ENV, serving_env

pytestmark = pytest.mark.triton
PROMPT = "the adapters say"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def built(tiny_checkpoints, tmp_path_factory):
    return lora_build(tmp_path_factory, tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def triton(built, tmp_path_factory):
    from llmc.triton_server import TritonServer, assemble

    serving_env()  # skips without .venv-serving
    root = tmp_path_factory.mktemp("lora-triton")
    shutil.copytree(built[0].parents[1], root / "repository")  # model_repository/ (hard links are copied)
    with TritonServer(root / "repository", server_dir=assemble(root / "server"), serving_env=SERVING_ENV,
                      log_path=root / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def client(triton):
    from llmc.openai.server import OpenAIServer
    from llmc.triton_server import free_port

    with OpenAIServer([triton.grpc_url], port=free_port()) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def expected(built, tiny_checkpoints) -> dict[str | None, str]:
    """PEFT's greedy text for PROMPT under each adapter and none, cut after an end id as the server cuts it."""
    from llmc.runtime.decoding.tokenizer import encode, load
    from llmc.runtime.manifest import RepositoryManifest

    version, adapters = built
    tokenizer, end_ids = load(version / "tokenizer.json"), RepositoryManifest.load(version).end_ids
    ids = encode(tokenizer, PROMPT)
    names = [None, "a", "b"]
    texts = {}
    for name, tokens in zip(names, peft_greedy(tiny_checkpoints["llama"], adapters, [(ids, n) for n in names],
                                               MAX_TOKENS)):
        cut = next((i for i, t in enumerate(tokens) if t in end_ids), len(tokens))
        texts[name] = tokenizer.decode(tokens[:cut])
    assert len(set(texts.values())) == 3  # each adapter changes the text its own way
    return texts


def test_models_lists_each_adapter_with_its_parent(client):
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {"tiny_lora", "a", "b"}
    assert models["a"].parent == models["b"].parent == "tiny_lora" and getattr(models["tiny_lora"], "parent", None) is None


def test_openai_model_names_the_adapter_and_its_text_equals_peft(client, expected):
    def complete(model):
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        return reply.model, reply.choices[0].text

    with ThreadPoolExecutor(3) as pool:  # at once: the server batches base, A and B into the same steps
        got = list(pool.map(complete, ["tiny_lora", "a", "b"]))
    assert got == [("tiny_lora", expected[None]), ("a", expected["a"]), ("b", expected["b"])]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="b", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert streamed == expected["b"]


def test_an_unknown_adapter_is_a_404_and_nothing_runs(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="c", prompt=PROMPT, max_tokens=4)
    body = err.value.body
    assert body["code"] == "model_not_found" and "'c'" in body["message"] and "a, b" in body["message"]


def test_tritonclient_names_the_adapter_with_lora_name(triton, expected):
    from llmc.client import Client, Refused

    with Client(triton.grpc_url, model="tiny_lora") as c:
        assert c.complete(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, lora_name="a").text == expected["a"]
        assert c.complete(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0).text == expected[None]
        with pytest.raises(Refused, match=r"lora_name: this model serves no adapter 'c' \(its adapters: a, b\)"):
            c.complete(PROMPT, max_tokens=4, lora_name="c")
