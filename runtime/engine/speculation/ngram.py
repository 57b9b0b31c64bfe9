"""Prompt-lookup proposals (`speculative.method: ngram`): the tokens that followed the last time the
sequence's latest n tokens appeared in its own prompt or output, with no second model.

For n from `max_n` down to `min_n`, the latest n tokens are looked for earlier in the sequence
(the most recent match wins: in an edit or a summary the output is copying the passage it reached
last); the first n that matches proposes the up to `num_tokens` tokens that followed it. Written
here (numpy: the positions holding the last token, then the tokens before them; ~10 us at 2048
tokens) because onnxruntime and numpy have no n-gram lookup; vLLM's NgramProposer and
transformers' prompt_lookup_num_tokens do the same search.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
        last = len(tokens) - 1
        if limit < 1 or last < 1:
            return []
        # earlier positions holding the last token: the candidate n-gram ends (one pass over the
        # sequence; the longer n-grams are checked at these few positions only)
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            match = ends[ends >= n - 1]
            for back in range(1, n):
                match = match[tokens[match - back] == tokens[last - back]]
            if match.size:
                start = int(match[-1]) + 1
                return tokens[start:start + limit].tolist()
        return []
