"""The verify-adapters stage: each adapter of the spec verified as the base is (graph/verify.py), after the base's
own verify and before anything is quantized.

    candidate   the fp32 export with a LoRA branch beside each site (graph.py), its weights the export's (a hard link
                beside it), run as its engine runs it, one session for base and adapter rows (llmc.LoraDelta where
                llmc's kernels load): a paged graph's rows joining a step apart, prompts in chunks (PagedRunner's
                shared LoRA session); a slot graph's prompts each prefilled into its slot, then every row in one batch
    reference   the checkpoint's own PyTorch model with PEFT's forward of the row's adapter added (peft_forward.py),
                each prompt alone, greedy

The cases, each over the verify prompts (three, of different lengths):

    <name>: batch-3    every row under adapter <name>
    mixed: batch-3     rows under the base, then each adapter in turn: steps mixing adapters with the base

A case passes as the base's do (graph/verify.compare): greedy tokens equal (or parted at a near tie) and logits
within the tolerance. A streamed build (source.load: layers) runs the candidate a segment at a time, fed a fixed
continuation (graph/segmented_candidate.py), and the reference a layer at a time with the hooks on: one pass over the
layers per adapter, and one for the base rows of the mixed case.

What this checks is the branch, the adapter's arrays (PEFT's scaling, rank_pattern, alpha_pattern, the expert
layout) and the runtime's slots and masks on the graph the quantized one is made from. The served graph of a
quantized build carries the same branch nodes (package.py) with AWQ's scales folded into the adapters' arrays
(fold.py): the tests compare that with PEFT over the dequantized weights (tests/e2e/lora/test_lora_awq.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from llmc.compiler.artifacts import AdapterVerifyReport, ExportedModel, VerifyCase
from llmc.compiler.graph import routing
from llmc.compiler.graph import streamed_reference as reference
from llmc.compiler.graph.greedy import Decoded, paged_blocks, paged_greedy, runner_greedy, torch_greedy
from llmc.compiler.graph.segmented_candidate import continuations, forced_cases
from llmc.compiler.graph.verify import DEFAULT_TOLERANCE, PAGED_CHUNK, ROUTING_TIE, compare, prompt_ids
from llmc.compiler.lora.adapter import Adapter, adapter_files
from llmc.compiler.lora.graph import lora_graph
from llmc.compiler.lora.package import checked_adapters
from llmc.compiler.lora.peft_forward import peft_forward
from llmc.compiler.lora.sites import find_sites
from llmc.compiler.lora.stacks import site_arrays
from llmc.compiler.spec import BuildSpec
from llmc.compiler.stage import Context, Located, Stage, ticker
from llmc.compiler.stream.model import StreamedModel
from llmc.errors import UnsupportedError, VerifyError
from llmc.plugins.op.lowering import Lowering
from llmc.runtime.lora.sites import Site
from llmc.runtime.lora.stacks import AdapterWeights, slot_masks, stack_slots
from llmc.runtime.runners.ort import OrtRunner
from llmc.runtime.runners.paged import PagedRunner, RowStep

MIXED = "mixed"
Case = tuple[str, list[list[int]], list[str | None]]  # name, prompts, each row's adapter (None: the base)


def adapter_cases(prompts: list[list[int]], names: Sequence[str]) -> list[Case]:
    """Each adapter alone over every prompt, then one batch of rows under the base and the adapters in turn."""
    turns = [None, *names]
    cases: list[Case] = [(f"{name}: batch-{len(prompts)}", prompts, [name] * len(prompts)) for name in names]
    cases.append((f"{MIXED}: batch-{len(prompts)}", prompts, [turns[r % len(turns)] for r in range(len(prompts))]))
    return cases


def verify_adapters(exported: ExportedModel, export_dir: Path, model, tokenizer, adapters: Sequence[Adapter],
                    sites: Sequence[Site], out_dir: Path, *, inputs_hash: str, steps: int = 32,
                    tolerance: float | None = None, num_threads: int = 0, progress=None) -> AdapterVerifyReport:
    """Run the adapter cases (module docstring) and write `out_dir/adapters_verify.json`. The report is falsy when a
    case failed; raising is the caller's decision. `model`: the checkpoint's PyTorch model, or a StreamedModel (the
    candidate then runs a segment at a time)."""
    layout = exported.kv_layout
    if exported.tensor_parallel != 1 or not exported.lowering.runs_on_onnxruntime or \
            (isinstance(model, StreamedModel) and not layout.paged):
        raise UnsupportedError("adapters are verified on an export of one rank that ONNX Runtime runs (streamed: a "
                               "paged one)")
    if not adapters:
        raise ValueError("no adapters to verify")
    prompts = prompt_ids(tokenizer, exported.model.vocab_size)
    tolerance = tolerance if tolerance is not None else DEFAULT_TOLERANCE[layout.dtype]
    by_name = {a.name: a for a in adapters}
    weights = {a.name: site_arrays(sites, a) for a in adapters}  # as the build writes them, unfolded (fp32 export)
    cases = adapter_cases(prompts, list(by_name))
    streamed = isinstance(model, StreamedModel)
    out_dir.mkdir(parents=True, exist_ok=True)
    with lora_graph(exported.graphs(export_dir)[0], sites, out_dir) as graph_file:
        if streamed:
            fed = continuations(prompts, steps, exported.model.vocab_size)
            cands = _segmented(graph_file, layout, sites, prompts, fed, cases, weights, steps,
                               exported.model.vocab_size, num_threads, progress)
            refs, ties = _streamed_references(model, by_name, prompts, fed, cases, steps, tolerance, progress)
        else:
            ticks = steps * sum(len(batch) for _, batch, _ in cases) + steps * len(_pairs(prompts, cases))
            tick = ticker(progress, ticks, "decode steps, ONNX Runtime's and PyTorch's")
            cands = _decoded(graph_file, layout, sites, prompts, cases, weights, steps, num_threads, tick)
            refs, ties = _references(model, by_name, prompts, cases, steps, tolerance, tick)
    at = {tuple(p): i for i, p in enumerate(prompts)}
    mixture = _mixture(model)
    results: list[VerifyCase] = []
    for (name, batch, names), decoded in zip(cases, cands):
        keys = [(at[tuple(p)], n) for p, n in zip(batch, names)]
        results.append(compare(name, [refs[k] for k in keys], decoded, batch, steps, tolerance,
                               [ties[k] for k in keys] if mixture else None))
    report = AdapterVerifyReport(
        inputs_hash=inputs_hash, adapters={a.name: a.digest for a in adapters},
        reference=f"pytorch ({exported.model.model_type}, fp32, HF attention) with PEFT's LoRA forward of the row's "
                  f"adapter added (hooks)" + (", streamed layer by layer, teacher-forced on the candidate's "
                                              "continuation" if streamed else ""),
        candidate=f"onnxruntime CPU, the fp32 export with a LoRA branch beside each of its {len(sites)} sites, "
                  + ("a graph segment at a time, each row fed a fixed continuation (seeded) after its prompt"
                     if streamed else "one session for base and adapter rows")
                  + (f", paged KV in blocks of {layout.block_size} ({layout.dtype}), prompts in chunks of {PAGED_CHUNK}"
                     if layout.paged else f", {exported.lowering.value} attention, each prompt prefilled into its KV "
                                          f"slot, then every row decoding in one batch"),
        tolerance=tolerance, max_abs_logit_diff=max(c.max_abs_logit_diff for c in results), cases=results,
        passed=all(c.passed for c in results))
    report.save(out_dir)
    return report


def _mixture(model) -> bool:
    return any(routing.routers(model.model if isinstance(model, StreamedModel) else model))


def _pairs(prompts: list[list[int]], cases: list[Case]) -> list[tuple[int, str | None]]:
    """Each (prompt index, adapter name or None) some case's row runs, once."""
    at = {tuple(p): i for i, p in enumerate(prompts)}
    return list(dict.fromkeys((at[tuple(p)], n) for _, batch, names in cases for p, n in zip(batch, names)))


