"""Verify stage: the exported graph on ONNX Runtime against the HF PyTorch model it came from.

The reference is the original HF model (not llmc's rebuilt decoder) running each prompt alone:
prefill, then greedy decoding on its own tokens. The candidate is the graph driven the way serving
drives it (runtime/runners/ort.py): each prompt prefilled into its own cache slot, then every row
decoding side by side in one batch, each at its own position (no padding, no attention mask).

A paged export (runtime/runners/paged.py) is driven as its engine drives it: rows joining one step
apart, each prompt fed in chunks while the rows before it decode, so steps mix decoding rows with
prompt chunks and a prompt spans several steps; every prompt token's logits are asked for.

Two cases: batch 1, and a batch of three prompts of different lengths. Logits are compared at every
prompt position and at every step up to a row's first token divergence (step k depends only on
tokens before k). A case passes when the largest |Δlogit| is within the spec's tolerance and the greedy
tokens agree everywhere, or part where the reference's own choice was a near tie: a row may diverge at a
step where the candidate's token trails the reference's best by at most twice the tolerance (an error
the tolerance admits can flip such a tie). In a mixture of experts a router's choice can be a near tie too
(routing.py): a row's logits are compared up to the first position where it was, its tokens everywhere. The tolerance unset (`verify.max_logit_diff`), it follows the
graph's KV cache: 1e-3 float32, 0.05 float16, 0.25 int8 (DEFAULT_TOLERANCE; what SmolLM2 and the tiny
test models need, docs/build.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from llmc.compiler.artifacts import ExportedModel, VerifyCase, VerifyReport
from llmc.compiler.graph import routing
from llmc.compiler.graph import streamed_reference as reference
from llmc.compiler.graph.greedy import Decoded, paged_blocks, paged_greedy, runner_greedy, torch_greedy
from llmc.compiler.graph.segmented_candidate import continuations, forced_cases
from llmc.compiler.spec import BuildSpec, VerifySpec
from llmc.compiler.stream.model import StreamedModel
from llmc.compiler.stage import Context, Located, Stage, ticker
from llmc.errors import UnsupportedError, VerifyError
from llmc.plugins.op.lowering import Lowering
from llmc.runtime.runners.ort import OrtRunner
from llmc.runtime.runners.paged import PagedRunner

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
)
RANDOM_PROMPT_LENGTHS = (7, 13, 4)  # used when the source has no tokenizer
PAGED_CHUNK = 5  # prompt tokens a row feeds per step in the paged batch case (prompts span several steps)
DEFAULT_TOLERANCE = {"float32": 1e-3, "float16": 0.05, "int8": 0.25}  # max |Δlogit| by KV cache element type
# a mixture's routing margin (k-th minus (k+1)-th router logit) at most this share of the tolerance is a near
# tie (routing.py): ONNX Runtime and PyTorch flipped a gap of 4.8e-7, not one of 3.8e-5 (float32 KV: 1e-4)
ROUTING_TIE = 0.1

Progress = Callable[[int, int], None]


def prompt_ids(tokenizer, vocab_size: int) -> list[list[int]]:
    if tokenizer is not None:
        return [tokenizer(p)["input_ids"] for p in PROMPTS]
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab_size, n).tolist() for n in RANDOM_PROMPT_LENGTHS]


def compare(name: str, refs: list[Decoded], cands: list[Decoded], prompts: list[list[int]], steps: int,
            tolerance: float, routing_ties: list[int | None] | None = None) -> VerifyCase:
    """`routing_ties`: per row, the first position whose expert choice was a near tie in the reference
    (routing.py); the logits at and after it may differ legitimately, so they are not compared."""
    diff, first_divergence, agree, near_ties = 0.0, [], 0, True
    for row, ((ref_prefill, ref_last), (cand_prefill, cand_last)) in enumerate(zip(refs, cands)):
        tie = routing_ties[row] if routing_ties else None
        length = len(prompts[row])
        compared = slice(None) if tie is None else slice(min(tie, length))  # prompt positions before the tie
        if len(ref_prefill[compared]):
            diff = max(diff, float(np.abs(ref_prefill[compared] - cand_prefill[compared]).max()))
        ref_tokens = np.array([l.argmax() for l in ref_last])
        cand_tokens = np.array([l.argmax() for l in cand_last])
        differ = np.nonzero(ref_tokens != cand_tokens)[0]
        end = int(differ[0]) if differ.size else steps
        first_divergence.append(end if differ.size else None)
        agree += int((ref_tokens == cand_tokens).sum())
        for k in range(min(end + 1, steps)):  # step k's logits sit at position length - 1 + k
            if tie is None or length - 1 + k < tie:
                diff = max(diff, float(np.abs(ref_last[k] - cand_last[k]).max()))
        if differ.size:  # the reference's margin over the candidate's token where they part
            near_ties &= float(ref_last[end].max() - ref_last[end][cand_tokens[end]]) <= 2 * tolerance
    agreement = agree / (steps * len(prompts))
    return VerifyCase(name=name, batch=len(prompts), prompt_lengths=[len(p) for p in prompts], decode_steps=steps,
                      max_abs_logit_diff=diff, token_agreement=agreement, first_divergence=first_divergence,
                      passed=near_ties and diff <= tolerance, routing_ties=routing_ties)


def _driver(graphs: list[Path], layout, prompts: list[list[int]], steps: int, num_threads: int):
    """The runner for this export (`graphs`: each rank's; one without a split) and how a case drives it:
    `drive(batch, tick) -> [Decoded]`. Its session reads the weights from the mapped data file, not prepacked:
    a prepacked copy was the model again in memory (at 1.1B fp32, 4.2 GiB anonymous against 0.6), and a
    decode step was no faster with it (7.5 against 8.3 tok/s)."""
    onnx_path = graphs[0]
    if layout.paged:
        # a step's tokens: every prompt, and every row's whole sequence when LongRoPE recomputes it
        sizes = dict(num_threads=num_threads, max_num_tokens=sum(len(p) + steps for p in prompts),
                     num_blocks=sum(map(len, paged_blocks(prompts, steps, layout.block_size))))
        if len(graphs) > 1:
            from llmc.runtime.runners.parallel.ort_group import TensorParallelRunner

            runner = TensorParallelRunner(graphs, layout, **sizes)
        else:
            runner = PagedRunner(onnx_path, layout, prepack=False, **sizes)
        chunks = {1: None}  # batch 1 prefills whole; the batch case in chunks, rows joining a step apart
        return lambda batch, tick: paged_greedy(runner, batch, steps, tick, chunks.get(len(batch), PAGED_CHUNK)), runner
    runner = OrtRunner(onnx_path, layout, max_batch=len(prompts), capacity=max(map(len, prompts)) + steps,
                       num_threads=num_threads, prepack=False)
    return lambda batch, tick: runner_greedy(runner, batch, steps, tick), runner


def verify(exported: ExportedModel, export_dir: Path, model, tokenizer, out_dir: Path, *, inputs_hash: str,
           steps: int = 32, tolerance: float | None = None, num_threads: int = 0,
           progress: Progress | None = None, segmented: bool = False) -> VerifyReport:
    """Run both models on the verify prompts and write `out_dir/verify.json`. The report is falsy
    when a case failed; raising is the caller's decision. `segmented`, with a streamed `model` and a paged graph
    on one rank: the candidate runs a segment of weights at a time, both fed a fixed continuation
    (segmented_candidate.py), so no session holds the whole graph."""
    if not exported.lowering.runs_on_onnxruntime:
        raise UnsupportedError(f"the {exported.lowering.value} attention lowering runs only in TensorRT; "
                               "verify a build with target: onnxruntime")
    prompts = prompt_ids(tokenizer, exported.model.vocab_size)
    layout = exported.kv_layout
    tolerance = tolerance if tolerance is not None else DEFAULT_TOLERANCE[layout.dtype]
    cases_in = [("batch-1", prompts[:1]), (f"batch-{len(prompts)}", prompts)]
    segmented = segmented and layout.paged and exported.tensor_parallel == 1 and isinstance(model, StreamedModel)
    if segmented:
        cases = _segmented_cases(exported.graphs(export_dir)[0], layout, model, prompts, cases_in, steps, tolerance,
                                 exported.model.vocab_size, num_threads, progress)
    else:
        cases = _decoded_cases(exported, export_dir, layout, model, prompts, cases_in, steps, tolerance, num_threads,
                               progress)
    streamed = ", streamed layer by layer, teacher-forced on " + (
        "the candidate's continuation)" if segmented else "the candidate's tokens)")
    report = VerifyReport(
        inputs_hash=inputs_hash,
        reference=f"pytorch ({exported.model.model_type}, fp32, HF attention"
                  + (streamed if isinstance(model, StreamedModel) else ")"),
        candidate=f"onnxruntime CPU, {exported.lowering.value} attention, "
                  f"{'in-place' if layout.in_place else 'copied'} KV cache"
                  + (f" in blocks of {layout.block_size} ({layout.dtype}), prompts in chunks of {PAGED_CHUNK}"
                     if layout.paged else "")
                  + (f", split over {exported.tensor_parallel} ranks" if exported.tensor_parallel > 1 else "")
                  + (", a graph segment at a time, each row fed a fixed continuation (seeded) after its prompt"
                     if segmented else ""),
        tolerance=tolerance, max_abs_logit_diff=max(c.max_abs_logit_diff for c in cases), cases=cases,
        passed=all(c.passed for c in cases),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    report.save(out_dir)
    return report


def _decoded_cases(exported, export_dir: Path, layout, model, prompts, cases_in, steps: int, tolerance: float,
                   num_threads: int, progress) -> list[VerifyCase]:
    """The cases with the candidate decoding greedily in one session over the whole graph."""
    drive, runner = _driver(exported.graphs(export_dir), layout, prompts, steps, num_threads)
    # ticks: one per reference step; one per candidate step (slot form) or per row's step (paged)
    total = steps * sum(len(b) if layout.paged else 1 for _, b in cases_in)
    if isinstance(model, StreamedModel):  # layers passed through
        total += reference.forwards(model, [p for _, batch in cases_in for p in batch], steps)
        counted = "ONNX Runtime's decode steps, then the reference's layers"
    else:  # steps decoded
        total += steps * len(prompts)
        counted = "decode steps, PyTorch's and ONNX Runtime's"
    tick = ticker(progress, total, counted)

    try:
        if isinstance(model, StreamedModel):
            cases = _streamed_cases(model, cases_in, drive, steps, tolerance, tick)
        else:
            cases = _cases(model, prompts, cases_in, drive, steps, tolerance, tick)
    finally:
        runner.close()
    return cases


def _cases(model, prompts, cases_in, drive, steps: int, tolerance: float, tick) -> list[VerifyCase]:
    """The whole model's greedy decode of each prompt against each case's candidate."""
    refs, ties = [], []
    for p in prompts:
        with routing.recording(model) as margins:
            refs.append(torch_greedy(model, p, steps, tick, margins))
        ties.append(None if margins is None else margins.first_tie(ROUTING_TIE * tolerance))
    mixture = any(routing.routers(model))
    return [compare(name, refs[:len(batch)], drive(batch, tick), batch, steps, tolerance,
                    ties[:len(batch)] if mixture else None)
            for name, batch in cases_in]


def _segmented_cases(graph_file: Path, layout, streamed: StreamedModel, prompts, cases_in, steps: int,
                     tolerance: float, vocab_size: int, num_threads: int, progress) -> list[VerifyCase]:
    """Every prompt continued by the same fixed tokens: the candidate a segment at a time, then the reference a
    layer at a time, each prompt once."""
    fed = dict(zip(map(tuple, prompts), continuations(prompts, steps, vocab_size)))
    batches = [batch for _, batch in cases_in]
    cands = forced_cases(graph_file, layout, batches, [[fed[tuple(p)] for p in b] for b in batches], steps,
                         [None if len(b) == 1 else PAGED_CHUNK for b in batches], vocab_size, num_threads=num_threads,
                         progress=progress and (lambda done, total: progress(
                             done, total, "the graph's steps, a segment at a time (segments x steps)")))
    tick = ticker(progress, reference.forwards(streamed, prompts, steps), "the reference's layers")
    refs, margins = reference.teacher_forced(streamed, prompts, [fed[tuple(p)] for p in prompts], steps, tick)
    at = {tuple(p): i for i, p in enumerate(prompts)}
    cases = []
    for (name, batch), decoded in zip(cases_in, cands):
        rows = [at[tuple(p)] for p in batch]
        ties = None if margins[0] is None else [routing.first_tie(margins[i], ROUTING_TIE * tolerance) for i in rows]
        cases.append(compare(name, [refs[i] for i in rows], decoded, batch, steps, tolerance, ties))
    return cases


def _streamed_cases(streamed: StreamedModel, cases_in, drive, steps: int, tolerance: float,
                    tick) -> list[VerifyCase]:
    """Each case's candidate first; then the reference, layer by layer, teacher-forced on every row's tokens in
    one pass over the layers (graph/streamed_reference.py)."""
    cands = [drive(batch, tick) for _, batch in cases_in]
    keys = [[(tuple(prompt), tuple(int(l.argmax()) for l in last)) for prompt, (_, last) in zip(batch, decoded)]
            for (_, batch), decoded in zip(cases_in, cands)]  # each row: (prompt, candidate tokens)
    rows = {key: i for i, key in enumerate(dict.fromkeys(k for case in keys for k in case))}  # each distinct once
    refs, margins = reference.teacher_forced(streamed, [list(p) for p, _ in rows], [list(t) for _, t in rows],
                                             steps, tick)
    cases = []
    for (name, batch), decoded, case in zip(cases_in, cands, keys):
        at = [rows[key] for key in case]
        ties = None if margins[0] is None else [routing.first_tie(margins[i], ROUTING_TIE * tolerance) for i in at]
        cases.append(compare(name, [refs[i] for i in at], decoded, batch, steps, tolerance, ties))
    return cases


def summary(report: VerifyReport) -> str:
    """The verify stage's line in the build report."""
    steps = report.cases[0].decode_steps
    agree = min(c.token_agreement for c in report.cases)
    verdict = "greedy tokens equal" if agree == 1.0 else f"greedy tokens {agree:.1%} equal"
    batches = " + ".join(f"batch {c.batch}" for c in report.cases)
    ties = sorted({t for c in report.cases for t in c.routing_ties or () if t is not None})
    tied = f"; logits compared before a routing near tie at position {', '.join(map(str, ties))}" if ties else ""
    return (f"{verdict} over {steps} steps ({batches}), max |Δlogit| "
            f"{report.max_abs_logit_diff:.1e} (tolerance {report.tolerance:.0e}){tied}")


# the verify stage: the export on ONNX Runtime against PyTorch

def _skip(spec: BuildSpec, done: Mapping[str, Located]) -> str | None:
    if not spec.verify.enabled:
        return "verify.enabled is false"
    if not Lowering(spec.attention_lowering).runs_on_onnxruntime:
        ranks = spec.parallel.tensor  # a split's rank graphs: their engines are checked together, a GPU each
        return ("the plugin graph runs on TensorRT only; the tensorrt stage checks the engine"
                + (f" ({ranks} rank engines run together)" if ranks > 1 else "") + " against ONNX Runtime")
    return None


def verify_key(spec: BuildSpec, ctx: Context) -> dict:
    """What keys a verify besides the export and the code (the draft stage's key holds it too)."""
    import onnxruntime

    return {"verify": spec.section_hash("verify"), "onnxruntime": onnxruntime.__version__}


def _run(exported: Located[ExportedModel], section: VerifySpec, ctx: Context) -> VerifyReport:
    model, tokenizer = ctx.model()
    return verify(exported.artifact, exported.folder, model, tokenizer, ctx.out, inputs_hash=ctx.inputs_hash,
                  steps=section.decode_steps, tolerance=section.max_logit_diff, num_threads=ctx.num_threads,
                  progress=ctx.progress, segmented=ctx.streamed)


def _accept(report: VerifyReport, spec: BuildSpec) -> None:
    if not report:
        raise VerifyError(f"verification failed: {summary(report)}\n"
                          + "\n".join(f"  {c.name}: {c.token_agreement:.1%} tokens equal, first divergence "
                                      f"{c.first_divergence}, max |Δlogit| {c.max_abs_logit_diff:.2e}"
                                      for c in report.cases))


VERIFY = Stage("verify", describe=lambda spec: f"PyTorch vs ONNX Runtime ({spec.attention_lowering} attention)",
               takes=("export",), artifact=VerifyReport, section=lambda spec: spec.verify,
               key=verify_key, skip=_skip, run=_run, accept=_accept, summary=lambda done: summary(done.artifact),
               loads_model=True)
