"""Split-KV (flash-decoding) merged inside one launch (plugins/gpu/split_kv.py), in the one-launch slot kernel
(plugins/gpu/one_launch.py) and both paged paths (plugins/gpu/paged_kernels.py, paged_kernels_aot.py), against
the op's references (`reference_attention`, `reference_paged_attention`) under TRITON_INTERPRET=1.

The split counts are forced above what the kernels would pick at these short contexts. Rows of 1 to 150 keys
over 2, 3 and 8 splits of whole 32-key blocks leave some splits with keys and some empty (8 ways: most), so the
merge meets empty partials, rows no split saw (the spare rows of a tile) and sinks joining a merged softmax.
The interpreter runs the programs one after another, so the tile's last program is the one that merges, and the
counters it leaves must be zero again for the next launch (the cases here share them, as launches do)."""

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined: they run on NumPy here
pytest.importorskip("triton", reason="the kernels need OpenAI Triton (installed by scripts/setup.sh)")

import math  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from helpers import all_pairs  # noqa: E402
from llmc.plugins.gpu import split_kv  # noqa: E402
from llmc.plugins.gpu.configs import decode_splits  # noqa: E402
from llmc.plugins.gpu.split_kv import merge_splits  # noqa: E402
from llmc.plugins.gpu.one_launch import one_launch_attention  # noqa: E402
from test_kernels import FEATURES, _case, _check  # noqa: E402
from test_paged_triton import KERNELS as PAGED, SINKS, check, make_case  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_counters_reset():
    """Every tile's counter is back at zero: the next launch counts from there."""
    assert split_kv._counters, "no split launch ran"
    assert all(int(c.abs().sum()) == 0 for c in split_kv._counters.values())


# every pair of (splits, feature, dtype, GQA ratio); each case ~0.5 s interpreted
@all_pairs(splits=[2, 3, 8], feature=list(FEATURES), dtype=DTYPES, gqa=[(6, 2), (8, 1), (4, 4)])
def test_one_launch_decode_split_matches_the_reference(splits, feature, dtype, gqa):
    sinks, softcap, window, rotary_dim = FEATURES[feature]
    case = _case(3, 1, *gqa, 16, 160, [0, 37, 149], dtype, rotary=True, seed=8, rotary_dim=rotary_dim)
    head_sink = (torch.rand(gqa[0], generator=torch.Generator().manual_seed(9)) * 8 - 3).to(dtype) if sinks else None
    _check(case, 0.3, one_launch_attention, (head_sink, softcap, window), splits=splits)
    assert_counters_reset()


def test_one_launch_prefill_split_matches_the_reference():
    """A prompt over several row tiles, one continuing a cached prefix: every tile's causal keys split 3 ways."""
    case = _case(2, 19, 6, 2, 16, 53, [0, 21], torch.float32, rotary=True, seed=10)
    _check(case, 0.3, one_launch_attention, splits=3)
    assert_counters_reset()


PAGED_OPTIONS = {
    "plain": {},
    "sinks": {"head_sink": SINKS},
    "softcap + window": {"softcap": 2.0, "local_window_size": 40, "scale": 0.3},
    "not causal": {"is_causal": False},
}


@all_pairs(splits=[2, 3, 8], kernel=list(PAGED), options=list(PAGED_OPTIONS), dtype=DTYPES)
def test_paged_split_matches_the_reference(splits, kernel, options, dtype):
    # decode rows at 151 and 71 keys (over shuffled 8-token blocks), an empty row, a 5-token chunk after 40
    case = make_case([1, 0, 5, 1], [150, 3, 40, 70], 6, 2, 16, 8, dtype, rotary_dim=16, seed=11)
    extra = PAGED_OPTIONS[options]
    if "head_sink" in extra:
        extra = {**extra, "head_sink": extra["head_sink"].to(dtype)}
    check(case, PAGED[kernel], splits=splits, **extra)
    assert_counters_reset()


