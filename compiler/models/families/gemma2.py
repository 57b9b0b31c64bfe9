"""Gemma 2: Gemma's (1 + w) norms and scaled embeddings (its own modules), plus sandwich norms around
attention and MLP, an attention logit softcap, `query_pre_attn_scalar` as the softmax scale (the
attention module's `scaling`), sliding windows on the layers `layer_types` marks, and a final logit
softcap."""

import torch

from llmc.compiler.models.base import Decoder
from llmc.compiler.models.family import Family


class SandwichDecoder(Decoder):
    """Blocks with a norm before and after attention and before and after the MLP (Gemma 2 and 3)."""

    def block(self, layer, hidden, attention):
        hidden = hidden + layer.post_attention_layernorm(attention(layer.input_layernorm(hidden)))
        mlp = self.feed_forward(layer, layer.pre_feedforward_layernorm(hidden))
        return hidden + layer.post_feedforward_layernorm(mlp)

    def head(self, hidden):
        logits = super().head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if not cap else torch.tanh(logits / cap) * cap


_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, initializer_range=0.1,
             tie_word_embeddings=False, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
             final_logit_softcapping=3.0)

FAMILY = Family(
    name="gemma2", decoder=SandwichDecoder,
    tiny={"gemma2": _TINY},
)
