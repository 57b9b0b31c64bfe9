"""RoPE for the decoders, computed by the model's own rotary modules (nothing re-derived here).

    default, linear, llama3, yarn   one fixed table per position, which the attention op applies
                                    (`cos_cache`/`sin_cache` [P, R/2]; yarn's attention factor and
                                    linear/llama3's scaling are already in the values)
    longrope                        two tables, short and long factors: the rotation happens in the
                                    model, before the op, per token with the long table where its row's
                                    sequence is longer than `original_max_position_embeddings`
                                    (`seq_lens`, see below)
    dynamic (and anything else)     refused: its frequencies change with the sequence length in a way
                                    no per-position table reproduces

LongRoPE, as transformers computes it: its rotary module picks the long factors for a whole forward
when `max(position_ids) + 1 > original_max_position_embeddings`, and Phi-3's generate() drops the KV
cache and recomputes the whole sequence the first time it grows past that length
(`Phi3ForCausalLM.prepare_inputs_for_generation`). So every token's logits are those of the whole
sequence so far in one forward: all of a sequence's positions take one table, the long one once the
sequence is longer than `original_max_position_embeddings`. The graph gets that length per row (the
`sequence_lengths` input, runtime/layout.py), since a prompt prefilled in chunks must rotate its
first chunks with the table its whole length picks; the runtime recomputes a sequence's KV when it
grows past the switch (runtime/engine/longrope.py).

Partial rotary (`partial_rotary_factor`: Phi-4-mini, R < D) needs nothing special: the module's cos/sin
are R wide, and so are the tables.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from llmc.compiler.models.config import SUPPORTED_ROPE, rope_parameters
from llmc.errors import SourceError

FIXED = set(SUPPORTED_ROPE) - {"longrope"}  # one table per position


def _table(rotary: Callable, positions: int) -> tuple[Tensor, Tensor]:
    """(cos, sin) [P, R/2]. Most rotary modules return R columns, the two halves equal (rotate-half
    applied to the whole head); some (gpt-oss) return the R/2 frequencies once."""
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1), torch.arange(positions)[None])
    cos, sin = cos[0].float(), sin[0].float()
    half = cos.shape[-1] // 2
    if torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:]):
        cos, sin = cos[:, :half], sin[:, :half]
    return cos.contiguous(), sin.contiguous()


class RotaryTables(nn.Module):
    """The RoPE tables of a decoder's layer kinds ("default", or Gemma 3's "sliding_attention" and
    "full_attention"), as non-persistent buffers."""

    def __init__(self, rotary: dict[str, Callable], kinds: set[str], config):
        super().__init__()
        self.fixed: list[str] = []
        self.longrope: dict[str, int] = {}  # kind -> original_max_position_embeddings
        positions = config.max_position_embeddings
        for kind in sorted(kinds):
            params = rope_parameters(config, None if kind == "default" else kind)
            rope_type, field = params.get("rope_type", "default"), _field(config, kind)
            if rope_type in FIXED:
                cos, sin = _table(rotary[kind], positions)
                self.fixed.append(kind)
            elif rope_type == "longrope":
                original = int(params["original_max_position_embeddings"])
                cos, sin = _table(rotary[kind], max(positions, original + 1))  # the long factors
                short_cos, short_sin = _table(rotary[kind], original)  # the short ones (resets the module)
                self.register_buffer(f"{kind}_short_cos", torch.cat([short_cos, cos[original:]]), persistent=False)
                self.register_buffer(f"{kind}_short_sin", torch.cat([short_sin, sin[original:]]), persistent=False)
                if self.longrope and original not in self.longrope.values():
                    raise SourceError(f"{field}.original_max_position_embeddings: {original}, where another layer "
                                      f"kind's LongRoPE switches at {next(iter(self.longrope.values()))}; llmc "
                                      f"switches a sequence's tables at one length")
                self.longrope[kind] = original
            else:
                raise SourceError(
                    f"{field}.rope_type: {rope_type!r} RoPE is not supported (its frequencies change with the "
                    f"sequence length, so no fixed table reproduces transformers); supported: "
                    f"{', '.join(SUPPORTED_ROPE)}")
            self.register_buffer(f"{kind}_cos", cos, persistent=False)
            self.register_buffer(f"{kind}_sin", sin, persistent=False)

    @property
    def switch(self) -> int | None:
        """LongRoPE's `original_max_position_embeddings`: a sequence longer than this takes the long
        factors (None without LongRoPE)."""
        return next(iter(self.longrope.values()), None)

    def tables(self, kind: str) -> tuple[Tensor, Tensor]:
        """The fixed table the op applies."""
        return getattr(self, f"{kind}_cos"), getattr(self, f"{kind}_sin")

    @property
    def rotary_dim(self) -> int:
        """The channels rotated (R), 0 when no layer rotates."""
        kinds = self.fixed + list(self.longrope)
        return 2 * int(getattr(self, f"{kinds[0]}_cos").shape[1]) if kinds else 0

    def in_model_rotation(self, positions: Tensor, seq_lens: Tensor | None) -> dict[str, tuple[Tensor, Tensor]]:
        """kind -> (cos, sin) [B, S, R/2] per token, for the kinds rotated in the model (LongRoPE):
        the long table for the tokens whose sequence (`seq_lens` [B, S], each token's row's length) is
        longer than `original_max_position_embeddings`."""
        out = {}
        for kind, original in self.longrope.items():
            long = (seq_lens > original)[..., None]
            out[kind] = tuple(torch.where(long, getattr(self, f"{kind}_{t}")[positions],
                                          getattr(self, f"{kind}_short_{t}")[positions]) for t in ("cos", "sin"))
        return out


def _field(config, kind: str) -> str:
    return "config.json rope_parameters" + ("" if kind == "default" else f"[{kind!r}]")