@triton.jit
def _arrivals(part_ptr, lock_ptr, out_ptr, merges_ptr, ACTIVE: tl.constexpr, SPLITS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The merge protocol alone, its splits arriving last split first (the kernels' grids run split 0 first here):
    split s holds row r's partial (max s - r, sum 1, accumulator s + 1); splits from ACTIVE on hold no keys."""
    tile = tl.program_id(0)
    split = SPLITS - 1 - tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m = (split - rows).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32) + (split + 1).to(tl.float32)
    acc, m, l, writes = merge_splits(acc, m, tl.full([BLOCK_M], 1.0, tl.float32), part_ptr, lock_ptr, tile, split,
                                     ACTIVE, d, BLOCK_D, SPLITS, BLOCK_M)
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(out_ptr + (tile * BLOCK_M + rows)[:, None] * BLOCK_D + d[None, :], out, mask=writes)
    tl.atomic_add(merges_ptr + tile, tl.max(tl.max(writes.to(tl.int32), 1), 0))


def test_exactly_one_program_per_tile_merges_and_it_sees_every_split():
    """Whatever order the splits finish in, one program per tile writes, after every split with keys stored
    its partial (the kernels' tests cannot see a second writer: under the interpreter the last one wins)."""
    tiles, splits, active, block_m, block_d = 3, 4, 3, 16, 16
    part = torch.full((tiles * splits * block_m * (block_d + 2),), float("nan"))  # unwritten reads as NaN
    counters = torch.zeros(tiles, dtype=torch.int32)
    out = torch.full((tiles, block_m, block_d), float("nan"))
    merges = torch.zeros(tiles, dtype=torch.int32)
    _arrivals[(tiles, splits)](part, counters, out, merges, active, splits, block_m, block_d)
    # 2^max x sum of each split's partial, over row r's 2^-r: the maxima are in base 2, as the kernels keep them
    weights = [2.0 ** s for s in range(active)]  # (kernels.logits)
    expected = sum((s + 1) * w for s, w in enumerate(weights)) / sum(weights)
    torch.testing.assert_close(out, torch.full_like(out, expected))
    assert merges.tolist() == [1] * tiles and counters.tolist() == [0] * tiles


def test_split_count_fills_the_gpu_from_shapes():
    """One-launch and paged kernels: about 2 programs per SM, at least 256 keys a split, a power of two."""
    assert decode_splits(32, 8, 4096) == 1  # 256 programs already
    assert decode_splits(8, 8, 32768) == 4  # 64 tiles x 4 = 256
    assert decode_splits(1, 8, 32768) == 32  # one row: 8 tiles x 32
    assert decode_splits(1, 8, 1000) == 2  # 3 slices of 256 keys at most, rounded down to a power of two
    assert decode_splits(1, 8, 1 << 20, num_sms=108) == 16  # an A100: 216 // 8 = 27
    assert decode_splits(1, 8, 200) == 1  # under one slice



def test_a_paged_decode_counts_only_the_tiles_holding_queries():
    """attention_grid gives each row a spare tile past the packed ones (any split of the tokens fits), which
    finishes at once: counted, 8 decode rows took 2 splits where 4 ran 1.85x faster on an H200."""
    from llmc.plugins.gpu.paged_kernels import attention_grid, busy_tiles

    assert attention_grid(8, 8, 32, 8)[0] == 10 and busy_tiles(8, 8, 32, 8) == 8  # a tile a decode row
    assert decode_splits(busy_tiles(8, 8, 32, 8), 8, 32768) == 4 != decode_splits(10, 8, 32768)
    assert decode_splits(busy_tiles(1, 1, 32, 8), 8, 131072) == 32
    assert busy_tiles(300, 2, 32, 8) == 75  # a prefill chunk: its (token, head) pairs in tiles of 16


@pytest.mark.parametrize("tiles, keys, slots, want", [
    (8, 32768, 264, 16),  # one row, 8 KV heads: the node's 16 (264 // 8 = 33 would allow more)
    (64, 32768, 264, 4),  # 8 rows: 264 // 64
    (264, 32768, 264, 1),  # the tiles already fill the partials: no splits
    (1280, 4096, 264, 1),  # a prefill's many row tiles
    (2, 700, 264, 2),  # 700 keys: two slices of 256 at most
    (2, 100, 264, 1),  # under one slice
])
def test_a_plugin_launch_takes_the_splits_its_tiles_and_workspace_allow(tiles, keys, slots, want):
    """The plugin's grid's third axis (a shape expression in TensorRT, ints here): of the node's 16 key splits, as
    many as the workspace's partials hold for the launch's tiles, in slices of 256 keys at least."""
    assert split_kv.plugin_splits(tiles, keys, 16, slots) == want
    assert split_kv.plugin_splits(tiles, keys, 1, slots) == 1  # a node without splits


def _guarded(monkeypatch, module, slots, head_dim, block_m=16):
    """Make `module`'s split_workspace hand out a NaN-filled workspace of exactly `slots` partials followed by a
    guard of NaNs; returns (workspace, counters) as the kernel gets them."""
    size = split_kv.workspace_floats(slots, 1, block_m, head_dim)
    held = {"part": torch.full((size + 4096,), float("nan")), "counters": torch.zeros(slots, dtype=torch.int32)}

    def workspace(device, tiles, splits, m, d):
        assert (tiles, splits, m, d) == (slots, 1, block_m, head_dim)  # a plugin's: `slots` partials, whatever the grid
        return held["part"], held["counters"]

    monkeypatch.setattr(module, "split_workspace", workspace)
    return held, size


@pytest.mark.parametrize("slots, splits_taken", [(24, 4), (6, 1)])
def test_plugin_launches_match_the_reference_within_their_workspace(monkeypatch, slots, splits_taken):
    """The slot kernel as the plugin launches it (up to 8 splits over a fixed workspace, the grid sized by
    plugin_splits): the op's reference, nothing written past the workspace's `slots` partials, counters back at
    zero. With room for 4 splits of the 6 tiles' keys, partials are written; with room for one, the workspace is
    untouched."""
    from llmc.plugins.gpu import one_launch

    held, size = _guarded(monkeypatch, one_launch, slots, 16)
    case = _case(3, 1, 6, 2, 16, 1100, [0, 700, 1090], torch.float32, rotary=True, seed=12)
    _check(case, 0.3, one_launch_attention, splits=8, slots=slots)
    part = held["part"]
    assert torch.isnan(part[size:]).all(), "written past the workspace"
    assert (not torch.isnan(part[:size]).all()) == (splits_taken > 1)
    assert int(held["counters"].abs().sum()) == 0


def test_paged_plugin_launch_matches_the_reference_within_its_workspace(monkeypatch):
    """The paged one-launch kernel as the plugin launches it: 8 splits in the grid, a workspace of 40 partials for
    its 2 + 4 (rows) = 6 row tiles x 2 KV heads, so 3 splits taken (40 // 12) over a 1,088-key reach."""
    import functools

    from llmc.plugins.gpu import paged_kernels_aot

    held, size = _guarded(monkeypatch, paged_kernels_aot, 40, 16)
    case = make_case([1, 0, 5, 1], [600, 3, 40, 900], 6, 2, 16, 64, torch.float32, rotary_dim=16, seed=13)
    check(case, functools.partial(PAGED["one launch"], slots=40), splits=8)
    part = held["part"]
    assert torch.isnan(part[size:]).all() and not torch.isnan(part[:size]).all()
    assert int(held["counters"].abs().sum()) == 0
