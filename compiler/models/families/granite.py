"""Granite: Llama with four multipliers: embeddings, the attention scale (the attention module's
`scaling` is `attention_multiplier`), each residual branch, and the logits (divided by `logits_scaling`)."""

from llmc.compiler.models.base import Decoder
from llmc.compiler.models.family import Family


class GraniteDecoder(Decoder):
    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids) * self.config.embedding_multiplier

    def block(self, layer, hidden, attention):
        r = self.config.residual_multiplier
        hidden = hidden + attention(layer.input_layernorm(hidden)) * r
        return hidden + self.feed_forward(layer, layer.post_attention_layernorm(hidden)) * r

    def head(self, hidden):
        return super().head(hidden) / self.config.logits_scaling


FAMILY = Family(
    name="granite", decoder=GraniteDecoder,
    tiny={"granite": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                          initializer_range=0.1, embedding_multiplier=6.0, attention_multiplier=0.2,
                          residual_multiplier=0.5, logits_scaling=2.5)},
)
