"""Qwen3: Llama plus an RMSNorm over each query and key head before RoPE, and a `head_dim` that is
not hidden / heads. Sliding layers (`use_sliding_window`, `layer_types`) reach the op through the base."""

from llmc.compiler.models.base import Decoder, HeadQKNorm
from llmc.compiler.models.family import Family


class Qwen3Decoder(HeadQKNorm, Decoder):
    pass


FAMILY = Family(
    name="qwen3", decoder=Qwen3Decoder,
    tiny={"qwen3": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                        initializer_range=0.1, use_sliding_window=True, sliding_window=8, max_window_layers=1)},
)
