"""The in-flight batching engine on a real fused graph: batch invariance, chunked prefill, cancel, limits."""

import pytest

from shared_builds import build_reusing_export
from llmc.compiler.source import inspect_source, load_model
from llmc.compiler.spec import parse_spec
from llmc.compiler.graph.greedy import torch_greedy
from llmc.runtime.engine.slot_engine import SlotEngine
from llmc.runtime.runners.ort import OrtRunner
from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine.core import QueueFull
from llmc.runtime.engine.sequence import FinishReason

PROMPTS = {"a": [5, 17, 99, 3, 42, 8, 1], "b": [7, 7, 200], "c": [31, 64, 2, 9, 120], "d": [11], "e": [250, 3, 3, 3]}


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints, tmp_path_factory):
    spec = parse_spec({"name": "t", "source": str(tiny_checkpoints["llama"]), "export": {"attention": "fused"}})
    out = tmp_path_factory.mktemp("engine") / "out"
    exported = build_reusing_export(tmp_path_factory, spec, out, until="export").exported
    model, _ = load_model(inspect_source(spec.source))
    return out / "export" / exported.onnx, exported.kv_layout, model


def _engine(tiny, max_batch=3, capacity=64, **kwargs):
    path, layout, _ = tiny
    return SlotEngine(OrtRunner(path, layout, max_batch=max_batch, capacity=capacity, num_threads=1), **kwargs)


def _run(engine, arrivals, params):
    """arrivals: {step number: [request ids]}; returns tokens and finish reason per request."""
    tokens, reasons, step = {}, {}, 0
    while step <= max(arrivals) or engine.has_work:
        for rid in arrivals.get(step, []):
            engine.add_request(rid, PROMPTS[rid], params[rid] if isinstance(params, dict) else params)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        step += 1
    return tokens, reasons


def test_requests_joining_and_leaving_get_their_solo_greedy_tokens(tiny):
    model = tiny[2]
    lengths = {"a": 9, "b": 4, "c": 12, "d": 6, "e": 7}
    params = {rid: SamplingParams(max_tokens=n) for rid, n in lengths.items()}
    # three slots for five requests: d and e wait, then take the slots a and b leave
    tokens, reasons = _run(_engine(tiny), {0: ["a", "b"], 2: ["c", "d"], 3: ["e"]}, params)
    for rid, n in lengths.items():
        _, last = torch_greedy(model, PROMPTS[rid], n, lambda: None)
        assert tokens[rid] == [int(l.argmax()) for l in last], rid
        assert reasons[rid] is FinishReason.length


def test_chunked_prefill_gives_the_same_tokens(tiny):
    whole, _ = _run(_engine(tiny), {0: ["a", "c"]}, SamplingParams(max_tokens=5))
    chunked, _ = _run(_engine(tiny, max_num_tokens=3), {0: ["a", "c"]}, SamplingParams(max_tokens=5))
    assert chunked == whole


def test_end_id_and_capacity_finish_requests(tiny):
    free, _ = _run(_engine(tiny), {0: ["a"]}, SamplingParams(max_tokens=6))
    end = free["a"][3]
    stopped, reasons = _run(_engine(tiny), {0: ["a"]}, SamplingParams(max_tokens=6, end_ids=(end,)))
    assert stopped["a"] == free["a"][:free["a"].index(end) + 1] and reasons["a"] is FinishReason.stop
    full, reasons = _run(_engine(tiny, capacity=10), {0: ["a"]}, SamplingParams(max_tokens=50))
    assert len(full["a"]) == 10 - len(PROMPTS["a"]) + 1 and reasons["a"] is FinishReason.length


def test_same_seed_same_sampled_tokens(tiny):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=123)
    first, _ = _run(_engine(tiny), {0: ["a", "b"]}, params)
    again, _ = _run(_engine(tiny), {0: ["b"], 1: ["a"]}, params)
    assert first == again


def test_cancel_frees_the_slot_for_a_waiting_request(tiny):
    engine = _engine(tiny, max_batch=1)
    engine.add_request("a", PROMPTS["a"], SamplingParams(max_tokens=100))
    engine.add_request("b", PROMPTS["b"], SamplingParams(max_tokens=3))
    engine.step()
    assert engine.scheduler.num_running == 1 and engine.scheduler.num_waiting == 1
    engine.cancel("a")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finish_reason is FinishReason.cancelled and outs["a"].token_ids == []
    assert engine.scheduler.running[0].request_id == "b"  # took the freed slot in the same step
    while engine.has_work:
        engine.step()
    assert engine.scheduler.num_running == 0 and not engine.has_work


def test_limits(tiny):
    engine = _engine(tiny, max_batch=1, capacity=8, max_queue_size=1)
    with pytest.raises(ValueError, match="at most 7 fit"):
        engine.add_request("long", list(range(8)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    engine.add_request("x", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("x", [1, 2], SamplingParams())
    with pytest.raises(QueueFull, match="retry"):
        engine.add_request("y", [1, 2], SamplingParams())


def _word_tokenizer(vocab_size=256):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def _collect(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params)
    texts, ids, reason = [], [], None
    while engine.has_work:
        for out in engine.step():
            texts.append(out.text)
            ids += out.token_ids
            reason = out.finish_reason or reason
    return "".join(texts), ids, reason


def test_streamed_text_and_stop_words(tiny):
    tok = _word_tokenizer()
    prompt = PROMPTS["c"]
    text, ids, reason = _collect(_engine(tiny, tokenizer=tok), "c", prompt, SamplingParams(max_tokens=8))
    assert text == tok.decode(prompt + ids)[len(tok.decode(prompt)):] and reason is FinishReason.length
    stop = f" w{ids[2]}"  # the third generated word, with its leading space
    cut, cut_ids, reason = _collect(_engine(tiny, tokenizer=tok), "c", prompt,
                                    SamplingParams(max_tokens=8, stop_words=(stop,)))
    assert reason is FinishReason.stop and cut == text[:text.index(stop)] and len(cut_ids) == 3
