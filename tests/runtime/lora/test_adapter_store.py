"""The runtime's LoRA parts without a graph: an adapter's file (written and read back, refused when it is not the
adapter the manifest names), the adapter store (an LRU with reference counts: a held adapter is never evicted nor
unloaded), the prefix cache's key chains per adapter identity, and the scheduler's cap on a step's distinct
adapters."""

from __future__ import annotations

import numpy as np
import pytest

from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine.block_manager import BlockManager
from llmc.runtime.engine.lora_slots import LoraSlots
from llmc.runtime.engine.sequence import Sequence
from llmc.runtime.engine.token_scheduler import TokenScheduler
from llmc.runtime.lora.files import AdapterFileError, read_adapter_file, write_adapter_file
from llmc.runtime.lora.stacks import AdapterRef, AdapterWeights
from llmc.runtime.lora.store import AdapterInUse, AdapterStore, UnknownAdapter


def weights(name: str, digest: str = "d0", rank: int = 2) -> AdapterWeights:
    rng = np.random.default_rng(len(name) + rank)
    return AdapterWeights(AdapterRef(name, digest), rank, {"qkv.0": (rng.standard_normal((4, 3 * rank), np.float32),
                                                                     rng.standard_normal((3 * rank, 8), np.float32))})


def test_an_adapter_file_reads_back_and_must_be_the_manifests_adapter(tmp_path):
    w = weights("fr", "abc", rank=3)
    write_adapter_file(tmp_path / "fr.safetensors", w)
    back = read_adapter_file(w.ref, tmp_path / "fr.safetensors")
    assert back.ref == w.ref and back.rank == 3 and back.sites.keys() == w.sites.keys()
    assert all(np.array_equal(x, y) for x, y in zip(back.sites["qkv.0"], w.sites["qkv.0"]))
    with pytest.raises(AdapterFileError, match="holds adapter 'fr' with digest abc, not the manifest's other"):
        read_adapter_file(AdapterRef("fr", "other"), tmp_path / "fr.safetensors")
    (tmp_path / "bad").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(AdapterFileError, match="not a readable adapter file|not an llmc adapter file"):
        read_adapter_file(w.ref, tmp_path / "bad")


def store_of(capacity: int, *names: str) -> tuple[AdapterStore, list[str]]:
    loads: list[str] = []
    store = AdapterStore(capacity, load=lambda ref, path: (loads.append(ref.name), weights(ref.name, ref.digest))[1])
    for name in names:
        store.register(AdapterRef(name, "d0"), f"/nowhere/{name}")
    return store, loads


def test_the_store_evicts_the_least_recently_released_adapter_no_request_holds():
    store, loads = store_of(2, "a", "b", "c")
    a, b, c = (store.resolve(n) for n in "abc")
    store.pin(a)
    store.pin(b)
    assert not store.can_pin(c)  # both held: c's requests wait
    store.unpin(b)
    store.pin(c)  # b is evicted, a (held) stays
    assert store.resident == [a, c] and loads == ["a", "b", "c"]
    store.unpin(c)
    store.pin(c)  # in memory still: no load
    assert loads == ["a", "b", "c"] and store.pins(c) == 1
    with pytest.raises(UnknownAdapter, match=r"lora_name: this model serves no adapter 'd' \(its adapters: a, b, c\)"):
        store.resolve("d")


def test_an_adapter_registered_with_its_weights_keeps_the_store_within_capacity():
    store, loads = store_of(2, "a", "b")
    a, b = store.resolve("a"), store.resolve("b")
    store.pin(a)
    store.pin(b)
    store.unpin(b)
    store.register(AdapterRef("c", "d0"), "/nowhere/c", weights("c"))  # read already (a run-time load)
    c = store.resolve("c")
    assert store.resident == [a, c] and loads == ["a", "b"]  # b, held by no request, made room
    store.register(AdapterRef("d", "d0"), "/nowhere/d", weights("d"))
    assert len(store.resident) == 2 and store.resident[0] == a  # c went; a is held
    store.pin(c)  # read back from its file
    assert loads == ["a", "b", "c"]


def test_an_adapter_in_use_is_not_unloaded_under_its_request():
    store, _ = store_of(2, "a")
    ref = store.resolve("a")
    store.pin(ref)
    with pytest.raises(AdapterInUse, match="adapter 'a': 1 running request"):
        store.unload("a")
    assert store.resident == [ref]
    store.unpin(ref)
    store.unload("a")
    assert store.resident == [] and store.names == []


def seq(rid: str, prompt: list[int], adapter: AdapterRef | None = None) -> Sequence:
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=4), adapter=adapter)


