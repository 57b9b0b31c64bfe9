"""The paged graph (`export.attention: paged`) and PagedRunner: export and its I/O per family, parity with
PyTorch through the build's verify (batch 1; three rows joining a step apart with prompts in chunks,
so steps mix decoding rows and prompt chunks), and the runner's steps: mixed and chunked steps equal
separate and whole ones, writes land only in a row's blocks, copy_blocks, refusals."""

import numpy as np
import onnx
import pytest

from llmc.compiler import build
from llmc.compiler.artifacts import ExportedModel
from llmc.compiler.spec import parse_spec
from llmc.runtime.layout import KVLayout
from llmc.runtime.runners.paged import RowStep, pack
from llmc.runtime.runners.paged import PagedRunner
from llmc.runtime.runners.protocol import RunnerClosed

FAMILIES = ("llama", "qwen2", "gpt2")


def _spec(tiny_checkpoints, family):
    return parse_spec({"name": "t", "source": str(tiny_checkpoints[family]), "export": {"attention": "paged"}})


@pytest.fixture(scope="module")
def paged_builds(tiny_checkpoints, tmp_path_factory):
    """Each family exported with the paged lowering: (build folder, result)."""
    root = tmp_path_factory.mktemp("paged")
    return {family: (root / family, build(_spec(tiny_checkpoints, family), output=root / family, until="export"))
            for family in FAMILIES}


