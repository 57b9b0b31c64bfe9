"""The LoRA benchmark's loading figures (llmc/bench/engine/lora.py runs them last): adapters loaded at run time
and held at once, one loaded from its PEFT folder on disk until it serves, and the first request's TTFT on it against
a warm adapter's (issue 54: < 1 s at 0.5B rank 16; <= 1.2x)."""

from __future__ import annotations

import time
from pathlib import Path

from llmc.bench.harness import median, median_ratio

IDLE = 0.5  # seconds the engine waits before each TTFT measured: the same idle spell before the first and the warm


def _converted(root: str, model: str, name: str, folder: str) -> tuple[bytes, float]:
    """In the converting process (the operator's, as `llmc adapters load` converts): the adapter file's bytes and the
    seconds convert took."""
    from llmc.fleet.adapters import Served, convert
    from llmc.fleet.localstore import LocalStore

    served = Served.read(LocalStore(Path(root)), model)  # as `llmc adapters load` reads it
    start = time.perf_counter()
    data = convert(served, name, Path(folder))  # an AWQ base's fold included
    return data, time.perf_counter() - start


def held_and_loaded(args, engine, version: Path, peft_folder: Path, tokenizer, prompts) -> dict:
    """--held adapters loaded at run time and held at once; one more from disk until it serves; TTFTs.

    The PEFT folder is converted in a process of its own, as `llmc adapters load` converts it outside the server: the
    torch work would otherwise run in the serving process, where a served model never runs it. Each TTFT starts after
    the same pause (IDLE): on the shared 2-core hosts measured, the first step after an idle spell ran up to 1.7x
    slower than one right after another, with an adapter or without, which would otherwise be charged to the first
    request (it follows the load) and not to the warm one (it follows the first).

    After the load the engine idles as the serving loop does when it has no work (`engine.idle()`: the adapter goes
    into a slot, runtime/engine/lora_slots.py), timed with the load. A second adapter loaded each pass skips it, as
    on a loop that never ran out of work: its first request's step fills the slot (`first_request_busy`)."""
    import multiprocessing
    import threading
    from concurrent.futures import ProcessPoolExecutor

    import numpy as np

    from llmc.runtime.lora.files import adapter_bytes
    from llmc.runtime.lora.stacks import AdapterRef, AdapterWeights
    from llmc.runtime.serving.lora_admin import LoraAdmin

    admin = LoraAdmin(engine, threading.Lock())
    template = engine.lora.store.pin(engine.lora.store.resolve("a0"))
    engine.lora.store.unpin(template.ref)
    rng = np.random.default_rng(0)
    for i in range(args.held):
        sites = {s: (rng.standard_normal(a.shape, np.float32) * 0.02, rng.standard_normal(b.shape, np.float32) * 0.02)
                 for s, (a, b) in template.sites.items()}
        admin.load(adapter_bytes(AdapterWeights(AdapterRef(f"h{i}", f"{i:064x}"), template.rank, sites)), None)
    engine.idle()  # as the loop idles after the burst: the last of them staged, not charged to the first load below
    store = engine.lora.store
    held = [r for r in store.resident if r.name.startswith("h")]
    out = {"held": len(held), "held_bytes": int(sum(store.pin(r).nbytes for r in held))}
    for r in held:
        store.unpin(r)
    loads, cold, warm, busy = [], [], [], []
    stagings = engine.runner.lora.num_stagings
    where = (str(version.parents[1]), version.parent.name)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as operator:
        operator.submit(_converted, *where, "warmup", str(peft_folder)).result()  # its imports, once
        for p in range(args.passes):
            data, converted = operator.submit(_converted, *where, f"disk{p}", str(peft_folder)).result()
            start = time.perf_counter()
            admin.load(data, None)
            engine.idle()
            loads.append((converted, converted + time.perf_counter() - start))
            time.sleep(IDLE)
            cold.append(ttft(engine, prompts(1)[0], f"disk{p}"))
            time.sleep(IDLE)
            warm.append(ttft(engine, prompts(1)[0], f"disk{p}"))
            admin.load(operator.submit(_converted, *where, f"busy{p}", str(peft_folder)).result()[0], None)
            # no engine.idle(): its first step fills the slot (the next idle finds it bound and writes nothing)
            time.sleep(IDLE)
            busy.append(ttft(engine, prompts(1)[0], f"busy{p}"))
    admin.close()
    return {**out, "load_s": {"convert": median(c for c, _ in loads), "until_served": median(t for _, t in loads),
                              "until_first_token": median(t + c for (_, t), c in zip(loads, cold))},
            "ttft_s": {"first_request": median(cold), "warm_adapter": median(warm), "first_request_busy": median(busy)},
            "ttft_first/warm": median_ratio(cold, warm), "ttft_first_busy/warm": median_ratio(busy, warm),
            "staged": engine.runner.lora.num_stagings - stagings}


def ttft(engine, ids: list[int], name: str | None) -> float:
    from llmc.runtime.decoding.sampling import SamplingParams

    start = time.perf_counter()
    engine.add_request(f"t{start}", ids, SamplingParams(max_tokens=1, temperature=0.0), adapter=name)
    first = None
    while engine.has_work:
        outs = engine.step()
        if first is None and any(o.token_ids for o in outs):
            first = time.perf_counter() - start
    return first
