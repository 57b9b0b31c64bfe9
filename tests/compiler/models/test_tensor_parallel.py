"""Tensor parallelism's split (compiler/models/parallel/shard.py) in PyTorch: every family's ranks, run as threads
in lockstep (plugins/op/collective.py's reference collectives), reproduce the checkpoint's own model; the rules
of which splits exist, and the refusals, name `parallel.tensor`."""

import threading

import pytest
import torch

from checkpoints import TINY, make_checkpoint
from llmc.compiler.models import decoder_for
from llmc.compiler.models.parallel.heads import tensor_split
from llmc.compiler.models.parallel.shard import shard
from llmc.compiler.spec import parse_spec
from llmc.errors import SpecError, UnsupportedError
from llmc.plugins.op.collective import lockstep

PROMPTS = [[(7 * i + 3) % 250 + 1 for i in range(30)], [7, 7, 200, 5, 9, 31, 64, 2, 9, 120, 33]]
STEPS = 12


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _decode(dec, prompts, steps):
    """Prefill both rows (right-padded), then greedy steps at each row's own position: each step's logits."""
    width = max(map(len, prompts))
    shape = (len(prompts), dec.num_kv_heads, width + steps, dec.head_dim)
    kc, vc = [torch.zeros(shape) for _ in dec.layers], [torch.zeros(shape) for _ in dec.layers]
    rows, lengths = torch.arange(len(prompts)), torch.tensor([len(p) for p in prompts])
    with torch.no_grad():
        logits, kc, vc = dec(torch.tensor([p + [0] * (width - len(p)) for p in prompts]),
                             torch.zeros(len(prompts), dtype=torch.int64), kc, vc)
        out = [logits[rows, lengths - 1]]
        for _ in range(steps):
            logits, kc, vc = dec(out[-1].argmax(-1)[:, None], lengths, kc, vc)
            lengths = lengths + 1
            out.append(logits[:, -1])
    return torch.stack(out)


def _ranks_decode(hf, ranks: int, prompts=PROMPTS, steps=STEPS) -> list[torch.Tensor]:
    """Each rank's logits, the ranks run as threads whose collectives meet in lockstep."""
    decoders = [shard(decoder_for(hf), r, ranks) for r in range(ranks)]
    outs, errors = [None] * ranks, []

    def run(r):
        try:
            outs[r] = _decode(decoders[r], prompts, steps)
        except BaseException as err:  # noqa: BLE001 (re-raised below)
            errors.append(err)
            raise

    with lockstep(ranks):
        threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    return outs


def _assert_matches_full(hf, outs):
    full = _decode(decoder_for(hf), PROMPTS, STEPS)
    for out in outs:  # every rank ends with the whole logits (the gathered LM head)
        torch.testing.assert_close(out, full, rtol=1e-4, atol=1e-4)
    tokens = full[:, 0].argmax(-1).tolist()
    assert len(set(tokens)) > 3, f"degenerate greedy output {tokens} proves little"


@pytest.mark.parametrize("model_type", sorted(set(TINY) - {"olmo2"}))
def test_two_ranks_reproduce_the_whole_model(tiny_checkpoints, model_type):
    hf = _load(tiny_checkpoints[model_type])
    _assert_matches_full(hf, _ranks_decode(hf, 2))


