"""The LoRA graph's stacks when a step's set of adapters changes (runtime/runners/paged_lora.py): the adapters that
stay keep their slots and only the changed slot is rewritten, equal to stacking them afresh; a new highest rank or
another count of adapters restacks every slot. Where the session reads each token's own slot only (llmc.LoraDelta:
`keep_stale`), adapters a step no longer uses stay in their slots until a new one takes them. A LoRA graph of the
layout before the flat one is refused."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from llmc.runtime.lora.sites import OLD_SLOTS, Member, Site, a_name, b_name, mask_name
from llmc.runtime.lora.stacks import AdapterRef, AdapterWeights, stack_slots
from llmc.runtime.runners.paged_lora import LoraGraph

SITE = Site("qkv.0", "x", "y", 4, 8, (Member("q", 0, 4), Member("k", 4, 2), Member("v", 6, 2)))


def adapter(name: str, rank: int) -> AdapterWeights:
    rng = np.random.default_rng(len(name) * 7 + rank)
    return AdapterWeights(AdapterRef(name, "d"), rank, {SITE.name: (rng.standard_normal((4, 3 * rank), np.float32),
                                                                    rng.standard_normal((3 * rank, 8), np.float32))})


class Binding:
    def __init__(self):
        self.bound = {}

    def bind_cpu_input(self, name, value):
        self.bound[name] = value


def graph(keep_stale: bool = False) -> LoraGraph:
    names = ["input_ids", mask_name(3), a_name(SITE), b_name(SITE)]
    session = SimpleNamespace(get_inputs=lambda: [SimpleNamespace(name=n) for n in names])
    lora = LoraGraph(session, [SITE], ["input_ids"], "model_lora.onnx", keep_stale=keep_stale)
    lora.binding = Binding()
    return lora


def test_a_changed_adapter_rewrites_its_slot_only_and_equals_a_fresh_stack():
    lora, a, b, c, d = graph(), adapter("a", 4), adapter("b", 2), adapter("c", 3), adapter("d", 8)
    lora.bind([a, b, None], [1, 1, 1])
    assert (lora.num_stackings, lora.num_refills) == (1, 0) and list(lora.token_slots) == [0, 1, -1]
    assert lora.binding.bound[mask_name(3)].tolist() == [[1.0] * 12 + [0.0] * 12, [0.0] * 12 + [1.0] * 12, [0.0] * 24]
    a_stack = lora.binding.bound[a_name(SITE)]
    before = {name: lora.binding.bound[name].copy() for name in (a_name(SITE), b_name(SITE))}
    lora.bind([c, a], [2, 1])  # b's requests ended as c's began: a keeps slot 0, c takes b's
    assert (lora.num_stackings, lora.num_refills) == (1, 1) and lora.binding.bound[a_name(SITE)] is a_stack
    assert list(lora.token_slots) == [1, 1, 0]
    assert lora.binding.bound[mask_name(3)].tolist() == [[0.0] * 12 + [1.0] * 12] * 2 + [[1.0] * 12 + [0.0] * 12]
    k = 3 * 4  # a slot's width: 3 modules at rank 4; slot 0 (a) kept its columns of A and rows of B untouched
    assert np.array_equal(a_stack[:, :k], before[a_name(SITE)][:, :k])
    assert np.array_equal(lora.binding.bound[b_name(SITE)][:k], before[b_name(SITE)][:k])
    fresh = stack_slots([SITE], [a, c], rank=4)
    for name in (a_name(SITE), b_name(SITE)):
        assert np.array_equal(lora.binding.bound[name], fresh[name])
    lora.bind([d, a], [1, 1])  # a higher rank: every slot again
    lora.bind([a], [1])  # fewer adapters: every slot again
    assert (lora.num_stackings, lora.num_refills) == (3, 1) and lora.binding.bound[a_name(SITE)].shape == (4, 12)


def test_with_the_fused_op_an_adapter_no_step_uses_keeps_its_slot_until_a_new_one_takes_it():
    lora, a, b, c, d = graph(keep_stale=True), adapter("a", 4), adapter("b", 2), adapter("c", 3), adapter("d", 8)
    lora.bind([a, b], [1, 1])
    a_stack = lora.binding.bound[a_name(SITE)]
    lora.bind([b, None], [2, 1])  # a's requests ended: nothing restacked, a's slot stays (its tokens: none)
    assert (lora.num_stackings, lora.num_refills) == (1, 0) and list(lora.token_slots) == [1, 1, -1]
    assert lora.binding.bound[mask_name(3)].tolist() == [[0.0] * 12 + [1.0] * 12] * 2 + [[0.0] * 24]
    lora.bind([a], [1])  # a again: still in its slot
    assert (lora.num_stackings, lora.num_refills) == (1, 0) and list(lora.token_slots) == [0]
    lora.bind([c, b], [1, 1])  # c takes a's slot, the one b's step did not use, in place
    assert (lora.num_stackings, lora.num_refills) == (1, 1) and lora.binding.bound[a_name(SITE)] is a_stack
    assert list(lora.token_slots) == [0, 1]
    fresh = stack_slots([SITE], [c, b], rank=4)
    for name in (a_name(SITE), b_name(SITE)):
        assert np.array_equal(lora.binding.bound[name], fresh[name])
    lora.bind([a, c, b], [1, 1, 1])  # more adapters than slots: every slot again
    lora.bind([d], [1])  # d alone, at a higher rank than the slots': every slot again
    assert (lora.num_stackings, lora.num_refills) == (3, 1)
    plain = graph()  # the four-node branch multiplies every token by every bound slot: the set is followed exactly
    plain.bind([a, b], [1, 1])
    plain.bind([b], [1])
    assert (plain.num_stackings, plain.num_refills) == (2, 0) and plain.binding.bound[a_name(SITE)].shape == (4, 6)


def test_a_graph_of_the_stacked_slot_layout_is_refused_naming_the_rebuild():
    names = ["input_ids", OLD_SLOTS, a_name(SITE), b_name(SITE)]
    session = SimpleNamespace(get_inputs=lambda: [SimpleNamespace(name=n) for n in names])
    with pytest.raises(ValueError, match=r"model_lora.onnx was built by an earlier llmc with the stacked-slot LoRA "
                                         r"layout .* rebuild the model with `llmc build`"):
        LoraGraph(session, [SITE], ["input_ids"], "model_lora.onnx")