def _active(model, adapter: Adapter | None):
    return peft_forward(model, adapter) if adapter is not None else contextlib.nullcontext()


def _decoded(graph_file: Path, layout, sites, prompts, cases: list[Case], weights: Mapping[str, AdapterWeights],
             steps: int, num_threads: int, tick) -> list[list[Decoded]]:
    """Each case decoded greedily by one session over the whole LoRA graph, as its engine steps it: the paged
    engine, or a slot graph's (each prompt prefilled into its slot, then every row decoding in one batch)."""
    rows = lambda names: [weights[n] if n is not None else None for n in names]  # noqa: E731
    if layout.paged:
        sizes = dict(num_threads=num_threads, max_num_tokens=sum(len(p) + steps for p in prompts),
                     num_blocks=sum(map(len, paged_blocks(prompts, steps, layout.block_size))))
        runner = PagedRunner(graph_file, layout, prepack=False, lora=(graph_file, list(sites)),
                             share_lora_session=True, **sizes)
        drive = lambda batch, names: paged_greedy(  # noqa: E731
            runner, batch, steps, tick, PAGED_CHUNK, adapters=rows(names))
    else:
        runner = OrtRunner(graph_file, layout, max_batch=len(prompts), capacity=max(map(len, prompts)) + steps,
                           num_threads=num_threads, prepack=False, lora=list(sites))
        drive = lambda batch, names: runner_greedy(runner, batch, steps, tick, adapters=rows(names))  # noqa: E731
    try:
        return [drive(batch, names) for _, batch, names in cases]
    finally:
        runner.close()


