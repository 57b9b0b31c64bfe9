"""Nemotron (Minitron, Nemotron-Mini): Llama's shape with its own modules doing the rest (LayerNorm1P
norms, a squared-ReLU MLP), and rotary over half of each head (`partial_rotary_factor`), which the op's
tables carry. Nothing to override: this file is its tiny config."""

from llmc.compiler.models.base import Decoder
from llmc.compiler.models.family import Family

FAMILY = Family(
    name="nemotron", decoder=Decoder,
    tiny={"nemotron": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                           initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.5})},
)
