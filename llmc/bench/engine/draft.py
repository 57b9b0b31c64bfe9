"""Draft-model speculative decoding (`speculative.method: draft`) against none: SmolLM2 fp32 target,
paged graph, batch 1, in process, 2 ONNX Runtime threads, greedy.

Two drafts, each built by `llmc build` into the same model version as the target:
- self: the target quantized int4-weight-only (AWQ), the issue's self-speculative draft;
- layers: the target's first `--draft-layers` decoder layers (embeddings, final norm and LM head kept),
  a separate checkpoint with the same tokenizer: what a smaller draft costs and gets accepted.

Measured in one run, `uptime` noted before and after:
1. Step costs at the prompt's context length, medians of COST_CALLS calls taking turns: a target
   decode call (1 token), the target verifying 1 + k tokens (one row), and a draft decode call
   for each draft. With acceptance rate a per proposal, a step of k proposals yields
   (1 - a^(k+1)) / (1 - a) tokens for k draft calls plus one verify call: `predicted`.
2. Decode tokens/s of one request served to its end with no speculation and with each draft at each
   k (tokens - 1 over the seconds of its steps after the first token's, prefill not timed), medians
   of the passes; all configurations over one target session per kind (each its own slice of the pool, as
   the speculative benchmark does) stepping in turn, so load on the shared host falls on all alike; no
   speculation on the default session (which spins after its runs, slowing whatever runs next)
   decodes alone, before or after them.
   Every speculative output is checked token for token against the plain one.
3. 16 streams at once with the self-draft (max_batch 4, disable_batch_size as the manifest has it,
   unset: max_batch, so nothing speculates while more than 4 requests are in), against none:
   throughput.

With a draft, serving.py stops both sessions' threads spinning after each run (two sessions taking
turns on 2 cores: a pool spinning after its run takes the cores the other computes on); "none" is
the default session, and no speculation on the drafts' kind of session is shown too.

    .venv/bin/python -m llmc.bench draft [--passes 3] [--ks 1,2,3,4] [--draft-layers 8]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from pathlib import Path

from llmc.bench.builds import BENCH, SMOLLM2, spec_data
from llmc.bench.harness import in_turn, median, medians
from llmc.bench.engine.speculative import PROMPTS, Slice, chat

ROOT = BENCH / "draft"
MAX_TOKENS, COST_CALLS, NUM_BLOCKS, MAX_NUM_TOKENS, STREAMS = 128, 15, 512, 256, 16


def truncated_checkpoint(layers: int) -> Path:
    """SmolLM2's first `layers` decoder layers as a checkpoint of its own (made once)."""
    folder = ROOT / f"smollm2-{layers}layers"
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(SMOLLM2)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(folder)
    for f in SMOLLM2.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copyfile(f, folder / f.name)
    return folder


def build_with_draft(name: str, draft: dict) -> Path:
    """The target with `draft` built into its version folder; the work folder keeps the stage cache."""
    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec

    data = {**spec_data("paged", limits={"max_batch_size": 4, "max_num_tokens": MAX_NUM_TOKENS}),
            "name": "smollm2", "speculative": {"method": "draft", "num_tokens": 4, "max_batch": 1, "draft": draft}}
    data["serving"]["itl_ratio"] = None
    result = build(parse_spec(data), output=ROOT / "work" / name)
    stage = next(s for s in result.stages if s.name == "draft")
    print(f"  draft {name}: {stage.status} in {stage.seconds:.0f} s; {stage.summary}")
    return result.repository / "smollm2" / "1"


class PoolSlice(Slice):
    """The speculative benchmark's Slice with what the draft engine also reads: each configuration's target
    and draft pools are the same block range of a shared target and a shared draft runner."""

    @property
    def vocab_size(self):
        return self.runner.vocab_size

    @property
    def max_num_tokens(self):
        return self.runner.max_num_tokens

    def close(self):
        pass


