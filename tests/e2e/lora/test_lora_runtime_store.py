"""Adapters loaded while serving, through the repository's store (llmc/fleet/adapters.py): on a real Triton server
and the OpenAI API's /v1/load_lora_adapter and /v1/unload_lora_adapter (allowed by the flag), a PEFT adapter loaded
from disk serves PEFT's text under its name and is listed with its parent, one made for another base is a 400 that
names it, and an unload makes it a 404; on S3 (moto), an adapter written into the store is served by a replica that
starts afterwards."""

from __future__ import annotations

import shutil

import httpx
import pytest

from lora_build import ADAPTER_A, lora_build, make_adapter, peft_greedy

PROMPT = "the store says"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def built(tiny_checkpoints, tmp_path_factory):
    return lora_build(tmp_path_factory, tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def adapter_c(tiny_checkpoints, tmp_path_factory):
    return make_adapter(tiny_checkpoints["llama"], tmp_path_factory.mktemp("store-adapter") / "c", 21, **ADAPTER_A)


def peft_tokens(built, tiny_checkpoints, folder) -> tuple[list[int], str]:
    from llmc.runtime.decoding.tokenizer import encode, load

    tokenizer = load(built[0] / "tokenizer.json")
    tokens = peft_greedy(tiny_checkpoints["llama"], {"c": folder}, [(encode(tokenizer, PROMPT), "c")], MAX_TOKENS)[0]
    return tokens, tokenizer


@pytest.mark.triton
def test_openai_loads_an_adapter_from_disk_until_it_serves_and_unloads_it(built, adapter_c, tiny_checkpoints,
                                                                          tmp_path):
    from serving_rig import SERVING_ENV, serving_env

    from llmc.openai.server import OpenAIServer
    from llmc.triton_server import TritonServer, assemble, free_port

    serving_env()
    repository = tmp_path / "repository"
    shutil.copytree(built[0].parents[1], repository)
    other = make_adapter(tiny_checkpoints["qwen3"], tmp_path / "q", 3, r=2, lora_alpha=4, target_modules=["q_proj"])
    tokens, tokenizer = peft_tokens(built, tiny_checkpoints, adapter_c)
    with TritonServer(repository, server_dir=assemble(tmp_path / "server"), serving_env=SERVING_ENV,
                      log_path=tmp_path / "server.log") as triton, \
            OpenAIServer([triton.grpc_url], port=free_port(), allow_lora_updates=True, repository=str(repository),
                         health_interval=0.5) as api, httpx.Client(base_url=f"{api.url}/v1", timeout=120) as http:
        bad = http.post("/load_lora_adapter", json={"lora_name": "q", "lora_path": str(other)})
        assert bad.status_code == 400 and "adapter 'q'" in bad.json()["error"]["message"]
        assert "another base" in bad.json()["error"]["message"]
        loaded = http.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapter_c)})
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["parent"] == "tiny_lora" and loaded.json()["servers"] == [triton.grpc_url]
        models = {m["id"]: m.get("parent") for m in http.get("/models").json()["data"]}
        assert models == {"tiny_lora": None, "a": "tiny_lora", "b": "tiny_lora", "c": "tiny_lora"}
        reply = http.post("/completions", json={"model": "c", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                "temperature": 0}).json()
        assert reply["model"] == "c" and reply["choices"][0]["text"] == tokenizer.decode(tokens)
        assert (repository / "tiny_lora" / "adapters" / "index.json").is_file()
        gone = http.post("/unload_lora_adapter", json={"lora_name": "c"})
        assert gone.status_code == 200, gone.text
        missing = http.post("/completions", json={"model": "c", "prompt": PROMPT, "max_tokens": 2})
        assert missing.status_code == 404
        again = http.post("/unload_lora_adapter", json={"lora_name": "c"})
        assert again.status_code == 404 and again.json()["error"]["code"] == "adapter_not_found"


def test_an_adapter_written_into_an_s3_store_is_served_by_a_replica_started_afterwards(built, adapter_c,
                                                                                     tiny_checkpoints, tmp_path):
    from s3_server import bucket_server

    from llmc.fleet import adapters
    from llmc.fleet.objectstore import open_store
    from llmc.runtime.decoding.sampling import SamplingParams
    from llmc.runtime.decoding.tokenizer import encode
    from llmc.runtime.serving.loader import load

    version = built[0]
    with bucket_server() as s3:
        store = open_store(f"s3://{s3.endpoint}/models/repo")
        store.upload_version("tiny_lora", 1, version)
        store.write("tiny_lora", "config.pbtxt", (version.parent / "config.pbtxt").read_text())
        result = adapters.load(store, None, "c", adapter_c)
        assert result["model"] == "tiny_lora" and result["replicas"] == {}
        assert adapters.listing(store, None)["store"] == ["a", "b", "c"]
        local = tmp_path / "tiny_lora"  # what Triton copies of the model's folder from S3 when it loads it
        for key in s3.keys("models", "repo/tiny_lora/"):
            path = local / key.removeprefix("repo/tiny_lora/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(s3.client().get_object(Bucket="models", Key=key)["Body"].read())
        adapters.unload(store, None, "a")
        assert adapters.listing(store, None)["store"] == ["b", "c"]
    engine, tokenizer, _ = load(local / "1")
    try:
        assert engine.lora.store.names == ["a", "b", "c"]  # the copy was made before `a` was unloaded
        tokens, _ = peft_tokens(built, tiny_checkpoints, adapter_c)
        engine.add_request("r", encode(tokenizer, PROMPT), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                           adapter="c")
        got = []
        while engine.has_work:
            got += [t for o in engine.step() for t in o.token_ids]
        assert got == tokens
    finally:
        engine.close()
