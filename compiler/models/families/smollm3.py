"""SmolLM3: Llama with no RoPE on the layers `no_rope_layers` marks 0 (they attend by content alone),
and optional sliding layers."""

from llmc.compiler.models.base import Decoder, LayerAttention
from llmc.compiler.models.family import Family


class SmolLM3Decoder(Decoder):
    def layer_attention(self, i, layer):
        spec = super().layer_attention(i, layer)
        return spec if layer.self_attn.use_rope else LayerAttention(spec.scale, spec.softcap, spec.window, rope=None)


FAMILY = Family(
    name="smollm3", decoder=SmolLM3Decoder,
    tiny={"smollm3": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                          initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          no_rope_layers=[1, 0, 1, 0], use_sliding_window=True, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"] * 2)},
)