def costs(targets: dict, drafts: dict, prompt_ids: list[int], ks: list[int]) -> dict[str, float]:
    """Median seconds of: a target decode call ("target"), the target verifying 1 + k tokens ("verify k"),
    a draft decode call ("draft <name>"), all on sessions that stop spinning after a run (as served with
    a draft), each after the prompt's KV, taking turns call by call. (A default session is left out:
    its pool spinning after its call would slow the next call, whichever; the tokens/s comparison
    shows both kinds of session decoding alike without speculation.)"""
    from llmc.runtime.runners.paged import RowStep

    target = targets["quiet"]
    width = -(-(len(prompt_ids) + max(ks) + 2) // target.block_size)
    table = list(range(width))
    calls = {"target": (target, 1), **{f"verify {k}": (target, k + 1) for k in ks},
             **{f"draft {n}": (r, 1) for n, r in drafts.items()}}
    for runner in {id(r): r for r, _ in calls.values()}.values():
        runner.step([RowStep(prompt_ids, 0, table)])
    times = {name: [] for name in calls}
    order = list(calls)
    for i in range(COST_CALLS * 2):  # each call first in turn: none always follows the same one
        for name in order[i % len(order):] + order[:i % len(order)]:
            runner, n = calls[name]
            start = time.perf_counter()
            runner.step([RowStep(prompt_ids[:n], len(prompt_ids), table, n)])
            times[name].append(time.perf_counter() - start)
    return medians(times)


class Run:
    def __init__(self, target, draft, manifest, tokenizer, prompt_ids: list[int], k: int | None):
        from llmc.runtime.manifest import SpeculativeConfig
        from llmc.runtime.engine.paged_engine import PagedEngine
        from llmc.runtime.decoding.sampling import SamplingParams

        spec = SpeculativeConfig(**{**manifest.speculative.model_dump(), "num_tokens": k}) if k else None
        self.engine = PagedEngine(target, tokenizer, end_ids=tuple(manifest.end_ids), max_rows=1, max_seq_len=2048,
                                  max_num_tokens=MAX_NUM_TOKENS, prefix_caching=False, speculative=spec,
                                  draft=draft if k else None)
        self.engine.add_request("0", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS))
        self.tokens: list[int] = []
        self.seconds = 0.0

    def step(self) -> None:
        start = time.perf_counter()
        outputs = self.engine.step()
        if self.tokens:
            self.seconds += time.perf_counter() - start
        for out in outputs:
            self.tokens += out.token_ids

    @property
    def rate(self) -> float:
        return (len(self.tokens) - 1) / self.seconds


def compare(targets: dict, draft_runners: dict, manifests: dict, tokenizer, prompt_ids, ks: dict, passes) -> dict:
    """Per configuration (draft, k): (median tokens/s, proposed, accepted, tokens). (None, None) is no
    speculation on the default session, ("quiet", None) the same on the kind of session (no spinning
    after a run) the drafts' configurations use."""
    configs = [(None, None), ("quiet", None)] + [(d, k) for d in draft_runners for k in ks[d]]
    share = NUM_BLOCKS // len(configs)
    rates = {c: [] for c in configs}
    for p in range(passes):
        runs = {}
        for i, (d, k) in enumerate(configs):
            draft = PoolSlice(draft_runners[d], i * share, share) if k else None
            target = targets["spinning" if d is None else "quiet"]
            runs[(d, k)] = Run(PoolSlice(target, i * share, share), draft, manifests["self" if d in (None, "quiet") else d],
                               tokenizer, prompt_ids, k)
        # the default session's pool spins after its runs and would slow whichever configuration steps
        # next: it decodes alone, before or after the others (alternating by pass)
        phases = [{c: r for c, r in runs.items() if c != (None, None)}, {(None, None): runs[(None, None)]}]
        for phase in in_turn(phases, p):
            while any(r.engine.has_work for r in phase.values()):
                for r in phase.values():
                    if r.engine.has_work:
                        r.step()
        for c, r in runs.items():
            rates[c].append(r.rate)
            assert r.tokens == runs[(None, None)].tokens, f"{c}: speculative output differs from the plain one"
    out = {}
    for c, r in runs.items():
        spec = r.engine.speculator
        out[c] = (median(rates[c]), spec.num_draft_tokens if spec else 0,
                  spec.num_accepted_tokens if spec else 0, len(r.tokens))
    return out


