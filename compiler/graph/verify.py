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
the tolerance admits can flip such a tie). The tolerance unset (`verify.max_logit_diff`), it follows the
graph's KV cache: 1e-3 float32, 0.05 float16, 0.25 int8 (DEFAULT_TOLERANCE; what SmolLM2 and the tiny
test models need, docs/build.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from llmc.compiler.artifacts import ExportedModel, VerifyCase, VerifyReport
from llmc.compiler.spec import BuildSpec, VerifySpec
from llmc.compiler.stage import Context, Located, Stage
from llmc.errors import UnsupportedError, VerifyError
from llmc.plugins.op.lowering import Lowering
from llmc.runtime.engine import longrope
from llmc.runtime.runners.ort import OrtRunner
from llmc.runtime.runners.paged import PagedRunner, RowStep
from llmc.runtime.runners.protocol import Runner

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
)
RANDOM_PROMPT_LENGTHS = (7, 13, 4)  # used when the source has no tokenizer
PAGED_CHUNK = 5  # prompt tokens a row feeds per step in the paged batch case (prompts span several steps)
DEFAULT_TOLERANCE = {"float32": 1e-3, "float16": 0.05, "int8": 0.25}  # max |Δlogit| by KV cache element type

Progress = Callable[[int, int], None]
Decoded = tuple[np.ndarray, list[np.ndarray]]  # prefill logits [L, V], each step's logits [V]


def prompt_ids(tokenizer, vocab_size: int) -> list[list[int]]:
    if tokenizer is not None:
        return [tokenizer(p)["input_ids"] for p in PROMPTS]
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab_size, n).tolist() for n in RANDOM_PROMPT_LENGTHS]