def _references(model, by_name: Mapping[str, Adapter], prompts, cases: list[Case], steps: int, tolerance: float,
                tick) -> tuple[dict, dict]:
    """The whole model's greedy decode of each (prompt, adapter) a case runs, and where its routing first tied."""
    refs, ties = {}, {}
    for i, name in _pairs(prompts, cases):
        with _active(model, by_name.get(name)), routing.recording(model) as margins:
            refs[i, name] = torch_greedy(model, prompts[i], steps, tick, margins)
        ties[i, name] = None if margins is None else margins.first_tie(ROUTING_TIE * tolerance)
    return refs, ties


def _segmented(graph_file: Path, layout, sites, prompts, fed, cases: list[Case], weights, steps: int,
               vocab_size: int, num_threads: int, progress) -> list[list[Decoded]]:
    """Each case's rows fed `fed` after their prompts, the LoRA graph run a segment at a time. Each case binds the
    stacks of the adapters its rows use, one slot each, for all its steps; a step's masks keep each token to its
    row's slot."""
    per_case = []
    for _, _, names in cases:
        used = [weights[n] for n in dict.fromkeys(n for n in names if n is not None)]
        rank = max(w.rank for w in used)
        per_case.append(({w.ref: s for s, w in enumerate(used)}, rank, stack_slots(sites, used, rank)))

    def lora_inputs(c: int, rows: Sequence[RowStep]) -> dict[str, np.ndarray]:
        slot_of, rank, stacks = per_case[c]
        slots = np.repeat(np.array([-1 if r.adapter is None else slot_of[r.adapter.ref] for r in rows], np.int64),
                          [len(r.token_ids) for r in rows])
        return {**stacks, **slot_masks(sites, slots, len(slot_of), rank)}

    at = {tuple(p): i for i, p in enumerate(prompts)}
    batches = [batch for _, batch, _ in cases]
    return forced_cases(graph_file, layout, batches, [[fed[at[tuple(p)]] for p in b] for b in batches], steps,
                        [PAGED_CHUNK] * len(cases), vocab_size, num_threads=num_threads,
                        progress=progress and (lambda done, total: progress(
                            done, total, "the LoRA graph's steps, a segment at a time (segments x steps)")),
                        adapters=[[weights[n] if n is not None else None for n in names] for _, _, names in cases],
                        extra=lora_inputs)


