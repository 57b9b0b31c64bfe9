"""Beam search in the paged engine (runtime/engine/beam.py): a request's beams equal transformers'
generate(num_beams=W, num_return_sequences=W, do_sample=False) token for token on tiny Llama, GPT-2
and Qwen2 graphs, over widths, length penalties, early_stopping values and end ids that beams hit;
beam requests of several widths run beside greedy and sampled ones (and through preemptions) with
the results each gets alone; beams share their blocks copy-on-write and leave none held."""

import numpy as np
import pytest

from llmc.compiler.spec import parse_spec
from llmc.runtime.engine.paged_engine import PagedEngine
from llmc.runtime.runners.paged import PagedRunner
from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine.sequence import FinishReason

rng = np.random.default_rng(11)
PROMPTS = [rng.integers(0, 256, n).tolist() for n in (5, 16, 23, 9)]
# an id each tiny model often produces (so beams end on it), and a second one
END_IDS = {"llama": (100, 53), "gpt2": (241, 197), "qwen2": (23, 122)}
# (prompt, width, length_penalty, early_stopping, which end id (None: none), max_tokens, min_tokens)
CASES = [(0, 2, 1.0, False, 0, 12, 0), (1, 3, 0.5, True, 0, 14, 0), (2, 4, 2.0, False, 1, 10, 0),
         (3, 4, -0.5, "never", 0, 10, 0), (0, 3, 1.0, False, None, 8, 0), (2, 2, 1.5, "never", 0, 10, 4),
         (1, 4, 1.0, True, 1, 12, 0)]


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen2"])
def paged(request, tiny_checkpoints, paged_export):
    kind = request.param
    return kind, tiny_checkpoints[kind], *paged_export(kind)


def _engine(paged, *, num_blocks=96, max_rows=8, max_num_tokens=32, max_beam_width=4):
    _, _, folder, exported = paged
    runner = PagedRunner(folder / exported.onnx, exported.kv_layout, num_blocks=num_blocks,
                         max_num_tokens=max_num_tokens, num_threads=1)
    return PagedEngine(runner, max_rows=max_rows, max_seq_len=128, max_num_tokens=max_num_tokens,
                       max_beam_width=max_beam_width)


def _params(kind, case) -> SamplingParams:
    _, width, lp, early, end, max_tokens, min_tokens = case
    return SamplingParams(beam_width=width, length_penalty=lp, early_stopping=early, max_tokens=max_tokens,
                          min_tokens=min_tokens, end_ids=() if end is None else (END_IDS[kind][end],))


