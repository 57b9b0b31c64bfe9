"""Structured output's costs on SmolLM2, in one run (in process, the paged engine, no Triton):

1. compile: every schema of a sample of the public JSONSchemaBench (guidance-ai/jsonschemabench, the
   first --per-folder files of each data/ folder, sorted), compiled by llguidance against SmolLM2's
   tokenizer with the cache cleared: p50 / p99 milliseconds, how many are refused and why (the first
   line of each message, grouped). Then --validate of the compiled ones are sampled from random
   logits through their masks (up to 256 tokens): every output that finishes must validate with
   jsonschema.
2. throughput: 16 streams at once (temperature 0.8), all constrained by one JSON schema against the
   same 16 unconstrained, each generating exactly --tokens tokens, passes taking turns; aggregate generated tokens/s, medians of --passes passes
   (the issue's target: constrained at least 0.9x unconstrained).
3. the mask's alternatives, replayed on the states of the constrained runs without fast-forward
   (SmolLM2's own logits and each row's matcher, captured step by step): always masking (fill the 16
   rows' bitmask, apply, sample) against llama.cpp's way (sample first, check the token, mask and
   sample again only on a rejection: what the engine does for rows whose draw ranks nothing,
   core.py); and how many steps have exactly one allowed token (what fast-forwarding skips).
4. fast-forward: the constrained load with the engine's fast-forward of forced tokens off and on
   (token_scheduler.py), passes alternating, at 16 streams and at one greedy stream: tokens/s
   medians and their ratio, the share of tokens fast-forwarded, the steps each run took.

    .venv/bin/python -m llmc.bench structured --build BUILD --schemas JSONSCHEMABENCH
        [--parts compile,throughput,fastforward] [--passes N]
        BUILD: a SmolLM2 build with a paged graph (default: build/bench/paged/structured-fp32, built on first use)
        JSONSCHEMABENCH: a checkout of https://github.com/guidance-ai/jsonschemabench (default: cloned into
        build/bench/jsonschemabench)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np

from llmc.bench.builds import BENCH, build_variant
from llmc.bench.harness import in_turn, median, median_ratio, medians

ROWS = 16
# a list of films long enough that every constrained stream runs to --tokens, as the unconstrained ones do
# (min_tokens), so both passes generate the same number of tokens
FILM = {"type": "object", "additionalProperties": False, "required": ["title", "year", "tags", "rating"],
        "properties": {"title": {"type": "string", "maxLength": 40}, "year": {"type": "integer"},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                       "rating": {"type": "number"}}}
SCHEMA = {"type": "object", "required": ["films"], "additionalProperties": False,
          "properties": {"films": {"type": "array", "items": FILM, "minItems": 40}}}
PROMPT = ("<|im_start|>user\nList films as JSON, each with a title, year, tags and rating.<|im_end|>\n"
          "<|im_start|>assistant\n")


def schemas(root: Path, per_folder: int) -> list[tuple[str, dict]]:
    out = []
    for folder in sorted((root / "data").iterdir()):
        for path in sorted(folder.glob("*.json"))[:per_folder]:
            data = json.loads(path.read_text())
            out.append((f"{folder.name}/{path.name}", data.get("json_schema", data) if isinstance(data, dict) else data))
    return out


def compile_times(compiler, sample) -> tuple[list[float], Counter, list]:
    from llmc.runtime.decoding.grammar import Guide, GuideCompiler, GuideError

    times, refused, compiled = [], Counter(), []
    for name, schema in sample:
        GuideCompiler._cache.clear()
        start = time.perf_counter()
        try:
            matcher = compiler.compile(Guide("json_schema", json.dumps(schema)))
        except GuideError as err:
            refused[str(err).removeprefix("guided_decoding_guide: ").splitlines()[0][:90]] += 1
            continue
        times.append(time.perf_counter() - start)
        compiled.append((name, schema, matcher))
    return times, refused, compiled


def validate_outputs(compiled, tokenizer, end_ids, vocab: int, limit: int) -> Counter:
    """Random logits through each schema's mask; every finished output must validate."""
    import jsonschema

    from llmc.runtime.decoding.grammar import next_token_bitmask
    from llmc.runtime.decoding.sampling import SamplingParams, sample_rows

    result, rng = Counter(), np.random.default_rng(0)
    params = SamplingParams(temperature=1.0, end_ids=tuple(end_ids))
    for name, schema, matcher in compiled[:limit]:
        out: list[int] = []
        for _ in range(256):
            bitmask = next_token_bitmask([matcher], [params.end_ids], end_ids, vocab)
            logits = rng.normal(0, 2, (1, vocab)).astype(np.float32)
            token = int(sample_rows(logits, [params], [[1]], [out], [rng], ([0], bitmask))[0])
            if token in end_ids:
                break
            out.append(token)
            matcher.consume(token)
            if matcher.is_stopped:
                break
        else:
            result["cut by the token limit"] += 1
            continue
        try:
            jsonschema.validate(json.loads(tokenizer.decode(out)), schema)
            result["finished and valid"] += 1
        except jsonschema.ValidationError as err:
            result["INVALID"] += 1
            print(f"  INVALID {name}: {err.message[:100]}")
        except jsonschema.SchemaError:
            result["finished; jsonschema cannot read the schema"] += 1
    return result


