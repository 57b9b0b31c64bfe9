"""The paged form of a decoder (decoder.py): packed tokens over block pools, what the `paged`
lowering exports.

    forward(input_ids int64 [T], position_ids int64 [T], cumulative_sequence_length int32 [B + 1],
            past_seqlens int32 [B], block_table int32 [B, max_blocks], logits_indices int64 [L],
            past (k0, v0, k1, v1, ...: [num_blocks, block_size, KVH, D] each)
            [, sequence_lengths int64 [B]: LongRoPE only])
        -> (logits [L, vocab], k0', v0', k1', v1', ...)

The T tokens of B rows come packed with no padding (row b's are `cumulative_sequence_length[b] ..
[b+1]`); the decoder's blocks run on them as one sequence of T tokens at their own positions
(`position_ids`: GPT-2's learned positions, Llama's rotary when it stays in the model), and each
layer's attention is one `llmc::paged_attention` call over the block pools. Only the tokens
`logits_indices` names reach the final norm and the LM head, so a prefill chunk costs one row of
the vocabulary projection, not one per token. A decoder with LongRoPE (compiler/models/rope.py) also
takes each row's whole sequence length, which picks the table its tokens are rotated with.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import llmc.plugins.op.paged_op  # noqa: F401  (registers torch.ops.llmc.paged_attention)
from llmc.compiler.models.base import Attend, LayerAttention
from llmc.runtime.layout import KVLayout, PAGED_INPUTS


def paged_attend(cumulative_sequence_length: Tensor, past_seqlens: Tensor, block_table: Tensor) -> Attend:
    """`llmc::paged_attention` for the decoder's [1, T, heads, D] tensors (one packed sequence)."""
    def attend(q, k, v, k_cache, v_cache, spec: LayerAttention, tables, sink=None):
        _, t, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        cos, sin = tables or (None, None)
        out, k_cache, v_cache = torch.ops.llmc.paged_attention(
            q.reshape(t, heads * head_dim), k.reshape(t, kv_heads * head_dim), v.reshape(t, kv_heads * head_dim),
            k_cache, v_cache, cumulative_sequence_length, past_seqlens, block_table, heads, kv_heads, spec.scale,
            cos, sin, sink, spec.softcap, spec.window)
        return out.view(1, t, heads, head_dim), k_cache, v_cache
    return attend


class PagedDecoder(nn.Module):
    """A decoder (decoder.py) driven over packed tokens and block pools, caches as one flat tuple."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids, position_ids, cumulative_sequence_length, past_seqlens, block_table, logits_indices,
                past, sequence_lengths=None):
        attend = paged_attend(cumulative_sequence_length, past_seqlens, block_table)
        seq_lens = None
        if self.decoder.rope.switch is not None:  # each token's row's length: row r owns tokens cu[r] .. cu[r+1]
            ends = cumulative_sequence_length[1:]
            row = (torch.arange(input_ids.shape[0])[:, None] >= ends[None, :]).sum(dim=1)
            if sequence_lengths is None:  # the row's last position this step + 1
                sequence_lengths = past_seqlens + ends - cumulative_sequence_length[:-1]
            seq_lens = sequence_lengths.to(torch.int64)[row][None]
        hidden, keys, values = self.decoder.body(input_ids[None], position_ids[None], attend, list(past[0::2]),
                                                 list(past[1::2]), seq_lens)
        # [1, L, hidden]: kept 3-D so the LM head exports as a MatMul, as in the slot graph (2-D makes it a
        # Gemm, which weight-only quantization leaves in fp32)
        logits = self.decoder.head(hidden.index_select(1, logits_indices))[0]
        return (logits, *(t for pair in zip(keys, values) for t in pair))


def input_names(layout: KVLayout) -> list[str]:
    return ["input_ids", layout.positions, *PAGED_INPUTS, *layout.past_names(), *layout.step_inputs]


def example_inputs(vocab_size: int, layout: KVLayout) -> tuple:
    """Two rows (a 2-token chunk after 3 cached tokens, and a 5-token first chunk of a 9-token prompt):
    every dynamic dim > 1 and distinct from the others, so torch.export specializes none of them."""
    gen = torch.Generator().manual_seed(0)
    lengths, past = [2, 5], [3, 0]
    input_ids = torch.randint(0, vocab_size, (sum(lengths),), generator=gen)
    position_ids = torch.cat([torch.arange(p, p + n) for p, n in zip(past, lengths)])
    cumulative = torch.tensor([0, 2, 7], dtype=torch.int32)
    past_seqlens = torch.tensor(past, dtype=torch.int32)
    num_blocks, block_size = 11, 4
    block_table = torch.tensor([[0, 1, -1, -1, -1], [2, 3, -1, -1, -1]], dtype=torch.int32)
    logits_indices = torch.tensor([1, 6, 5], dtype=torch.int64)
    pools = tuple(torch.zeros(num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
                  for _ in range(2 * layout.num_layers))
    inputs = input_ids, position_ids, cumulative, past_seqlens, block_table, logits_indices, pools
    return (*inputs, torch.tensor([5, 9])) if layout.step_inputs else inputs


def dynamic_shapes(layout: KVLayout) -> dict:
    from torch.export import Dim

    tokens, batch = Dim("num_tokens"), Dim("batch")
    pool = {0: Dim(layout.dims[0]), 1: Dim(layout.dims[1])}
    return {
        "input_ids": {0: tokens},
        "position_ids": {0: tokens},
        "cumulative_sequence_length": {0: batch + 1},
        "past_seqlens": {0: batch},
        "block_table": {0: batch, 1: Dim("max_blocks")},
        "logits_indices": {0: Dim("num_logits")},
        "past": tuple(pool for _ in range(2 * layout.num_layers)),
        **({"sequence_lengths": {0: batch}} if layout.step_inputs else {}),
    }