def cache_kwarg(model) -> str:
    """The name the model's forward takes (and its output returns) the KV cache under: `cache` in
    recent transformers 5.x (`past_key_values` still works there but warns), `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def torch_greedy(model, prompt: list[int], steps: int, tick: Callable[[], None]) -> Decoded:
    """The HF model alone on one prompt: prefill + `steps` greedy steps with its own KV cache, as its
    generate() runs them: a LongRoPE model's cache is dropped and the whole sequence recomputed when it
    first grows past `original_max_position_embeddings` (Phi3ForCausalLM.prepare_inputs_for_generation)."""
    import torch

    from llmc.compiler.models.config import longrope_switch

    cache_name, switch = cache_kwarg(model), longrope_switch(model.config)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        prefill, cache = out.logits[0].float().numpy(), getattr(out, cache_name)
        last, tokens = [prefill[-1]], list(prompt)
        for _ in range(steps - 1):
            tokens.append(int(last[-1].argmax()))
            if longrope.crossed(switch, len(tokens)):
                out = model(input_ids=torch.tensor([tokens]), use_cache=True)
            else:
                out = model(input_ids=torch.tensor([tokens[-1:]]), use_cache=True, **{cache_name: cache})
            cache = getattr(out, cache_name)
            last.append(out.logits[0, -1].float().numpy())
            tick()
    tick()
    return prefill, last


def runner_greedy(runner: Runner, prompts: list[list[int]], steps: int, tick: Callable[[], None]) -> list[Decoded]:
    """Each prompt prefilled alone into slot r, then all rows decoded together at their own positions;
    a LongRoPE row that grows past the switch prefills its whole sequence again in its slot, as the
    slot engine does (runtime/engine/longrope.py)."""
    switch, prefills, lasts, seqs = runner.layout.longrope_switch, [], [], []
    for row, prompt in enumerate(prompts):
        logits = _prefill_slot(runner, row, list(prompt))
        prefills.append(logits[0])
        lasts.append([logits[0, -1]])
        seqs.append(list(prompt))
    positions = np.array([len(p) for p in prompts], dtype=np.int64)
    for _ in range(steps - 1):
        tokens = np.array([[int(last[-1].argmax())] for last in lasts])
        logits = runner.step(tokens, positions, first_row=0, sequence_lengths=positions + 1)
        positions += 1
        for row, last in enumerate(lasts):
            seqs[row].append(int(tokens[row, 0]))
            if longrope.crossed(switch, len(seqs[row])):
                logits[row] = _prefill_slot(runner, row, seqs[row])[0, -1:]
            last.append(logits[row, -1])
        tick()
    tick()
    return list(zip(prefills, lasts))


def _prefill_slot(runner: Runner, row: int, tokens: list[int]) -> np.ndarray:
    """`tokens` as the whole sequence of slot `row`: logits [1, len(tokens), V]."""
    return runner.step(np.array([tokens]), np.zeros(1, dtype=np.int64), first_row=row,
                       sequence_lengths=np.array([len(tokens)]))


def paged_blocks(prompts: list[list[int]], steps: int, block_size: int, seed: int = 0) -> list[list[int]]:
    """Each row's blocks, enough for its prompt and `steps` tokens, drawn shuffled from one pool (rows
    interleave in memory, as under a block manager)."""
    needs = [-(-(len(p) + steps) // block_size) for p in prompts]
    order = np.random.default_rng(seed).permutation(sum(needs)).tolist()
    return [order[sum(needs[:r]):sum(needs[:r + 1])] for r in range(len(prompts))]


def paged_greedy(runner: PagedRunner, prompts: list[list[int]], steps: int, tick: Callable[[], None],
                 chunk: int | None = None, blocks: list[list[int]] | None = None) -> list[Decoded]:
    """Row r joins at step r and feeds its prompt `chunk` tokens a step (whole when None), asking for
    every prompt token's logits, then decodes greedily beside the others until it has `steps` tokens'
    logits: steps mix decoding rows with prompt chunks, all in one call of the graph each. Each row
    carries its sequence's length, and a LongRoPE row that grows past the switch feeds its whole
    sequence again, as the paged engine does (runtime/engine/longrope.py)."""
    blocks = blocks or paged_blocks(prompts, steps, runner.block_size)
    switch = runner.layout.longrope_switch
    prefills: list[list[np.ndarray]] = [[] for _ in prompts]
    lasts: list[list[np.ndarray]] = [[] for _ in prompts]
    seqs = [list(p) for p in prompts]  # each row's tokens so far
    long = [longrope.is_long(switch, len(p)) for p in prompts]  # its KV's RoPE table
    fed, step = [0] * len(prompts), 0
    while any(len(last) < steps for last in lasts):
        rows, live = [], [r for r in range(min(step + 1, len(prompts))) if len(lasts[r]) < steps]
        for r in live:
            if fed[r] < len(prompts[r]):
                tokens = prompts[r][fed[r]:fed[r] + (chunk or len(prompts[r]))]
                rows.append(RowStep(tokens, fed[r], blocks[r], num_logits=len(tokens), seq_len=len(seqs[r])))
            elif longrope.must_recompute(switch, long[r], len(seqs[r])):
                long[r] = True
                rows.append(RowStep(seqs[r], 0, blocks[r], seq_len=len(seqs[r])))
            else:
                rows.append(RowStep(seqs[r][-1:], fed[r], blocks[r], seq_len=len(seqs[r])))
        logits = runner.step(rows)
        at = 0
        for r, row in zip(live, rows):
            out, at = logits[at:at + row.num_logits], at + row.num_logits
            if fed[r] < len(prompts[r]):  # a prompt chunk
                prefills[r].extend(out)
            fed[r] = row.past_len + len(row.token_ids)
            if fed[r] >= len(prompts[r]):
                lasts[r].append(out[-1])
                seqs[r].append(int(out[-1].argmax()))
                tick()
        step += 1
    return [(np.stack(p), last) for p, last in zip(prefills, lasts)]


def compare(name: str, refs: list[Decoded], cands: list[Decoded], prompts: list[list[int]], steps: int,
            tolerance: float) -> VerifyCase:
    diff, first_divergence, agree, near_ties = 0.0, [], 0, True
    for (ref_prefill, ref_last), (cand_prefill, cand_last) in zip(refs, cands):
        diff = max(diff, float(np.abs(ref_prefill - cand_prefill).max()))
        ref_tokens = np.array([l.argmax() for l in ref_last])
        cand_tokens = np.array([l.argmax() for l in cand_last])
        differ = np.nonzero(ref_tokens != cand_tokens)[0]
        end = int(differ[0]) if differ.size else steps
        first_divergence.append(end if differ.size else None)
        agree += int((ref_tokens == cand_tokens).sum())
        for k in range(min(end + 1, steps)):
            diff = max(diff, float(np.abs(ref_last[k] - cand_last[k]).max()))
        if differ.size:  # the reference's margin over the candidate's token where they part
            near_ties &= float(ref_last[end].max() - ref_last[end][cand_tokens[end]]) <= 2 * tolerance
    agreement = agree / (steps * len(prompts))
    return VerifyCase(name=name, batch=len(prompts), prompt_lengths=[len(p) for p in prompts], decode_steps=steps,
                      max_abs_logit_diff=diff, token_agreement=agreement, first_divergence=first_divergence,
                      passed=near_ties and diff <= tolerance)


def _driver(graphs: list[Path], layout, prompts: list[list[int]], steps: int, num_threads: int):
    """The runner for this export (`graphs`: each rank's; one without a split) and how a case drives it:
    `drive(batch, tick) -> [Decoded]`."""
    onnx_path = graphs[0]
    if layout.paged:
        # a step's tokens: every prompt, and every row's whole sequence when LongRoPE recomputes it
        sizes = dict(num_threads=num_threads, max_num_tokens=sum(len(p) + steps for p in prompts),
                     num_blocks=sum(map(len, paged_blocks(prompts, steps, layout.block_size))))
        if len(graphs) > 1:
            from llmc.runtime.runners.tensor_parallel import TensorParallelRunner

            runner = TensorParallelRunner(graphs, layout, **sizes)
        else:
            runner = PagedRunner(onnx_path, layout, **sizes)
        chunks = {1: None}  # batch 1 prefills whole; the batch case in chunks, rows joining a step apart
        return lambda batch, tick: paged_greedy(runner, batch, steps, tick, chunks.get(len(batch), PAGED_CHUNK)), runner
    runner = OrtRunner(onnx_path, layout, max_batch=len(prompts), capacity=max(map(len, prompts)) + steps,
                       num_threads=num_threads)
    return lambda batch, tick: runner_greedy(runner, batch, steps, tick), runner


def verify(exported: ExportedModel, export_dir: Path, model, tokenizer, out_dir: Path, *, inputs_hash: str,
           steps: int = 32, tolerance: float | None = None, num_threads: int = 0,
           progress: Progress | None = None) -> VerifyReport:
    """Run both models on the verify prompts and write `out_dir/verify.json`. The report is falsy
    when a case failed; raising is the caller's decision."""
    if not exported.lowering.runs_on_onnxruntime:
        raise UnsupportedError(f"the {exported.lowering.value} attention lowering runs only in TensorRT; "
                               "verify a build with target: onnxruntime")
    prompts = prompt_ids(tokenizer, exported.model.vocab_size)
    layout = exported.kv_layout
    tolerance = tolerance if tolerance is not None else DEFAULT_TOLERANCE[layout.dtype]
    cases_in = [("batch-1", prompts[:1]), (f"batch-{len(prompts)}", prompts)]
    drive, runner = _driver(exported.graphs(export_dir), layout, prompts, steps, num_threads)
    # ticks: one per reference step; one per candidate step (slot form) or per row's step (paged)
    total, done = steps * (len(prompts) + sum(len(b) if layout.paged else 1 for _, b in cases_in)), 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    try:
        refs = [torch_greedy(model, p, steps, tick) for p in prompts]
        cases = [compare(name, refs[:len(batch)], drive(batch, tick), batch, steps, tolerance)
                 for name, batch in cases_in]
    finally:
        runner.close()
    report = VerifyReport(
        inputs_hash=inputs_hash, reference=f"pytorch ({exported.model.model_type}, fp32, HF attention)",
        candidate=f"onnxruntime CPU, {exported.lowering.value} attention, "
                  f"{'in-place' if layout.in_place else 'copied'} KV cache"
                  + (f" in blocks of {layout.block_size} ({layout.dtype}), prompts in chunks of {PAGED_CHUNK}"
                     if layout.paged else "")
                  + (f", split over {exported.tensor_parallel} ranks" if exported.tensor_parallel > 1 else ""),
        tolerance=tolerance, max_abs_logit_diff=max(c.max_abs_logit_diff for c in cases), cases=cases,
        passed=all(c.passed for c in cases),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    report.save(out_dir)
    return report


def summary(report: VerifyReport) -> str:
    """The verify stage's line in the build report."""
    steps = report.cases[0].decode_steps
    agree = min(c.token_agreement for c in report.cases)
    verdict = "greedy tokens equal" if agree == 1.0 else f"greedy tokens {agree:.1%} equal"
    batches = " + ".join(f"batch {c.batch}" for c in report.cases)
    return (f"{verdict} over {steps} steps ({batches}), max |Δlogit| "
            f"{report.max_abs_logit_diff:.1e} (tolerance {report.tolerance:.0e})")


# the verify stage: the export on ONNX Runtime against PyTorch

def _skip(spec: BuildSpec, done: Mapping[str, Located]) -> str | None:
    if not spec.verify.enabled:
        return "verify.enabled is false"
    if not Lowering(spec.attention_lowering).runs_on_onnxruntime:
        ranks = spec.parallel.tensor  # a split's rank graphs: their engines are checked together, a GPU each
        return ("the plugin graph runs on TensorRT only; the engine stage checks the engine"
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
                  progress=ctx.progress)


def _accept(report: VerifyReport, spec: BuildSpec) -> None:
    if not report:
        raise VerifyError(f"verification failed: {summary(report)}\n"
                          + "\n".join(f"  {c.name}: {c.token_agreement:.1%} tokens equal, first divergence "
                                      f"{c.first_divergence}, max |Δlogit| {c.max_abs_logit_diff:.2e}"
                                      for c in report.cases))


# what runs a verify: this package, the checkpoint's loader, the runners, the CPU kernels they load
# (the paged attention op and MatMulNBits, C sources), the KV layout
VERIFY_CODE = ("llmc.compiler.graph", "llmc.compiler.source", "llmc.runtime.runners", "llmc.runtime.kernels",
               "llmc.runtime.layout")
VERIFY = Stage("verify", describe=lambda spec: f"PyTorch vs ONNX Runtime ({spec.attention_lowering} attention)",
               takes=("export",), artifact=VerifyReport, section=lambda spec: spec.verify, code=VERIFY_CODE,
               key=verify_key, skip=_skip, run=_run, accept=_accept, summary=lambda done: summary(done.artifact),
               loads_model=True)