def load(build: Path):
    from tokenizers import Tokenizer

    from llmc.runtime.engine.paged_engine import PagedEngine
    from llmc.runtime.manifest import RepositoryManifest
    from llmc.runtime.runners.paged import PagedRunner

    version = next((build / "model_repository").iterdir()) / "1"
    m = RepositoryManifest.load(version)
    runner = PagedRunner(version / m.model_file, m.kv_layout, num_blocks=512, max_num_tokens=512, num_threads=2)
    engine = PagedEngine(runner, end_ids=tuple(m.end_ids), max_rows=ROWS, max_seq_len=m.limits.max_seq_len,
                         max_num_tokens=512, prefix_caching=False)
    return engine, Tokenizer.from_file(str(version / m.tokenizer)), list(m.end_ids), runner.vocab_size


def run_batch(engine, prompt_ids, params, guides) -> tuple[float, int, int]:
    """One request per entry of `params` at once, until all finish: seconds, tokens generated, steps."""
    start, steps, tokens = time.perf_counter(), 0, 0
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", prompt_ids, p, guide=guides[i] if guides else None)
    while engine.has_work:
        tokens += sum(len(out.token_ids) for out in engine.step())
        steps += 1
    return time.perf_counter() - start, tokens, steps


def capture(engine):
    """Record each guided sampling pass (of steps without fast-forward): the rows' logits and a copy
    of each matcher before the token."""
    from llmc.runtime.decoding.grammar import GuideMatcher

    seen, sample = [], engine.core.sample

    def recording(seqs, logits, sampled):
        guided = [(i, s) for i, s in enumerate(seqs) if s.guide is not None]
        if guided and not engine.scheduler.fast_forward:
            seen.append((logits[[i for i, _ in guided]].copy(),
                         [GuideMatcher(s.guide.llmatcher.deep_copy(), s.guide.vocab_size) for _, s in guided]))
        sample(seqs, logits, sampled)

    engine.core.sample = recording
    return seen


def strategies(seen, end_ids, vocab: int) -> None:
    from llmc.runtime.decoding.grammar import next_token_bitmask
    from llmc.runtime.decoding.sampling import SamplingParams, sample_rows

    params = SamplingParams(end_ids=tuple(end_ids))
    always, first, rejected, rows, forced = [], [], 0, 0, 0
    for logits, matchers in seen:
        n = len(matchers)
        p, prompts, outs, rngs = [params] * n, [[1]] * n, [[]] * n, [None] * n
        start = time.perf_counter()
        bitmask = next_token_bitmask(matchers, [params.end_ids] * n, end_ids, vocab)
        sample_rows(logits, p, prompts, outs, rngs, (list(range(n)), bitmask))
        always.append(time.perf_counter() - start)
        start = time.perf_counter()  # llama.cpp's: sample, check the token, mask only the rejected rows
        tokens = sample_rows(logits, p, prompts, outs, rngs)
        bad = [i for i, (m, t) in enumerate(zip(matchers, tokens.tolist()))
               if not (t in end_ids and m.is_accepting) and m.llmatcher.validate_tokens([t]) != 1]
        if bad:
            again = next_token_bitmask([matchers[i] for i in bad], [params.end_ids] * len(bad), end_ids, vocab)
            sample_rows(logits[bad], p[:len(bad)], prompts[:len(bad)], outs[:len(bad)], rngs[:len(bad)],
                        (list(range(len(bad))), again))
        first.append(time.perf_counter() - start)
        rejected, rows = rejected + len(bad), rows + n
        forced += int((np.unpackbits(bitmask.view(np.uint8), axis=1).sum(axis=1) == 1).sum())
    print(f"3. per sampling pass of up to {ROWS} guided rows, over {len(seen)} passes of the constrained run: "
          f"always masking {median(always) * 1e3:.2f} ms, sample first {median(first) * 1e3:.2f} ms "
          f"(medians); {rejected}/{rows} sampled tokens rejected ({rejected / max(rows, 1):.0%}); "
          f"{forced}/{rows} rows had exactly one allowed token (fast-forward candidates)")


