"""How a batch of rows draws when some follow a grammar: the guided-decoding draw policy.

A guided row whose draw does not depend on which tokens are allowed (greedy, or temperature without top-k/p
or min-p: `SamplingParams.draws_first`) draws first and is masked and drawn again only when its grammar refuses
the token, llama.cpp's way, which gives the masked distribution exactly (a refused draw is followed by a draw
from p restricted to the allowed tokens); `python -m llmc.bench structured` measured it 6x cheaper than filling every
guided row's mask. Other guided rows are masked first. A sampled row drawn first takes two uniforms a token
from its generator, the second for the redraw whether it needs one or not, so its tokens are the same function
of its generator when a step verifies them as proposals instead (engine/speculation/speculator.py: forced
tokens, prompt lookup).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from llmc.runtime.decoding.draw import Uniforms
from llmc.runtime.decoding.grammar import GuideMatcher, next_token_bitmask
from llmc.runtime.decoding.sampling import SamplingParams, sample_rows


def sample_guided(logits: np.ndarray, params: Sequence[SamplingParams], prompt_ids: Sequence[np.ndarray],
                  output_ids: Sequence[Any], rngs: Sequence[Any], guides: Sequence[GuideMatcher | None],
                  end_ids: tuple[int, ...]) -> np.ndarray:
    """The next token of each row of `logits` [R, V], in one pass, every guided row's obeying its grammar
    (`guides[i]`, None for a free row); `end_ids` are the model's, besides each row's own."""
    guided = [i for i, g in enumerate(guides) if g is not None]
    first = [i for i in guided if params[i].draws_first]
    masked = [i for i in guided if i not in first]
    tokens = _sample(logits, params, prompt_ids, output_ids, rngs, guides, masked, end_ids)
    redraws = {i: rngs[i].random() for i in first if not params[i].is_greedy}
    retry = [i for i in first if not guides[i].allows(int(tokens[i]), params[i].end_ids, end_ids)]
    if retry:
        def pick(values: Sequence[Any]) -> list:
            return [values[i] for i in retry]
        again = [Uniforms([redraws[i]]) if i in redraws else rngs[i] for i in retry]
        tokens[retry] = _sample(logits[retry], pick(params), pick(prompt_ids), pick(output_ids), again,
                                pick(guides), list(range(len(retry))), end_ids)
    return tokens


def _sample(logits: np.ndarray, params: Sequence[SamplingParams], prompt_ids: Sequence[np.ndarray],
            output_ids: Sequence[Any], rngs: Sequence[Any], guides: Sequence[GuideMatcher | None],
            masked: list[int], end_ids: tuple[int, ...]) -> np.ndarray:
    """sample_rows over the rows, those in `masked` masked to what their grammars allow."""
    bitmask = (masked, next_token_bitmask([guides[i] for i in masked], [params[i].end_ids for i in masked],
                                          end_ids, logits.shape[1])) if masked else None
    return sample_rows(logits, params, prompt_ids, output_ids, rngs, bitmask)
