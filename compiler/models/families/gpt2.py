"""GPT-2: learned positions, one Conv1D computing q, k and v, multi-head attention, no RoPE, and a
softmax scale that may shrink with depth (`scale_attn_by_inverse_layer_idx`)."""

import math

from llmc.compiler.models.base import Decoder, LayerAttention
from llmc.compiler.models.family import Family


class GPT2Decoder(Decoder):
    def __init__(self, hf_model):
        if getattr(hf_model.config, "add_cross_attention", False):
            raise NotImplementedError("GPT-2 with cross-attention is an encoder-decoder; llmc exports decoder-only "
                                      "models")
        super().__init__(hf_model)
        self.wpe = hf_model.transformer.wpe

    def modules_of(self, hf_model):
        inner = hf_model.transformer
        return inner.wte, inner.h, inner.ln_f, hf_model.lm_head

    def rotary_modules(self, hf_model):
        return {}

    def layer_attention(self, i, layer):
        c = self.config
        scale = 1 / math.sqrt(c.n_embd // c.n_head) if c.scale_attn_weights else 1.0
        return LayerAttention(scale=scale / (i + 1) if c.scale_attn_by_inverse_layer_idx else scale, rope=None)

    def attention_module(self, layer):
        return layer.attn

    def fused_qkv(self, layer):
        return layer.attn.c_attn

    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids) + self.wpe(positions)

    def out_proj(self, layer):
        return layer.attn.c_proj

    def block(self, layer, hidden, attention):
        hidden = hidden + attention(layer.ln_1(hidden))
        return hidden + self.feed_forward(layer, layer.ln_2(hidden))


FAMILY = Family(name="gpt2", decoder=GPT2Decoder,
                tiny={"gpt2": dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=2048,
                                   initializer_range=0.4, bos_token_id=0, eos_token_id=0)})
