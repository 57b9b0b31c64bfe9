"""Concurrent streams at size, for `python -m llmc.bench sizes`: llmc's packaged engine and onnxruntime-genai's
`og.Engine`, in process, driven the same way. A closed loop: `streams` clients each send their next request
when their last one ends, `len(prompts)` requests in all, every prompt its own (no prefix-cache hits), greedy,
exactly `new` tokens each. Per run: generated tokens/s over the wall time, and the time to each request's
first token and between its tokens (p50 and p99 over every request).

og.Engine on CPU is its static batcher: its dynamic batcher needs paged-KV decoder layers, which the model
builder's CPU graphs lack (0.18 refuses them: "Paged cache input must have rank four"). Its batch is set to
`streams` in the model's genai_config.json, and its max_length to the run's longest prompt plus `new`.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable, Hashable, Iterable


def closed_loop(submit: Callable[[int], Hashable], step: Callable[[], Iterable[tuple[Hashable, int, bool]]],
                count: int, streams: int) -> dict[str, float]:
    """Drive an engine: `submit(i)` queues request i and returns its key; `step()` runs the engine once and
    yields (key, tokens it produced, finished) per request it advanced."""
    arrived: dict[Hashable, float] = {}
    produced: dict[Hashable, list[float]] = {}
    sent = done = 0

    def send() -> None:
        nonlocal sent
        key = submit(sent)
        arrived[key], produced[key], sent = time.perf_counter(), [], sent + 1

    start = time.perf_counter()
    for _ in range(min(streams, count)):
        send()
    while done < count:
        for key, tokens, finished in step():
            produced[key] += [time.perf_counter()] * tokens
            if finished:
                done += 1
                if sent < count:
                    send()
    wall = time.perf_counter() - start
    ttft = [times[0] - arrived[key] for key, times in produced.items() if times]
    itl = [b - a for times in produced.values() for a, b in zip(times, times[1:])]
    tokens = sum(map(len, produced.values()))
    return {"tokens": tokens, "tok_s": tokens / wall, "ttft_p50_s": _quantile(ttft, 0.5),
            "ttft_p99_s": _quantile(ttft, 0.99), "itl_p50_s": _quantile(itl, 0.5), "itl_p99_s": _quantile(itl, 0.99)}


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1] if len(values) > 1 \
        else (values[0] if values else float("nan"))


def llmc_streams(version_dir: Path, prompts: list[list[int]], new: int, streams: int) -> dict[str, float]:
    """The packaged engine (loader.py: what Triton's model.py serves), stepped here without a server."""
    from llmc.runtime.decoding.sampling import SamplingParams
    from llmc.runtime.manifest import RepositoryManifest
    from llmc.runtime.serving.loader import load

    rows = RepositoryManifest.load(version_dir).limits.max_batch_size
    if rows < streams:
        raise ValueError(f"{version_dir}: steps {rows} rows (limits.max_batch_size), fewer than {streams} streams")
    engine = load(version_dir)[0]

    def submit(i: int) -> str:
        engine.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=new, min_tokens=new))
        return f"r{i}"

    try:
        return closed_loop(submit, lambda: [(o.request_id, len(o.token_ids), o.finished) for o in engine.step()],
                           len(prompts), streams)
    finally:
        engine.close()


def genai_streams(model_dir: Path, prompts: list[list[int]], new: int, streams: int) -> dict[str, float]:
    """onnxruntime-genai's og.Engine on its build in `model_dir`, its batch set to `streams`."""
    import numpy as np
    import onnxruntime_genai as og

    path = model_dir / "genai_config.json"
    config = json.loads(path.read_text())
    config["engine"] = {"static_batching": {"max_batch_size": streams}}
    # its KV buffers are max_length long for every row of the batch: the checkpoint's context (Llama-3.2-1B's
    # 131,072) at 16 rows is ~68 GB, so the run's own length, as generate()'s search options set it
    config["search"]["max_length"] = max(map(len, prompts)) + new
    path.write_text(json.dumps(config, indent=4))
    engine = og.Engine(og.Model(str(model_dir)))
    events = engine.create_event_buffer(4 * streams)
    token, finished, failed = (int(getattr(og.EngineEventFlags, f).value) for f in ("TOKEN", "TURN_FINISHED", "FAILED"))
    requests: list = []  # held: an event's request is the object made here

    def submit(i: int):
        request = engine.create_request()
        options = og.TurnOptions(request)
        options.set_do_sample(False)
        options.set_min_generated_tokens(new)
        options.set_max_generated_tokens(new)
        request.begin_turn(np.array(prompts[i], dtype=np.int32), options)
        requests.append(request)
        return request

    def step():
        for event in engine.run(events):
            flags = int(event.flags.value)
            if flags & failed:
                raise RuntimeError(f"og.Engine failed a request: {event.error_code}")
            yield event.request, 1 if flags & token else 0, bool(flags & finished)

    return closed_loop(submit, step, len(prompts), streams)