@pytest.mark.parametrize("heads, kv_heads, ranks", [(6, 3, 3), (6, 1, 3), (4, 2, 4)])
def test_three_and_four_ranks_split_or_replicate_the_kv_heads(tmp_path, heads, kv_heads, ranks):
    # 3 ranks: KV heads split one each, or one KV head kept by all three; 4 ranks over 2 KV heads: each kept by two.
    # The vocabulary (256) is no multiple of 3: the LM head's padding is cut after the gather.
    path = make_checkpoint("qwen2", tmp_path / "m", num_attention_heads=heads, num_key_value_heads=kv_heads,
                           hidden_size=16 * heads, intermediate_size=48 * ranks)
    hf = _load(path)
    split = tensor_split(heads, kv_heads, ranks)
    assert (split.heads, split.kv_heads) == (heads // ranks, max(1, kv_heads // ranks))
    assert split.kv_replicas == max(1, ranks // kv_heads)
    _assert_matches_full(hf, _ranks_decode(hf, ranks))


def test_a_rank_holds_its_share_of_the_weights(tiny_checkpoints):
    hf = _load(tiny_checkpoints["llama"])
    full = sum(p.numel() for p in decoder_for(hf).parameters())
    rank = shard(decoder_for(hf), 1, 2)
    layer = rank.layers[0]
    assert rank.qkv[0].weight.shape[0] == (rank.num_heads + 2 * rank.num_kv_heads) * rank.head_dim
    assert rank.tp_out[0].inner.weight.shape[1] == rank.num_heads * rank.head_dim
    assert rank.tp_out[0].inner.bias is None and rank.tp_mlp[0].inner.down.bias is None
    assert rank.tp_mlp[0].inner.gate.weight.shape[0] == layer.mlp.gate_proj.weight.shape[0] // 2
    assert sum(p.numel() for n, p in rank.named_parameters() if n.startswith(("qkv", "tp_"))) < full / 2


@pytest.mark.parametrize("heads, kv_heads, ranks, fault", [
    (4, 2, 3, "must divide the model's 4 attention heads"),
    (6, 4, 3, "must divide the model's 4 KV heads, or be a multiple of them"),
    (4, 4, 0, "at least 1"),
])
def test_splits_the_heads_do_not_allow_are_refused(heads, kv_heads, ranks, fault):
    with pytest.raises(ValueError, match="parallel.tensor") as err:
        tensor_split(heads, kv_heads, ranks)
    assert fault in str(err.value)


def test_olmo2_is_refused_naming_the_field(tiny_checkpoints):
    with pytest.raises(UnsupportedError, match=r"parallel.tensor: 2 cannot split olmo2: .*all heads together"):
        shard(decoder_for(_load(tiny_checkpoints["olmo2"])), 0, 2)


def test_a_collective_outside_a_rank_group_says_how_to_run_one():
    with pytest.raises(RuntimeError, match=r"outside a rank group.*lockstep\(2\)"):
        torch.ops.llmc.all_reduce(torch.ones(3), 0, 2)
    assert torch.equal(torch.ops.llmc.all_gather(torch.ones(2, 3), 0, 1), torch.ones(2, 3))


def test_the_spec_splits_only_the_paged_graph(tiny_checkpoints):
    source = str(tiny_checkpoints["llama"])
    assert parse_spec({"name": "t", "source": source}).parallel.tensor == 1
    assert parse_spec({"name": "t", "source": source, "parallel": {"tensor": 2}}).parallel.tensor == 2
    with pytest.raises(SpecError, match=r"parallel.tensor: 2 splits the paged graph.*export.attention: fused"):
        parse_spec({"name": "t", "source": source, "parallel": {"tensor": 2}, "export": {"attention": "fused"}})
    with pytest.raises(SpecError, match=r"parallel.tensor: .*greater than or equal to 1"):
        parse_spec({"name": "t", "source": source, "parallel": {"tensor": 0}})


def test_a_split_model_takes_the_weight_only_modes_and_a_draft(tiny_checkpoints):
    base = {"name": "t", "source": str(tiny_checkpoints["llama"]), "parallel": {"tensor": 2}}
    with pytest.raises(SpecError, match=r"parallel.tensor: 2 with quantization.mode: int8: .*weight-only modes"):
        parse_spec({**base, "quantization": {"mode": "int8"}})
    assert parse_spec({**base, "quantization": {"mode": "int4-weight-only"}}).quantization.weight_only
    draft = {"method": "draft", "draft": {"quantization": {"mode": "int4-weight-only"}}}
    assert parse_spec({**base, "speculative": draft}).speculative.draft is not None  # it runs whole, beside the ranks
    assert parse_spec({**base, "speculative": {"method": "ngram"}}).speculative.method.value == "ngram"


def test_a_tensorrt_split_takes_the_plugin_lowering_and_refuses_the_rest_naming_the_field(tiny_checkpoints):
    base = {"name": "t", "source": str(tiny_checkpoints["llama"]), "target": "tensorrt", "precision": "fp16",
            "parallel": {"tensor": 2}}
    spec = parse_spec(base)  # auto: the plugin lowering, one engine per rank
    assert (spec.parallel.tensor, spec.attention_lowering) == (2, "plugin")
    assert parse_spec({**base, "export": {"attention": "plugin"}}).attention_lowering == "plugin"
    with pytest.raises(SpecError, match=r"parallel.tensor: 2 with target: tensorrt splits the plugin lowering.*"
                                        r"export.attention: reference gives reference"):
        parse_spec({**base, "export": {"attention": "reference"}})
    for mode in ("int8", "fp8"):  # Q/DQ quantizes the reference graph, which a split does not take
        with pytest.raises(SpecError, match=rf"parallel.tensor: 2 with quantization.mode: {mode}: "):
            parse_spec({**base, "quantization": {"mode": mode}})
    with pytest.raises(SpecError, match=r"speculative: needs the paged graph"):
        parse_spec({**base, "speculative": {"method": "ngram"}})
