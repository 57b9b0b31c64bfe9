"""The paged engine's features on mixtures of experts, unchanged (the expert op is one more node in the graph):
greedy rows in flight together, prompt-lookup and self-draft speculation, prefix caching and beam search
equal transformers' generate() on a tiny gpt-oss graph (sinks, a window shorter than the prompts, biased and
clamped experts: the mixture with the most features; the others serve the same op)."""

import numpy as np
import pytest

from helpers import run_greedy
from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine.paged_engine import PagedEngine
from llmc.runtime.manifest import DraftModel, SpeculativeConfig
from llmc.runtime.runners.paged import PagedRunner

rng = np.random.default_rng(5)
PROMPTS = {"a": rng.integers(3, 256, 23).tolist(), "b": rng.integers(3, 256, 9).tolist(),
           "c": [7, 8, 9, 10] * 5}  # repeats, so prompt lookup has something to propose
TOKENS = 12


@pytest.fixture(scope="module")
def mixture(tiny_checkpoints, paged_export):
    from transformers import AutoModelForCausalLM

    folder, exported = paged_export("gpt_oss")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["gpt_oss"]).eval()
    return model, folder / exported.onnx, exported.kv_layout


def _engine(mixture, speculative=None, max_beam_width=1):
    _, path, layout = mixture

    def runner():
        return PagedRunner(path, layout, num_blocks=64, max_num_tokens=32, num_threads=1)

    draft = runner() if speculative is not None and speculative.method == "draft" else None
    return PagedEngine(runner(), end_ids=(), max_rows=4, max_seq_len=128, max_num_tokens=32,
                       speculative=speculative, draft=draft, max_beam_width=max_beam_width)


def _generate(model, prompt, **kwargs):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0,
                             eos_token_id=None, **kwargs)
    return out[:, len(prompt):].tolist()


@pytest.fixture(scope="module")
def want(mixture):
    tokens = {name: _generate(mixture[0], p)[0] for name, p in PROMPTS.items()}
    assert all(len(set(t)) > 3 for t in tokens.values()), tokens  # not one token repeated
    return tokens


def test_greedy_rows_in_flight_together_equal_transformers(mixture, want):
    assert run_greedy(_engine(mixture), PROMPTS, TOKENS) == want


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_gives_the_same_tokens(mixture, want, method):
    _, path, layout = mixture
    draft = DraftModel(model_file=path.name, kv_layout=layout, source="target", source_hash="0", quantization="none")
    spec = SpeculativeConfig(method=method, num_tokens=3, max_batch=4, min_n=1, max_n=2,
                             draft=draft if method == "draft" else None)
    engine = _engine(mixture, speculative=spec)
    assert run_greedy(engine, PROMPTS, TOKENS) == want
    assert engine.speculator.num_accepted_tokens > 0


def test_a_cached_prefix_gives_the_same_tokens(mixture, want):
    engine = _engine(mixture)
    assert run_greedy(engine, {"a": PROMPTS["a"]}, TOKENS) == {"a": want["a"]}
    hits = engine.blocks.prefix_hits
    assert run_greedy(engine, {"again": PROMPTS["a"]}, TOKENS) == {"again": want["a"]}
    assert engine.blocks.prefix_hits > hits


def test_beam_search_equals_transformers(mixture):
    engine = _engine(mixture, max_beam_width=3)
    engine.add_request("beams", PROMPTS["a"], SamplingParams(beam_width=3, max_tokens=TOKENS, end_ids=()))
    final = None
    while engine.has_work:
        final = next((o for o in engine.step() if o.finished), final)
    assert [b.token_ids for b in final.beams] == _generate(mixture[0], PROMPTS["a"], num_beams=3,
                                                           num_return_sequences=3, early_stopping=False)