def _run(engine, requests: dict):
    """{rid: (prompt, params)} all in flight together -> {rid: final StepOutput}, plus token lists."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals, tokens = {}, {rid: [] for rid in requests}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids if out.beams is None else []
            if out.finished:
                finals[out.request_id] = out
    return finals, tokens


def _hf_beams(model, prompt, params: SamplingParams):
    import torch

    end = params.end_ids[0] if params.end_ids else None
    out = model.generate(torch.tensor([prompt]), num_beams=params.beam_width, num_return_sequences=params.beam_width,
                         do_sample=False, max_new_tokens=params.max_tokens, length_penalty=params.length_penalty,
                         early_stopping=params.early_stopping, eos_token_id=end, pad_token_id=255,
                         min_new_tokens=params.min_tokens or None, output_scores=True, return_dict_in_generate=True)
    beams = []
    for row in out.sequences[:, len(prompt):].tolist():
        beams.append(row[:row.index(end) + 1] if end is not None and end in row else row)
    return beams, out.sequences_scores.tolist()


def test_beams_equal_transformers_beam_search(paged):
    from transformers import AutoModelForCausalLM

    kind, checkpoint, _, _ = paged
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    requests = {f"c{i}": (PROMPTS[c[0]], _params(kind, c)) for i, c in enumerate(CASES)}
    finals, _ = _run(_engine(paged), requests)
    ended = 0
    for rid, (prompt, params) in requests.items():
        beams, scores = _hf_beams(model, prompt, params)
        got = finals[rid].beams
        assert [b.token_ids for b in got] == beams, (rid, params)
        assert [b.score for b in got] == pytest.approx(scores, rel=1e-4, abs=1e-4), rid
        lengths = [len(b.token_ids) for b in got]
        assert [b.cum_log_prob for b in got] == pytest.approx(
            [s * n ** params.length_penalty for s, n in zip(scores, lengths)], rel=1e-4, abs=1e-4), rid
        assert all(len(b) >= params.min_tokens for b in beams)
        ended += sum(b.ended for b in got)
        assert finals[rid].finish_reason is (FinishReason.stop if got[0].ended else FinishReason.length)
    assert ended >= 3, "the end ids should end several beams"


def _mixed(kind):
    requests = {f"b{i}": (PROMPTS[CASES[i][0]], _params(kind, CASES[i])) for i in (0, 1, 2, 3)}
    requests["greedy"] = (PROMPTS[1], SamplingParams(max_tokens=12))
    requests["sampled"] = (PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=5))
    return requests


def _results(finals, tokens):
    return {rid: ([b.token_ids for b in out.beams] if out.beams is not None else tokens[rid])
            for rid, out in finals.items()}


def test_beam_requests_of_several_widths_beside_greedy_and_sampled_ones_get_their_solo_results(paged):
    kind = paged[0]
    requests = _mixed(kind)
    solo = {}
    for rid, request in requests.items():
        solo.update(_results(*_run(_engine(paged), {rid: request})))
    assert _results(*_run(_engine(paged, max_rows=12), requests)) == solo
    # a pool too small for all at once: groups are preempted whole and restart from their prompts
    engine = _engine(paged, num_blocks=10, max_rows=12)
    assert _results(*_run(engine, requests)) == solo
    assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_used == 0 and not any(engine.blocks.ref_counts)


def test_beams_share_blocks_and_copy_only_the_partial_block_they_write(paged):
    engine = _engine(paged, max_num_tokens=32)
    bs = engine.blocks.block_size
    prompt = PROMPTS[2]  # 23 tokens: full blocks and a partial one at any block size below 23
    assert len(prompt) % bs
    seq = engine.add_request("b", prompt, SamplingParams(beam_width=3, max_tokens=bs + 4))
    copies, at_copy = [], []
    real = engine.runner.copy_blocks

    def copy_blocks(pairs):  # what the beams hold when the copies are made, before the step writes
        copies.extend(pairs)
        at_copy.extend([list(r.block_ids) for r in seq.beam.rows])
        real(pairs)

    engine.runner.copy_blocks = copy_blocks
    engine.step()  # the prompt, once, as one row: then three beams fork from its blocks
    rows = seq.beam.rows
    assert len(rows) == 3 and not copies
    partial = len(prompt) // bs
    for i in range(partial + 1):  # every prompt block is held by all three beams
        assert len({r.block_ids[i] for r in rows}) == 1 and engine.blocks.ref_counts[rows[0].block_ids[i]] == 3
    shared = rows[0].block_ids[partial]
    engine.step()  # the beams write their first tokens: two copy the shared partial block, the last keeps it
    assert len(copies) == 2 and all(src == shared for src, _ in copies)
    assert sorted(t[partial] for t in at_copy) == sorted([shared] + [dst for _, dst in copies])
    assert all(t[:partial] == at_copy[0][:partial] for t in at_copy)  # the full blocks stay shared
    pool, used = engine.runner.pools[0], len(prompt) % bs  # the copies hold the prompt's last keys (and after)
    assert all(np.array_equal(pool[dst, :used], pool[shared, :used]) for _, dst in copies)
    while engine.has_work:
        engine.step()
    assert engine.blocks.num_used == 0 and not any(engine.blocks.ref_counts)
    assert engine.blocks.num_free + engine.blocks.num_cached == engine.blocks.num_blocks


def test_a_beam_request_above_the_limit_or_too_big_for_the_pool_is_refused(paged):
    engine = _engine(paged, max_beam_width=2)
    with pytest.raises(ValueError, match=r"beam_width: 3 is above this model's limit of 2 \(serving.max_beam_width\)"):
        engine.add_request("x", [1, 2, 3], SamplingParams(beam_width=3))
    small = _engine(paged, num_blocks=3, max_beam_width=4)
    with pytest.raises(ValueError, match="KV blocks"):
        small.add_request("y", list(range(20)), SamplingParams(beam_width=4))
    with pytest.raises(ValueError, match="max_beam_width"):
        _engine(paged, max_rows=2, max_beam_width=4)


SMOL_CASES = [  # (prompt, width, length_penalty, early_stopping, max_tokens)
    ("<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n<|im_start|>assistant\n",
     4, 1.0, False, 24),
    ("The three primary colors are", 3, 0.7, True, 12),
    ("def fibonacci(n):", 2, 2.0, "never", 16),
]


@pytest.mark.slow
def test_smollm2_beams_equal_transformers_beam_search(smollm2, tmp_path, tmp_path_factory):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from shared_builds import build_reusing_export

    spec = parse_spec({"name": "s", "source": str(smollm2), "export": {"attention": "paged"},
                       "verify": {"enabled": False}})
    # the run's shared SmolLM2 export (tests/e2e/test_smollm2.py and test_draft_smollm2.py build it too)
    exported = build_reusing_export(tmp_path_factory, spec, tmp_path / "s", until="export").exported
    engine = _engine(("smollm2", smollm2, tmp_path / "s" / "export", exported), num_blocks=64, max_num_tokens=64)
    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    requests = {f"c{i}": (tokenizer.encode(prompt).ids,
                          SamplingParams(beam_width=w, length_penalty=lp, early_stopping=early, max_tokens=n,
                                         end_ids=(2,)))
                for i, (prompt, w, lp, early, n) in enumerate(SMOL_CASES)}
    finals, _ = _run(engine, requests)
    for rid, (prompt, params) in requests.items():
        beams, scores = _hf_beams(model, prompt, params)
        assert [b.token_ids for b in finals[rid].beams] == beams, rid
        assert [b.score for b in finals[rid].beams] == pytest.approx(scores, rel=1e-3, abs=1e-3), rid
    assert any(b.ended for b in finals["c0"].beams)  # the answer ends with <|im_end|>


def test_a_beam_request_alone_in_a_pool_it_outgrows_ends_with_length_and_its_running_beams(paged):
    engine = _engine(paged, num_blocks=6)  # 23 prompt tokens: 2 blocks, then 4 beams need 8 by position 32
    finals, _ = _run(engine, {"b": (PROMPTS[2], SamplingParams(beam_width=4, max_tokens=40))})
    out = finals["b"]
    assert out.finish_reason is FinishReason.length and len(out.beams) == 4
    lengths = {len(b.token_ids) for b in out.beams}  # the running beams, at the length the pool allowed
    assert len(lengths) == 1 and 0 < lengths.pop() < 40 and not any(b.ended for b in out.beams)
    assert [b.score for b in out.beams] == sorted((b.score for b in out.beams), reverse=True)
    assert not any(engine.blocks.ref_counts) and engine.blocks.num_used == 0


def test_a_cancelled_beam_request_gives_its_blocks_back(paged):
    engine = _engine(paged)
    engine.add_request("b", PROMPTS[1], SamplingParams(beam_width=3, max_tokens=30))
    for _ in range(4):
        engine.step()
    assert engine.blocks.num_used > 0
    engine.cancel("b")
    outs = engine.step()
    assert [o.finish_reason for o in outs] == [FinishReason.cancelled] and len(outs[0].beams) == 3
    assert not engine.has_work and engine.blocks.num_used == 0 and not any(engine.blocks.ref_counts)


def test_beams_beside_speculating_rows_get_their_solo_results(paged):
    from llmc.runtime.manifest import SpeculativeConfig

    kind, _, folder, exported = paged
    repetitive = [7, 8, 9, 10] * 6  # prompt lookup proposes for the greedy row
    requests = {"b": (PROMPTS[0], _params(kind, CASES[0])), "greedy": (repetitive, SamplingParams(max_tokens=16))}
    solo = {}
    for rid, request in requests.items():
        solo.update(_results(*_run(_engine(paged), {rid: request})))
    runner = PagedRunner(folder / exported.onnx, exported.kv_layout, num_blocks=96, max_num_tokens=32, num_threads=1)
    engine = PagedEngine(runner, max_rows=8, max_seq_len=128, max_num_tokens=32, max_beam_width=4,
                         speculative=SpeculativeConfig(method="ngram", num_tokens=3, max_batch=2, min_n=1, max_n=2))
    assert _results(*_run(engine, requests)) == solo
    assert engine.speculator.num_draft_tokens > 0


def test_fork_and_copy_on_write_count_references_and_take_what_write_cost_says():
    from llmc.runtime.engine.beam import BeamRow
    from llmc.runtime.engine.block_manager import BlockManager

    blocks = BlockManager(num_blocks=12, block_size=4)
    parent = BeamRow(list(range(10)), [blocks._take() for _ in range(3)], 10, np.float32(0))  # 2 full + 2 of 4
    rows = [BeamRow(parent.token_ids + [t], blocks.fork(parent.block_ids), 10, np.float32(0)) for t in (1, 2, 3)]
    blocks.free(parent)
    assert [blocks.ref_counts[b] for b in rows[0].block_ids] == [3, 3, 3]
    free_before = blocks.num_available
    assert blocks.write_cost(rows) == 2  # the partial block: two copies, the last holder keeps it
    copies = blocks.make_writable(rows)
    assert blocks.num_available == free_before - 2 and len(copies) == 2
    assert {src for src, _ in copies} == {rows[2].block_ids[2]} and blocks.ref_counts[rows[2].block_ids[2]] == 1
    assert len({r.block_ids[2] for r in rows}) == 3 and [blocks.ref_counts[r.block_ids[0]] for r in rows] == [3] * 3
    for row in rows:  # at a block boundary each row takes a new block
        row.num_cached, row.token_ids = 12, row.token_ids + [0]
    assert blocks.write_cost(rows) == 3 and blocks.make_writable(rows) == [] and len(rows[0].block_ids) == 4
    for row in rows:
        blocks.free(row)
    assert not any(blocks.ref_counts) and blocks.num_available == 12
