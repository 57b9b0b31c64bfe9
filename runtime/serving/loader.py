"""The composition root: from a packaged model version's manifest to a running engine, its
tokenizer and the limits requests are checked against. The only place that knows every runner
and engine class; `ServingLoop.from_manifest` (loop.py) serves what it loads.

    paged graph (kv_layout.paged)   PagedEngine over a PagedRunner (and a draft's, with speculative.draft), or over
                                    a TensorParallelRunner when the model is split over ranks; with `lora`, the
                                    runner also holds the LoRA graph and the engine the adapters (lora_engine_parts)
    tensorrt                        SlotEngine over a TrtRunner, or over a TrtTensorParallelRunner (one GPU a rank)
                                    when the model is split over ranks; with `lora`, the engine has the LoRA inputs
    onnxruntime                     SlotEngine over an OrtRunner; with `lora`, over the LoRA graph's session
                                    (one for base and adapter rows) and the engine the adapters
"""

from __future__ import annotations

import sys
from pathlib import Path

from llmc.runtime.decoding.tokenizer import load as load_tokenizer
from llmc.runtime.engine.core import Engine
from llmc.runtime.manifest import RepositoryManifest
from llmc.runtime.serving.request import Limits


def load(folder: Path) -> tuple[Engine, object, Limits]:
    """The engine, tokenizer (HF `tokenizers`) and request limits the version in `folder` describes."""
    folder = Path(folder)
    m = RepositoryManifest.load(folder)
    lim = m.limits
    tokenizer = load_tokenizer(folder / m.tokenizer)
    limits = Limits(lim.max_seq_len, lim.default_max_tokens, lim.max_stop_words, lim.max_beam_width)
    engine = paged_engine(folder, m, tokenizer) if m.kv_layout.paged else slot_engine(folder, m, tokenizer)
    return engine, tokenizer, limits


def slot_engine(folder: Path, m: RepositoryManifest, tokenizer) -> Engine:
    """A slot graph's engine: TensorRT's runner or ONNX Runtime's, `max_batch_size` slots."""
    from llmc.runtime.engine.slot_engine import SlotEngine

    lim = m.limits
    lora_graph, slots = lora_parts(folder, m)
    if m.target == "tensorrt" and m.tensor_parallel > 1:  # a rank engine per GPU, rank 0 here, the others workers
        from llmc.runtime.runners.parallel.trt_group import TrtTensorParallelRunner

        runner = TrtTensorParallelRunner(m.graphs(folder), m.kv_layout, max_batch=lim.max_batch_size,
                                         capacity=lim.max_seq_len, max_num_tokens=lim.max_num_tokens, info=m.tensorrt)
    elif m.target == "tensorrt":
        from llmc.runtime.runners.trt import TrtRunner

        lora = (m.lora.sites, m.lora.max_slots, m.lora.max_rank) if m.lora is not None else None  # in the engine
        runner = TrtRunner(folder / m.model_file, m.kv_layout, max_batch=lim.max_batch_size,
                           capacity=lim.max_seq_len, max_num_tokens=lim.max_num_tokens, info=m.tensorrt, lora=lora)
    else:
        from llmc.runtime.runners.ort import OrtRunner

        graph, sites = lora_graph if lora_graph is not None else (folder / m.model_file, None)
        runner = OrtRunner(graph, m.kv_layout, max_batch=lim.max_batch_size, capacity=lim.max_seq_len,
                           num_threads=lim.num_threads, lora=sites)
    return SlotEngine(runner, tokenizer, end_ids=tuple(m.end_ids), max_queue_size=lim.max_queue_size,
                      max_num_tokens=lim.max_num_tokens, lora=slots)


