"""Log probabilities of the generated tokens, computed in the served model so that every client
(tritonclient, HTTP generate, the OpenAI frontend) gets the same values.

The values are the log-softmax of the model's raw logits: before temperature, top-k/p/min-p and
penalties (vLLM's default, "raw logprobs"), so a sampled request reports the same numbers for a
token as a greedy one would. A request asks for them with `return_log_probs` (TensorRT-LLM's
name); `num_top_logprobs` (0-20) adds the N most likely alternatives of each step.

Nothing here runs unless a request asks: the engine calls `record` only for a sequence that
carries a recorder, so a request without log probabilities costs one `is None` check per token.

Outputs (each response carries the values of the tokens it carries, so a stream's chunks line up
with their `output_ids`):
    output_log_probs   FP32  [tokens]         the sampled token's log probability
    cum_log_probs      FP32  [1]              their sum over the whole request so far
    token_texts        BYTES [tokens]         each sampled token decoded alone (for OpenAI's `tokens`)
    top_log_prob_ids   INT32 [tokens, N]      the N most likely tokens of each step, best first
    top_log_probs      FP32  [tokens, N]      their log probabilities
    top_token_texts    BYTES [tokens, N]      each decoded alone
"""

from __future__ import annotations

import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat `top_logprobs`


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log-softmax of one row of logits [V], in float64 for the sum, returned as float32."""
    x = logits.astype(np.float64, copy=False)
    shifted = x - x.max()
    return (shifted - np.log(np.exp(shifted).sum())).astype(np.float32)


class LogprobRecorder:
    """One request's log probabilities: `record` is called by the engine for each sampled token,
    `take_outputs` by the serving loop when it sends a response (the values since the last one)."""

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

    def take_outputs(self, tokenizer) -> dict[str, np.ndarray]:
        """The output tensors for the tokens recorded since the last call; `tokenizer` (HF
        `tokenizers`) decodes each token alone."""
        outputs = {"output_log_probs": np.array(self._values, dtype=np.float32),
                   "cum_log_probs": np.array([self.cumulative], dtype=np.float32),
                   "token_texts": _texts(tokenizer, self._ids)}
        if self.num_top:
            n = len(self._top_ids)
            ids = np.stack(self._top_ids) if n else np.zeros((0, self.num_top), dtype=np.int32)
            outputs["top_log_prob_ids"] = ids
            outputs["top_log_probs"] = np.stack(self._top_values) if n else np.zeros((0, self.num_top), np.float32)
            outputs["top_token_texts"] = _texts(tokenizer, ids.reshape(-1).tolist()).reshape(ids.shape)
        self._ids, self._values, self._top_ids, self._top_values = [], [], [], []
        return outputs


def _texts(tokenizer, ids: list[int]) -> np.ndarray:
    """Each id decoded alone (a piece of a multi-byte character decodes to U+FFFD, as in vLLM)."""
    texts = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False) if ids else []
    return np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
