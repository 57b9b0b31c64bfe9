"""Sampling: the parameters a request may set (validated), and turning the logits of a step's rows
into their next tokens, one vectorized pass over every row.

Greedy is the default (`temperature` 0); with `temperature` > 0 the next token is drawn from the
softmax of the penalized, temperature-scaled logits restricted by `top_k`, `top_p` and `min_p`.
Penalties apply in both modes: `repetition_penalty` (CTRL-style, over prompt and output),
`frequency_penalty` and `presence_penalty` (OpenAI-style, over the output). Each request owns a
random generator and draws one uniform number per token from it; the same `seed` gives the same
tokens for the same logits, whatever else shares the step.

`sample_rows` works on `[rows, vocab]` at once: penalties scattered through flat indices, one
set of float32 weights (exp of the shifted, scaled logits), top-k and top-p over each row's most
likely candidates (a row whose nucleus reaches past them is sorted in full), min-p as a threshold,
and the draw as an inverse CDF in two levels (blocks of tokens, then one block) with float64 sums
(the weights, the ranking and the inverse CDF are draw.py's). numpy has no batched categorical
sampler with per-row filters, so this is written here.

`sample_guided` is the policy for a batch where some rows follow a grammar (grammar.py). A guided row whose draw
does not depend on which tokens are allowed (greedy, or temperature without top-k/p or min-p:
`SamplingParams.draws_first`) draws first and is masked and drawn again only when its grammar refuses the token,
llama.cpp's way, which gives the masked distribution exactly (a refused draw is followed by a draw from p
restricted to the allowed tokens); `python -m llmc.bench structured` measured it 6x cheaper than filling every
guided row's mask. Other guided rows are masked first. A sampled row drawn first takes two uniforms a token from
its generator, the second for the redraw whether it needs one or not, so its tokens are the same function of its
generator when a step verifies them as proposals instead (engine/speculation/speculator.py: forced tokens, prompt
lookup).
"""

from __future__ import annotations

from typing import Any, Literal, Sequence, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmc.runtime.decoding.draw import Uniforms, draw_ranked, inverse_cdf, ranked_weights, rows_where, weights
from llmc.runtime.decoding.grammar import GuideMatcher, apply_bitmask, next_token_bitmask

