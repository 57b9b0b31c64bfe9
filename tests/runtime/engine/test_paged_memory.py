"""The paged KV cache's memory target at the tiny model's scale: from a pool no larger than 16 slots,
64 streams run at once with max_seq_len four times a slot's, and one request of almost max_seq_len
still fits (SmolLM2's case: 16 x 2048 tokens, 64 streams of a few hundred tokens, max_seq_len 8192
and one 8,000-token request; `python -m llmc.bench paged` measures that one served)."""

import numpy as np

from llmc.runtime.engine.paged_engine import PagedEngine
from llmc.runtime.runners.paged import PagedRunner
from llmc.runtime.decoding.sampling import SamplingParams

SLOTS, SLOT_LEN = 16, 128  # what the slot graph would reserve: 16 slots of max_seq_len tokens
MAX_SEQ_LEN = 4 * SLOT_LEN  # 8192 / 2048
STREAMS, PROMPT, NEW = 64, 20, 6  # 26 tokens a stream: about a fifth of a slot, as 364 of 2048
BUDGET = STREAMS * PROMPT  # every prompt in the first step, so all 64 run before any finishes


def test_64_streams_and_one_long_request_fit_a_pool_of_16_slots(tiny_paged_build):
    exported = tiny_paged_build.exported
    layout = exported.kv_layout
    runner = PagedRunner(tiny_paged_build.output / "export" / exported.onnx, layout,
                         num_blocks=SLOTS * SLOT_LEN // layout.block_size, max_num_tokens=BUDGET, num_threads=1)
    assert runner.num_blocks * layout.block_size <= SLOTS * SLOT_LEN
    engine = PagedEngine(runner, max_rows=STREAMS, max_seq_len=MAX_SEQ_LEN, max_num_tokens=BUDGET)
    rng = np.random.default_rng(3)
    for i in range(STREAMS):
        engine.add_request(f"s{i}", rng.integers(0, 256, PROMPT).tolist(), SamplingParams(max_tokens=NEW))
    tokens, peak = {f"s{i}": 0 for i in range(STREAMS)}, 0
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += len(out.token_ids)
        peak = max(peak, engine.scheduler.num_running)
    assert peak == STREAMS  # all 64 held their KV at once
    assert set(tokens.values()) == {NEW} and engine.scheduler.num_preemptions == 0

    long_prompt = rng.integers(0, 256, MAX_SEQ_LEN * 8000 // 8192).tolist()  # 500 tokens
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=MAX_SEQ_LEN - len(long_prompt)))
    generated = []
    while engine.has_work:
        generated += [t for out in engine.step() for t in out.token_ids]
    assert len(long_prompt) + len(generated) == MAX_SEQ_LEN  # up to max_seq_len, from the same pool
