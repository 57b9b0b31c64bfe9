"""Speculative decoding (`speculative.method: ngram`) against none: SmolLM2 fp32, paged graph, batch 1,
in process, 2 ONNX Runtime threads.

Two measurements in one run:
1. What verifying costs: one graph call carrying a row's last token plus k proposals (k+1 tokens,
   k+1 logits rows) against a plain decode call (k = 0), at the prompt's context length, for one row
   and for four (speculative.max_batch's default); medians.
2. Decode tokens/s of a request served to its end with no speculation and with ngram speculation at
   each k, on editing prompts whose answer copies its input (fix the typos in a paragraph; rename a
   variable in a function) and on one whose answer does not (add a docstring: the model rewrites
   the code). One engine per configuration, all over one ONNX Runtime session (each its own share
   of the block pool), stepping in turn, so a burst of load on the shared host falls on all alike;
   tokens/s = (tokens - 1) / the seconds of the engine's own steps after the one that sampled the
   first token (the prefill is not timed); medians of the passes. Every speculative output is
   checked token for token against the plain one. `predicted` is the speed-up the verification
   cost alone explains: tokens per step over what a step costs in decode steps.

    .venv/bin/python -m llmc.bench speculative [--passes 3] [--ks 2,4,6]
"""

from __future__ import annotations

import argparse
import time

from llmc.bench.builds import build_variant
from llmc.bench.harness import in_turn, median, medians

PARAGRAPH = ("The quikc brown fox jumps over the lazy dog. The dog, however, was not amused, and it barked loudly at "
             "the fox until the farmr came out of the house to see what was hapening in the yard. The farmer looked "
             "at the fox, then at the dog, and decided that both of them deserved a treat for the morning's "
             "entertainment, so he went back inside to find some bred and cheese.")
CODE = ("def average(values):\n    total = 0\n    count = 0\n    for value in values:\n        total += value\n"
        "        count += 1\n    if count == 0:\n        return 0\n    return total / count\n")
PROMPTS = {  # SmolLM2-Instruct's chat format
    "edit (copies)": f"Fix the spelling mistakes in this paragraph and write out the corrected paragraph:\n\n{PARAGRAPH}",
    "rename (copies)": f"Rename the variable `total` to `running_sum` in this function and show the whole "
                       f"function.\n\n```python\n{CODE}```",
    "docstring (rewrites)": f"Add a docstring to this function and show the full function.\n\n```python\n{CODE}```",
}
MAX_TOKENS, COST_CALLS = 160, 15
STREAMS = 16
VERIFY_ROWS = (1, 4)  # batch 1, and the default speculative.max_batch


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def load():
    from tokenizers import Tokenizer

    from llmc.runtime.manifest import RepositoryManifest
    from llmc.runtime.runners.paged import PagedRunner

    folder = build_variant("speculative-fp32", "paged", limits={"max_batch_size": 4, "max_num_tokens": 256},
                           serving={"itl_ratio": None})
    version = folder / "model_repository" / "smollm2" / "1"
    manifest = RepositoryManifest.load(version)
    runner = PagedRunner(version / manifest.model_file, manifest.kv_layout, num_blocks=512, max_num_tokens=256,
                         num_threads=2)
    return manifest, Tokenizer.from_file(str(version / manifest.tokenizer)), runner