def _runner(paged_builds, family="llama", num_blocks=32, max_num_tokens=64):
    folder, result = paged_builds[family]
    return PagedRunner(folder / "export" / result.exported.onnx, result.exported.kv_layout, num_blocks=num_blocks,
                       max_num_tokens=max_num_tokens, num_threads=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_export_io_layout_and_checker(paged_builds, family):
    folder, result = paged_builds[family]
    exported, layout = result.exported, result.exported.kv_layout
    path = folder / "export" / "model.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    graph = onnx.load(str(path)).graph
    assert [i.name for i in graph.input] == ["input_ids", "position_ids", "cumulative_sequence_length", "past_seqlens",
                                             "block_table", "logits_indices", *layout.past_names()]
    assert [o.name for o in graph.output] == ["logits", *layout.present_names()]
    dims = {t.name: (t.dtype, t.shape) for t in exported.inputs + exported.outputs}
    assert dims["input_ids"] == dims["position_ids"] == ("int64", ["num_tokens"])
    assert dims["cumulative_sequence_length"] == ("int32", ["batch + 1"])
    assert dims["past_seqlens"] == ("int32", ["batch"])
    assert dims["block_table"] == ("int32", ["batch", "max_blocks"])
    assert dims["logits_indices"] == ("int64", ["num_logits"])
    pool = ("float32", ["num_blocks", "block_size", layout.num_kv_heads, layout.head_dim])
    assert dims["past_key_values.1.value"] == dims["present.1.value"] == pool
    assert dims["logits"] == ("float32", ["num_logits", exported.model.vocab_size])
    nodes = [n for n in graph.node if (n.domain, n.op_type) == ("llmc", "PagedAttention")]
    assert len(nodes) == exported.model.num_layers
    assert all(list(n.input[1:3]) == ["", ""] for n in nodes)  # QKV packed: no Split, no reshapes per tensor
    assert not any(n.op_type == "Split" for n in graph.node)
    rotary = {onnx.helper.get_attribute_value(a) for n in nodes for a in n.attribute if a.name == "do_rotary"}
    assert rotary == ({0} if family == "gpt2" else {1})  # Llama's rotary inside the op, from cos/sin tables
    assert not any(n.op_type in ("Softmax", "Attention", "GroupQueryAttention") for n in graph.node)
    assert layout.paged and layout.in_place and layout.block_size == 16 and layout.dims[:2] == ("num_blocks", "block_size")
    assert exported.lowering.value == "paged"
    assert ExportedModel.load(folder / "export").kv_layout == layout  # recorded and read back


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_build_verifies_against_pytorch(tiny_checkpoints, paged_builds, family):
    folder = paged_builds[family][0]
    result = build(_spec(tiny_checkpoints, family), output=folder, until="verify")  # the export is reused
    assert result.exported == paged_builds[family][1].exported
    report = result.verify
    assert report and report.passed and "paged" in report.candidate
    by_name = {c.name: c for c in report.cases}
    assert by_name["batch-1"].batch == 1 and by_name["batch-1"].token_agreement == 1.0
    batch = by_name["batch-3"]
    assert batch.batch == 3 and len(set(batch.prompt_lengths)) == 3 and max(batch.prompt_lengths) > 5  # chunked
    assert batch.decode_steps == 32 and batch.first_divergence == [None, None, None]
    assert report.max_abs_logit_diff < 1e-4


PROMPT = [5, 17, 42, 99, 3, 250, 7, 61, 12, 88, 140, 33, 9, 201, 64, 2, 19, 77, 180, 4]  # 20 tokens: 2 blocks


def _prefill(runner, prompt, blocks):
    return runner.step([RowStep(prompt, 0, blocks, num_logits=len(prompt))])


def test_a_prompt_in_chunks_equals_the_prompt_whole(paged_builds):
    runner = _runner(paged_builds)
    whole = _prefill(runner, PROMPT, [3, 9])
    chunks, fed = [], 0
    for size in (3, 13, 1, 3):  # crossing the block boundary inside a chunk and at a chunk's edge
        chunks.append(runner.step([RowStep(PROMPT[fed:fed + size], fed, [20, 4], num_logits=size)]))
        fed += size
    np.testing.assert_allclose(np.concatenate(chunks), whole, atol=1e-5)


def test_a_mixed_step_equals_its_rows_run_apart(paged_builds):
    runner = _runner(paged_builds)
    _prefill(runner, PROMPT[:11], [0])
    decode = RowStep([PROMPT[11]], 11, [0])
    chunk = RowStep(PROMPT[:6], 0, [5, 6], num_logits=2)
    together = runner.step([decode, chunk])
    apart = _runner(paged_builds)
    _prefill(apart, PROMPT[:11], [0])
    np.testing.assert_allclose(together[:1], apart.step([decode]), atol=1e-5)
    np.testing.assert_allclose(together[1:], apart.step([chunk]), atol=1e-5)
    # and the rows' caches are the same afterwards: a decode continues alike on both
    np.testing.assert_allclose(runner.step([RowStep([1], 12, [0])]), apart.step([RowStep([1], 12, [0])]), atol=1e-5)


def test_steps_write_only_their_rows_blocks_in_place(paged_builds):
    runner = _runner(paged_builds, num_blocks=8)
    pools = list(runner.pools)
    for pool in pools:
        pool[...] = 7.0  # stale data: a block's earlier owner
    _prefill(runner, PROMPT[:18], [5, 2])
    runner.step([RowStep([1], 18, [5, 2])])
    assert all(a is b for a, b in zip(runner.pools, pools))  # no reallocation
    for pool in pools:
        assert (pool[5] != 7.0).all() and (pool[2, :3] != 7.0).all() and (pool[2, 3:] == 7.0).all()
        assert (np.delete(pool, [2, 5], axis=0) == 7.0).all()


def test_copied_blocks_continue_like_the_originals(paged_builds):
    runner = _runner(paged_builds)
    _prefill(runner, PROMPT, [1, 2])
    runner.copy_blocks([(1, 10), (2, 11)])
    a = runner.step([RowStep([8], 20, [1, 2])])
    b = runner.step([RowStep([8], 20, [10, 11])])
    np.testing.assert_array_equal(a, b)


def test_decode_rows_at_different_lengths_match_decoding_alone(paged_builds):
    runner = _runner(paged_builds)
    rows = [(PROMPT[:4], [0]), (PROMPT[:17], [1, 2]), (PROMPT, [3, 4])]
    for tokens, blocks in rows:
        _prefill(runner, tokens, blocks)
    batch = runner.step([RowStep([9], len(t), b) for t, b in rows])
    alone = _runner(paged_builds)
    for i, (tokens, blocks) in enumerate(rows):
        _prefill(alone, tokens, blocks)
        np.testing.assert_allclose(batch[i:i + 1], alone.step([RowStep([9], len(tokens), blocks)]), atol=1e-5)


def test_decoding_across_blocks_matches_the_prompt_whole(paged_builds):
    """One row decoded token by token from 14 to 36 cached tokens (two block boundaries, block tables
    1, 2 and 3 blocks wide) gives the logits the same tokens get as one prompt."""
    runner, whole = _runner(paged_builds), _runner(paged_builds)
    tokens = (PROMPT * 2)[:36]
    expected = _prefill(whole, tokens, [6, 0, 3])
    _prefill(runner, tokens[:14], [6, 0, 3])
    got = np.concatenate([runner.step([RowStep([t], 14 + i, [6, 0, 3])]) for i, t in enumerate(tokens[14:])])
    np.testing.assert_allclose(got, expected[14:], atol=1e-5)


@pytest.mark.parametrize("row, message", [
    (RowStep([], 0, [0]), "token_ids is empty"),
    (RowStep([1] * 17, 0, [0]), "need 2 of 16"),
    (RowStep([1], 0, [32]), "outside the pool"),
    (RowStep([1], -1, [0]), "past_len is -1"),
    (RowStep([1, 2], 0, [0], num_logits=3), "num_logits is 3"),
    (RowStep([256], 0, [0]), "token ids must be in 0..255"),
    (RowStep([1] * 65, 0, [0, 1, 2, 3, 4]), "max_num_tokens=64"),
])
def test_bad_rows_are_refused_by_name(paged_builds, row, message):
    runner = _runner(paged_builds)
    with pytest.raises(ValueError, match=message):
        runner.step([RowStep([1], 0, [0]), row])


def test_closed_runner_and_slot_layouts_are_refused(paged_builds):
    runner = _runner(paged_builds)
    runner.close()
    with pytest.raises(RunnerClosed):
        runner.step([RowStep([1], 0, [0])])
    folder, result = paged_builds["llama"]
    slot = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="paged graphs"):
        PagedRunner(folder / "export" / "model.onnx", slot, num_blocks=4, max_num_tokens=8)


