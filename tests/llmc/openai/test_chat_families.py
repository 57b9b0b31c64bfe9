"""Each family's chat template shape through the OpenAI API: a /v1/chat/completions request to the
FastAPI app (llmc/openai/app.py) reaches the served model as the ids transformers'
apply_chat_template gives. Only the gRPC hop is left out: the pool hands the request's tensors, as
llmc's client makes them, to the runtime's serving loop (runtime/serving/loop.py) over the packaged
tokenizer, and answers with the prompt ids the engine was given."""

import asyncio
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from tokenizer_cases import FAMILIES

SYSTEM_USER = [{"role": "system", "content": "You answer in one line."},
               {"role": "user", "content": "Write def add(a, b): in Python,  with   spaces. 🎉"}]
TURNS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello — how can I help?"},
         {"role": "user", "content": "Café au lait?\n\nMerci!"}]


class _Engine:
    """Records the prompt ids the serving loop gives it."""

    end_ids: tuple[int, ...] = ()  # what the loop's guide compiler reads (no guide is sent here)

    def __init__(self):
        self.prompts: list[list[int]] = []

    def add_request(self, request_id, prompt_ids, params, logprobs=None, adapter=None):
        self.prompts.append(list(prompt_ids))


class _Sink:
    def __init__(self):
        self.errors: list[str] = []

    def send(self, outputs, final):
        pass

    def error(self, message):
        self.errors.append(message)


def _as_triton_hands_them(tensors) -> dict[str, np.ndarray]:
    """tritonclient InferInputs as the Python backend's model receives them (numpy arrays by name)."""
    from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

    out = {}
    for t in tensors:
        raw = t._raw_content
        array = deserialize_bytes_tensor(raw) if t.datatype() == "BYTES" else \
            np.frombuffer(raw, dtype=triton_to_np_dtype(t.datatype()))
        out[t.name()] = array.reshape(list(t.shape()))
    return out


class _InProcessPool:
    """What app.py asks of its Pool for a chat request (resolve, info, pick, generate), with the model served
    in process: the client's input tensors into the runtime's ServingLoop.submit."""

    def __init__(self, chat_template: dict, tokenizer):
        from llmc.openai.backends import ModelInfo
        from llmc.runtime.serving.loop import ServingLoop
        from llmc.runtime.serving.request import Limits

        self.model = ModelInfo("m", "1", chat_template)
        self.engine = _Engine()
        self.loop = ServingLoop(self.engine, tokenizer, Limits(max_seq_len=512, default_max_tokens=8,
                                                                max_stop_words=4))

    def resolve(self, model):
        return model, None  # a model, never a LoRA adapter: this model serves none

    def info(self, model):
        return self.model

    def pick(self, model):
        return None, self.model

    async def generate(self, backend, model, prompt, stream, gen, params):
        import tritonclient.grpc as grpc

        from llmc.client.generation import make_inputs

        sink = _Sink()
        self.loop.submit(_as_triton_hands_them(make_inputs(grpc, prompt, stream, params)), sink)
        assert not sink.errors, sink.errors
        gen.finish_reason = "stop"
        await asyncio.sleep(0)
        yield json.dumps(self.engine.prompts[-1])


@pytest.fixture(params=["gemma", "phi3"])
def family(request, tmp_path, monkeypatch):
    return _serve(request.param, tmp_path, monkeypatch)


def _serve(name: str, tmp_path, monkeypatch):
    """(name, transformers' tokenizer, the OpenAI app's test client over the packaged tokenizer and the
    chat template the build records)."""
    from transformers import AutoTokenizer

    import llmc.openai.app as app_module
    from llmc.chat_template import parse_parameter
    from llmc.compiler.repository.chat_template import find_chat_template
    from llmc.compiler.repository.tokenizer import write_tokenizer
    from llmc.compiler.source import SourceInfo
    from llmc.runtime.decoding.tokenizer import load

    folder = FAMILIES[name](tmp_path / name)
    hf = AutoTokenizer.from_pretrained(folder)
    source = SourceInfo(path=folder, kind="hf", model_type=name, weight_files=(), hashed_files=(),
                        uses_pickle=False, max_position_embeddings=None)
    chat = parse_parameter(find_chat_template(source, None).model_dump_json())  # as config.pbtxt carries it
    write_tokenizer(hf, tmp_path / "tokenizer.json", origin=str(folder), chat_template=chat)
    pool = _InProcessPool(chat, load(tmp_path / "tokenizer.json"))
    monkeypatch.setattr(app_module, "Pool", lambda urls, health_interval: pool)
    return name, hf, TestClient(app_module.create_app(["unused:1"]))


def _served_ids(client, messages) -> list[int]:
    reply = client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
    assert reply.status_code == 200, reply.text
    return json.loads(reply.json()["choices"][0]["message"]["content"])


def test_a_chat_request_reaches_the_model_as_apply_chat_templates_ids(family):
    name, hf, client = family
    for messages in (SYSTEM_USER, TURNS, TURNS[:1]):
        expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        ids = _served_ids(client, messages)
        assert ids == list(expected), (name, messages, hf.decode(ids), hf.decode(expected))
        text = hf.decode(ids)
        if name == "gemma":  # one BOS (the template's; the tokenizer's own is not added again)
            assert ids.count(hf.bos_token_id) == 1 and ids[0] == hf.bos_token_id
            assert text.endswith("<start_of_turn>model\n")
        else:  # no BOS: Phi-3's template has none, and a chat prompt gets no added special tokens
            assert hf.bos_token_id not in ids and text.endswith("<|end|>\n<|assistant|>\n")
    system_folded = hf.decode(_served_ids(client, SYSTEM_USER))
    if name == "gemma":  # the system message opens the first user turn; there is no system turn
        assert system_folded.startswith("<bos><start_of_turn>user\nYou answer in one line.\n\nWrite def add")
        assert "<start_of_turn>system" not in system_folded
    else:
        assert system_folded.startswith("<|system|>\nYou answer in one line.<|end|>\n<|user|>\n")


def test_a_conversation_gemmas_template_refuses_is_a_400_naming_messages(tmp_path, monkeypatch):
    _, _, client = _serve("gemma", tmp_path, monkeypatch)
    reply = client.post("/v1/chat/completions", json={"model": "m", "messages": [TURNS[0], TURNS[0]]})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages" and "roles must alternate" in error["message"]


def test_a_model_built_before_add_special_tokens_is_not_sent_it():
    """The frontend sends `add_special_tokens: false` with a chat prompt only to a model that declares
    the input; an older build (which Triton would refuse it for) adds them as it always did."""
    from llmc.openai.app import _inputs
    from llmc.openai.backends import ModelInfo
    from llmc.openai.protocol import ChatRequest

    req = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    new = ModelInfo("m", "1", None, frozenset({"text_input", "add_special_tokens"}))
    old = ModelInfo("m", "1", None, frozenset({"text_input"}))
    assert _inputs(req, 0, None, new)["add_special_tokens"] is False
    assert "add_special_tokens" not in _inputs(req, 0, None, old)