def verification_cost(runner, prompt_ids: list[int], ks: list[int], rows: int) -> dict[int, float]:
    """Median seconds of one call carrying `rows` rows of 1 + k tokens each after the prompt's KV,
    each row its own copy of it; the k take turns call by call, so load on the host falls on all alike."""
    from llmc.runtime.runners.paged import RowStep

    width = -(-(len(prompt_ids) + max(ks) + 1) // runner.block_size)
    tables = [list(range(r * width, (r + 1) * width)) for r in range(rows)]
    for table in tables:  # one prompt a call: max_num_tokens
        runner.step([RowStep(prompt_ids, 0, table)])
    times = {k: [] for k in [0, *ks]}
    for _ in range(COST_CALLS):
        for k in times:
            start = time.perf_counter()
            runner.step([RowStep(prompt_ids[:k + 1], len(prompt_ids), table, k + 1) for table in tables])
            times[k].append(time.perf_counter() - start)
    return medians(times)


class Slice:
    """Blocks first..first+num_blocks-1 of a shared runner's pool, seen as a pool of its own: every
    configuration runs on the same session, its engine stepping in turn with the others'."""

    def __init__(self, runner, first: int, num_blocks: int):
        self.runner, self.first, self.num_blocks, self.block_size = runner, first, num_blocks, runner.block_size

    def step(self, rows):
        from llmc.runtime.runners.paged import RowStep

        return self.runner.step([RowStep(r.token_ids, r.past_len, [b + self.first for b in r.block_ids], r.num_logits)
                                 for r in rows])


class Run:
    """Requests served to their end by one configuration, timed step by step. For one request the
    decode tokens/s is (tokens - 1) over the seconds of the steps after the one that sampled its
    first token; for several, `throughput` is all their tokens over all the steps' seconds."""

    def __init__(self, pool: Slice, manifest, tokenizer, prompts: list[list[int]], k: int | None,
                 ngram: tuple[int, int], rows: int = 4):
        from llmc.runtime.manifest import SpeculativeConfig
        from llmc.runtime.engine.paged_engine import PagedEngine
        from llmc.runtime.decoding.sampling import SamplingParams

        spec = SpeculativeConfig(method="ngram", num_tokens=k, max_batch=4, min_n=ngram[0], max_n=ngram[1]) \
            if k else None
        self.engine = PagedEngine(pool, tokenizer, end_ids=tuple(manifest.end_ids), max_rows=rows, max_seq_len=2048,
                                  max_num_tokens=256, prefix_caching=False, speculative=spec)
        for i, ids in enumerate(prompts):
            self.engine.add_request(str(i), ids, SamplingParams(max_tokens=MAX_TOKENS))
        self.outputs = {str(i): [] for i in range(len(prompts))}
        self.seconds = self.all_seconds = 0.0
        self.steps = 0

    @property
    def tokens(self) -> list[int]:
        return self.outputs["0"]

    def step(self) -> None:
        start = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - start
        self.all_seconds += seconds
        if self.tokens:
            self.seconds += seconds
            self.steps += 1
        for out in outputs:
            self.outputs[out.request_id] += out.token_ids

    @property
    def rate(self) -> float:
        return (len(self.tokens) - 1) / self.seconds

    @property
    def throughput(self) -> float:
        return sum(map(len, self.outputs.values())) / self.all_seconds


def step_in_turn(runs) -> None:
    while any(r.engine.has_work for r in runs):
        for r in runs:
            if r.engine.has_work:
                r.step()


def compare(runner, manifest, tokenizer, prompt_ids: list[int], ks: list[int], passes: int,
            ngram: tuple[int, int]) -> dict:
    """Per configuration: (median tokens/s, proposed, accepted, decode steps, tokens) over `passes`."""
    configs = [None, *ks]
    share = runner.num_blocks // len(configs)
    rates = {c: [] for c in configs}
    for _ in range(passes):
        runs = {c: Run(Slice(runner, i * share, share), manifest, tokenizer, [prompt_ids], c, ngram)
                for i, c in enumerate(configs)}
        step_in_turn(list(runs.values()))
        for c, r in runs.items():
            rates[c].append(r.rate)
            assert r.tokens == runs[None].tokens, f"k={c}: speculative output differs from the plain one"
    out = {}
    for c, r in runs.items():
        spec = r.engine.speculator
        drafted, accepted = (spec.num_draft_tokens, spec.num_accepted_tokens) if spec else (0, 0)
        out[c] = (median(rates[c]), drafted, accepted, r.steps, len(r.tokens))
    return out


def report(name: str, results: dict, costs: dict[int, float]) -> None:
    import numpy as np

    base = results[None][0]
    print(f"\n{name}: {results[None][4]} tokens, outputs identical with and without speculation")
    print(f"  {'k':>4} {'tok/s':>7} {'ratio':>6} {'accepted':>9} {'rate':>6} {'tok/step':>8} {'predicted':>9}")
    for c, (rate, drafted, accepted, steps, n) in results.items():
        if c is None:
            print(f"  {'none':>4} {rate:7.1f} {1:6.2f}")
            continue
        per_step = (n - 1) / steps
        # what the steps cost in decode steps: the verification cost at their mean number of proposals
        ks = sorted(costs)
        step_cost = np.interp(drafted / steps, ks, [costs[k] / costs[0] for k in ks])
        print(f"  {c:>4} {rate:7.1f} {rate / base:6.2f} {accepted:>4}/{drafted:<4} {accepted / max(drafted, 1):6.2f} "
              f"{per_step:8.2f} {per_step / step_cost:9.2f}")


def streams(runner, manifest, tokenizer, prompts: list[list[int]], k: int, passes: int, ngram: tuple[int, int]):
    """STREAMS requests at once (the prompts in turn), with and without speculation: their tokens/s
    (prefill included) and the ratio, medians of the passes; every output checked against the plain one."""
    rates = {None: [], k: []}
    batch = [prompts[i % len(prompts)] for i in range(STREAMS)]
    share = runner.num_blocks // 2
    for p in range(passes):
        runs = {c: Run(Slice(runner, i * share, share), manifest, tokenizer, batch, c, ngram, rows=STREAMS)
                for i, c in enumerate(in_turn([None, k], p))}
        step_in_turn(list(runs.values()))
        assert runs[k].outputs == runs[None].outputs, "speculative outputs differ from the plain ones under load"
        for c, r in runs.items():
            rates[c].append(r.throughput)
    plain, spec = median(rates[None]), median(rates[k])
    s = runs[k].engine.speculator
    print(f"\n{STREAMS} streams (prompts in turn; at most 4 rows speculate a step): none {plain:.1f} tok/s, "
          f"k {k} {spec:.1f} tok/s = {spec / plain:.2f}x, accepted {s.num_accepted_tokens}/{s.num_draft_tokens}; "
          f"outputs identical")


def choose(results: dict, costs: dict[int, float]) -> None:
    """The k that decodes the copying prompt fastest, and what it costs the prompts that do not copy."""
    ratio = {name: {k: r[0] / runs[None][0] for k, r in runs.items() if k} for name, runs in results.items()}
    copying, *others = ratio
    best = max(ratio[copying], key=ratio[copying].get)
    worst = min((ratio[name][best] for name in others), default=float("nan"))
    print(f"\nchoice at batch 1: k {best} ({ratio[copying][best]:.2f}x on {copying.split(' ')[0]}; verifying costs "
          f"{costs[best] / costs[0]:.2f} decode steps; the prompts that do not copy: {worst:.2f}x at worst)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--ks", default="2,4,6,8", help="proposal lengths to compare, comma-separated")
    parser.add_argument("--min-n", type=int, default=2, help="speculative.min_n: shortest n-gram looked up")
    parser.add_argument("--max-n", type=int, default=3, help="speculative.max_n: longest n-gram looked up")
    parser.add_argument("--streams-k", type=int, default=4, help="k for the 16-stream comparison (0: skip it)")
    parser.add_argument("--skip-batch1", action="store_true", help="only the verification cost and the streams")


def run(args: argparse.Namespace) -> None:
    ks = [int(k) for k in args.ks.split(",")]
    manifest, tokenizer, runner = load()
    prompts = {name: tokenizer.encode(chat(text)).ids for name, text in PROMPTS.items()}
    first = next(iter(prompts.values()))
    costs = {rows: verification_cost(runner, first, ks, rows) for rows in VERIFY_ROWS}
    print(f"verification cost of 1 + k tokens a row against a decode step (k 0), medians of {COST_CALLS} calls:")
    for rows, by_k in costs.items():
        print(f"  {rows} row(s): " + "  ".join(f"k {k}: {s * 1e3:5.1f} ms = {s / by_k[0]:4.2f}" for k, s in by_k.items()))
    costs = costs[1]
    ngram = (args.min_n, args.max_n)
    results = {}
    for name, ids in ({} if args.skip_batch1 else prompts).items():
        results[name] = compare(runner, manifest, tokenizer, ids, ks, args.passes, ngram)
        report(name, results[name], costs)
    if results:
        choose(results, costs)
    if args.streams_k:
        streams(runner, manifest, tokenizer, list(prompts.values()), args.streams_k, args.passes, ngram)
