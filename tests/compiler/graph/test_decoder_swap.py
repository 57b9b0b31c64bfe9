"""The HF model rebuilt around llmc::attention matches the original, with rows at different positions."""

import pytest
import torch

from llmc.compiler.decoder import LlamaFamilyDecoder, decoder_for
from llmc.compiler.source import SUPPORTED_MODEL_TYPES



def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gpt2"])
def test_batch_at_different_positions_matches_each_row_alone(tiny_checkpoints, model_type):
    hf = _load(tiny_checkpoints[model_type])
    dec = decoder_for(hf, SUPPORTED_MODEL_TYPES[model_type])
    prompts = [[5, 17, 99, 3, 42, 8, 1], [7, 7, 200], [31, 64, 2, 9, 120]]  # 7, 3 and 5 tokens
    steps, capacity = 6, 32
    width = max(map(len, prompts))
    shape = (len(prompts), dec.num_kv_heads, capacity, dec.head_dim)
    kc = [torch.zeros(shape) for _ in range(hf.config.num_hidden_layers)]
    vc = [torch.zeros(shape) for _ in range(hf.config.num_hidden_layers)]
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])  # right-padded
    with torch.no_grad():
        logits, kc, vc = dec(ids, torch.zeros(3, dtype=torch.int64), kc, vc)
        lengths = torch.tensor([len(p) for p in prompts])
        last = logits[torch.arange(3), lengths - 1]
        ours = [last]
        for _ in range(steps):
            token = ours[-1].argmax(-1)[:, None]
            logits, kc, vc = dec(token, lengths, kc, vc)  # each row at its own position
            lengths = lengths + 1
            ours.append(logits[:, -1])
        for row, prompt in enumerate(prompts):
            seq = torch.tensor([prompt + [int(o[row].argmax()) for o in ours[:-1]]])
            ref = hf(seq).logits[0, len(prompt) - 1:]
            got = torch.stack([o[row] for o in ours])
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_sliding_window_models_are_refused(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mistral", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                  sliding_window=16)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        LlamaFamilyDecoder(AutoModelForCausalLM.from_config(config))


def _matches_hf(hf, dec, prompt=(5, 17, 9, 3), steps=3):
    capacity = 16
    shape = (1, dec.num_kv_heads, capacity, dec.head_dim)
    kc = [torch.zeros(shape) for _ in range(hf.config.num_hidden_layers)]
    vc = [torch.zeros(shape) for _ in range(hf.config.num_hidden_layers)]
    seq = list(prompt)
    with torch.no_grad():
        logits, kc, vc = dec(torch.tensor([seq]), torch.zeros(1, dtype=torch.int64), kc, vc)
        for _ in range(steps):
            seq.append(int(logits[0, -1].argmax()))
            logits, kc, vc = dec(torch.tensor([seq[-1:]]), torch.tensor([len(seq) - 1]), kc, vc)
        torch.testing.assert_close(logits[0, -1], hf(torch.tensor([seq])).logits[0, -1], rtol=1e-4, atol=1e-4)


def test_rope_without_a_fixed_table_is_applied_in_the_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                  rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    hf = AutoModelForCausalLM.from_config(config).eval()
    dec = LlamaFamilyDecoder(hf)
    assert not dec.fuse_rotary
    _matches_hf(hf, dec)


def test_gpt2_scaled_by_inverse_layer_index():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", vocab_size=64, n_embd=32, n_layer=3, n_head=2, n_positions=64,
                                  scale_attn_by_inverse_layer_idx=True, initializer_range=0.2)
    hf = AutoModelForCausalLM.from_config(config).eval()
    _matches_hf(hf, decoder_for(hf, "gpt2"))
