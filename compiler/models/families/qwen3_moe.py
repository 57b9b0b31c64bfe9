"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with sparse feed-forwards: a softmax router over
`num_experts`, the `num_experts_per_tok` largest, renormalized only under `norm_topk_prob` (False by
default). Dense layers sit between sparse ones where `mlp_only_layers` names them or
`decoder_sparse_step` skips them (compiler/models/moe.py)."""

from llmc.compiler.models.base import Decoder, HeadQKNorm
from llmc.compiler.models.family import Family
from llmc.compiler.models.moe import MoEDecoder, concatenated_experts


class Qwen3MoeDecoder(MoEDecoder, HeadQKNorm, Decoder):
    def expert_layer(self, layer):
        return concatenated_experts(layer.mlp, normalize=bool(self.config.norm_topk_prob))


FAMILY = Family(
    name="qwen3_moe", experts=True, decoder=Qwen3MoeDecoder,
    # three layers, the middle one dense; top-3 of 6 experts without renormalizing (the default)
    tiny={"qwen3_moe": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=6, num_experts_per_tok=3, mlp_only_layers=[1], max_position_embeddings=2048,
                            initializer_range=0.1, use_sliding_window=True, sliding_window=8,
                            max_window_layers=1)},
)