def test_pack_gives_a_longrope_graph_each_rows_sequence_length(paged_builds):
    """`sequence_lengths` (LongRoPE graphs, runtime/layout.py): each row's seq_len, or its last position
    + 1 unset; a length that does not reach past the row's cached tokens is refused by name, and a
    graph without the input is refused for a LongRoPE layout, naming it."""
    rows = [RowStep([1, 2, 3], 16, [4, 7], seq_len=40), RowStep([9], 0, [2, 5, 6])]
    assert pack(rows, block_size=16, num_blocks=8, max_num_tokens=8, vocab_size=10).sequence_lengths is None
    p = pack(rows, block_size=16, num_blocks=8, max_num_tokens=8, vocab_size=10, sequence_lengths=True)
    assert p.sequence_lengths.tolist() == [40, 1] and p.feeds()["sequence_lengths"] is p.sequence_lengths
    with pytest.raises(ValueError, match="row 1: seq_len is 5; its tokens start at position 5"):
        pack([rows[0], RowStep([9], 5, [2], seq_len=5)], block_size=16, num_blocks=8, max_num_tokens=8,
             vocab_size=10, sequence_lengths=True)
    folder, result = paged_builds["llama"]
    layout = result.exported.kv_layout.model_copy(update={"longrope_switch": 16})
    with pytest.raises(ValueError, match="its input 10 is 'missing', expected 'sequence_lengths'"):
        PagedRunner(folder / "export" / "model.onnx", layout, num_blocks=4, max_num_tokens=8)


def test_inspect_shows_the_paged_layout(paged_builds):
    from llmc.compiler.inspect import inspect_path

    rows = dict(row for section in inspect_path(paged_builds["gpt2"][0]) for row in section.rows)
    assert "paged: blocks of 16 tokens" in rows["kv layout"] and rows["kv layout"].startswith("[num_blocks, block_size")
    assert rows["block_table"] == "int32[batch, max_blocks]" and rows["logits"] == "float32[num_logits, 256]"


def test_weight_only_quantization_measures_a_paged_graph_as_the_slot_graph(tiny_checkpoints, paged_builds, tmp_path):
    """The quantize stage calibrates (AWQ) and measures (perplexity, agreement) a paged export through
    the slot-shaped PagedSlots: the same figures as for the fused export of the same checkpoint."""
    quantization = {"mode": "int4-weight-only", "algorithm": "awq"}
    reports = {}
    for attention in ("paged", "fused"):
        spec = parse_spec({"name": "t", "source": str(tiny_checkpoints["llama"]), "export": {"attention": attention},
                           "quantization": quantization, "verify": {"enabled": False}})
        reports[attention] = build(spec, output=tmp_path / attention, until="quantize").quantized.report
    paged, fused = reports["paged"], reports["fused"]
    assert paged.perplexity_reference == pytest.approx(fused.perplexity_reference, rel=1e-4)
    assert paged.perplexity_quantized == pytest.approx(fused.perplexity_quantized, rel=1e-3)
    assert paged.token_agreement == pytest.approx(fused.token_agreement, abs=2 / paged.agreement_tokens)  # near ties
    counts = [sum(n.op_type == "MatMulNBits" for n in onnx.load(str(tmp_path / a / "quantize" / "model.onnx")).graph.node)
              for a in ("paged", "fused")]
    assert counts[0] == counts[1]  # the LM head too: a MatMul in both graphs (a Gemm would stay fp32)


def test_static_quantization_refuses_the_paged_lowering(tiny_checkpoints):
    from llmc.errors import SpecError

    with pytest.raises(SpecError, match="not export.attention: paged"):
        parse_spec({"name": "t", "source": str(tiny_checkpoints["llama"]), "export": {"attention": "paged"},
                    "quantization": {"mode": "int8"}})


def test_layouts_written_before_paging_still_load():
    old = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32",
           "dims": ["batch", "num_kv_heads", "kv_capacity", "head_dim"], "positions": "cache_position",
           "in_place": True, "max_prefill_rows": 1}  # a manifest's kv_layout from before the paged fields
    layout = KVLayout.model_validate(old)
    assert not layout.paged and layout.block_size is None
    with pytest.raises(ValueError, match="block_size is set exactly when kv_layout.paged"):
        KVLayout.model_validate({**old, "paged": True})
