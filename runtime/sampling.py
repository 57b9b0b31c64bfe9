"""Sampling: the parameters a request may set (validated), and turning a row of logits into a token.

Greedy is the default (`temperature` 0); with `temperature` > 0 the next token is drawn from the
softmax of the penalized, temperature-scaled logits restricted by `top_k`, `top_p` and `min_p`.
Penalties apply in both modes: `repetition_penalty` (CTRL-style, over prompt and output),
`frequency_penalty` and `presence_penalty` (OpenAI-style, over the output). Each request owns a
random generator; the same `seed` gives the same tokens for the same logits.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

_CANDIDATES = 1024  # top-p sorts the most likely tokens first; the full sort is the fallback


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(256, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0, description="0 = no limit")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    end_ids: tuple[int, ...] = ()
    stop_words: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _min_below_max(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any(not w for w in self.stop_words):
            raise ValueError("stop_words must not contain an empty string")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def make_rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def apply_penalties(logits: np.ndarray, params: SamplingParams, prompt_ids: np.ndarray,
                    output_ids: np.ndarray) -> np.ndarray:
    """Penalized copy of one row of logits (float32 [V])."""
    logits = logits.astype(np.float32, copy=True)
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.concatenate([prompt_ids, output_ids]).astype(np.int64))
        values = logits[seen]
        logits[seen] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output_ids.size and (params.frequency_penalty or params.presence_penalty):
        tokens, counts = np.unique(output_ids.astype(np.int64), return_counts=True)
        logits[tokens] -= params.frequency_penalty * counts + params.presence_penalty
    if len(output_ids) < params.min_tokens and params.end_ids:
        logits[list(params.end_ids)] = -np.inf
    return logits


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _nucleus(ids: np.ndarray, probs: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest most-likely subset of `ids` whose mass (renormalized over `ids`) reaches top_p;
    sorts only the first candidates unless they fall short."""
    p = probs[ids]
    total = p.sum()
    for width in (min(_CANDIDATES, ids.size), ids.size):
        part = np.argpartition(-p, width - 1)[:width] if width < ids.size else np.arange(ids.size)
        part = part[np.argsort(-p[part], kind="stable")]
        mass = np.cumsum(p[part]) / total
        if width == ids.size or mass[-1] >= top_p:
            return ids[part[mass - p[part] / total < top_p]]  # the token that crosses top_p stays
    raise AssertionError("unreachable")


def _filtered(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, probabilities) that top-k, then top-p, then min-p allow."""
    # shift before scaling, in float64: a tiny temperature then sends the runners-up to -inf instead
    # of overflowing everything (or underflowing to 0/0): found by the property tests as NaN
    # probabilities, which failed the whole batch's step
    with np.errstate(over="ignore"):  # the runners-up of a tiny temperature: -inf, on purpose
        probs = _softmax((logits.astype(np.float64) - logits.max()) / params.temperature)
    ids = np.arange(probs.size)
    if 0 < params.top_k < probs.size:
        ids = np.argpartition(-probs, params.top_k - 1)[:params.top_k]
    if params.top_p < 1.0:
        ids = _nucleus(ids, probs, params.top_p)
    kept = probs[ids]
    if params.min_p > 0.0:
        allowed = kept >= params.min_p * kept.max()
        ids, kept = ids[allowed], kept[allowed]
    return ids, kept / kept.sum()


def sample(logits: np.ndarray, params: SamplingParams, prompt_ids: np.ndarray, output_ids: np.ndarray,
           rng: np.random.Generator) -> int:
    """The next token for one sequence from its row of logits [V]."""
    logits = apply_penalties(logits, params, prompt_ids, output_ids)
    if params.is_greedy:
        return int(np.argmax(logits))
    ids, probs = _filtered(logits, params)
    return int(ids[rng.choice(ids.size, p=probs)])
