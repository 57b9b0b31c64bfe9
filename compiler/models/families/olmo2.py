"""OLMo 2: post-norm blocks (the norm after attention and after the MLP, inside the residual) and an
RMSNorm over the whole query and key projections (not per head) before RoPE."""

from llmc.compiler.models.base import Decoder
from llmc.compiler.models.family import Family


class Olmo2Decoder(Decoder):
    def project(self, i, layer, x):
        b, s, _ = x.shape
        q, k, v = self.qkv[i](x).split(self.qkv_sizes, dim=-1)
        q, k = layer.self_attn.q_norm(q), layer.self_attn.k_norm(k)
        return (q.view(b, s, self.num_heads, self.head_dim), k.view(b, s, self.num_kv_heads, self.head_dim),
                v.view(b, s, self.num_kv_heads, self.head_dim))

    def block(self, layer, hidden, attention):
        hidden = hidden + layer.post_attention_layernorm(attention(hidden))
        return hidden + layer.post_feedforward_layernorm(self.feed_forward(layer, hidden))


FAMILY = Family(
    name="olmo2", decoder=Olmo2Decoder,
    tiny={"olmo2": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                        initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)},
)
