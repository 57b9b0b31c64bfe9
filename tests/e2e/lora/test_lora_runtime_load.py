"""LoRA adapters loaded and unloaded while the model serves (runtime/serving/lora_admin.py), through the serving loop
as Triton's model drives it, on the tiny Llama built with adapters a and b (lora_build.py): an adapter converted
from PEFT (compiler/lora/convert.py) and loaded serves PEFT's greedy tokens, by name and by lora_task_id; reloaded
under the same name with other weights it serves the new ones and never hits the old one's prefix blocks; an unload
while a request uses it is refused, or waits for it; a bad adapter is refused naming what is wrong, and nothing of it
stays."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from lora_build import ADAPTER_A, lora_build, make_adapter, peft_greedy
from serving_rig import RecordingSink

PROMPT = "adapters at run time"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def built(tiny_checkpoints, tmp_path_factory):
    return lora_build(tmp_path_factory, tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def peft_c(tiny_checkpoints, tmp_path_factory):
    """Two PEFT adapters to load as `c`: the first and, for a reload, other weights."""
    root = tmp_path_factory.mktemp("runtime-adapters")
    return [make_adapter(tiny_checkpoints["llama"], root / f"c{i}", 10 + i, **ADAPTER_A) for i in range(2)]


@pytest.fixture
def loop(built):
    from llmc.runtime.serving.loop import ServingLoop

    loop = ServingLoop.from_manifest(built[0]).start()
    yield loop
    loop.stop()


def control(loop, op: dict, adapter: bytes | None = None) -> tuple[dict | None, str | None]:
    inputs = {"text_input": np.array([b""], dtype=object), "lora_control": np.array([json.dumps(op).encode()],
                                                                                     dtype=object)}
    if adapter is not None:
        inputs["lora_adapter"] = np.array([adapter], dtype=object)
    sink = RecordingSink()
    loop.submit(inputs, sink)
    sink.wait(60)
    if sink.errors:
        return None, sink.errors[0]
    return json.loads(sink.responses[0]["text_output"][0]), None


def generate(loop, **inputs) -> RecordingSink:
    sink = RecordingSink()
    tensors = {"text_input": np.array([PROMPT.encode()], dtype=object),
               "max_tokens": np.array([inputs.pop("max_tokens", MAX_TOKENS)], dtype=np.int32)}
    for name, value in inputs.items():
        tensors[name] = np.array([value], dtype=np.uint64) if name == "lora_task_id" else \
            np.array([value.encode()], dtype=object)
    loop.submit(tensors, sink)
    return sink


def converted(built, folder) -> bytes:
    from llmc.compiler.lora.convert import convert
    from llmc.runtime.manifest import RepositoryManifest

    lora = RepositoryManifest.load(built[0]).lora
    return convert("c", folder, lora)[0]


def served(loop) -> dict:
    return {a["name"]: a["digest"] for a in control(loop, {"op": "list"})[0]["adapters"]}


def expected(built, tiny_checkpoints, folder) -> list[int]:
    from llmc.runtime.decoding.tokenizer import encode, load

    ids = encode(load(built[0] / "tokenizer.json"), PROMPT)
    return peft_greedy(tiny_checkpoints["llama"], {"c": folder}, [(ids, "c")], MAX_TOKENS)[0]


def test_a_loaded_adapter_serves_peft_tokens_and_a_reload_serves_the_new_weights_apart(loop, built, peft_c,
                                                                                     tiny_checkpoints):
    first, second = (converted(built, f) for f in peft_c)
    assert generate(loop, lora_name="c").wait().errors[0].startswith("lora_name: this model serves no adapter 'c'")
    result, error = control(loop, {"op": "load", "lora_task_id": 7}, first)
    assert error is None and result["loaded"] == "c" and result["replaced"] is None
    assert served(loop).keys() == {"a", "b", "c"}
    want = expected(built, tiny_checkpoints, peft_c[0])
    assert generate(loop, lora_name="c").wait().ids == want
    blocks = loop.engine.blocks
    before = blocks.prefix_hits
    assert generate(loop, lora_task_id=7).wait().ids == want  # TensorRT-LLM's task id names it too
    assert blocks.prefix_hits > before  # its own prefix, found again
    assert control(loop, {"op": "load", "lora_task_id": 7}, first)[0]["unchanged"]

    old = served(loop)["c"]
    result, error = control(loop, {"op": "load", "lora_task_id": 7}, second)
    assert error is None and result["replaced"] == old != result["digest"] == served(loop)["c"]
    before = blocks.prefix_hits
    new = generate(loop, lora_name="c").wait().ids
    assert new == expected(built, tiny_checkpoints, peft_c[1]) != want
    assert blocks.prefix_hits == before  # the old weights' blocks are never a hit for the new ones


def test_the_loop_puts_a_loaded_adapter_into_a_slot_before_its_first_request(loop, built, peft_c, tiny_checkpoints):
    """While it has no work, the loop writes an adapter loaded at run time into a slot (runtime/engine/lora_slots.py):
    its first request binds nothing new and serves PEFT's tokens. The four-node branch, whose stacks follow each step's
    adapters, stages nothing."""
    lora = loop.engine.runner.lora
    assert control(loop, {"op": "load"}, converted(built, peft_c[0]))[1] is None
    deadline = time.monotonic() + 10
    while lora.keep_stale and not lora.num_stagings and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (lora.num_stagings, [r.name for r in lora.bound]) == ((1, ["c"]) if lora.keep_stale else (0, []))
    stacked = lora.num_stackings, lora.num_refills
    assert generate(loop, lora_name="c").wait().ids == expected(built, tiny_checkpoints, peft_c[0])
    if lora.keep_stale:
        assert (lora.num_stackings, lora.num_refills) == stacked  # its first step found it bound


def test_an_unload_while_a_request_uses_the_adapter_is_refused_or_waits(loop, built, peft_c):
    assert control(loop, {"op": "load"}, converted(built, peft_c[0]))[1] is None
    busy = generate(loop, lora_name="c", max_tokens=60)
    _, error = control(loop, {"op": "unload", "name": "c"})
    assert error.startswith("in use: adapter 'c': ") and "request(s) use it; not unloaded" in error
    assert "c" in served(loop) and not busy.done.is_set()
    result, error = control(loop, {"op": "unload", "name": "c", "wait": 30})
    assert error is None and result["unloaded"] == "c" and busy.done.is_set() and not busy.errors
    assert "c" not in served(loop)
    assert generate(loop, lora_name="c").wait().errors[0].startswith("lora_name: this model serves no adapter 'c'")


def test_a_bad_adapter_is_refused_naming_what_is_wrong_and_nothing_stays(loop, built, peft_c):
    from llmc.runtime.lora.files import adapter_bytes, parse_adapter
    from llmc.runtime.lora.stacks import AdapterRef, AdapterWeights

    good = parse_adapter(converted(built, peft_c[0]), "c")
    site, (a, b) = next(iter(good.sites.items()))
    other_base = {**good.sites, site: (np.zeros((a.shape[0] + 8, a.shape[1]), np.float32), b)}
    missing = bytearray(adapter_bytes(good))
    wide = {s: (np.zeros((x.shape[0], x.shape[1] * 8), np.float32), np.zeros((y.shape[0] * 8, y.shape[1]), np.float32))
            for s, (x, y) in good.sites.items()}
    header = len(missing)
    bad = {
        "a missing tensor": (without_tensor(adapter_bytes(good), f"{site}.b"), f"missing tensor {site}.b"),
        "another base": (adapter_bytes(AdapterWeights(good.ref, good.rank, other_base)), "another base"),
        "rank over the limit": (adapter_bytes(AdapterWeights(good.ref, good.rank * 8, wide)), "rank 32 is above"),
        "a truncated file": (bytes(missing[:header - b.nbytes]), "truncated or damaged"),
        "not an adapter": (b"\x02\x00\x00\x00\x00\x00\x00\x00{}", "not an llmc adapter file"),
    }
    names = dict(served(loop))
    for what, (data, message) in bad.items():
        result, error = control(loop, {"op": "load"}, data)
        assert result is None and error.startswith("lora_adapter: ") and message in error, (what, error)
    assert served(loop) == names and (loop.lora._scratch is None or not any(loop.lora._scratch.iterdir()))
    assert control(loop, {"op": "unload", "name": "zz"})[1].startswith("lora_name: this model serves no adapter 'zz'")
    assert control(loop, {"op": "merge"})[1].startswith("lora_control: op 'merge'")
    assert AdapterRef("c", good.ref.digest) == good.ref


def without_tensor(data: bytes, name: str) -> bytes:
    """An adapter file's bytes with `name` left out of its header (its bytes stay)."""
    import struct

    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    del header[name]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (size - len(text))
    return data[:8] + text + data[8 + size:]


def test_an_adapter_whose_copy_of_the_head_is_not_the_bases_is_refused_at_conversion(built, peft_c, tmp_path):
    """Adapter c targets the untied LM head, so PEFT saved a copy of the head's weight; one that differs from the
    served base's (the manifest's digest) would have PEFT serve another head: refused before anything is written."""
    import shutil

    from safetensors.torch import load_file, save_file

    from llmc.compiler.lora import AdapterError

    folder = tmp_path / "c"
    shutil.copytree(peft_c[0], folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    key = "base_model.model.lm_head.base_layer.weight"
    assert key in tensors and converted(built, peft_c[0])
    save_file({**tensors, key: tensors[key] * 1.01}, folder / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"its copy of lm_head's weight \(base_layer.weight\) differs"):
        converted(built, folder)