def paged_engine(folder: Path, m: RepositoryManifest, tokenizer) -> Engine:
    """The paged graph's engine: a pool of `kv_cache_tokens` tokens in blocks, `max_batch_size` rows a step
    (and, with a draft model, the draft's pools of as many blocks). A split model's ranks each get
    `num_threads` / ranks threads (0: the cores shared out)."""
    from llmc.runtime.engine.paged_engine import PagedEngine
    from llmc.runtime.runners.paged import PagedRunner

    lim = m.limits
    num_blocks = -(-lim.kv_cache_tokens // m.kv_layout.block_size)
    spec = m.speculative
    lora_graph, slots = lora_parts(folder, m)
    drafting = spec is not None and spec.draft is not None  # two sessions in turn: neither spins after its run
    if m.tensor_parallel > 1:
        from llmc.runtime.runners.parallel.ort_group import TensorParallelRunner

        runner = TensorParallelRunner(m.graphs(folder), m.kv_layout, num_blocks=num_blocks,
                                      max_num_tokens=lim.max_num_tokens, spin_after_run=not drafting,
                                      num_threads=max(1, lim.num_threads // m.tensor_parallel) if lim.num_threads else 0)
    else:
        runner = PagedRunner(folder / m.model_file, m.kv_layout, num_blocks=num_blocks, max_num_tokens=lim.max_num_tokens,
                             num_threads=lim.num_threads, spin_after_run=not drafting, lora=lora_graph)
    draft = PagedRunner(folder / spec.draft.model_file, spec.draft.kv_layout, num_blocks=num_blocks,
                        max_num_tokens=lim.max_num_tokens, num_threads=lim.num_threads, spin_after_run=False) \
        if drafting else None
    return PagedEngine(runner, tokenizer, end_ids=tuple(m.end_ids), max_rows=lim.max_batch_size,
                       max_seq_len=lim.max_seq_len, max_num_tokens=lim.max_num_tokens,
                       max_queue_size=lim.max_queue_size, prefix_caching=lim.prefix_caching, itl_ratio=lim.itl_ratio,
                       speculative=spec, draft=draft, max_beam_width=lim.max_beam_width, lora=slots)


class LoraNotServed(RuntimeError):
    """A manifest with adapters this runtime cannot serve them with (speculative decoding, tensor parallelism)."""


def lora_parts(folder: Path, m: RepositoryManifest):
    """The LoRA graph and sites for the runner and the adapter slots for the engine, or (None, None) without
    adapters; refuses what adapters are not served with yet, naming it. The adapters are the build's and those of
    the repository's store beside the versions (runtime/lora/index.py: loaded at run time, or unloaded)."""
    if m.lora is None:
        return None, None
    from llmc.runtime.engine.lora_slots import LoraSlots
    from llmc.runtime.lora.check import AdapterRefused, check_shapes
    from llmc.runtime.lora.files import AdapterFileError, read_header
    from llmc.runtime.lora.index import DIR, read_index
    from llmc.runtime.lora.stacks import AdapterRef
    from llmc.runtime.lora.store import AdapterStore

    for field, on in (("speculative", m.speculative is not None), ("tensor_parallel", m.tensor_parallel > 1),
                      ("target", m.target != "onnxruntime")):
        if on:
            raise LoraNotServed(f"{folder}: lora: adapters are not served with {field} "
                                f"({getattr(m, field)!r}) yet; rebuild without one or the other (docs/lora.md)")
    store = AdapterStore(m.lora.max_host_adapters)
    index = read_index(folder.parent)  # the store's adapters, beside the versions (runtime/lora/index.py)
    for adapter in m.lora.adapters:
        if adapter.name not in index.adapters and adapter.name not in index.removed:
            store.register(AdapterRef(adapter.name, adapter.digest), folder / adapter.file)
    for entry in index.adapters.values():
        path = folder.parent / DIR / entry.file
        try:
            ref, rank, shapes = read_header(path)
            if ref != AdapterRef(entry.name, entry.digest):
                raise AdapterFileError(f"{path} holds {ref.name!r} {ref.digest[:12]}, not the index's "
                                       f"{entry.name!r} {entry.digest[:12]}")
            check_shapes(ref.name, rank, shapes, m.lora.sites, m.lora.max_rank)
        except (AdapterFileError, AdapterRefused) as err:  # one bad adapter in the store does not stop the model
            print(f"llmc: the repository's adapter {entry.name!r} is not served: {err}", file=sys.stderr)
            continue
        store.register(ref, path, task_id=entry.lora_task_id)
    return (folder / m.lora.lora_file, m.lora.sites), LoraSlots(store, m.lora.max_slots, m.lora.max_rank)
