"""The serving loop in process (no Triton): streamed responses, errors, cancellation, metrics."""

import threading
import time

import numpy as np
import pytest

from checkpoints import byte_tokenizer
from serving_rig import RecordingSink, greedy_reference, request_inputs
from helpers import Recorder
from llmc.runtime.engine.core import CacheState
from llmc.runtime.serving.metrics import ServingMetrics
from llmc.runtime.serving.loop import ServingLoop


@pytest.fixture(params=["slots", "paged"])
def served(request):
    """The tiny model served in process, from its slot graph and from its paged graph."""
    recorder = Recorder()
    built = request.getfixturevalue("tiny_slot_build" if request.param == "slots" else "tiny_paged_build")
    version = built.repository / "tiny" / "1"
    loop = ServingLoop.from_manifest(version, ServingMetrics(recorder)).start()
    yield loop, recorder
    loop.stop()


def test_streamed_chunks_add_up_to_the_whole_text_and_match_pytorch(served, tiny_checkpoints):
    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec

    loop, recorder = served
    whole = RecordingSink()
    loop.submit(request_inputs(max_tokens=12), whole)
    streamed = RecordingSink()
    loop.submit(request_inputs(max_tokens=12, stream=True), streamed)
    whole.wait(), streamed.wait()
    assert len(whole.responses) == 1 and len(streamed.responses) > 1
    assert streamed.text == whole.text and streamed.ids == whole.ids
    assert whole.finish_reason == streamed.finish_reason
    model, _ = load_model(inspect_source(SourceSpec(path=tiny_checkpoints["llama"])))
    prompt_ids = byte_tokenizer().encode("hello there").ids
    assert whole.ids == greedy_reference(model, prompt_ids, 12, end_ids=(2,))
    assert recorder.values["llmc_generation_tokens_total"] == 2 * len(whole.ids)
    assert len(recorder.values["llmc_time_to_first_token_seconds"]) == 2


def test_bad_requests_get_an_error_naming_the_input_and_others_go_on(served):
    loop, recorder = served
    good = RecordingSink()
    loop.submit(request_inputs(max_tokens=40, stream=True), good)
    bad = {"temperature": request_inputs(temperature=-1.0), "top_p": request_inputs(top_p=0.0), "max_tokens": request_inputs(max_tokens=0),
           "text_input": request_inputs("x" * 200), "stop_words": {**request_inputs(), "stop_words": np.array([b"a"] * 9, dtype=object)},
           "num_top_logprobs": request_inputs(return_log_probs=True, num_top_logprobs=21)}
    sinks = {name: RecordingSink() for name in bad}
    for name, inputs in bad.items():
        loop.submit(inputs, sinks[name])
    for name, sink in sinks.items():
        assert sink.wait().responses == [] and len(sink.errors) == 1 and sink.errors[0].startswith(name), sink.errors
    assert good.wait().errors == [] and good.finish_reason in ("length", "stop")
    assert recorder.values["llmc_request_failure_total"] == len(bad)


def test_a_stop_request_ends_the_request_with_its_id(served):
    class Held(RecordingSink):  # holds the engine thread in its first send until released
        entered, release = threading.Event(), threading.Event()

        def send(self, outputs, final):
            self.entered.set()
            assert self.release.wait(10)
            super().send(outputs, final)

    loop, _ = served
    sink, stop_sink, stray = Held(), RecordingSink(), RecordingSink()
    loop.submit(request_inputs(max_tokens=100, stream=True, min_tokens=100), sink, "abc")
    stop = {"text_input": np.array([b""], dtype=np.object_), "stop": np.array([True])}
    assert sink.entered.wait(10)
    loop.submit(stop, stop_sink, "abc")
    loop.submit(stop, stray, "no-such-request")  # already over, or never was: just answered
    sink.release.set()
    assert sink.wait().finish_reason == "cancelled" and len(sink.ids) < 100 and sink.errors == []
    for s in (stop_sink, stray):
        assert len(s.wait().responses) == 1 and s.text == "" and s.errors == [] and "finish_reason" not in s.responses[0]
    assert loop.num_in_flight == 0


