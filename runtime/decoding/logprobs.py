"""Log probabilities of the generated tokens, computed in the served model so that every client
(tritonclient, HTTP generate, the OpenAI frontend) gets the same values.

The values are the log-softmax of the model's raw logits: before temperature, top-k/p/min-p and
penalties (vLLM's default, "raw logprobs"), so a sampled request reports the same numbers for a
token as a greedy one would. A request asks for them with `return_log_probs` (TensorRT-LLM's
name); `num_top_logprobs` (0-20) adds the N most likely alternatives of each step.

Nothing here runs unless a request asks: the engine calls `record` only for a sequence that
carries a recorder, so a request without log probabilities costs one `is None` check per token.

The engine takes a step's values as `Logprobs`, each token's text decoded alone (for OpenAI's
`tokens`), and hands them out with the step's tokens; the serving wing joins a response's steps
and lays them out as TensorRT-LLM's tensors (runtime/serving/responses.py): output_log_probs,
cum_log_probs, token_texts, top_log_prob_ids, top_log_probs, top_token_texts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat `top_logprobs`


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log-softmax of one row of logits [V], in float64 for the sum, returned as float32."""
    x = logits.astype(np.float64, copy=False)
    shifted = x - x.max()
    return (shifted - np.log(np.exp(shifted).sum())).astype(np.float32)


@dataclass(frozen=True)
class Logprobs:
    """The log probabilities of some of a request's tokens, in order: each sampled token's value,
    the sum over the whole request so far, each token's text, and with `num_top` the most likely
    tokens of each step (best first), their values and texts."""

    num_top: int
    values: np.ndarray  # float32 [n]
    cumulative: float
    token_texts: tuple[str, ...]
    top_ids: np.ndarray  # int32 [n, num_top]
    top_values: np.ndarray  # float32 [n, num_top]
    top_texts: tuple[tuple[str, ...], ...]

    @classmethod
    def empty(cls, num_top: int, cumulative: float = 0.0) -> "Logprobs":
        return cls(num_top, np.zeros(0, np.float32), cumulative, (), np.zeros((0, num_top), np.int32),
                   np.zeros((0, num_top), np.float32), ())

    def __len__(self) -> int:
        return len(self.values)

    @classmethod
    def concat(cls, parts: list["Logprobs"]) -> "Logprobs":
        """Consecutive records of one request as one, in a single copy (a response gathers a step's
        record at a time); the cumulative sum is the last part's. `parts` is not empty."""
        if len(parts) == 1:
            return parts[0]
        return cls(parts[0].num_top, np.concatenate([p.values for p in parts]), parts[-1].cumulative,
                   tuple(t for p in parts for t in p.token_texts), np.concatenate([p.top_ids for p in parts]),
                   np.concatenate([p.top_values for p in parts]), tuple(t for p in parts for t in p.top_texts))


class LogprobRecorder:
    """One request's log probabilities: `record` is called by the engine for each sampled token,
    `take` when it hands a step's tokens out (the values since the last take)."""

    def __init__(self, num_top: int = 0):
        assert 0 <= num_top <= MAX_TOP_LOGPROBS, num_top
        self.num_top = num_top
        self.cumulative = 0.0
        self._ids: list[int] = []
        self._values: list[float] = []
        self._top_ids: list[np.ndarray] = []
        self._top_values: list[np.ndarray] = []

    def record(self, logits: np.ndarray, token: int) -> None:
        logprobs = log_softmax(logits)
        value = float(logprobs[token])
        self._ids.append(token)
        self._values.append(value)
        self.cumulative += value
        if self.num_top:
            top = np.argpartition(-logprobs, self.num_top - 1)[:self.num_top]
            top = top[np.argsort(-logprobs[top], kind="stable")]
            self._top_ids.append(top.astype(np.int32))
            self._top_values.append(logprobs[top])

    def take(self, tokenizer) -> Logprobs:
        """The values recorded since the last call; `tokenizer` (HF `tokenizers`) decodes each token
        alone (without one, as an engine without one has no text, the texts are empty)."""
        n = len(self._ids)
        top_ids = np.stack(self._top_ids) if self.num_top and n else np.zeros((n, self.num_top), np.int32)
        top_values = np.stack(self._top_values) if self.num_top and n else np.zeros((n, self.num_top), np.float32)
        texts = _texts(tokenizer, self._ids + top_ids.reshape(-1).tolist())
        top_texts = tuple(tuple(texts[n + i * self.num_top:n + (i + 1) * self.num_top]) for i in range(n)) \
            if self.num_top else ()
        out = Logprobs(self.num_top, np.array(self._values, dtype=np.float32), self.cumulative, tuple(texts[:n]),
                       top_ids, top_values, top_texts)
        self._ids, self._values, self._top_ids, self._top_values = [], [], [], []
        return out


def _texts(tokenizer, ids: list[int]) -> list[str]:
    """Each id decoded alone (a piece of a multi-byte character decodes to U+FFFD, as in vLLM)."""
    if tokenizer is None or not ids:
        return [""] * len(ids)
    return tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
