"""Load generation against a served model: streaming requests over gRPC at a fixed concurrency,
with time to first token, inter-token latency, request latency, throughput and errors.

Each request asks for exactly `max_tokens` tokens (`min_tokens` = `max_tokens`, so end ids do not
cut it short) after a prompt of about `prompt_words` words; the server reports the prompt's token
count. `run_load` keeps `concurrency` requests in flight until `num_requests` have finished.

Every request's prompt is its own (request i of a run gets seed `first_seed + i`): a server with
prefix caching must compute each one, so repeated prompts cannot pass for speed. With
`shared_prefix` tokens, every prompt starts with the same system prompt (the prefix-caching case)
followed by its own question.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

from llmc.client import AsyncClient, Generation, GenerationError

# 25 words, one token each in common BPE vocabularies (SmolLM2's among them)
_WORDS = ("the quick brown fox jumps over a lazy dog while seven owls quietly judge boxing matches "
          "near an old river bank under grey autumn skies").split()
_LEAD = 4  # a prompt's first words spell its seed in base 25: distinct for 25**4 seeds


def make_prompt(num_words: int, seed: int) -> str:
    """A prompt of `num_words` words (at least 4) that no other seed gives: its first four words spell
    the seed (lowest digit first), so two prompts differ within their first few tokens and share no
    KV block; the rest are drawn from a generator seeded with `seed`."""
    if num_words < _LEAD:
        raise ValueError(f"prompt_words is {num_words}; distinct prompts need at least {_LEAD} words")
    lead = [_WORDS[seed // len(_WORDS) ** d % len(_WORDS)] for d in range(_LEAD)]
    rng = random.Random(seed)
    return " ".join(lead + [rng.choice(_WORDS) for _ in range(num_words - _LEAD)])


def system_prompt(num_tokens: int, seed: int = 0) -> str:
    """About `num_tokens` tokens (one word each) that every request of a run starts with, as a shared
    system prompt does; `seed` picks which (a different one per run keeps runs apart)."""
    rng = random.Random(f"system {seed}")
    return " ".join(["You", "are", "a", "helpful", "assistant."] +
                    [rng.choice(_WORDS) for _ in range(max(num_tokens - 5, 0))])


@dataclass
class RequestStats:
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival time of each token, from the start
    latency: float | None = None
    num_prompt_tokens: int = 0
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_times)

    def inter_token(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first, per second after the first: the decode speed one stream sees."""
        if self.num_tokens < 2:
            return None
        return (self.num_tokens - 1) / (self.token_times[-1] - self.token_times[0])


@dataclass
class LoadResult:
    concurrency: int
    seconds: float
    requests: list[RequestStats]

    def summary(self) -> dict[str, float | int | None]:
        ok = [r for r in self.requests if r.error is None]
        itl = [x for r in ok for x in r.inter_token()]
        decode = [d for r in ok if (d := r.decode_tokens_per_s()) is not None]
        tokens = sum(r.num_tokens for r in ok)
        return {
            "concurrency": self.concurrency, "requests": len(self.requests), "errors": len(self.requests) - len(ok),
            "prompt_tokens_mean": statistics.fmean(r.num_prompt_tokens for r in ok) if ok else None,
            "output_tokens": tokens, "seconds": self.seconds, "tokens_per_s": tokens / self.seconds,
            "stream_decode_tokens_per_s_p50": _pct(decode, 50),
            **{f"{name}_{p}": _pct(values, q) for name, values in
               (("ttft_s", [r.ttft for r in ok]), ("itl_s", itl), ("latency_s", [r.latency for r in ok]))
               for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def _one(client: AsyncClient, prompt: str, max_tokens: int) -> RequestStats:
    stats, gen = RequestStats(), Generation()
    start = time.perf_counter()
    seen = 0
    try:
        async for _ in client.generate(prompt, True, gen, max_tokens=max_tokens, min_tokens=max_tokens,
                                       return_num_input_tokens=True):
            now = time.perf_counter() - start
            stats.token_times += [now] * (len(gen.output_ids) - seen)
            seen = len(gen.output_ids)
        now = time.perf_counter() - start
        stats.token_times += [now] * (len(gen.output_ids) - seen)  # ids of a final response without text
        stats.latency = now
        stats.ttft = stats.token_times[0] if stats.token_times else None
        stats.num_prompt_tokens = gen.num_input_tokens or 0
    except GenerationError as err:
        stats.error = str(err)
    return stats


def prompts(num_requests: int, prompt_words: int, *, first_seed: int = 0, shared_prefix: int = 0,
            prefix_seed: int | None = None) -> list[str]:
    """The run's prompts: request i's is `make_prompt(prompt_words, first_seed + i)`, after a
    `shared_prefix`-token system prompt (seeded with `prefix_seed`, else `first_seed`) when that is not 0."""
    seed = first_seed if prefix_seed is None else prefix_seed
    head = system_prompt(shared_prefix, seed) + "\n" if shared_prefix else ""
    return [head + make_prompt(prompt_words, first_seed + i) for i in range(num_requests)]


async def run_load(url: str, model: str | None, *, concurrency: int, num_requests: int, prompt_words: int,
                   max_tokens: int, progress=None, first_seed: int = 0, shared_prefix: int = 0,
                   prefix_seed: int | None = None) -> LoadResult:
    """`num_requests` requests, `concurrency` in flight; prompts as `prompts()` makes them (give each
    run of one server its own `first_seed` range, or a prefix cache serves the repeats)."""
    todo = prompts(num_requests, prompt_words, first_seed=first_seed, shared_prefix=shared_prefix,
                   prefix_seed=prefix_seed)
    async with AsyncClient(url, model) as client:
        await client.model()  # resolve the model (and fail fast if unreachable) before timing
        await _one(client, "Warm up.", 2)  # shares no block with any prompt
        pending = list(range(num_requests))
        results: list[RequestStats] = []

        async def worker():
            while pending:
                i = pending.pop(0)
                results.append(await _one(client, todo[i], max_tokens))
                if progress is not None:
                    progress(len(results), num_requests)

        start = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return LoadResult(concurrency, time.perf_counter() - start, results)
