"""Beam search from the spec to the served model: `serving.max_beam_width` is carried into the
manifest and config.pbtxt; a beam request gets every beam once, at its end, in TensorRT-LLM's shapes
(also when it streams), equal to the engine's own beams; inputs that contradict beam search or pass
the limit are refused naming the field; the slot graph takes no beams."""

import io

import numpy as np
import pytest
from pydantic import ValidationError

from checkpoints import TINY_SERVING_SPEC
from serving_rig import RecordingSink, request_inputs, serving_env
from shared_builds import build_reusing_export
from llmc.compiler.spec import parse_spec
from llmc.compiler.repository.triton_config import parse
from llmc.errors import SpecError
from llmc.runtime.manifest import RepositoryManifest
from llmc.runtime.serving.loop import ServingLoop

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def beam_build(tiny_checkpoints, tmp_path_factory):
    spec = parse_spec({"name": "tiny", "source": str(tiny_checkpoints["llama"]), "verify": {"enabled": False},
                       **TINY_SERVING_SPEC, "serving": {**TINY_SERVING_SPEC["serving"], "max_beam_width": 4}})
    return build_reusing_export(tmp_path_factory, spec, tmp_path_factory.mktemp("beam_build") / "tiny")


@pytest.fixture(scope="module")
def loop(beam_build):
    loop = ServingLoop.from_manifest(beam_build.repository / "tiny" / "1").start()
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def end_id(beam_build) -> int:
    """An id the tiny Llama's second beam produces four tokens in after PROMPT, searched with no end id:
    with it as the end id, that beam ends there (the search before it is the same)."""
    from tokenizers import Tokenizer

    from llmc.runtime.decoding.sampling import SamplingParams

    engine = ServingLoop.from_manifest(beam_build.repository / "tiny" / "1").engine
    tokenizer = Tokenizer.from_file(str(beam_build.repository / "tiny" / "1" / "tokenizer.json"))
    engine.add_request("probe", tokenizer.encode(PROMPT).ids, SamplingParams(beam_width=3, max_tokens=10,
                                                                             end_ids=(), length_penalty=0.5))
    final = None
    while engine.has_work:
        final = next((o for o in engine.step() if o.finished), final)
    return final.beams[1].token_ids[3]


def _submit(loop, **kw):
    sink = RecordingSink()
    loop.submit(request_inputs(PROMPT, **kw), sink)
    return sink.wait(60)


def test_the_build_carries_max_beam_width_into_the_manifest_and_config(beam_build):
    model = beam_build.repository / "tiny"
    assert RepositoryManifest.load(model / "1").limits.max_beam_width == 4
    assert parse((model / "config.pbtxt").read_text()).parameters["max_beam_width"].string_value == "4"


def test_a_beam_request_gets_every_beam_once_in_tensorrt_llms_shapes(loop, beam_build, end_id):
    from tokenizers import Tokenizer

    sink = _submit(loop, beam_width=3, max_tokens=10, end_id=end_id, length_penalty=0.5)
    assert not sink.errors and len(sink.responses) == 1
    out = sink.responses[0]
    assert out["text_output"].shape == (3,) and out["output_ids"].dtype == np.int32
    assert out["output_ids"].shape == (3, int(out["sequence_length"].max()))
    assert out["sequence_length"].shape == (3,) and out["cum_log_probs"].shape == (3,)
    assert out["cum_log_probs"].dtype == np.float32
    # the engine's own beams for the same request, through a fresh engine
    engine = ServingLoop.from_manifest(beam_build.repository / "tiny" / "1").engine
    tokenizer = Tokenizer.from_file(str(beam_build.repository / "tiny" / "1" / "tokenizer.json"))
    from llmc.runtime.decoding.sampling import SamplingParams

    engine.add_request("x", tokenizer.encode(PROMPT).ids, SamplingParams(beam_width=3, max_tokens=10,
                                                                         end_ids=(end_id,), length_penalty=0.5))
    final = None
    while engine.has_work:
        final = next((o for o in engine.step() if o.finished), final)
    beams = final.beams
    for i, beam in enumerate(beams):
        n = int(out["sequence_length"][i])
        assert out["output_ids"][i, :n].tolist() == beam.token_ids and n == len(beam.token_ids)
        assert (out["output_ids"][i, n:] == end_id).all()  # padded with the end id
        assert out["text_output"][i].decode() == beam.text
        assert out["cum_log_probs"][i] == pytest.approx(beam.cum_log_prob)
    assert any(b.ended for b in beams) and out["finish_reason"][0].decode() == final.finish_reason.value
    # streamed: the same one response, at the end
    streamed = _submit(loop, beam_width=3, max_tokens=10, end_id=end_id, length_penalty=0.5, stream=True)
    assert len(streamed.responses) == 1
    assert streamed.responses[0]["output_ids"].tolist() == out["output_ids"].tolist()
    # with the prompt: every beam's text starts with it
    whole = _submit(loop, beam_width=2, max_tokens=6, exclude_input_in_output=False)
    assert all(t.decode().startswith(PROMPT) for t in whole.responses[0]["text_output"])


