"""gpt-oss: biased q/k/v/o projections, attention sinks (one logit per head joining each softmax),
a window on alternating layers (`layer_types`), YaRN RoPE (a fixed table: compiler/models/rope.py), and
a sparse feed-forward in every layer: a biased router whose top-k logits go through a softmax, experts
with biases and a clamped SwiGLU (alpha `swiglu_alpha`, up + 1, `swiglu_limit`), stored transposed with
gate and up already interleaved (compiler/models/moe.py)."""

from llmc.compiler.models.base import Decoder
from llmc.compiler.models.family import Family
from llmc.compiler.models.moe import ExpertLayer, MoEDecoder, Routing


class GptOssDecoder(MoEDecoder, Decoder):
    GATE_UP_INTERLEAVED = True

    def expert_layer(self, layer):
        router, experts = layer.mlp.router, layer.mlp.experts
        routing = Routing(k=int(router.top_k), normalize=True, alpha=float(experts.alpha), beta=1.0,
                          limit=float(experts.limit))
        return ExpertLayer(router.weight, router.bias, experts.gate_up_proj.transpose(1, 2),
                           experts.gate_up_proj_bias, experts.down_proj.transpose(1, 2), experts.down_proj_bias,
                           routing)


FAMILY = Family(
    name="gpt_oss", experts=True, decoder=GptOssDecoder,
    # a clamp the tiny activations reach (swiglu_limit 1.0), a window shorter than the verify prompts
    tiny={"gpt_oss": dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                          num_experts_per_tok=2, max_position_embeddings=2048, sliding_window=8,
                          swiglu_limit=1.0, initializer_range=0.1,
                          rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 150000.0},
                          pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          layer_types=["sliding_attention", "full_attention"])},
)
