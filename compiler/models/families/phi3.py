"""Phi-3 / Phi-3.5 / Phi-4-mini: one `qkv_proj` and one `gate_up_proj` (the MLP module handles the
latter), partial rotary (`partial_rotary_factor`: the tables are that fraction of the head wide), and
LongRoPE (short and long factors with an attention factor, switched at
`original_max_position_embeddings` as transformers switches it: compiler/models/rope.py)."""

from llmc.compiler.models.base import Decoder
from llmc.compiler.models.family import Family


class Phi3Decoder(Decoder):
    def fused_qkv(self, layer):
        return layer.self_attn.qkv_proj


# A LongRoPE switch the verify prompts cross while decoding (the byte tokenizer's prompts are 17, 24 and
# 80 tokens; 80 + 32 steps pass 88), on 3/4 of the head (Phi-4-mini's partial rotary).
_HALF = 6  # rotary channels / 2: head_dim 16 * 0.75 = 12
FAMILY = Family(
    name="phi3", decoder=Phi3Decoder,
    tiny={"phi3": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       original_max_position_embeddings=88, initializer_range=0.1, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2,
                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                        "short_factor": [1.0 + 0.1 * i for i in range(_HALF)],
                                        "long_factor": [2.0 + 0.5 * i for i in range(_HALF)],
                                        "original_max_position_embeddings": 88})},
)
