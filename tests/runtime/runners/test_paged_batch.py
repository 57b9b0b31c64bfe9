"""A paged step's rows packed into the graph's inputs (runtime/runners/paged.py), and the KV layout's
LongRoPE switch (runtime/layout.py), without a graph; the graph's own steps are tests/compiler/graph/test_paged_graph.py."""

import numpy as np
import pytest

from llmc.runtime.layout import KVLayout
from llmc.runtime.runners.paged import RowStep, pack


def test_pack_lays_rows_out_as_the_graph_takes_them():
    rows = [RowStep([1, 2, 3], 16, [4, 7]), RowStep([9], 0, [2, 5, 6]), RowStep([5, 6], 30, [0, 1], num_logits=2)]
    p = pack(rows, block_size=16, num_blocks=8, max_num_tokens=8, vocab_size=10)
    assert p.input_ids.tolist() == [1, 2, 3, 9, 5, 6]
    assert p.position_ids.tolist() == [16, 17, 18, 0, 30, 31]
    assert p.cumulative_sequence_length.tolist() == [0, 3, 4, 6] and p.cumulative_sequence_length.dtype == np.int32
    assert p.past_seqlens.tolist() == [16, 0, 30] and p.past_seqlens.dtype == np.int32
    assert p.block_table.tolist() == [[4, 7], [2, -1], [0, 1]]  # only the blocks a row reaches
    assert p.logits_indices.tolist() == [2, 3, 4, 5]


def test_a_layout_names_its_longrope_switch_only_when_it_has_one():
    """Every other model's layout (and so its manifest) reads as before the field existed."""
    layout = KVLayout.paged_layout(2, 2, 16)
    assert "longrope_switch" not in layout.model_dump_json() and layout.step_inputs == ()
    long = layout.model_copy(update={"longrope_switch": 4096})
    assert KVLayout.model_validate_json(long.model_dump_json()) == long and long.step_inputs == ("sequence_lengths",)
    with pytest.raises(ValueError, match="kv_layout.longrope_switch must be at least 1"):
        KVLayout.model_validate({**layout.model_dump(), "longrope_switch": 0})
