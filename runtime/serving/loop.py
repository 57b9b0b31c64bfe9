"""The serving loop: Triton-style requests in, streamed responses out, one engine thread batching.

`submit(inputs, sink)` parses and queues a request and returns at once (a bad request is answered
with an error right there); one thread runs the engine's `step()` while there is work and sends each
request's new text through its `sink` (responses.py: a request in flight, what a sink offers). A sink is
whatever delivers responses: the Python-backend model wraps Triton's response sender, tests use a recording one.

Every request ends with exactly one final response (text, error, or finish_reason `cancelled`),
except one whose sink reported it cancelled: that one gets the final flag alone (`sink.finish()`), as soon
as the loop sees the cancellation, and nothing more. Triton's Python backend holds a request, and with it
the model version, until the request's final flag, cancelled or not: without it, a version that had served
one cancelled stream never unloaded (a deploy's old version kept its KV cache; a stopping server waited out
its whole exit timeout).

Cancelling: a client ends a request early either by closing its gRPC stream (Triton cancels the
request; the loop notices at its next poll) or in band, with a stop request (`stop` true) under
the same request id on the same stream: the request ends with finish_reason `cancelled`, the stop
request gets one empty final response, and the client closes a stream with nothing pending. llmc's
clients stop in band: cancelling a call with responses in flight can crash Triton 2.51's gRPC
frontend (SIGSEGV in the tritonserver binary; triton-inference-server server#7368, fixed in 24.12):
measured in 1 of 3 40-second soaks of 64 streams with half of them cancelled that way, and in
none of 6 that stopped in band.
A failing step ends the requests in flight with an error and the loop keeps serving; when the runner cannot step
again (a rank of a split model died: runtime/runners/parallel/ort_group.py), the loop loads a new engine as the first
was loaded, requests arriving meanwhile waiting for it.

A beam request (beam_width W > 1, runtime/engine/beam.py) gets one response, at its end, streamed or not
(beams reorder and are replaced until the search ends, so no partial text is final): every beam in
TensorRT-LLM's shapes, text_output [W], output_ids [W, longest] padded with the end id,
sequence_length [W] and cum_log_probs [W], best beam first.

The engine hands out text, beams and log probabilities (token texts included) with each step's
tokens; the loop joins a response's steps and lays them out (responses.py). The engine and its
tokenizer come from the composition root (loader.py).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from llmc.runtime.decoding.grammar import GuideCompiler
from llmc.runtime.decoding.logprobs import Logprobs
from llmc.runtime.decoding.tokenizer import encode
from llmc.runtime.engine.core import Engine, QueueFull, StepOutput
from llmc.runtime.engine.sequence import FinishReason
from llmc.runtime.lora.store import UnknownAdapter
from llmc.runtime.manifest import RepositoryManifest
from llmc.runtime.runners.protocol import RunnerBroken
from llmc.runtime.serving.metrics import ServingMetrics, null_metrics
from llmc.runtime.serving.lora_admin import LoraAdmin, is_control
from llmc.runtime.serving.request import Limits, Request, RequestError, is_stop, parse_request
from llmc.runtime.serving.responses import LiveRequest, Sink, bytes_tensor, call

CANCEL_CHECK_INTERVAL = 0.02  # seconds between polls of the clients' cancellation flags


class ServingLoop:
    def __init__(self, engine: Engine, tokenizer, limits: Limits, metrics: ServingMetrics | None = None,
                 restart: Callable[[], Engine] | None = None):
        """`restart`: builds a new engine when the runner of this one breaks (RunnerBroken); None: none."""
        self.engine, self.tokenizer, self.limits, self._restart = engine, tokenizer, limits, restart
        self.metrics = metrics or null_metrics()
        self._live: dict[str, LiveRequest] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake, self._stopping = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmc-engine", daemon=True)
        self._last_cancel_check = 0.0
        # guides compile on the compiler's threads; a guided request joins the engine once its grammar is ready
        self.guides = GuideCompiler(tokenizer, engine.end_ids)
        self.lora = LoraAdmin(engine, self._lock)  # adapters loaded and unloaded while serving (lora_admin.py)

    @classmethod
    def from_manifest(cls, folder: Path, metrics: ServingMetrics | None = None) -> "ServingLoop":
        """Serve the engine and tokenizer a packaged model version describes (loader.py)."""
        from llmc.runtime.serving.loader import load

        engine, tokenizer, limits = load(folder)
        loop = cls(engine, tokenizer, limits, metrics, restart=lambda: load(folder)[0])
        loop.metrics.ranks(RepositoryManifest.load(folder).tensor_parallel)
        return loop

    def start(self) -> "ServingLoop":
        self._thread.start()
        return self

    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the requests in flight to finish (an unloading model version
        gets no new ones: Triton sends them to the version that replaces it). True if all did."""
        deadline = time.monotonic() + timeout
        while self.num_in_flight and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        return not self.num_in_flight

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight get an error. Once the loop thread has ended, the
        engine is closed: an unloaded version frees its models and KV cache (GPU memory for TensorRT)."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._fail_all("the model is being unloaded")
        self.guides.close()
        if not self._thread.is_alive():  # no step can be running
            self.engine.close()
        self.lora.close()

    def submit(self, inputs: Mapping[str, np.ndarray], sink: Sink, client_id: str = "") -> None:
        """Queue a request (never blocks); a request that cannot run is answered with an error at once.
        `client_id` is the request id the client chose (Triton's `request.request_id()`); a stop
        request ends the live request with the same one and is answered at once."""
        rid = f"r{next(self._ids)}"
        try:
            if is_control(inputs):  # a LoRA adapter loaded, unloaded or listed: answered once, maybe later
                self.lora.handle(inputs, lambda result, error: self._answer_control(sink, result, error))
                return
            if is_stop(inputs):
                self._stop(client_id)
                call(sink.send, {"text_output": bytes_tensor(""), "output_ids": np.zeros(0, dtype=np.int32)}, True)
                return
            request = parse_request(inputs, self.limits)
            prompt_ids = encode(self.tokenizer, request.prompt, request.add_special_tokens)
            top = request.num_top_logprobs if request.return_log_probs else None
            with self._lock:
                self._live[rid] = LiveRequest(request, sink, len(prompt_ids), time.monotonic(), client_id=client_id,
                                        logprobs=[Logprobs.empty(top)] if top is not None else None)
                if request.guide is None:
                    self.engine.add_request(rid, prompt_ids, request.params, logprobs=top,
                                            adapter=self.lora.adapter_of(request))
        except (RequestError, ValueError, QueueFull) as err:
            self._refuse(rid, sink, err)
            return
        if request.guide is not None:  # it waits for its grammar; the engine's steps do not
            future = self.guides.submit(request.guide)
            future.add_done_callback(lambda f: self._guided(rid, prompt_ids, top, f))
            return
        self.metrics.admitted(len(prompt_ids))
        self._wake.set()

    def _guided(self, rid: str, prompt_ids: list[int], top: int | None, compiled) -> None:
        """A guided request's grammar is compiled (on a compiler thread): queue it, or fail it alone
        with the compiler's message naming the input."""
        with self._lock:
            entry = self._live.get(rid)
        if entry is None:  # the loop stopped meanwhile and answered it
            return
        try:
            if entry.stopped or entry.closed or compiled.cancelled():
                with self._lock:
                    self._live.pop(rid, None)
                self._send(rid, entry, FinishReason.cancelled)
                return
            with self._lock:
                self.engine.add_request(rid, prompt_ids, entry.request.params, logprobs=top, guide=compiled.result(),
                                        adapter=self.lora.adapter_of(entry.request))
        except (RequestError, ValueError, QueueFull) as err:
            self._refuse(rid, entry.sink, err)
            return
        except Exception as err:  # the compiler failed otherwise: still this request's answer, not a hang
            self._refuse(rid, entry.sink, RequestError(f"guided_decoding_guide: the guide did not compile: {err!r}"))
            return
        self.metrics.admitted(len(prompt_ids))
        self._wake.set()

    def _refuse(self, rid: str, sink: Sink, err: Exception) -> None:
        with self._lock:
            self._live.pop(rid, None)
        message = str(err)
        if isinstance(err, QueueFull):
            message = f"busy, retry: {err}"
        elif not isinstance(err, (RequestError, UnknownAdapter)) and not message.startswith("guided_decoding_guide"):
            message = f"text_input: {err}"
        self.metrics.failed()
        call(sink.error, message)

    @staticmethod
    def _answer_control(sink: Sink, result: dict | None, error: str | None) -> None:
        if error is not None:
            call(sink.error, error)
        else:
            call(sink.send, {"text_output": bytes_tensor(json.dumps(result))}, True)

    def _stop(self, client_id: str) -> None:
        """Cancel the live request(s) sent under `client_id`; none (it already ended): nothing to do."""
        with self._lock:
            rids = [rid for rid, entry in self._live.items() if client_id and entry.client_id == client_id]
            for rid in rids:
                self._live[rid].stopped = True  # one still compiling its guide ends when the compile does
        for rid in rids:
            self.engine.cancel(rid)
        self._wake.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            if not self.engine.has_work:
                self.engine.idle()  # an adapter loaded meanwhile goes into a slot (runtime/engine/lora_slots.py)
                self._wake.wait(0.1)
                continue
            self._poll_cancellations()
            try:
                outputs = self.engine.step()
            except Exception as err:  # the step failed: end what was in flight, keep serving
                self.engine.abort_all()
                self._fail_all(f"internal error while generating: {err!r}")
                if isinstance(err, RunnerBroken) and self._restart is not None:
                    self._replace_engine(err)
                continue
            self.metrics.load(self.engine.cache_state())  # first: a client that sees a response sees them current
            now = time.monotonic()
            for out in outputs:
                self._respond(out, now)
        self.metrics.load(self.engine.cache_state())

    def _replace_engine(self, err: Exception) -> None:
        """A new engine for one whose runner broke; submissions wait on the lock meanwhile. Requests that reached the
        broken engine after its failure was answered are ended with an error too (retrying them is the client's)."""
        with self._lock:
            broken, late, self._live = self.engine, list(self._live.values()), {}
            try:
                broken.close()
            except Exception:  # noqa: BLE001 (what broke may fail to close; the new engine matters)
                pass
            try:
                self.engine = self._restart()
                self.lora.engine = self.engine  # adapters loaded at run time are gone: the store's come back
                self.metrics.restarted()
            except Exception as failure:  # noqa: BLE001 (the closed engine stays: its steps fail each request)
                err = RuntimeError(f"{err}; restarting failed too: {failure!r}")
        for entry in late:
            self.metrics.failed()
            call(entry.sink.error, f"the model restarted after a failure ({err}); retry")

    def _poll_cancellations(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_check < CANCEL_CHECK_INTERVAL:
            return
        self._last_cancel_check = now
        with self._lock:
            live = list(self._live.items())
        for rid, entry in live:
            reachable, cancelled = call(entry.sink.is_cancelled)
            if cancelled or not reachable:
                entry.closed = True
                self.engine.cancel(rid)
                if cancelled:  # its final flag, which releases the request in Triton
                    call(entry.sink.finish)

    def _respond(self, out: StepOutput, now: float) -> None:
        entry = self._live.get(out.request_id)
        if entry is None:
            return
        if out.token_ids:
            if entry.last_token_at is None:
                self.metrics.first_token(now - entry.arrived)
                self.metrics.tokens(len(out.token_ids), None)
            else:
                # a speculating row's step brings several tokens: each counts its share of the wait
                self.metrics.tokens(len(out.token_ids), (now - entry.last_token_at) / len(out.token_ids))
            entry.last_token_at = now
        entry.collect(out)
        if out.finished:
            with self._lock:
                self._live.pop(out.request_id, None)
            self.metrics.finished(now - entry.arrived, out.finish_reason is not FinishReason.cancelled)
            self._send(out.request_id, entry, out.finish_reason, out.beams)
        elif entry.request.stream and out.text:
            self._send(out.request_id, entry, None)

    def _send(self, rid: str, entry: LiveRequest, reason: FinishReason | None, beams: tuple = ()) -> None:
        if entry.closed:
            return
        outputs = entry.outputs(reason, beams, entry.request.params.end_ids or self.engine.end_ids)
        sent, _ = call(entry.sink.send, outputs, reason is not None)
        if not sent and reason is None:
            entry.closed = True
            self.engine.cancel(rid)  # the client cannot be reached: stop generating for it

    def _fail_all(self, message: str) -> None:
        with self._lock:
            live, self._live = list(self._live.values()), {}
        for entry in live:
            self.metrics.failed()
            if not entry.closed:
                call(entry.sink.error, message)

