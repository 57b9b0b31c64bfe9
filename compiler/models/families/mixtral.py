"""Mixtral: Mistral's blocks with a sparse feed-forward in every layer: a softmax router over
`num_local_experts`, the `num_experts_per_tok` largest renormalized (compiler/models/moe.py)."""

from llmc.compiler.models.base import Decoder
from llmc.compiler.models.family import Family
from llmc.compiler.models.moe import MoEDecoder, concatenated_experts


class MixtralDecoder(MoEDecoder, Decoder):
    def expert_layer(self, layer):
        return concatenated_experts(layer.mlp, normalize=True)


FAMILY = Family(
    name="mixtral", experts=True, decoder=MixtralDecoder,
    # more experts than a batch-3 step has rows at top-2, a window shorter than the verify prompts
    tiny={"mixtral": dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                          max_position_embeddings=2048, sliding_window=8, initializer_range=0.1)},
)
