"""Each family's decoder (compiler/models/) reproduces its checkpoint's own PyTorch model, with rows at
different positions, on tiny configs that can fail: norms moved off their initial values, windows
shorter than the prompts, a LongRoPE switch crossed while decoding and a prompt past it in chunks."""

import dataclasses

import pytest
import torch

from checkpoints import TINY
from llmc.compiler.models import FAMILIES, SUPPORTED_MODEL_TYPES, decoder_for
from llmc.compiler.source import inspect_source
from llmc.compiler.spec import SourceSpec
from llmc.errors import SourceError

# 30, 11 and 19 tokens: longer than every tiny window (8)
PROMPTS = [[(7 * i + 3) % 250 + 1 for i in range(30)], [7, 7, 200, 5, 9, 31, 64, 2, 9, 120, 33],
           [(11 * i) % 256 for i in range(19)]]


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _decode(dec, prompts, steps, capacity):
    """Prefill all rows at once (right-padded), then decode each at its own position."""
    width = max(map(len, prompts))
    shape = (len(prompts), dec.num_kv_heads, capacity, dec.head_dim)
    kc = [torch.zeros(shape) for _ in dec.layers]
    vc = [torch.zeros(shape) for _ in dec.layers]
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    rows = torch.arange(len(prompts))
    with torch.no_grad():
        logits, kc, vc = dec(ids, torch.zeros(len(prompts), dtype=torch.int64), kc, vc)
        lengths = torch.tensor([len(p) for p in prompts])
        ours = [logits[rows, lengths - 1]]
        for _ in range(steps):
            logits, kc, vc = dec(ours[-1].argmax(-1)[:, None], lengths, kc, vc)
            lengths = lengths + 1
            ours.append(logits[:, -1])
    return ours


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_batch_at_different_positions_matches_the_checkpoints_own_model(tiny_checkpoints, model_type):
    hf = _load(tiny_checkpoints[model_type])
    dec = decoder_for(hf)
    prompts, steps = PROMPTS, 24  # phi3's LongRoPE switch (88) is not reached here: see the test below
    ours = _decode(dec, prompts, steps, capacity=128)
    for row, prompt in enumerate(prompts):
        seq = torch.tensor([prompt + [int(o[row].argmax()) for o in ours[:-1]]])
        with torch.no_grad():
            ref = hf(seq).logits[0, len(prompt) - 1:]
        torch.testing.assert_close(torch.stack([o[row] for o in ours]), ref, rtol=1e-4, atol=1e-4)
    tokens = [int(o[0].argmax()) for o in ours]
    assert len(set(tokens)) > 3, f"{model_type}: degenerate greedy output {tokens} proves little"


def test_the_tiny_configs_exercise_every_feature(tiny_checkpoints):
    """A feature nobody's tiny config has is a feature no test sees."""
    specs = {t: decoder_for(_load(tiny_checkpoints[t])).specs for t in ("gemma2", "gemma3_text", "smollm3", "qwen3")}
    assert {s.window for s in specs["gemma2"]} == {8, -1} and all(s.softcap == 5.0 for s in specs["gemma2"])
    assert [s.rope for s in specs["gemma3_text"]] == ["sliding_attention"] * 5 + ["full_attention"]
    assert [s.rope for s in specs["smollm3"]] == ["default", None, "default", None]
    assert [s.window for s in specs["qwen3"]] == [-1, 8]
    phi3 = decoder_for(_load(tiny_checkpoints["phi3"]))
    assert phi3.rope.longrope == {"default": 88} and phi3.rope.rotary_dim == 12 < phi3.head_dim
    mixtures = {t: decoder_for(_load(tiny_checkpoints[t])) for t in ("mixtral", "qwen3_moe", "gpt_oss")}
    assert sorted(mixtures["qwen3_moe"].experts) == ["0", "2"]  # a dense layer between sparse ones
    assert [m.routing.normalize for m in mixtures["qwen3_moe"].experts.values()] == [False, False]
    assert all(m.num_experts > 3 * m.routing.k for m in mixtures["mixtral"].experts.values())  # more than batch 3 picks
    gpt_oss = mixtures["gpt_oss"]
    assert [s.window for s in gpt_oss.specs] == [8, -1] and gpt_oss.sinks is not None
    clamped = _decode(gpt_oss, PROMPTS[:1], 0, capacity=64)[0]  # the SwiGLU clamp (swiglu_limit) is reached:
    for layer in gpt_oss.experts.values():  # without it the logits move
        layer.routing = dataclasses.replace(layer.routing, limit=0.0)
    assert not torch.allclose(_decode(gpt_oss, PROMPTS[:1], 0, capacity=64)[0], clamped, atol=1e-3)


def test_longrope_chunked_prefill_takes_the_whole_prompts_table(tiny_checkpoints):
    """A 90-token prompt (past the switch at 88) prefilled in chunks of 30, each told the whole length
    (`sequence_lengths`), equals transformers' forward on the whole prompt at every position; told
    nothing, the first chunks take the short table and do not."""
    hf = _load(tiny_checkpoints["phi3"])
    dec = decoder_for(hf)
    prompt = PROMPTS[0] * 3
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
        for lengths in (torch.tensor([len(prompt)]), None):
            shape = (1, dec.num_kv_heads, 96, dec.head_dim)
            kc, vc = [torch.zeros(shape) for _ in dec.layers], [torch.zeros(shape) for _ in dec.layers]
            chunks = []
            for at in range(0, len(prompt), 30):
                logits, kc, vc = dec(torch.tensor([prompt[at:at + 30]]), torch.tensor([at]), kc, vc, lengths)
                chunks.append(logits[0])
            ours = torch.cat(chunks)
            if lengths is not None:
                torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
            else:
                assert float((ours[:60] - ref[:60]).abs().max()) > 1e-2


