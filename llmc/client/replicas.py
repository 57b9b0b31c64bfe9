"""Several Triton replicas behind one client: which to try, and which failures another may fix.

Requests start on the replicas in turn (round robin). A request that fails before its first
response (connection refused, server or model not ready, a crashed model instance, a full queue)
is tried once more on another replica; a replica that failed so is tried last for
`COOLDOWN_SECONDS`. Once a response has arrived a failure is final: the stream ends with
GenerationError, never a silent second run of the same prompt.

gRPC's own load balancing (a `dns:` name resolving to every pod behind a headless Service) spreads
connections but neither retries a request on another pod nor tells a refusal from a crash, which
is why this small policy is written here. `check` sorts a stream's responses (llmc/client/stream.py)
for the clients: NotStarted for a failure before the first response, which they may try again.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Sequence

from llmc.client.generation import GenerationError, Refused, Unreachable, from_model, message

COOLDOWN_SECONDS = 5.0
# what a request that never started may hit on one replica and not on another
RETRYABLE = ("UNAVAILABLE", "failed to connect", "connection refused", "socket closed", "not ready",
             "is not found", "unknown model", "is not healthy", "busy", "no longer in valid state")


def as_urls(url: str | Sequence[str]) -> list[str]:
    """One address, a comma-separated list, or a sequence of addresses -> a non-empty list."""
    urls = [u.strip() for u in (url.split(",") if isinstance(url, str) else url) if u and u.strip()]
    if not urls:
        raise ValueError("no server URL given")
    return urls


def retryable(message: str) -> bool:
    """The failure (of a request that got no response yet) is one another replica may not have."""
    low = message.lower()
    return any(marker.lower() in low for marker in RETRYABLE)


class Replicas:
    """The replicas' URLs, in the order the next request should try them."""

    def __init__(self, urls: Sequence[str]):
        self.urls = list(urls)
        self._turn = itertools.count()
        self._failed: dict[str, float] = {}  # url -> when it last failed before a first response
        self._lock = threading.Lock()

    def order(self) -> list[str]:
        """All replicas, starting at the next in turn; those that failed recently come last."""
        start = next(self._turn) % len(self.urls)
        turn = self.urls[start:] + self.urls[:start]
        now = time.monotonic()
        with self._lock:
            recent = {u for u, t in self._failed.items() if now - t < COOLDOWN_SECONDS}
        return [u for u in turn if u not in recent] + [u for u in turn if u in recent]

    def attempts(self) -> list[str]:
        """Where one request may run: its replica, and one other to retry on."""
        return self.order()[:2]

    def failed(self, url: str) -> None:
        with self._lock:
            self._failed[url] = time.monotonic()

    def succeeded(self, url: str) -> None:
        with self._lock:
            self._failed.pop(url, None)


class NotStarted(Exception):
    """The request failed before its first response: `error` is what to raise, `reason` what to judge
    (whether another replica may not fail the same way)."""

    def __init__(self, error: GenerationError, reason: str | None = None):
        super().__init__(str(error))
        self.error, self.reason = error, reason or str(error)


def check(error, started: bool) -> None:
    """Raise for an error response that Generation.take is not to raise: a transport failure
    (Unreachable; the client names the replica, `not_started`), and any error before the first
    response (NotStarted: another replica may take the request). A model's error after the first
    response is take's to raise (Refused)."""
    if error is None or (started and from_model(error)):
        return
    if not from_model(error):
        raise Unreachable(message(error))
    raise NotStarted(Refused(message(error)))


def not_started(url: str, err: Unreachable, started: bool) -> Exception:
    """What a transport failure on replica `url` raises: NotStarted before the first response."""
    failure = Unreachable(f"{url}: {err}")
    return failure if started else NotStarted(failure, str(err))