def fast_forward(engine, compiler, prompt_ids, passes: int, tokens: int) -> None:
    """The constrained load with fast-forward off and on, passes alternating, at 16 streams
    (temperature 0.8) and at one greedy stream: tokens/s medians, their ratio, the share of tokens
    fast-forwarded (fed as proposals, no step of their own) and the steps each run took."""
    from llmc.runtime.decoding.grammar import Guide
    from llmc.runtime.decoding.sampling import SamplingParams

    for rows, temperature in ((ROWS, 0.8), (1, 0.0)):
        params = [SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=temperature, seed=i)
                  for i in range(rows)]
        rates: dict[bool, list[float]] = {False: [], True: []}
        steps: dict[bool, list[int]] = {False: [], True: []}
        forced = 0
        for p in range(passes):
            for on in in_turn((False, True), p):
                engine.scheduler.fast_forward = on
                guides = [compiler.compile(Guide("json_schema", json.dumps(SCHEMA))) for _ in range(rows)]
                before = engine.scheduler.num_forced_tokens
                seconds, generated, n = run_batch(engine, prompt_ids, params, guides)
                assert generated == rows * tokens, (rows, on, generated)
                rates[on].append(generated / seconds)
                steps[on].append(n)
                forced += engine.scheduler.num_forced_tokens - before
        engine.scheduler.fast_forward = True
        off, on = median(rates[False]), median(rates[True])
        paired = median_ratio(rates[True], rates[False])  # each pass against its neighbour
        print(f"4. fast-forward, {rows} constrained stream(s) x {tokens} tokens (temperature {temperature}), medians of "
              f"{passes} alternating passes: off {off:.1f}, on {on:.1f} tokens/s, ratio {on / off:.2f} "
              f"(median of the passes' ratios {paired:.2f}); "
              f"{forced / (passes * rows * tokens):.0%} of tokens fast-forwarded; steps a pass "
              f"{median(steps[False])} off, {median(steps[True])} on "
              f"(passes off: {', '.join(f'{r:.1f}' for r in rates[False])}; on: {', '.join(f'{r:.1f}' for r in rates[True])})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--build", type=Path)
    parser.add_argument("--schemas", type=Path)
    parser.add_argument("--per-folder", type=int, default=40)
    parser.add_argument("--validate", type=int, default=60)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--parts", default="compile,throughput,fastforward",
                        help="which to run: compile (1), throughput (2), fastforward (4 and, from its passes, 3)")


def run(args: argparse.Namespace) -> None:
    parts = set(args.parts.split(","))
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    from llmc.runtime.decoding.grammar import Guide, GuideCompiler
    from llmc.runtime.decoding.sampling import SamplingParams

    build = args.build or build_variant("structured-fp32", "paged")
    engine, tokenizer, end_ids, vocab = load(build)
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    compiler = GuideCompiler(tokenizer, end_ids, vocab)
    start = time.perf_counter()
    compiler.compile(Guide("regex", "x"))
    print(f"llguidance's tokenizer for SmolLM2 (once per model): {time.perf_counter() - start:.2f} s")
    if "compile" in parts:
        compile_part(compiler, tokenizer, end_ids, vocab, args)

    prompt_ids = tokenizer.encode(PROMPT).ids
    params = [SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens, temperature=0.8, seed=i) for i in range(ROWS)]
    run_batch(engine, prompt_ids, params, None)  # warm-up
    if "throughput" in parts:
        rates: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
        for i in range(args.passes):
            for name in in_turn(list(rates), i):
                guides = [compiler.compile(Guide("json_schema", json.dumps(SCHEMA))) for _ in range(ROWS)] \
                    if name == "constrained" else None
                seconds, tokens, _ = run_batch(engine, prompt_ids, params, guides)
                assert tokens == ROWS * args.tokens, (name, tokens)
                rates[name].append(tokens / seconds)
            print(f"   pass {i + 1}: " + ", ".join(f"{n} {r[-1]:.1f} tokens/s" for n, r in rates.items()))
        ratio = median_ratio(rates["constrained"], rates["unconstrained"])
        print(f"2. {ROWS} streams, up to {args.tokens} tokens each, medians of {args.passes} passes: "
              + ", ".join(f"{n} {v:.1f} tokens/s" for n, v in medians(rates).items())
              + f"; ratio {ratio:.2f} (median of the passes' ratios; target >= 0.9)")
    if "fastforward" in parts:
        seen = capture(engine)
        fast_forward(engine, compiler, prompt_ids, args.passes, args.tokens)
        strategies(seen, end_ids, vocab)
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


def compile_part(compiler, tokenizer, end_ids, vocab: int, args) -> None:
    root = args.schemas or BENCH / "jsonschemabench"
    if not (root / "data").is_dir():
        subprocess.run(["git", "clone", "--depth", "1", "https://github.com/guidance-ai/jsonschemabench", str(root)],
                       check=True)
    sample = schemas(root, args.per_folder)
    times, refused, compiled = compile_times(compiler, sample)
    ms = np.array(times) * 1e3
    print(f"1. compile: {len(sample)} JSONSchemaBench schemas, {len(times)} compiled: p50 {np.percentile(ms, 50):.2f} ms, "
          f"p99 {np.percentile(ms, 99):.2f} ms, max {ms.max():.1f} ms; {sum(refused.values())} refused:")
    for why, count in refused.most_common():
        print(f"   {count:4d}  {why}")
    print(f"   outputs of {min(args.validate, len(compiled))} compiled schemas from random logits: "
          f"{dict(validate_outputs(compiled, tokenizer, end_ids, vocab, args.validate))}")