@pytest.mark.parametrize("inputs, field", [
    ({"beam_width": 5}, "beam_width: at most 4 on this model (serving.max_beam_width); got 5"),
    ({"beam_width": 0}, "beam_width: Input should be greater than or equal to 1"),
    ({"beam_width": 2, "temperature": 0.7}, "temperature: beam search (beam_width 2) draws nothing"),
    ({"beam_width": 2, "top_k": 5}, "top_k: beam search (beam_width 2) draws nothing"),
    ({"beam_width": 2, "top_p": 0.9}, "top_p: beam search"),
    ({"beam_width": 2, "seed": 3}, "seed: beam search (beam_width 2) is deterministic"),
    ({"beam_width": 2, "repetition_penalty": 1.2}, "repetition_penalty: beam search (beam_width 2) takes no penalties"),
    ({"beam_width": 2, "presence_penalty": 0.5}, "presence_penalty: beam search"),
    ({"beam_width": 2, "return_log_probs": True}, "return_log_probs: not with beam search (beam_width 2)"),
    ({"beam_width": 2, "length_penalty": float("nan")}, "length_penalty: Input should be a finite number"),
])
def test_beam_requests_that_contradict_beam_search_are_refused_naming_the_field(loop, inputs, field):
    kw = dict(inputs)
    seed = kw.pop("seed", None)
    tensors = request_inputs(PROMPT, **kw)
    if seed is not None:  # UINT64
        tensors["seed"] = np.array([seed], dtype=np.uint64)
    sink = RecordingSink()
    loop.submit(tensors, sink)
    sink.wait(10)
    assert len(sink.errors) == 1 and sink.errors[0].startswith(field), sink.errors


def test_temperature_one_and_stop_words_with_beams(loop):
    assert not _submit(loop, beam_width=2, max_tokens=4, temperature=1.0).errors  # TensorRT-LLM clients' default
    sink = RecordingSink()
    inputs = request_inputs(PROMPT, beam_width=2)
    inputs["stop_words"] = np.array([b"mat"], dtype=object)
    loop.submit(inputs, sink)
    assert sink.wait(10).errors[0].startswith("stop_words: beam search (beam_width 2) ends beams on end ids only")


def test_the_slot_graph_takes_no_beams(tiny_checkpoints, tiny_slot_build, tmp_path):
    with pytest.raises(SpecError, match=r"serving.max_beam_width: 2 needs the paged graph"):
        parse_spec({"name": "tiny", "source": str(tiny_checkpoints["llama"]), "export": {"attention": "fused"},
                     "serving": {"max_beam_width": 2}})
    with pytest.raises(SpecError, match=r"serving.max_beam_width \(9\) must be <= limits.max_batch_size \(8\)"):
        parse_spec({"name": "tiny", "source": str(tiny_checkpoints["llama"]), "serving": {"max_beam_width": 9}})
    version = tiny_slot_build.repository / "tiny" / "1"
    data = RepositoryManifest.load(version).model_dump(mode="json")
    data["limits"]["max_beam_width"] = 2
    with pytest.raises(ValidationError, match="limits.max_beam_width: 2 needs a paged graph"):
        RepositoryManifest.model_validate(data)
    slot = ServingLoop.from_manifest(version).start()
    try:
        sink = RecordingSink()
        slot.submit(request_inputs(PROMPT, beam_width=2), sink)
        assert sink.wait(10).errors == ["beam_width: at most 1 on this model (serving.max_beam_width); got 2"]
    finally:
        slot.stop()


@pytest.mark.triton
def test_on_a_real_triton_server_a_beam_request_returns_every_beam_at_the_end(beam_build, loop, tmp_path, end_id):
    from llmc.client import Client, Generation
    from llmc.serve import generate_to
    from llmc.triton_server import TritonServer, assemble

    expected = _submit(loop, beam_width=4, max_tokens=10, end_id=end_id).responses[0]
    with TritonServer(beam_build.repository, server_dir=assemble(tmp_path / "server"), serving_env=serving_env(),
                      log_path=tmp_path / "server.log") as server:
        client = Client(server.grpc_url, "tiny")
        gen = client.complete(PROMPT, beam_width=4, max_tokens=10, end_id=end_id)
        streamed = Generation()
        chunks = list(client.generate(PROMPT, True, streamed, beam_width=4, max_tokens=10, end_id=end_id))
        with pytest.raises(Exception, match="beam_width: at most 4"):
            client.complete(PROMPT, beam_width=5)
        with pytest.raises(TypeError, match="early_stopping: the served model takes true or false"):
            client.complete(PROMPT, beam_width=2, early_stopping="never")
        printed = io.StringIO()  # `llmc generate --beam-width 4`: every beam, best first
        generate_to(printed, PROMPT, url=server.grpc_url, model="tiny", stream=True, beam_width=4, max_tokens=10,
                    end_id=end_id)
    lengths = expected["sequence_length"].tolist()
    assert gen.beam_ids == [row[:n] for row, n in zip(expected["output_ids"].tolist(), lengths)]
    assert gen.beams == [t.decode() for t in expected["text_output"]] and gen.text == gen.beams[0]
    assert gen.cum_log_probs == pytest.approx(expected["cum_log_probs"].tolist())
    assert len(chunks) == 1 and streamed.beam_ids == gen.beam_ids  # one response, at the end
    lines = printed.getvalue().splitlines()
    headers = [line for line in lines if line.startswith("[beam ")]
    assert len(headers) == 4 and headers[0].startswith(f"[beam 0: {lengths[0]} tokens, cum_log_prob ")
    assert f"{headers[1]}\n{gen.beams[1]}\n" in printed.getvalue()