def test_cancelled_request_frees_its_slot_and_the_gauges_return_to_zero(served, monkeypatch):
    from llmc.runtime.serving import loop as serving

    monkeypatch.setattr(serving, "CANCEL_CHECK_INTERVAL", 0.0)  # poll every step: the tiny model is fast
    loop, recorder = served
    sink = RecordingSink(cancel_after=2)
    loop.submit(request_inputs(max_tokens=100, stream=True, min_tokens=100), sink)
    deadline = time.monotonic() + 5
    while (loop.engine.has_work or loop.num_in_flight) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.engine.scheduler.num_running == 0 and loop.num_in_flight == 0
    # once the sink said it was cancelled: its final flag alone (Triton releases the request at it), nothing else
    assert len(sink.responses) == 2 and sink.errors == [] and sink.finished == 1
    time.sleep(0.3)  # the idle loop publishes the gauges
    assert recorder.values["llmc_requests_running"] == 0 and recorder.values["llmc_kv_cache_usage_ratio"] == 0


def test_full_queue_answers_busy_retry(tiny_build):
    from llmc.runtime.serving.loop import ServingLoop

    loop = ServingLoop.from_manifest(tiny_build.repository / "tiny" / "1")  # not started: nothing leaves the queue
    loop.engine.scheduler.max_queue_size = 1
    first, second = RecordingSink(), RecordingSink()
    loop.submit(request_inputs(), first)
    loop.submit(request_inputs(), second)
    assert second.errors and second.errors[0].startswith("busy, retry")
    loop.stop()
    assert first.errors == ["the model is being unloaded"]  # stopping answers what was still queued


@pytest.mark.parametrize("graph", ["slots", "paged"])
def test_stopping_the_loop_closes_its_runner(graph, request):
    """An unloaded model version frees its model and KV cache (GPU memory for a TensorRT engine)."""
    from llmc.runtime.runners.paged import RowStep
    from llmc.runtime.runners.protocol import RunnerClosed

    built = request.getfixturevalue("tiny_slot_build" if graph == "slots" else "tiny_build")
    loop = ServingLoop.from_manifest(built.repository / "tiny" / "1").start()
    sink = RecordingSink()
    loop.submit(request_inputs(max_tokens=3), sink)
    assert sink.wait().errors == []
    loop.stop()
    with pytest.raises(RunnerClosed):
        if graph == "slots":
            loop.engine.runner.step(np.array([[1]]), np.array([0]))
        else:
            loop.engine.runner.step([RowStep([1], 0, [0])])


def test_a_failing_step_ends_requests_in_flight_and_the_loop_keeps_serving(served, monkeypatch):
    loop, _ = served
    real_step, calls = loop.engine.runner.step, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop.engine.runner, "step", failing_once)
    victim = RecordingSink()
    loop.submit(request_inputs(max_tokens=5), victim)
    assert victim.wait().errors and "boom" in victim.errors[0]
    after = RecordingSink()
    loop.submit(request_inputs(max_tokens=5), after)
    assert after.wait().errors == [] and len(after.ids) == 5
    assert loop.engine.scheduler.num_running == 0