_Ids = Union[np.ndarray, Sequence[int]]  # a row's prompt or output ids: an array or a list
# sampled rows go through in groups this large: a [16, 49152] float32 pass stays in cache, 64 rows
# measured slower than a row-by-row loop (`python -m llmc.bench sampling`)
_ROWS_AT_ONCE = 16


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
    # beam search (runtime/engine/beam.py): 1 = off; W > 1 returns W beams, as transformers' generate(num_beams=W)
    beam_width: int = Field(1, ge=1)
    length_penalty: float = Field(1.0, ge=-100.0, le=100.0, allow_inf_nan=False)
    early_stopping: Union[bool, Literal["never"]] = False

    @model_validator(mode="after")
    def _min_below_max(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any(not w for w in self.stop_words):
            raise ValueError("stop_words must not contain an empty string")
        if self.beam_width > 1:
            self._beam_compatible()
        return self

    def _beam_compatible(self) -> None:
        """Beam search ranks every continuation by its log-probability and draws nothing, so the
        parameters that shape or seed a draw contradict it and are refused, naming the field:
        temperature (0 and 1 both leave the log-probabilities as they are: 0 is llmc's "no
        sampling" default, 1 TensorRT-LLM clients' default), top_k, top_p, min_p and seed. The
        penalties are refused too: llmc applies them to raw logits per row, transformers' beam
        search to log-probabilities per beam, and a beam's frequency counts are its own, so no
        single answer is right. stop_words are not matched on beams (only end ids end one)."""
        width = f"beam search (beam_width {self.beam_width})"
        contradictions = [
            ("temperature", self.temperature not in (0.0, 1.0), "draws nothing; temperature must be 0 or 1"),
            ("top_k", self.top_k != 0, "draws nothing; top_k must be 0"),
            ("top_p", self.top_p != 1.0, "draws nothing; top_p must be 1"),
            ("min_p", self.min_p != 0.0, "draws nothing; min_p must be 0"),
            ("seed", self.seed is not None, "is deterministic and draws nothing; send no seed"),
            ("repetition_penalty", self.repetition_penalty != 1.0, "takes no penalties; repetition_penalty must be 1"),
            ("frequency_penalty", self.frequency_penalty != 0.0, "takes no penalties; frequency_penalty must be 0"),
            ("presence_penalty", self.presence_penalty != 0.0, "takes no penalties; presence_penalty must be 0"),
            ("stop_words", bool(self.stop_words), "ends beams on end ids only; send no stop_words"),
        ]
        for name, bad, why in contradictions:
            if bad:
                raise ValueError(f"{name}: {width} {why}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def make_rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)

    @property
    def draws_first(self) -> bool:
        """A guided row's token follows the masked distribution when drawn unmasked and redrawn masked
        on a refusal: its draw ranks nothing among the tokens (top-k/p and min-p would rank the
        allowed ones), so the engine masks it only when the grammar refuses its draw (core.py)."""
        return self.is_greedy or (self.top_k == 0 and self.top_p == 1.0 and self.min_p == 0.0)


def apply_penalties(logits: np.ndarray, params: SamplingParams, prompt_ids: np.ndarray,
                    output_ids: np.ndarray) -> np.ndarray:
    """Penalized copy of one row of logits (float32 [V])."""
    return penalize(logits[None], [params], [prompt_ids], [output_ids])[0].copy()


def penalize(logits: np.ndarray, params: Sequence[SamplingParams], prompt_ids: Sequence[_Ids],
             output_ids: Sequence[_Ids]) -> np.ndarray:
    """The rows' logits [R, V] with each row's penalties and min_tokens applied; `logits` itself when
    no row has any (never modified). A row's ids are read only when its penalties need them."""
    rep = [r for r, p in enumerate(params) if p.repetition_penalty != 1.0]
    freq = [r for r, p in enumerate(params) if (p.frequency_penalty or p.presence_penalty) and len(output_ids[r])]
    early = [r for r, p in enumerate(params) if len(output_ids[r]) < p.min_tokens and p.end_ids]
    if not (rep or freq or early):
        return logits
    out = logits.astype(np.float32, copy=True)
    flat, vocab = out.reshape(-1), out.shape[1]
    if rep:  # each row's seen tokens as flat indices, once each
        seen = np.unique(np.concatenate([r * vocab + np.concatenate([prompt_ids[r], output_ids[r]]).astype(np.int64)
                                         for r in rep]))
        penalty = np.array([p.repetition_penalty for p in params], np.float32)[seen // vocab]
        values = flat[seen]
        flat[seen] = np.where(values > 0, values / penalty, values * penalty)
    if freq:
        tokens, counts = np.unique(np.concatenate([r * vocab + np.asarray(output_ids[r], dtype=np.int64) for r in freq]),
                                   return_counts=True)
        rows = tokens // vocab
        frequency = np.array([p.frequency_penalty for p in params], np.float32)
        presence = np.array([p.presence_penalty for p in params], np.float32)
        flat[tokens] -= frequency[rows] * counts + presence[rows]
    for r in early:
        out[r, list(params[r].end_ids)] = -np.inf
    return out


def sample_rows(logits: np.ndarray, params: Sequence[SamplingParams], prompt_ids: Sequence[_Ids],
                output_ids: Sequence[_Ids], rngs: Sequence[np.random.Generator],
                guided: tuple[Sequence[int], np.ndarray] | None = None) -> np.ndarray:
    """The next token of each row (int64 [R]) from the rows' logits [R, V], in one pass. `guided`:
    (rows, their bitmask [len(rows), ceil(V / 32)], grammar.py): those rows draw only among the tokens
    their grammar allows, masked before penalties, temperature, top-k/p and min-p."""
    if guided is not None and len(guided[0]):
        logits = apply_bitmask(logits, *guided)
    logits = penalize(logits, params, prompt_ids, output_ids)
    tokens = logits.argmax(axis=1)
    hot = [r for r, p in enumerate(params) if not p.is_greedy]
    for lo in range(0, len(hot), _ROWS_AT_ONCE):
        rows = hot[lo:lo + _ROWS_AT_ONCE]
        tokens[rows] = _draw(logits[rows], [params[r] for r in rows], [rngs[r] for r in rows])
    return tokens


def sample(logits: np.ndarray, params: SamplingParams, prompt_ids: np.ndarray, output_ids: np.ndarray,
           rng: np.random.Generator) -> int:
    """The next token for one sequence from its row of logits [V]."""
    return int(sample_rows(logits[None], [params], [prompt_ids], [output_ids], [rng])[0])


def distributions(logits: np.ndarray, params: Sequence[SamplingParams], prompt_ids: Sequence[_Ids],
                  output_ids: Sequence[_Ids]) -> np.ndarray:
    """The distribution `sample_rows` draws each row's token from, as probabilities [R, V] (float64):
    the penalized logits' softmax at the row's temperature with top-k, top-p and min-p applied, the
    same weights `_draw` walks; a greedy row's is a point mass on its argmax. Speculative decoding
    with a draft model (engine/speculation/speculator.py) compares the target's and the draft's distributions with it."""
    logits = penalize(logits, params, prompt_ids, output_ids).astype(np.float32, copy=False)
    rows, vocab = logits.shape
    out = np.zeros((rows, vocab), dtype=np.float64)
    greedy = np.array([p.is_greedy for p in params], dtype=bool)
    if greedy.any():
        g = np.nonzero(greedy)[0]
        out[g, logits[g].argmax(axis=1)] = 1.0
    hot = np.nonzero(~greedy)[0]
    for lo in range(0, len(hot), _ROWS_AT_ONCE):
        rows = hot[lo:lo + _ROWS_AT_ONCE]
        block, hp = logits[rows], [params[r] for r in rows]
        top = block.max(axis=1)
        temperature = np.array([p.temperature for p in hp], np.float32)
        k = np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in hp])
        top_p = np.array([p.top_p for p in hp])
        min_p = np.array([p.min_p for p in hp], np.float32)
        ranked = (k < vocab) | (top_p < 1.0)
        if (~ranked).any():
            w = weights(block[~ranked], top[~ranked], temperature[~ranked])
            out[rows[~ranked]] = np.where(w >= min_p[~ranked, None], w, np.float32(0.0))
        if ranked.any():
            cand, w = ranked_weights(block[ranked], top[ranked], temperature[ranked], k[ranked], top_p[ranked],
                                     min_p[ranked])
            dense = np.zeros((len(cand), vocab), dtype=np.float64)
            np.put_along_axis(dense, cand, w, axis=1)
            out[rows[ranked]] = dense
    out[~greedy] /= out[~greedy].sum(axis=1, keepdims=True)
    return out


def draw_from(probabilities: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a probability row [V] with one uniform of `rng` (the inverse CDF `_draw` uses)."""
    return int(inverse_cdf(probabilities[None], np.array([rng.random()]))[0])


def _draw(logits: np.ndarray, params: list[SamplingParams], rngs: list[np.random.Generator]) -> np.ndarray:
    """Sampled rows: weights at each row's temperature, its filters, one uniform draw per row. A row
    with top-k or top-p draws among its ranked candidates alone; the others over the whole row.
    Each full-row pass costs more than the arithmetic (a [16, 49152] batch leaves the cache), so
    the ranked rows make three: the max, the partition and, for top-p without top-k, the total."""
    logits = logits.astype(np.float32, copy=False)
    vocab = logits.shape[1]
    top = logits.max(axis=1)
    temperature = np.array([p.temperature for p in params], np.float32)
    k = np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = np.array([p.top_p for p in params])
    min_p = np.array([p.min_p for p in params], np.float32)
    u = np.array([rng.random() for rng in rngs])
    tokens = np.empty(len(params), dtype=np.int64)
    ranked = (k < vocab) | (top_p < 1.0)
    plain, rows = rows_where(~ranked), rows_where(ranked)
    if plain is not None:
        w = weights(logits[plain], top[plain], temperature[plain])
        if min_p[plain].any():  # min_p times the top weight, which is 1: the top token always stays
            w = np.where(w >= min_p[plain, None], w, np.float32(0.0))
        tokens[plain] = inverse_cdf(w, u[plain])
    if rows is not None:
        tokens[rows] = draw_ranked(logits[rows], top[rows], temperature[rows], k[rows], top_p[rows], min_p[rows],
                                   u[rows])
    return tokens


def sample_guided(logits: np.ndarray, params: Sequence[SamplingParams], prompt_ids: Sequence[np.ndarray],
                  output_ids: Sequence[Any], rngs: Sequence[Any], guides: Sequence[GuideMatcher | None],
                  end_ids: tuple[int, ...]) -> np.ndarray:
    """The next token of each row of `logits` [R, V], in one pass, every guided row's obeying its grammar
    (`guides[i]`, None for a free row); `end_ids` are the model's, besides each row's own."""
    guided = [i for i, g in enumerate(guides) if g is not None]
    first = [i for i in guided if params[i].draws_first]
    masked = [i for i in guided if i not in first]
    tokens = _sample_masked(logits, params, prompt_ids, output_ids, rngs, guides, masked, end_ids)
    redraws = {i: rngs[i].random() for i in first if not params[i].is_greedy}
    retry = [i for i in first if not guides[i].allows(int(tokens[i]), params[i].end_ids, end_ids)]
    if retry:
        def pick(values: Sequence[Any]) -> list:
            return [values[i] for i in retry]
        again = [Uniforms([redraws[i]]) if i in redraws else rngs[i] for i in retry]
        tokens[retry] = _sample_masked(logits[retry], pick(params), pick(prompt_ids), pick(output_ids), again,
                                pick(guides), list(range(len(retry))), end_ids)
    return tokens


def _sample_masked(logits: np.ndarray, params: Sequence[SamplingParams], prompt_ids: Sequence[np.ndarray],
            output_ids: Sequence[Any], rngs: Sequence[Any], guides: Sequence[GuideMatcher | None],
            masked: list[int], end_ids: tuple[int, ...]) -> np.ndarray:
    """sample_rows over the rows, those in `masked` masked to what their grammars allow."""
    bitmask = (masked, next_token_bitmask([guides[i] for i in masked], [params[i].end_ids for i in masked],
                                          end_ids, logits.shape[1])) if masked else None
    return sample_rows(logits, params, prompt_ids, output_ids, rngs, bitmask)
