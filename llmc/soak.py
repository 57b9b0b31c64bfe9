"""Reliability under load: many concurrent streams against a served model for a while, with
cancellations and malformed requests mixed in, then the checks a production server must pass.

    every completed greedy request equals its solo output (no lost or duplicated tokens)
    every malformed request is answered with an error
    the server is still ready afterwards, and its metrics show no request running and no KV in use

Each stream loops until the deadline, drawing per request: a malformed request (`bad_fraction`), a
stream it leaves after a few chunks (`cancel_fraction`: the client cancels it on the server), or
a greedy request checked against the prompt's solo output, measured first, one request at a time.
"busy, retry" answers (the queue is full) are counted and retried; they are the server's load
shedding, not failures.
"""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request
from dataclasses import dataclass, field

from llmc.bench.load import make_prompt
from llmc.client import AsyncClient, Generation, GenerationError

# (parameters, what the server's error must mention): requests every llmc model must refuse
MALFORMED = (
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"stop_words": [f"w{i}" for i in range(100)]}, "stop_words"),
)


@dataclass
class SoakReport:
    seconds: float = 0.0
    completed: int = 0
    cancelled: int = 0
    refused: int = 0  # malformed requests answered with the expected error
    busy: int = 0
    tokens: int = 0
    mismatches: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)  # errors on good requests, bad requests accepted, ...
    ready_after: bool = False
    running_after: float | None = None
    kv_usage_after: float | None = None

    @property
    def ok(self) -> bool:
        return (not self.mismatches and not self.unexpected and self.ready_after and self.completed > 0
                and self.running_after == 0 and self.kv_usage_after == 0)

    def lines(self) -> list[str]:
        return [f"{self.seconds:.0f} s: {self.completed} greedy requests checked ({self.tokens} tokens), "
                f"{self.cancelled} cancelled, {self.refused} malformed refused, {self.busy} busy retries",
                f"mismatches: {len(self.mismatches)}, unexpected: {len(self.unexpected)}, ready after: "
                f"{self.ready_after}, running after: {self.running_after}, KV in use after: {self.kv_usage_after}",
                *[f"  mismatch: {m}" for m in self.mismatches[:5]], *[f"  unexpected: {u}" for u in self.unexpected[:5]]]


def llmc_metrics(metrics_url: str, model: str) -> dict[str, float]:
    """The llmc_* metrics of `model` from Triton's Prometheus endpoint, summed over label sets."""
    text = urllib.request.urlopen(f"{metrics_url}/metrics", timeout=5).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("llmc_") and f'model="{model}"' in line:
            name = line.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


async def _greedy(client: AsyncClient, prompt: str, max_tokens: int, report: SoakReport) -> list[int] | None:
    while True:
        gen = Generation()
        try:
            async for _ in client.generate(prompt, True, gen, max_tokens=max_tokens):
                pass
            return gen.output_ids
        except GenerationError as err:
            if "busy, retry" not in str(err):
                report.unexpected.append(f"greedy {prompt[:20]!r}: {err}")
                return None
            report.busy += 1
            await asyncio.sleep(0.05)


async def _stream(client: AsyncClient, rng: random.Random, prompts: list[str], expected: dict[str, list[int]],
                  max_tokens: int, deadline: float, cancel_fraction: float, bad_fraction: float,
                  report: SoakReport) -> None:
    while time.monotonic() < deadline:
        draw, prompt = rng.random(), rng.choice(prompts)
        if draw < bad_fraction:
            params, field_name = rng.choice(MALFORMED)
            try:
                await client.complete(prompt, **params)
                report.unexpected.append(f"malformed request {params} was accepted")
            except GenerationError as err:
                if field_name in str(err):
                    report.refused += 1
                elif "busy, retry" in str(err):
                    report.busy += 1
                else:
                    report.unexpected.append(f"malformed {params}: error does not name {field_name}: {err}")
        elif draw < bad_fraction + cancel_fraction:
            stream = client.generate(prompt, True, Generation(), max_tokens=max_tokens, min_tokens=max_tokens)
            try:
                for _ in range(rng.randint(1, 3)):
                    await stream.__anext__()
            except (StopAsyncIteration, GenerationError):
                pass
            await stream.aclose()  # left early: the client cancels it on the server
            report.cancelled += 1
        else:
            ids = await _greedy(client, prompt, max_tokens, report)
            if ids is None:
                continue
            report.completed += 1
            report.tokens += len(ids)
            if ids != expected[prompt]:
                report.mismatches.append(f"{prompt[:20]!r}: {ids} != solo {expected[prompt]}")


async def soak(url: str, model: str | None, *, streams: int = 200, seconds: float = 60.0, max_tokens: int = 16,
               cancel_fraction: float = 0.1, bad_fraction: float = 0.1, num_prompts: int = 12,
               metrics_url: str | None = None, seed: int = 0) -> SoakReport:
    report = SoakReport()
    rng = random.Random(seed)
    prompts = [make_prompt(4 + i % 9, i) for i in range(num_prompts)]
    async with AsyncClient(url, model) as client:
        name = await client.model()
        expected = {}
        for p in prompts:  # the solo outputs: one request at a time
            ids = await _greedy(client, p, max_tokens, report)
            if ids is None:
                return report
            expected[p] = ids
        start = time.monotonic()
        await asyncio.gather(*[_stream(client, random.Random(rng.random()), prompts, expected, max_tokens,
                                       start + seconds, cancel_fraction, bad_fraction, report)
                               for _ in range(streams)])
        report.seconds = time.monotonic() - start
        report.ready_after = await client.ready()
    if metrics_url is not None:
        deadline = time.monotonic() + 10  # cancellations reach the engine at its next poll
        while True:
            m = llmc_metrics(metrics_url, name)
            report.running_after, report.kv_usage_after = m.get("llmc_requests_running"), m.get("llmc_kv_cache_usage_ratio")
            if (report.running_after == 0 and report.kv_usage_after == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    return report