def _streamed_references(streamed: StreamedModel, by_name, prompts, fed, cases: list[Case], steps: int,
                         tolerance: float, progress) -> tuple[dict, dict]:
    """The reference a layer at a time, teacher-forced on `fed`: one pass over the layers for each adapter (and for
    the base), every prompt that runs under it in that pass."""
    pairs = _pairs(prompts, cases)
    names = list(dict.fromkeys(n for _, n in pairs))
    rows_of = {n: [i for i, m in pairs if m == n] for n in names}
    total = sum(reference.forwards(streamed, [prompts[i] for i in rows_of[n]], steps) for n in names)
    tick = ticker(progress, total, "the reference's layers, an adapter at a time")
    refs, ties = {}, {}
    for name in names:
        rows = rows_of[name]
        with _active(streamed.model, by_name.get(name)):
            decoded, margins = reference.teacher_forced(streamed, [prompts[i] for i in rows], [fed[i] for i in rows],
                                                        steps, tick)
        for i, d, m in zip(rows, decoded, margins):
            refs[i, name] = d
            ties[i, name] = None if m is None else routing.first_tie(m, ROUTING_TIE * tolerance)
    return refs, ties


def summary(report: AdapterVerifyReport) -> str:
    """The stage's line in the build report."""
    steps = report.cases[0].decode_steps
    agree = min(c.token_agreement for c in report.cases)
    verdict = "greedy tokens equal" if agree == 1.0 else f"greedy tokens {agree:.1%} equal"
    return (f"{', '.join(report.adapters)}: {verdict} over {steps} steps (each adapter over the prompts, then mixed "
            f"with the base in one batch), max |Δlogit| {report.max_abs_logit_diff:.1e} "
            f"(tolerance {report.tolerance:.0e})")


# the verify-adapters stage: the LoRA graph of the export on ONNX Runtime against PyTorch with PEFT's forward

def _skip(spec: BuildSpec, done: Mapping[str, Located]) -> str | None:
    if not spec.verify.enabled:
        return "verify.enabled is false"
    if not Lowering(spec.attention_lowering).runs_on_onnxruntime:
        return "the plugin graph runs on TensorRT only; the tensorrt stage checks each adapter on the engine"
    return None


def _key(spec: BuildSpec, ctx: Context) -> dict:
    """The adapters' files, the verify section (steps, tolerance), lora's limits (max_rank refuses) and ONNX
    Runtime's version."""
    import onnxruntime

    return {"verify": spec.section_hash("verify"), "lora": spec.section_hash("lora"),
            "onnxruntime": onnxruntime.__version__, "adapters": adapter_files(spec)}


def _run(exported: Located[ExportedModel], spec: BuildSpec, ctx: Context) -> AdapterVerifyReport:
    import onnx

    model, tokenizer = ctx.model()
    hf = model.model if isinstance(model, StreamedModel) else model
    adapters, _ = checked_adapters(spec, ctx.source, hf)
    graph = onnx.load(str(exported.artifact.graphs(exported.folder)[0]), load_external_data=False)
    sites = find_sites(graph, hf)
    del graph
    return verify_adapters(exported.artifact, exported.folder, model, tokenizer, adapters, sites, ctx.out,
                           inputs_hash=ctx.inputs_hash, steps=spec.verify.decode_steps,
                           tolerance=spec.verify.max_logit_diff, num_threads=ctx.num_threads, progress=ctx.progress)


def _accept(report: AdapterVerifyReport, spec: BuildSpec) -> None:
    if not report:
        failed = [c for c in report.cases if not c.passed]
        raise VerifyError(f"adapter verification failed: {summary(report)} (verify.max_logit_diff sets the "
                          f"tolerance)\n"
                          + "\n".join(f"  {c.name}: {c.token_agreement:.1%} tokens equal, first divergence "
                                      f"{c.first_divergence}, max |Δlogit| {c.max_abs_logit_diff:.2e}"
                                      for c in failed))


VERIFY_ADAPTERS = Stage(
    "verify-adapters", describe=lambda spec: f"PyTorch with PEFT's LoRA vs the LoRA graph ({', '.join(spec.adapters)})",
    takes=("export",), artifact=AdapterVerifyReport, section=lambda spec: spec, key=_key, skip=_skip,
    applies=lambda spec: bool(spec.adapters), run=_run, accept=_accept, summary=lambda done: summary(done.artifact),
    loads_model=True)
