"""Log probabilities computed in the served model (runtime/decoding/logprobs.py), in process: equal to
PyTorch's log_softmax of the HF model's logits for greedy and sampled requests, streamed and not."""

import numpy as np
import pytest

from checkpoints import byte_tokenizer
from serving_rig import RecordingSink, request_inputs
from llmc.runtime.decoding.logprobs import LogprobRecorder, log_softmax
from llmc.runtime.serving.loop import ServingLoop


@pytest.fixture(scope="module")
def loop(tiny_build):
    loop = ServingLoop.from_manifest(tiny_build.repository / "tiny" / "1").start()
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def torch_model(tiny_checkpoints):
    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec

    return load_model(inspect_source(SourceSpec(path=tiny_checkpoints["llama"])))[0]


def torch_logprobs(model, prompt_ids, output_ids):
    """log_softmax of the HF model's logits at each generated position (teacher-forced)."""
    import torch

    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].double()
    return torch.log_softmax(logits, dim=-1).numpy()


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.3, "seed": 7, "top_k": 50, "repetition_penalty": 1.2}],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_equal_pytorch_log_softmax(loop, torch_model, sampling, stream):
    sink = RecordingSink()
    loop.submit(request_inputs("log probs of", max_tokens=12, stream=stream, return_log_probs=True, num_top_logprobs=5,
                        **sampling), sink)
    ids = sink.joined("output_ids").tolist()
    values, top_ids = sink.joined("output_log_probs"), sink.joined("top_log_prob_ids")
    reference = torch_logprobs(torch_model, byte_tokenizer().encode("log probs of").ids, ids)
    assert len(values) == len(ids) == len(top_ids) and len(ids) > 1
    assert np.abs(values - reference[np.arange(len(ids)), ids]).max() <= 1e-3
    assert np.abs(sink.joined("top_log_probs") - np.take_along_axis(reference, top_ids, 1)).max() <= 1e-3
    best = np.sort(reference, axis=1)[:, ::-1][:, :5]
    assert np.abs(sink.joined("top_log_probs") - best).max() <= 1e-3  # the 5 best, best first
    assert abs(sink.responses[-1]["cum_log_probs"][0] - values.sum()) <= 1e-3
    texts = sink.joined("token_texts").tolist()
    assert [t.decode() for t in texts] == [byte_tokenizer().decode([i]) for i in ids]
    if stream:
        assert len(sink.responses) > 1
        assert all(len(r["output_ids"]) == len(r["output_log_probs"]) for r in sink.responses)
    if not sampling:
        assert ids == [int(row.argmax()) for row in reference]


def test_without_return_log_probs_no_log_prob_outputs(loop):
    sink = RecordingSink()
    loop.submit(request_inputs("plain", max_tokens=4), sink)
    sink.joined("output_ids")
    assert not {"output_log_probs", "cum_log_probs", "top_log_probs"} & set(sink.responses[-1])


def test_num_top_logprobs_needs_return_log_probs(loop):
    sink = RecordingSink()
    loop.submit(request_inputs("plain", max_tokens=4, num_top_logprobs=3), sink)
    assert sink.done.wait(10) and sink.errors == ["num_top_logprobs: needs return_log_probs true"]


def test_recorder_hands_out_only_what_was_recorded_since_the_last_take():
    rec = LogprobRecorder(2)
    logits = np.array([0.0, 2.0, 1.0, -1.0], dtype=np.float32)
    rec.record(logits, 2)
    tok = byte_tokenizer()
    first = rec.take(tok)
    assert first.values.tolist() == pytest.approx([log_softmax(logits)[2]])
    assert first.top_ids.tolist() == [[1, 2]] and first.token_texts == (tok.decode([2], skip_special_tokens=False),)
    assert first.top_texts == (tuple(tok.decode([i], skip_special_tokens=False) for i in (1, 2)),)
    empty = rec.take(tok)
    assert len(empty) == 0 and empty.top_values.shape == (0, 2) and empty.top_texts == ()
    assert empty.cumulative == pytest.approx(log_softmax(logits)[2])


def test_a_responses_steps_join_into_tensors_that_line_up_with_its_tokens():
    """A response carries several steps' values (a stream sends when text is final): joined in
    order, laid out with one row per token and the latest cumulative sum."""
    from llmc.runtime.decoding.logprobs import Logprobs
    from llmc.runtime.serving.responses import logprob_outputs

    rec, tok = LogprobRecorder(3), byte_tokenizer()
    logits = np.array([0.0, 2.0, 1.0, -1.0], dtype=np.float32)
    steps = []
    for token in (1, 3):
        rec.record(logits, token)
        steps.append(rec.take(tok))
    joined = Logprobs.concat([Logprobs.empty(3), *steps])
    out = logprob_outputs(joined)
    expected = log_softmax(logits)[[1, 3]]
    assert out["output_log_probs"].tolist() == pytest.approx(expected.tolist())
    assert out["cum_log_probs"].tolist() == pytest.approx([expected.sum()])
    assert out["token_texts"].tolist() == [tok.decode([i], skip_special_tokens=False).encode() for i in (1, 3)]
    assert out["top_log_prob_ids"].tolist() == [[1, 2, 0]] * 2 and out["top_token_texts"].shape == (2, 3)
    assert logprob_outputs(Logprobs.empty(3, 1.5))["top_token_texts"].shape == (0, 3)