def test_prefix_blocks_never_cross_adapters_nor_a_reload_under_the_same_name():
    blocks = BlockManager(num_blocks=32, block_size=4)
    prompt = list(range(13))
    a, b, a_reloaded = AdapterRef("a", "d1"), AdapterRef("b", "d1"), AdapterRef("a", "d2")

    def run(adapter):
        s = seq("x", prompt, adapter)
        blocks.allocate(s)
        hit = s.num_cached
        s.num_cached = len(prompt)
        blocks.commit(s)
        blocks.free(s)
        return hit

    assert run(a) == 0 and run(a) == 12  # the same adapter hits its own prefix
    assert run(b) == 0 and run(a_reloaded) == 0 and run(None) == 0  # another adapter, other weights, the base
    assert run(None) == 12 and run(b) == 12 and run(a) == 12


def test_a_step_carries_at_most_max_slots_adapters_and_the_others_wait():
    store, _ = store_of(2, "a", "b")
    scheduler = TokenScheduler(BlockManager(64, 4), max_rows=4, max_num_tokens=64, max_queue_size=8, capacity=64,
                               lora=LoraSlots(store, max_slots=1))
    first, other, base, second = (seq("1", [1, 2, 3], store.resolve("a")), seq("2", [4, 5], store.resolve("b")),
                                  seq("3", [6, 7]), seq("4", [8, 9], store.resolve("a")))
    for s in (first, other, base, second):
        scheduler.add(s)
    plan = scheduler.schedule()
    assert [c.seq.request_id for c in plan] == ["1", "3", "4"]  # b waits; the base and a's second pass it
    assert [r.adapter for r in plan.row_steps()] == [first.lora, None, first.lora] and first.lora is second.lora
    assert store.pins(store.resolve("a")) == 2 and list(scheduler.waiting) == [other]
    for s in (first, second):
        s.finish_reason = None
        scheduler.release(s)
    assert store.pins(store.resolve("a")) == 0
    assert [c.seq.request_id for c in scheduler.schedule()] == ["3", "2"] and other.lora is not None


def test_a_request_passed_over_too_long_for_a_slot_stops_other_adapters_until_a_slot_frees():
    """With the one slot held by a's requests, b waits while a's newcomers keep the slot busy; once b was passed over
    `starved_after` schedules, a's newcomers wait behind it (the base model's still pass), a's running requests drain,
    and b takes the slot before them."""
    store, _ = store_of(2, "a", "b")
    scheduler = TokenScheduler(BlockManager(64, 4), max_rows=8, max_num_tokens=64, max_queue_size=16, capacity=64,
                               lora=LoraSlots(store, max_slots=1, starved_after=3))
    a, b = store.resolve("a"), store.resolve("b")

    def admitted(*new: Sequence) -> list[str]:
        before = {s.request_id for s in scheduler.running}
        for s in new:
            scheduler.add(s)
        scheduler.schedule()
        return [s.request_id for s in scheduler.running if s.request_id not in before]

    waiting = seq("b0", [3, 4], b)
    assert admitted(seq("a0", [1, 2], a), waiting) == ["a0"] and waiting.lora_passes == 1
    assert admitted(seq("a1", [5, 6], a)) == ["a1"] and waiting.lora_passes == 2  # a's newcomer passes b
    assert admitted(seq("a2", [7, 8], a), seq("base", [9, 10])) == ["base"] and waiting.lora_passes == 3
    assert [s.request_id for s in scheduler.waiting] == ["b0", "a2"]  # b waited 3 schedules: a2 waits behind it
    for s in [s for s in scheduler.running if s.adapter == a]:
        scheduler.release(s)
    assert admitted() == ["b0"] and waiting.lora is not None  # b took the freed slot; a2 waits for it now
    assert [s.request_id for s in scheduler.waiting] == ["a2"]


def test_the_slot_scheduler_stops_other_adapters_behind_a_request_passed_over_too_long():
    from llmc.runtime.engine.slot_scheduler import Scheduler

    store, _ = store_of(2, "a", "b")
    scheduler = Scheduler(max_batch_size=8, max_queue_size=16, lora=LoraSlots(store, max_slots=1, starved_after=2))
    a, b = store.resolve("a"), store.resolve("b")
    waiting = seq("b0", [3, 4], b)
    for s in (seq("a0", [1], a), waiting, seq("a1", [2], a)):
        scheduler.add(s)
    scheduler.admit()  # b passed over once: a1 passes it
    scheduler.add(seq("a2", [5], a))
    scheduler.add(seq("base", [6]))
    scheduler.admit()  # twice: a2 waits behind it, the base passes
    assert sorted(s.request_id for s in scheduler.running.values()) == ["a0", "a1", "base"]
    assert [s.request_id for s in scheduler.waiting] == ["b0", "a2"] and waiting.lora_passes == 2
