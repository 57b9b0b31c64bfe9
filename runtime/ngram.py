"""Prompt-lookup proposals (`speculative.method: ngram`): the tokens that followed the last time the
sequence's latest n tokens appeared in its own prompt or output, with no second model.

For n from `max_n` down to `min_n`, the latest n tokens are looked for earlier in the sequence
(the most recent match wins: in an edit or a summary the output is copying the passage it reached
last); the first n that matches proposes the up to `num_tokens` tokens that followed it. Written
here (numpy over a sliding window) because onnxruntime and numpy have no n-gram lookup; vLLM's
NgramProposer and transformers' prompt_lookup_num_tokens do the same search.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramProposer:
    num_tokens: int  # k: tokens proposed at most
    min_n: int = 1
    max_n: int = 3

    def __post_init__(self) -> None:
        if self.num_tokens < 1 or not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"num_tokens ({self.num_tokens}) must be >= 1 and 1 <= min_n ({self.min_n}) <= "
                             f"max_n ({self.max_n})")

    def propose(self, tokens: np.ndarray, limit: int) -> list[int]:
        """Up to min(num_tokens, limit) tokens to follow `tokens` (int64 [L]); [] when nothing matches."""
        limit = min(self.num_tokens, limit)
        length = len(tokens)
        if limit < 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting at 0..length-n-1: each is followed by at least one token
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + limit].tolist()
        return []