def test_the_longrope_reference_is_transformers_generate(tiny_checkpoints):
    """verify's reference (torch_greedy) decodes as generate() does: a 77-token prompt crosses the switch
    (88) at step 12, where generate() drops its cache and recomputes the whole sequence with the long
    factors; a decode on the cache alone would part from it there."""
    from llmc.compiler.graph.greedy import torch_greedy

    hf = _load(tiny_checkpoints["phi3"])
    prompt = PROMPTS[1] * 7
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    ref = torch.stack(out.logits)[:, 0]
    ours = torch.stack([torch.as_tensor(x) for x in torch_greedy(hf, prompt, 16, lambda: None)[1]])
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    tokens = out.sequences[0, len(prompt):].tolist()
    with torch.no_grad():  # the cache kept across the switch
        first = hf(torch.tensor([prompt + tokens[:11]]), use_cache=True)
        kept = hf(torch.tensor([tokens[11:12]]), past_key_values=first.past_key_values).logits[0, -1]
    assert float((kept - ref[12]).abs().max()) > 1e-2


def test_a_window_or_norm_off_by_one_would_show(tiny_checkpoints):
    """The check above can fail: the same decoder with its window one wider, or its q/k norms skipped,
    no longer matches."""
    from dataclasses import replace

    hf = _load(tiny_checkpoints["gemma2"])
    dec = decoder_for(hf)
    dec.specs = [replace(s, window=s.window + 1 if s.window > 0 else -1) for s in dec.specs]
    ours = _decode(dec, PROMPTS[:1], 2, capacity=64)
    with torch.no_grad():
        ref = hf(torch.tensor(PROMPTS[:1])).logits[0, -1]
    assert not torch.allclose(ours[0][0], ref, atol=1e-3)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},  # with its attention factor
])
def test_fixed_table_rope_variants_match(rope):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **{**TINY["llama"], "rope_parameters": {"rope_theta": 10000.0, **rope}})
    hf = AutoModelForCausalLM.from_config(config).eval()
    dec = decoder_for(hf)
    assert dec.rope.fixed == ["default"] and not dec.rope.longrope
    ours = _decode(dec, PROMPTS[:1], 4, capacity=64)
    seq = torch.tensor([PROMPTS[0] + [int(o[0].argmax()) for o in ours[:-1]]])
    with torch.no_grad():
        ref = hf(seq).logits[0, len(PROMPTS[0]) - 1:]
    torch.testing.assert_close(torch.stack([o[0] for o in ours]), ref, rtol=1e-4, atol=1e-4)


def test_dynamic_rope_is_refused_naming_the_field(tmp_path):
    import json

    from checkpoints import make_checkpoint

    ckpt = make_checkpoint("llama", tmp_path / "dyn", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                        "rope_theta": 10000.0})
    assert json.loads((ckpt / "config.json").read_text())["rope_parameters"]["rope_type"] == "dynamic"
    with pytest.raises(SourceError, match=r"rope_parameters.rope_type 'dynamic' is not supported"):
        inspect_source(SourceSpec(path=ckpt))


def test_the_registry_claims_each_model_type_once():
    claimed = [t for f in FAMILIES for t in f.model_types]
    assert len(claimed) == len(set(claimed)) == len(SUPPORTED_MODEL_TYPES)
    assert {"qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "granite", "olmo2", "smollm3"} <= set(claimed)


def test_gpt2_scaled_by_inverse_layer_index():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", vocab_size=64, n_embd=32, n_layer=3, n_head=2, n_positions=64,
                                  scale_attn_by_inverse_layer_idx=True, initializer_range=0.2)
    hf = AutoModelForCausalLM.from_config(config).eval()
    ours = _decode(decoder_for(hf), [[5, 17, 9, 3]], 3, capacity=16)
    seq = torch.tensor([[5, 17, 9, 3] + [int(o[0].argmax()) for o in ours[:-1]]])
    with torch.no_grad():
        torch.testing.assert_close(torch.stack([o[0] for o in ours]), hf(seq).logits[0, 3:], rtol=1e-4, atol=1e-4)


def test_attention_sinks_match_gpt_oss():
    """The op's sinks (and a rotary module that returns each frequency once) against gpt-oss's own
    attention; its mixture-of-experts MLP returns (hidden, router logits), which this test's block unpacks
    (the family itself is issue 33's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmc.compiler.models.base import Decoder

    class SinkDecoder(Decoder):
        def block(self, layer, hidden, attention):
            hidden = hidden + attention(layer.input_layernorm(hidden))
            return hidden + layer.mlp(layer.post_attention_layernorm(hidden))[0]

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "gpt_oss", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=2048,
        sliding_window=8, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["sliding_attention", "full_attention"])
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "sinks" in name:
                param.copy_(torch.randn_like(param) * 2)
    dec = SinkDecoder(hf).eval()
    assert dec.sinks is not None and [s.window for s in dec.specs] == [8, -1]
    ours = _decode(dec, PROMPTS[:1], 6, capacity=64)
    seq = torch.tensor([PROMPTS[0] + [int(o[0].argmax()) for o in ours[:-1]]])
    with torch.no_grad():
        ref = hf(seq).logits[0, len(PROMPTS[0]) - 1:]
        torch.testing.assert_close(torch.stack([o[0] for o in ours]), ref, rtol=1e-4, atol=1e-4)
        dec.sinks = None  # the check can fail: without the sinks the logits move
        assert not torch.allclose(_decode(dec, PROMPTS[:1], 0, capacity=64)[0][0], ref[0], atol=1e-3)