def streams(targets: dict, drafts: dict, manifest, tokenizer, prompts: list[list[int]], k: int, passes: int) -> None:
    """STREAMS requests at once (the prompts in turn), 16 rows a step, at most `manifest`'s max_batch 4 of
    them speculating with the self-draft at k, against none, both on the sessions served with a draft,
    stepping in turn: all tokens over all the steps' seconds (prefill included), medians of the passes;
    every output checked against the plain one."""
    from llmc.runtime.manifest import SpeculativeConfig
    from llmc.runtime.engine.paged_engine import PagedEngine
    from llmc.runtime.decoding.sampling import SamplingParams

    spec = SpeculativeConfig(**{**manifest.speculative.model_dump(), "num_tokens": k, "max_batch": 4})
    batch = [prompts[i % len(prompts)] for i in range(STREAMS)]
    share, rates = NUM_BLOCKS // 2, {None: [], k: []}
    for p in range(passes):
        engines = {}
        for i, c in enumerate(in_turn([None, k], p)):
            engines[c] = PagedEngine(PoolSlice(targets["quiet"], i * share, share), tokenizer,
                                     end_ids=tuple(manifest.end_ids), max_rows=STREAMS, max_seq_len=2048,
                                     max_num_tokens=MAX_NUM_TOKENS, prefix_caching=False,
                                     speculative=spec if c else None,
                                     draft=PoolSlice(drafts["self"], i * share, share) if c else None)
            for j, ids in enumerate(batch):
                engines[c].add_request(str(j), ids, SamplingParams(max_tokens=MAX_TOKENS // 2))
        outputs = {c: {str(j): [] for j in range(STREAMS)} for c in engines}
        seconds = {c: 0.0 for c in engines}
        while any(e.has_work for e in engines.values()):
            for c, e in engines.items():
                if e.has_work:
                    start = time.perf_counter()
                    for out in e.step():
                        outputs[c][out.request_id] += out.token_ids
                    seconds[c] += time.perf_counter() - start
        assert outputs[k] == outputs[None], "speculative outputs differ from the plain ones under load"
        for c in engines:
            rates[c].append(sum(map(len, outputs[c].values())) / seconds[c])
    s = engines[k].speculator
    plain, fast = median(rates[None]), median(rates[k])
    print(f"\n{STREAMS} streams (max_batch 4, no speculation above {s.disable_batch_size} requests): none {plain:.1f} "
          f"tok/s, self-draft k {k} "
          f"{fast:.1f} tok/s = {fast / plain:.2f}x, accepted {s.num_accepted_tokens}/{s.num_draft_tokens}; "
          f"outputs identical")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--ks", default="1,2,3,4")
    parser.add_argument("--draft-layers", type=int, default=8, help="the truncated draft's layers (0: none)")
    parser.add_argument("--layers-ks", default="1", help="k for the truncated draft (its acceptance is low)")
    parser.add_argument("--streams-k", type=int, default=3, help="k for the 16-stream comparison (0: skip it)")
    parser.add_argument("--skip-batch1", action="store_true", help="only the step costs and the streams")
    parser.add_argument("--prompts", default="", help="comma-separated prefixes of the prompt names (default: all)")


def run(args: argparse.Namespace) -> None:
    ks = [int(k) for k in args.ks.split(",")]
    from tokenizers import Tokenizer

    from llmc.runtime.manifest import RepositoryManifest
    from llmc.runtime.runners.paged import PagedRunner

    print("uptime before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    versions = {"self": build_with_draft("self", {"quantization": {"mode": "int4-weight-only"}})}
    layers = f"{args.draft_layers}layers"
    if args.draft_layers:
        versions[layers] = build_with_draft(layers, {"source": str(truncated_checkpoint(args.draft_layers))})
    draft_ks = {"self": ks, layers: [int(k) for k in args.layers_ks.split(",")]}
    manifests = {n: RepositoryManifest.load(v) for n, v in versions.items()}
    version = versions["self"]
    tokenizer = Tokenizer.from_file(str(version / manifests["self"].tokenizer))
    m = manifests["self"]
    # as serving.py makes them: no speculation on the default session; with a draft, neither spins after a run
    targets = {mode: PagedRunner(version / m.model_file, m.kv_layout, num_blocks=NUM_BLOCKS, max_num_tokens=MAX_NUM_TOKENS,
                                 num_threads=2, spin_after_run=mode == "spinning") for mode in ("spinning", "quiet")}
    drafts = {n: PagedRunner(v / manifests[n].speculative.draft.model_file, manifests[n].speculative.draft.kv_layout,
                             num_blocks=NUM_BLOCKS, max_num_tokens=MAX_NUM_TOKENS, num_threads=2, spin_after_run=False)
              for n, v in versions.items()}
    prompts = {name: tokenizer.encode(chat(text)).ids for name, text in PROMPTS.items()
               if not args.prompts or name.startswith(tuple(args.prompts.split(",")))}
    c = costs(targets, drafts, next(iter(prompts.values())), ks)
    base = c["target"]
    print(f"\nstep costs at batch 1, medians of {2 * COST_CALLS} calls (ms, and in target decode steps):")
    for name, s in c.items():
        print(f"  {name:>14}: {s * 1e3:6.1f} ms = {s / base:4.2f}")
    for name, ids in ({} if args.skip_batch1 else prompts).items():
        results = compare(targets, drafts, manifests, tokenizer, ids, draft_ks, args.passes)
        plain = results[(None, None)][0]
        print(f"\n{name}: {results[(None, None)][3]} tokens, {args.passes} passes, outputs identical with and without")
        print(f"  {'draft':>9} {'k':>3} {'tok/s':>7} {'ratio':>6} {'accepted':>11} {'rate':>5} {'predicted':>9}")
        print(f"  {'none':>9} {'':>3} {plain:7.1f} {1:6.2f}")
        print(f"  {'none':>9} {'':>3} {results[('quiet', None)][0]:7.1f} {results[('quiet', None)][0] / plain:6.2f}"
              f"   (no spinning after a run, as with a draft)")
        for (d, k), (rate, drafted, accepted, _) in results.items():
            if not k:
                continue
            a = accepted / max(drafted, 1)
            tokens = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
            predicted = tokens / ((k * c[f"draft {d}"] + c[f"verify {k}"]) / base)
            print(f"  {d:>9} {k:>3} {rate:7.1f} {rate / plain:6.2f} {accepted:>5}/{drafted:<5} {a:5.2f} {predicted:9.2f}")
    if args.streams_k:
        streams(targets, drafts, manifests["self"], tokenizer, list(prompts.values()), args.streams_k, args.passes)
    print("\nuptime after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
