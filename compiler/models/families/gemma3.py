"""Gemma 3 (text): Gemma 2's sandwich blocks plus per-head q/k norms, five sliding layers to one global
(`layer_types`), and a RoPE of its own per layer type (`rope_parameters` nested by type: a local base
for sliding layers, the global base and scaling for full ones)."""

from functools import partial

from llmc.compiler.models.base import HeadQKNorm, LayerAttention
from llmc.compiler.models.family import Family
from llmc.compiler.models.families.gemma2 import SandwichDecoder


class Gemma3Decoder(HeadQKNorm, SandwichDecoder):
    def rotary_modules(self, hf_model):
        rotary = hf_model.model.rotary_emb
        return {kind: partial(rotary, layer_type=kind) for kind in set(self.config.layer_types)}

    def layer_attention(self, i, layer):
        spec = super().layer_attention(i, layer)
        return LayerAttention(spec.scale, spec.softcap, spec.window, rope=self.config.layer_types[i])


FAMILY = Family(
    name="gemma3", decoder=Gemma3Decoder,
    tiny={"gemma3_text": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                              initializer_range=0.1, tie_word_embeddings=False, sliding_window=8,
                              query_pre_attn_scalar=16,
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                               "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 10000.0}})},
)
