"""A mixture's routing near-ties in verify (compiler/graph/routing.py): where the reference's router could pick
either of two experts, ONNX Runtime may pick the other and every later logit differ, though both graphs compute
the same function (issue 51: a tiny Mixtral verified at |Δlogit| 5.64 in a batch, greedy tokens equal). Verify
compares a row's logits before its first such position, and its tokens everywhere."""

from __future__ import annotations

import numpy as np
import torch

from llmc.compiler import build
from llmc.compiler.graph import routing
from llmc.compiler.graph.verify import PROMPTS, compare
from llmc.compiler.spec import parse_spec


def _decoded(prompt_len: int, steps: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(prompt_len, vocab)), [rng.normal(size=vocab) for _ in range(steps)]


def test_logits_are_compared_before_the_first_routing_tie_and_tokens_everywhere():
    prompt, steps = list(range(6)), 4
    ref = _decoded(6, steps, 32, 0)
    off = (ref[0].copy(), [l.copy() for l in ref[1]])
    off[0][4:] += 0.5  # positions 4 and 5 differ, and every step after (steps sit at positions 5 ..)
    for k in range(steps):
        off[1][k][:] += 0.5  # a uniform shift: the same argmax, the greedy tokens equal
    assert not compare("c", [ref], [off], [prompt], steps, 1e-3).passed  # no tie recorded: fails
    assert not compare("c", [ref], [off], [prompt], steps, 1e-3, [5]).passed  # position 4 is before the tie
    case = compare("c", [ref], [off], [prompt], steps, 1e-3, [4])
    assert case.passed and case.max_abs_logit_diff == 0.0 and case.routing_ties == [4]
    swapped = (off[0], [*off[1][:2], np.roll(off[1][2], 1), off[1][3]])  # a different token at step 2
    assert not compare("c", [ref], [swapped], [prompt], steps, 1e-3, [0]).passed  # tokens are still compared


def test_the_margins_are_the_smallest_over_the_layers_at_each_position():
    margins = routing.RoutingMargins()
    margins.at(0)
    margins.record(np.array([[3.0, 1.0, 2.0], [0.0, 5.0, 4.9]]), k=1)  # margins 1.0, 0.1
    margins.record(np.array([[1.0, 1.5, 0.0], [9.0, 0.0, 0.0]]), k=1)  # another layer: 0.5, 9.0
    margins.at(2)
    margins.record(np.array([[2.0, 2.0, 0.0]]), k=2)  # k-th minus (k+1)-th: 2.0
    np.testing.assert_allclose(margins.margins, [0.5, 0.1, 2.0])
    assert margins.first_tie(0.2) == 1 and margins.first_tie(0.05) is None


def test_a_planted_routing_tie_verifies_and_is_reported(tmp_path):
    """A tiny Mixtral whose last router, at one token of the first verify prompt, ties its k-th and (k+1)-th
    experts exactly: verify passes with its logits compared before that position, and says where it was."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from checkpoints import make_checkpoint

    checkpoint = make_checkpoint("mixtral", tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    prompt = AutoTokenizer.from_pretrained(checkpoint)(PROMPTS[0])["input_ids"]
    router, position = routing.routers(model)[-1], 3
    seen = {}

    def catch(module, args):  # returns None: the router's input stays as it is
        seen.setdefault("h", args[0][position].clone())

    handle = router.register_forward_pre_hook(catch)
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt]))
        handle.remove()
        h = seen["h"].double()
        logits = router.weight.double() @ h
        order = torch.argsort(logits, descending=True)
        kth, next_ = order[router.top_k - 1], order[router.top_k]
        router.weight[next_] += ((logits[kth] - logits[next_]) * h / h.dot(h)).float()  # now they tie
    model.save_pretrained(checkpoint)
    result = build(parse_spec({"name": "t", "source": str(checkpoint)}), output=tmp_path / "out", until="verify")
    assert result.verify.passed, result.verify
    for case in result.verify.cases:
        assert case.routing_ties[0] == position, case  # the first prompt is in both cases
        assert case.token_agreement == 1.0
