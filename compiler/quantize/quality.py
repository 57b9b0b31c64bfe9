"""Quality of a quantized graph against the unquantized one it came from, both on ONNX Runtime.

- perplexity on held-out token windows (never calibration text): each window prefilled in one step,
  next-token negative log-likelihood averaged over every position;
- greedy-token agreement on the verify prompts: the unquantized graph decodes greedily, then both
  graphs are fed the prompt and those tokens in one step (teacher forcing) and the quantized one must
  pick the unquantized one's next token. Both are judged on the same inputs: a model whose one-step
  prefill and step-by-step decode differ (LongRoPE past `original_max_position_embeddings` switches
  every position's table) would otherwise count that difference against quantization;
- size on disk, and batch-1 decode tokens/s (median step time, both measured here).

A streamed build's reference (`segmented_reference`) runs the unquantized graph a segment of weights at a time
(graph/segments.py): its windows and the agreement rows go through each segment in one pass, in the memory of a
segment. It cannot decode (each step would open every segment again), so the greedy tokens both graphs are fed
are the quantized graph's own, and the reference's decode speed is not measured.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

from llmc.compiler.artifacts import QualityReport
from llmc.compiler.stage import ticker
from llmc.runtime.layout import KVLayout
from llmc.runtime.runners.paged_slots import slot_runner
from llmc.runtime.runners.protocol import Runner

SPEED_PROMPT, SPEED_STEPS = 64, 24


def perplexity(runner: Runner, windows: list[np.ndarray], tick: Callable[[], None]) -> float:
    nll = 0.0
    for ids in windows:
        nll += next_token_nll(runner.step(ids[None], np.zeros(1, dtype=np.int64))[0], ids)
        tick()
    return math.exp(nll / sum(len(ids) - 1 for ids in windows))


def next_token_nll(logits: np.ndarray, ids: np.ndarray) -> float:
    """The summed next-token negative log-likelihood of `ids` under `logits` [len(ids), V]."""
    logits = logits[:-1]
    top = logits.max(-1)
    # log-sum-exp in float32 (every term <= 1 after the max is taken out), summed in float64
    log_total = np.log(np.exp(logits - top[:, None]).sum(-1, dtype=np.float64)) + top
    return float((log_total - logits[np.arange(len(ids) - 1), ids[1:]]).sum())


def greedy(runner: Runner, prompts: list[list[int]], steps: int,
           tick: Callable[[], None] | None = None) -> list[list[int]]:
    """Each prompt's `steps` greedy tokens, the prompts decoding side by side in rows 0.. of `runner`: a step
    reads the weights once for all its rows, where one prompt after another read them once a row."""
    tokens = []
    for row, prompt in enumerate(prompts):
        logits = runner.step(np.array([prompt]), np.zeros(1, dtype=np.int64), first_row=row)
        tokens.append([int(logits[0, -1].argmax())])
    for k in range(steps - 1):
        logits = runner.step(np.array([[t[-1]] for t in tokens]), np.array([len(p) + k for p in prompts]))
        for row, t in zip(logits, tokens):
            t.append(int(row[-1].argmax()))
    if tick:
        tick()
    return tokens


def agreement(runners: list[Runner], prompt: list[int], reference: list[int]) -> int:
    """At how many of `reference`'s positions the runners (unquantized, quantized) pick the same next
    token when fed the prompt and `reference` in one step."""
    picks = [_picks(r, prompt, reference) for r in runners]
    return int((picks[0] == picks[1]).sum())


def _picks(runner: Runner, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """`runner`'s next token at each of `tokens`' positions, fed the prompt and `tokens` in one step."""
    ids = np.array([prompt + tokens[:-1]])
    return runner.step(ids, np.zeros(1, dtype=np.int64))[0, len(prompt) - 1:].argmax(-1)


def decode_speed(runner: Runner, vocab_size: int) -> float:
    prompt = np.random.default_rng(0).integers(0, vocab_size, SPEED_PROMPT)
    token = runner.step(prompt[None], np.zeros(1, dtype=np.int64))[:, -1].argmax(-1)[:, None]
    times = []
    for k in range(SPEED_STEPS + 2):
        start = time.perf_counter()
        token = runner.step(token, np.array([SPEED_PROMPT + k]))[:, -1].argmax(-1)[:, None]
        times.append(time.perf_counter() - start)
    return 1.0 / statistics.median(times[2:])


def compare(reference: Path, quantized: Path, layout: KVLayout, *, windows: list[np.ndarray], eval_text: str,
            prompts: list[list[int]], steps: int, vocab_size: int, sizes: tuple[int, int], num_threads: int,
            optimize_quantized: bool = True, progress: Callable[[int, int], None] | None = None,
            segmented_reference: bool = False) -> QualityReport:
    """`optimize_quantized=False` runs the quantized graph with ONNX Runtime's graph optimizations off;
    `segmented_reference`: the reference runs a segment of weights at a time (the module's docstring)."""
    capacity = max(max(map(len, windows)), max(map(len, prompts)) + steps, SPEED_PROMPT + SPEED_STEPS + 2)
    if segmented_reference:
        return _compare_segmented(reference, quantized, layout, windows=windows, eval_text=eval_text, prompts=prompts,
                                  steps=steps, vocab_size=vocab_size, sizes=sizes, num_threads=num_threads,
                                  optimize_quantized=optimize_quantized, progress=progress, capacity=capacity)
    # the fp32 reference reads its weights from the mapped file (prepacked, they were a second copy of the model
    # in memory: 4.2 GiB anonymous at 1.1B against 0.6, and its decode 7.5 tok/s against 8.3)
    runners = [slot_runner(p, layout, max_batch=rows, capacity=capacity, num_threads=num_threads, optimize=opt,
                           prepack=prepack)
               for p, opt, rows, prepack in ((reference, True, len(prompts), False),
                                             (quantized, optimize_quantized, 1, True))]
    tick = ticker(progress, 2 * len(windows) + 1 + len(prompts), "quality report (windows and prompts)")

    ppl = [perplexity(r, windows, tick) for r in runners]
    agreed = 0
    for prompt, reference_tokens in zip(prompts, greedy(runners[0], prompts, steps, tick)):
        agreed += agreement(runners, prompt, reference_tokens)
        tick()
    speed = [decode_speed(r, vocab_size) for r in runners]
    for r in runners:
        r.close()
    return _report(ppl, agreed, speed, windows=windows, eval_text=eval_text, prompts=prompts, steps=steps,
                   sizes=sizes, num_threads=num_threads, optimize_quantized=optimize_quantized)


def _compare_segmented(reference: Path, quantized: Path, layout: KVLayout, *, windows, eval_text, prompts, steps,
                       vocab_size, sizes, num_threads, optimize_quantized, progress, capacity) -> QualityReport:
    """compare(), its reference run a segment of weights at a time on the windows and on the prompts fed the
    quantized graph's own greedy tokens."""
    from llmc.compiler.graph.segments import SegmentedGraph
    from llmc.compiler.quantize.calibrate import feeds

    runner = slot_runner(quantized, layout, max_batch=len(prompts), capacity=capacity, num_threads=num_threads,
                         optimize=optimize_quantized)
    tick = ticker(progress, len(windows) + 1 + len(prompts),
                  "quality report: the quantized graph (windows and prompts)")

    ppl_quantized = perplexity(runner, windows, tick)
    tokens = greedy(runner, prompts, steps, tick)
    picks = []
    for prompt, t in zip(prompts, tokens):
        picks.append(_picks(runner, prompt, t))
        tick()
    speed = decode_speed(runner, vocab_size)
    runner.close()
    inputs = [*windows, *(np.array(p + t[:-1]) for p, t in zip(prompts, tokens))]
    nll, agreed = 0.0, 0
    with SegmentedGraph(reference, num_threads=num_threads) as graph:
        ticks = None if progress is None else (
            lambda done, total: progress(done, total, f"quality report: the reference, {len(graph.segments)} graph "
                                                      "segments over the windows and prompts"))
        for k, values in graph.run(len(inputs), lambda k: feeds(layout, inputs[k]), ["logits"], ticks):
            logits = values["logits"].reshape(len(inputs[k]), -1)
            if k < len(windows):
                nll += next_token_nll(logits, inputs[k])
            else:
                prompt = prompts[k - len(windows)]
                agreed += int((logits[len(prompt) - 1:].argmax(-1) == picks[k - len(windows)]).sum())
    ppl_reference = math.exp(nll / sum(len(ids) - 1 for ids in windows))
    return _report([ppl_reference, ppl_quantized], agreed, [None, speed], windows=windows, eval_text=eval_text,
                   prompts=prompts, steps=steps, sizes=sizes, num_threads=num_threads,
                   optimize_quantized=optimize_quantized,
                   how="; the reference a graph segment at a time, both fed the quantized graph's greedy tokens")


def _report(ppl, agreed: int, speed, *, windows, eval_text, prompts, steps, sizes, num_threads, optimize_quantized,
            how: str = "") -> QualityReport:
    return QualityReport(
        eval_text=eval_text, eval_tokens=sum(len(w) for w in windows), perplexity_reference=ppl[0],
        perplexity_quantized=ppl[1], perplexity_increase=ppl[1] / ppl[0] - 1.0,
        token_agreement=agreed / (steps * len(prompts)), agreement_tokens=steps * len(prompts),
        size_reference_mib=sizes[0] / 2**20, size_quantized_mib=sizes[1] / 2**20,
        decode_tok_s_reference=speed[0], decode_tok_s_quantized=speed[1],
        runtime=f"onnxruntime CPU, {num_threads or 'all'} thread(s)"
                + ("" if optimize_quantized else "; quantized graph with graph optimizations off (reference path)")
                + how)
