"""LongRoPE in the engines (runtime/engine/longrope.py) on real graphs of a tiny Phi-3 that switches at
16 tokens, its long factors 4-19x its short ones: what they serve equals transformers' generate() on
the whole prompt (which recomputes its cache when the sequence grows past the switch), for a prompt
past the switch prefilled in chunks shorter than it, a sequence growing past the switch while it
decodes (with and without speculation), and a prompt past the switch whose prefix a shorter prompt
left in the prefix cache, on the paged and the slot engine; a beam search that would cross is refused."""

import pytest

from checkpoints import TINY, make_checkpoint
from helpers import run_greedy
from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine.paged_engine import PagedEngine
from llmc.runtime.engine.slot_engine import SlotEngine
from llmc.runtime.manifest import DraftModel, SpeculativeConfig
from llmc.runtime.runners.ort import OrtRunner
from llmc.runtime.runners.paged import PagedRunner

SWITCH = 16
SHORT = [7, 7, 200, 5, 9, 31, 64, 2, 9, 120]  # 10 tokens: grows past the switch while it decodes
LONG = [(7 * i + 3) % 250 + 1 for i in range(40)]  # past the switch from the start
TOKENS = 12
END_ID = TINY["phi3"]["eos_token_id"]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(the checkpoint's PyTorch model, graph(lowering) -> (onnx path, kv layout), each exported on first use)."""
    from transformers import AutoModelForCausalLM

    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec

    root = tmp_path_factory.mktemp("longrope")
    rope = {**TINY["phi3"]["rope_parameters"], "original_max_position_embeddings": SWITCH,
            "long_factor": [4.0 + 3.0 * i for i in range(6)]}
    ckpt = make_checkpoint("phi3", root / "ckpt", original_max_position_embeddings=SWITCH, rope_parameters=rope)
    graphs = {}

    def graph(lowering: str):
        if lowering not in graphs:
            spec = parse_spec({"name": "t", "source": str(ckpt), "export": {"attention": lowering}})
            exported = build(spec, output=root / lowering, until="export").exported
            graphs[lowering] = root / lowering / "export" / exported.onnx, exported.kv_layout
        return graphs[lowering]

    return AutoModelForCausalLM.from_pretrained(ckpt).eval(), graph


@pytest.fixture(scope="module")
def want(phi3):
    """transformers' generate() greedy tokens for each prompt (ending at the config's end id, as the
    engines here do)."""
    import torch

    model = phi3[0]
    prompts = {"short": SHORT, "long": LONG, "cached": SHORT + LONG[:2], "past": SHORT + LONG[:2] + LONG}
    with torch.no_grad():
        out = {name: model.generate(torch.tensor([p]), max_new_tokens=TOKENS, do_sample=False)[0, len(p):].tolist()
               for name, p in prompts.items()}
    return out, prompts


def _paged(phi3, *, max_num_tokens=64, block_size=None, speculative=None):
    path, layout = phi3[1]("paged")
    assert layout.longrope_switch == SWITCH
    if block_size is not None:
        layout = layout.model_copy(update={"block_size": block_size})  # the graph takes any
    runner = PagedRunner(path, layout, num_blocks=64, max_num_tokens=max_num_tokens, num_threads=1)
    draft = None
    if speculative is not None and speculative.method == "draft":  # the target its own draft
        draft = PagedRunner(path, layout, num_blocks=64, max_num_tokens=max_num_tokens, num_threads=1)
    return PagedEngine(runner, end_ids=(END_ID,), max_rows=4, max_seq_len=128, max_num_tokens=max_num_tokens,
                       speculative=speculative, draft=draft, max_beam_width=2)


def _run(engine, prompts: dict[str, list[int]], max_tokens=TOKENS) -> dict[str, list[int]]:
    return run_greedy(engine, prompts, max_tokens)


def test_the_table_changes_what_the_model_says(phi3, want):
    """The checks below can fail: the 40-token prompt's first 16 positions (long factors) give logits far
    from those of the same 16 tokens alone (short ones), and the outputs compared are not one token
    repeated."""
    import torch

    model = phi3[0]
    with torch.no_grad():
        whole = model(torch.tensor([LONG])).logits[0, :SWITCH]
        alone = model(torch.tensor([LONG[:SWITCH]])).logits[0]
    assert float((whole - alone).abs().max()) > 1.0 and int((whole.argmax(-1) != alone.argmax(-1)).sum()) > 3
    assert all(len(t) == TOKENS and len(set(t)) > 3 for t in want[0].values()), want[0]


@pytest.mark.parametrize("chunk", [5, 64], ids=["chunks-of-5", "whole"])
def test_paged_engine_equals_transformers_across_the_switch(phi3, want, chunk):
    """A 40-token prompt in chunks of 5 (each chunk's rows rotated as the whole prompt picks), and a
    10-token prompt decoding past 16 (its KV recomputed with the long factors), side by side."""
    tokens, prompts = want
    engine = _paged(phi3, max_num_tokens=chunk)
    got = _run(engine, {"short": prompts["short"], "long": prompts["long"]})
    assert got == {"short": tokens["short"], "long": tokens["long"]}
    assert engine.scheduler.num_preemptions == 0 and engine.blocks.num_used == 0


def test_prefix_cache_keeps_short_and_long_factor_blocks_apart(phi3, want):
    """A 12-token prompt leaves short-factor blocks in the cache; a 52-token prompt starting with it
    must not use them (it equals transformers), and the same long prompt again reuses its own."""
    tokens, prompts = want
    engine = _paged(phi3, block_size=4)
    assert _run(engine, {"cached": prompts["cached"]}, max_tokens=1) == {"cached": tokens["cached"][:1]}
    hits = engine.blocks.prefix_hits
    assert engine.blocks.num_cached >= 3  # its three full blocks, keyed
    assert _run(engine, {"past": prompts["past"]}) == {"past": tokens["past"]}
    assert engine.blocks.prefix_hits == hits  # none of the short prompt's blocks served it
    assert _run(engine, {"again": prompts["past"]}) == {"again": tokens["past"]}
    assert engine.blocks.prefix_hits > hits


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculation_does_not_verify_past_the_switch(phi3, want, method):
    """Proposals for the 10-token row: a self-draft's (all accepted, so a step verifying positions on both
    sides of the switch would emit tokens of the short table's there) and prompt lookup's."""
    tokens, prompts = want
    path, layout = phi3[1]("paged")
    draft = DraftModel(model_file=path.name, kv_layout=layout, source="target", source_hash="0", quantization="none")
    spec = SpeculativeConfig(method=method, num_tokens=4, max_batch=4, min_n=1, max_n=2,
                             draft=draft if method == "draft" else None)
    engine = _paged(phi3, speculative=spec)
    assert _run(engine, {"short": prompts["short"], "long": prompts["long"]}) == \
        {"short": tokens["short"], "long": tokens["long"]}
    assert engine.speculator.num_accepted_tokens > 0


def test_a_beam_search_that_would_cross_the_switch_is_refused(phi3):
    engine = _paged(phi3)
    with pytest.raises(ValueError, match=r"beam_width: .* switch at 16 tokens .*at most 7 tokens"):
        engine.add_request("b", SHORT, SamplingParams(beam_width=2, max_tokens=8))
    engine.add_request("ok", SHORT, SamplingParams(beam_width=2, max_tokens=7))  # its last token needs no forward
    engine.add_request("long", LONG, SamplingParams(beam_width=2, max_tokens=8))  # long from the start


def test_slot_engine_equals_transformers_across_the_switch(phi3, want):
    """The slot graph (`fused`): the long prompt prefilled 5 tokens a step, the short one recomputed in
    its slot when it grows past the switch."""
    tokens, prompts = want
    path, layout = phi3[1]("fused")
    assert layout.longrope_switch == SWITCH
    engine = SlotEngine(OrtRunner(path, layout, max_batch=2, capacity=64, num_threads=1), end_ids=(END_ID,),
                        max_num_tokens=5)
    assert _run(engine, {"short": prompts["short"], "long": prompts["long"]}) == \
        {"short": tokens["short"], "long": tokens["long"]}
