"""Llama and the families shaped exactly like it: Mistral, Qwen2, SmolLM2 (a Llama) and Gemma (its
(1 + w) RMSNorm, √hidden embedding scale and GeGLU live in its own modules, which the base reuses).
Mistral's and Qwen2's sliding windows reach the op through the base's `layer_attention`."""

from llmc.compiler.models.base import Decoder
from llmc.compiler.models.family import Family

_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.1)

FAMILY = Family(
    name="llama", decoder=Decoder,
    tiny={"llama": _TINY, "qwen2": _TINY, "mistral": {**_TINY, "num_key_value_heads": 1},
          # untied: a tied head over Gemma's √hidden-scaled embeddings repeats the input token
          "gemma": {**_TINY, "head_dim": 16, "num_key_value_heads": 1, "tie_word_embeddings": False}},
)
