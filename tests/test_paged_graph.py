"""The paged graph (`export.attention: paged`): its export and I/O per family, what inspect shows, and how
PagedRunner packs rows into the graph's inputs."""

import numpy as np
import onnx
import pytest

from llmc.compiler import build
from llmc.compiler.artifacts import ExportedModel
from llmc.compiler.spec import parse_spec
from llmc.runtime.paged_batch import RowStep, pack

FAMILIES = ("llama", "qwen2", "gpt2")


def _spec(tiny_checkpoints, family):
    return parse_spec({"name": "t", "source": str(tiny_checkpoints[family]), "export": {"attention": "paged"}})


@pytest.fixture(scope="module")
def paged_builds(tiny_checkpoints, tmp_path_factory):
    """Each family exported with the paged lowering: (build folder, result)."""
    root = tmp_path_factory.mktemp("paged")
    return {family: (root / family, build(_spec(tiny_checkpoints, family), output=root / family, until="export"))
            for family in FAMILIES}


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
    assert not any(n.op_type in ("Softmax", "Attention", "GroupQueryAttention") for n in graph.node)
    assert layout.paged and layout.in_place and layout.block_size == 16 and layout.dims[:2] == ("num_blocks", "block_size")
    assert exported.lowering.value == "paged"
    assert ExportedModel.load(folder / "export").kv_layout == layout  # recorded and read back


def test_pack_lays_rows_out_as_the_graph_takes_them():
    rows = [RowStep([1, 2, 3], 16, [4, 7]), RowStep([9], 0, [2, 5, 6]), RowStep([5, 6], 30, [0, 1], num_logits=2)]
    p = pack(rows, block_size=16, num_blocks=8, max_num_tokens=8, vocab_size=10)
    assert p.input_ids.tolist() == [1, 2, 3, 9, 5, 6]
    assert p.position_ids.tolist() == [16, 17, 18, 0, 30, 31]
    assert p.cumulative_sequence_length.tolist() == [0, 3, 4, 6] and p.cumulative_sequence_length.dtype == np.int32
    assert p.past_seqlens.tolist() == [16, 0, 30] and p.past_seqlens.dtype == np.int32
    assert p.block_table.tolist() == [[4, 7], [2, -1], [0, 1]]  # only the blocks a row reaches
    assert p.logits_indices.tolist() == [2, 3, 4, 5]
    wide = pack(rows[:2], block_size=16, num_blocks=8, max_num_tokens=8, vocab_size=10, table_width=4)
    assert wide.block_table.tolist() == [[4, 7, -1, -1], [2, -1, -1, -1]]


def test_inspect_shows_the_paged_layout(paged_builds):
    from llmc.compiler.inspect import inspect_path

    rows = dict(row for section in inspect_path(paged_builds["gpt2"][0]) for row in section.rows)
    assert "paged: blocks of 16 tokens" in rows["kv layout"] and rows["kv layout"].startswith("[num_blocks, block_size")
    assert rows["block_table"] == "int32[batch, max_blocks]" and rows["logits"] == "float32[num_logits, 256]"