def test_triton_metrics_are_never_updated_from_two_threads_at_once():
    """The Python backend's metric calls are not thread-safe (unserialized updates from the execute
    thread and the loop thread crashed Triton 2.51): triton_metrics serializes every update."""
    from llmc.runtime.serving.metrics import triton_metrics

    inside, overlaps = [0], []

    class Metric:
        def __init__(self, **_):
            pass

        def _update(self, value):
            inside[0] += 1
            overlaps.append(inside[0] > 1)
            time.sleep(0.0005)  # long enough for another thread to come in, were it allowed
            inside[0] -= 1

        observe = increment = set = _update

    class MetricFamily:
        HISTOGRAM, COUNTER, GAUGE = "h", "c", "g"

        def __init__(self, **_):
            self.Metric = Metric

    metrics = triton_metrics(type("pb_utils", (), {"MetricFamily": MetricFamily}), {"model": "m"})
    state = CacheState(running=1, waiting=0, usage=0.5)
    threads = [threading.Thread(target=lambda: [metrics.failed() or metrics.load(state) for _ in range(50)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(overlaps) == 4 * 50 * 4 and not any(overlaps)


def test_the_paged_graph_reports_its_blocks_and_prefix_reuse(tiny_paged_build):
    recorder = Recorder()
    loop = ServingLoop.from_manifest(tiny_paged_build.repository / "tiny" / "1", ServingMetrics(recorder)).start()
    try:
        prompt = "a prompt long enough to fill a block or two of sixteen tokens"  # byte-level: 62 tokens
        sinks = [RecordingSink(), RecordingSink()]
        for sink in sinks:  # the second time, the prompt's full blocks are in the prefix cache
            loop.submit(request_inputs(prompt, max_tokens=6), sink)
            sink.wait()
        time.sleep(0.3)  # the idle loop publishes the gauges
    finally:
        loop.stop()
    assert sinks[0].ids == sinks[1].ids and len(sinks[0].ids) == 6
    values = recorder.values
    assert values["llmc_prefix_cache_queries_total"] == 2 * len(prompt) and values["llmc_prefix_cache_hits_total"] == 48
    assert values["llmc_kv_cache_blocks{state=used}"] == 0 and values["llmc_kv_cache_blocks{state=cached}"] > 0
    assert values["llmc_kv_cache_blocks{state=free}"] + values["llmc_kv_cache_blocks{state=cached}"] == 16
    assert values["llmc_kv_cache_usage_ratio"] == 0 and values.get("llmc_preemptions_total", 0) == 0


def test_guided_requests_obey_their_guides_and_a_bad_guide_fails_alone(served):
    """Through the loop: the guide compiles off the engine thread, the output obeys it (slot and paged
    engines), a guide that does not compile fails its request only, naming the input."""
    import json
    import re

    loop, recorder = served
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}, "b": {"type": "boolean"}},
              "required": ["n", "b"], "additionalProperties": False}
    sinks = {"schema": RecordingSink(), "regex": RecordingSink(), "bad": RecordingSink(), "free": RecordingSink()}
    loop.submit(request_inputs(max_tokens=40, stream=True, guided_decoding_guide_type="json_schema",
                               guided_decoding_guide=json.dumps(schema)), sinks["schema"])
    loop.submit(request_inputs(max_tokens=40, guided_decoding_guide_type="regex", guided_decoding_guide="(ab|cd)+!"),
                sinks["regex"])
    loop.submit(request_inputs(max_tokens=40, guided_decoding_guide_type="regex", guided_decoding_guide="a(("),
                sinks["bad"])
    loop.submit(request_inputs(max_tokens=12), sinks["free"])
    for name in ("schema", "regex", "free"):
        assert sinks[name].wait().errors == [], (name, sinks[name].errors)
    value = json.loads(sinks["schema"].text)
    assert set(value) == {"n", "b"} and isinstance(value["n"], int) and value["n"] <= 99
    assert sinks["schema"].finish_reason == "stop"
    assert re.fullmatch(r"(ab|cd)+!", sinks["regex"].text)
    bad = sinks["bad"].wait()
    assert bad.responses == [] and bad.errors[0].startswith("guided_decoding_guide: ") and "a((" in bad.errors[0]
    assert loop.num_in_flight == 0


def test_a_stop_request_ends_a_guided_request_while_its_guide_compiles(served, monkeypatch):
    loop, _ = served
    held, compiling = threading.Event(), threading.Event()
    compile_guide = loop.guides.compile

    def slow_compile(guide):
        compiling.set()
        assert held.wait(10)
        return compile_guide(guide)

    monkeypatch.setattr(loop.guides, "compile", slow_compile)
    sink, stop_sink = RecordingSink(), RecordingSink()
    loop.submit(request_inputs(max_tokens=20, guided_decoding_guide_type="json"), sink, "g1")
    assert compiling.wait(10)
    other = RecordingSink()
    loop.submit(request_inputs(max_tokens=8), other)  # the engine serves others while a guide compiles
    assert other.wait().errors == [] and not sink.done.is_set()
    loop.submit({"text_input": np.array([b""], dtype=np.object_), "stop": np.array([True])}, stop_sink, "g1")
    held.set()
    assert sink.wait().finish_reason == "cancelled" and sink.errors == [] and sink.ids == []
