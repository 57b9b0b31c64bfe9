"""The OpenAI Triton paged attention kernels (plugins/gpu/paged_kernels.py: cache write + attention;
plugins/gpu/paged_kernels_aot.py: the one-launch form the TensorRT plugin runs) against the contract's
reference (plugins/op/attention.py `reference_paged_attention`): on CPU under TRITON_INTERPRET=1 over
packed rows at different positions, compiled to PTX for sm_80/sm_90 without a GPU, and on a GPU
where one exists (marked `cuda`)."""

import math
import os
import random
import subprocess
import sys

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: they run on NumPy here
pytest.importorskip("triton", reason="the kernels need OpenAI Triton (installed by scripts/setup.sh)")

import torch  # noqa: E402

from helpers import PLUGIN_CASES, all_pairs  # noqa: E402
from llmc.plugins.op.attention import reference_paged_attention  # noqa: E402
from llmc.plugins.gpu.paged_kernels import BLOCK_M, attention_grid, paged_attention  # noqa: E402
from llmc.plugins.gpu.paged_kernels_aot import paged_attention_one_launch  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SINKS = torch.tensor([-3.0, 5.0, 0.5, 2.0, -1.0, 4.0])  # one per head of the 6-head cases
KERNELS = {"write + attention": paged_attention, "one launch": paged_attention_one_launch}


def make_case(lens, pasts, heads, kv_heads, head_size, block_size, dtype, *, rotary_dim=0, seed=0, holes=()):
    """Packed rows (row b: lens[b] new tokens after pasts[b] cached) over a pool of stale random blocks,
    each row's blocks shuffled through the pool, tables padded with -1 and one out-of-range entry;
    `holes`: (row, table index, entry) for entries that map no block (-1, or past the pool's end)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil((p + n) / block_size) for n, p in zip(lens, pasts)]
    num_blocks, width = sum(need) + 2, max(need) + 2
    pool = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    for b, count in enumerate(need):
        table[b, :count] = torch.tensor([pool.pop() for _ in range(count)], dtype=torch.int32)
    table[0, -1] = num_blocks + 5  # out of range: unmapped
    for row, index, entry in holes:
        table[row, index] = entry
    tokens = sum(lens)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    cos = sin = None
    if rotary_dim:
        angles = torch.rand(max(p + n for n, p in zip(lens, pasts)) + 3, rotary_dim // 2, generator=g) * 6
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cache_shape = (num_blocks, block_size, kv_heads, head_size)
    return dict(query=rand(tokens, heads * head_size), key=rand(tokens, kv_heads * head_size),
                value=rand(tokens, kv_heads * head_size), key_cache=rand(*cache_shape), value_cache=rand(*cache_shape),
                cumulative_sequence_length=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
                past_seqlens=torch.tensor(pasts, dtype=torch.int32), block_table=table, num_heads=heads,
                kv_num_heads=kv_heads, cos_cache=cos, sin_cache=sin)


def check(case, kernel, tol=None, splits=None, **options):
    """The kernel's output and caches (written in place, the rest kept) equal the reference's (run on CPU);
    `splits`: the kernel's key splits (default: its own choice)."""
    fresh = {n: v.clone() if n.endswith("_cache") and v is not None else v for n, v in case.items()}
    ref = reference_paged_attention(**{n: v.cpu().clone() if isinstance(v, torch.Tensor) else v
                                       for n, v in case.items()}, **options)
    out, key_cache, value_cache = kernel(**fresh, **options, **({"splits": splits} if splits else {}))
    assert key_cache is fresh["key_cache"] and value_cache is fresh["value_cache"]  # in place
    tol = tol or TOLERANCE[case["query"].dtype]
    torch.testing.assert_close(out.float().cpu(), ref[0].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(key_cache.float().cpu(), ref[1].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(value_cache.float().cpu(), ref[2].float(), atol=0, rtol=0)


# each interpreted case costs seconds: every pair of values (all_pairs), not the product; GQA ratios 1, 3, 8
@all_pairs(dtype=[torch.float32, torch.float16, torch.bfloat16], gqa=[(4, 4), (6, 2), (8, 1)], kernel=list(KERNELS))
def test_mixed_rows_match_the_reference(dtype, gqa, kernel):
    # a decode row straddling a block boundary, an empty row, a chunk with a past across blocks, a prompt
    # of many tokens after a past (chunked prefill / verification), rotary in the op
    case = make_case([1, 0, 5, 21], [12, 3, 6, 9], *gqa, 16, 4, dtype, rotary_dim=16)
    check(case, KERNELS[kernel])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("options, rotary_dim", [
    ({}, 0),  # no rotary: keys arrive rotated (or the model has none)
    ({"rotary_interleaved": True}, 16),
    ({}, 8),  # partial rotary: half the channels rotate, the rest pass through
    ({"softcap": 2.5, "scale": 0.4}, 16),
    ({"local_window_size": 6}, 16),
    ({"is_causal": False}, 16),
    ({"head_sink": SINKS}, 16),  # attention sinks: from no share of a softmax to most of it
    ({"head_sink": SINKS, "softcap": 2.0, "local_window_size": 6, "scale": 0.3}, 8),  # all, with partial rotary
])
def test_contract_options_match_the_reference(kernel, options, rotary_dim):
    case = make_case([3, 1, 17], [5, 30, 2], 6, 2, 16, 8, torch.float32, rotary_dim=rotary_dim, seed=1)
    check(case, KERNELS[kernel], **options)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_all_features_in_half_precision(dtype, kernel):
    case = make_case([3, 1, 17], [5, 30, 2], 6, 2, 16, 8, dtype, rotary_dim=8, seed=6)
    check(case, KERNELS[kernel], head_sink=SINKS.to(dtype), softcap=2.0, local_window_size=6, scale=0.3)


@pytest.mark.parametrize("kernel", KERNELS)
def test_unmapped_blocks_are_neither_read_nor_written(kernel):
    # row 0 lost a cached block (-1), row 1 one its new tokens would go to (an index past the pool)
    case = make_case([2, 6], [9, 5], 4, 2, 16, 4, torch.float32, rotary_dim=16, seed=2, holes=[(0, 1, -1), (1, 2, 99)])
    check(case, KERNELS[kernel])


@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_qkv_matches_the_reference(kernel):
    case = make_case([4, 1], [0, 7], 6, 2, 16, 4, torch.float16, rotary_dim=16, seed=3)
    packed = torch.cat([case["query"], case["key"], case["value"]], dim=1)
    check({**case, "query": packed, "key": None, "value": None}, KERNELS[kernel])


def test_slot_mapping_writes_where_it_says():
    case = make_case([3, 2], [4, 0], 4, 2, 16, 4, torch.float32, rotary_dim=16, seed=4)
    free = case["key_cache"].shape[0] - 1  # slots outside the rows' tables, and one write skipped
    slots = torch.tensor([free * 4, free * 4 + 1, -1, 3, free * 4 + 2], dtype=torch.int64)
    check(case, paged_attention, slot_mapping=slots)
    with pytest.raises(ValueError, match="no slot_mapping"):
        paged_attention_one_launch(**case, slot_mapping=slots)


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_match_the_reference(seed):
    rnd = random.Random(seed)
    kv_heads, group = rnd.choice([1, 2, 3]), rnd.choice([1, 3, 8])
    rows = rnd.randint(1, 4)
    lens = [rnd.choice([0, 1, 1, rnd.randint(2, 24)]) for _ in range(rows)]
    lens[rnd.randrange(rows)] = max(lens[0], 1)
    case = make_case(lens, [rnd.randint(0, 40) for _ in range(rows)], kv_heads * group, kv_heads,
                     rnd.choice([16, 24, 32]), rnd.choice([1, 3, 5, 16]), torch.float32,
                     rotary_dim=rnd.choice([0, 16]), seed=seed)
    for kernel in KERNELS.values():
        check(case, kernel)


def test_decode_steps_after_a_prefill_equal_one_prefill():
    case = make_case([9], [0], 4, 2, 16, 4, torch.float32, rotary_dim=16, seed=5)
    whole = paged_attention(**{**case, "key_cache": case["key_cache"].clone(),
                               "value_cache": case["value_cache"].clone()})[0]
    split = {**case, "cumulative_sequence_length": torch.tensor([0, 1], dtype=torch.int32)}
    for name in ("query", "key", "value"):
        split[name] = case[name][:1]
    outputs = []
    for i in range(9):
        step = {**split, **{n: case[n][i:i + 1] for n in ("query", "key", "value")},
                "past_seqlens": torch.tensor([i], dtype=torch.int32)}
        outputs.append(paged_attention_one_launch(**step)[0])
    torch.testing.assert_close(torch.cat(outputs), whole, atol=1e-5, rtol=1e-5)


def test_grid_covers_every_row_however_the_tokens_split():
    rnd = random.Random(0)
    for _ in range(200):
        heads, kv_heads = rnd.choice([(4, 4), (6, 2), (8, 1), (32, 8)])
        lens = [rnd.choice([0, 1, rnd.randint(1, 70)]) for _ in range(rnd.randint(1, 9))]
        group, starts = heads // kv_heads, [0, *torch.tensor(lens).cumsum(0).tolist()]
        grid_x, grid_y, splits = attention_grid(sum(lens), len(lens), heads, kv_heads)
        assert grid_y == kv_heads and splits == 1
        owned = [p for b, n in enumerate(lens)
                 for p in range(starts[b] * group // BLOCK_M + b, starts[b] * group // BLOCK_M + b
                                + math.ceil(n * group / BLOCK_M))]
        assert len(set(owned)) == len(owned) and all(p < grid_x for p in owned)


def _compiled(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python with the kernels compiled, not interpreted."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.parametrize("capability", [80, 90])
def test_paged_kernels_compile_to_ptx_without_a_gpu(capability):
    # both float types on each target, rotary over every channel (sm_80) or none (sm_90), and partial with the
    # other features
    plain, featured = ("(torch.float16, 64, {})", "torch.bfloat16") if capability == 80 else (
        "(torch.bfloat16, 0, {})", "torch.float16")
    code = (
        "import torch\n"
        "from llmc.plugins.gpu.paged_kernels_aot import compile_paged_ptx\n"
        "from llmc.plugins.gpu.ptx import ptx_header\n"
        f"for dtype, rotary_dim, features in ({plain}, ({featured}, 32, dict(softcap=30.0, window=128, sinks=True))):\n"
        f"    ptx = compile_paged_ptx(9, 3, 64, dtype, {capability}, rotary_dim=rotary_dim, **features)\n"
        "    for name, text in ptx.items():\n"
        f"        assert '.target sm_{capability}' in text and '.entry _paged_' in text, name\n"
        "        assert ptx_header(text) == ('8.0', 'sm_" f"{capability}'), (name, ptx_header(text))\n"
        "print('ok', sorted(ptx))\n"
    )
    assert ("ok ['paged_attention', 'paged_attention_one_launch', 'paged_attention_one_launch_split', "
            "'paged_attention_split', 'paged_write']") in _compiled(code).stdout


def test_paged_plugin_kernel_has_tensorrt_aot_calling_convention():
    """13 input pointers (head_sink's too, read or not, and the split workspace and counters), 4 int32 extras, 5
    output pointers and nothing after, with and without rotary (without: with sinks, softcap and key splits) for
    sm_80 and for sm_90, and for each float type (helpers.PLUGIN_CASES: each type compiled once)."""
    code = (
        "from llmc.plugins.gpu.kernels_aot import entry_params\n"
        "from llmc.plugins.gpu.paged_kernels_aot import paged_plugin_kernel\n"
        f"for cap, dtype, rotary in {PLUGIN_CASES!r}:\n"
        "    rotary_dim = 128 if rotary else 0\n"
        "    k = paged_plugin_kernel(9, 3, 128, 0.125, dtype, cap, rotary_dim=rotary_dim, sinks=not rotary,\n"
        "                            softcap=50.0 * (not rotary), splits=1 if rotary else 16, slots=0 if rotary else 264)\n"
        "    types = [t for t, _ in entry_params(k.ptx, k.name)]\n"
        "    assert types == ['.u64'] * 13 + ['.u32'] * 4 + ['.u64'] * 5, types\n"
        "    assert f'.target sm_{cap}' in k.ptx and k.num_warps > 0 and 0 < k.shared_mem <= 48 * 1024\n"
        "    print('ok', cap, dtype, rotary)\n"
    )
    assert sum(line.startswith("ok ") for line in _compiled(code).stdout.splitlines()) == len(PLUGIN_CASES)


@pytest.mark.cuda
def test_paged_kernels_on_the_gpu_match_the_reference():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here (the paged kernels are checked under the interpreter and compiled to PTX)")
    code = (  # a fresh process: this module put the kernels in interpreter mode
        "import functools, torch\n"
        "from test_paged_triton import make_case, check, KERNELS\n"
        "for dtype in (torch.float16, torch.bfloat16):\n"
        "    case = make_case([1, 300, 1, 37], [4000, 700, 17, 0], 32, 8, 128, 16, dtype, rotary_dim=128)\n"
        "    case = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.items()}\n"
        "    for kernel in KERNELS.values():\n"
        "        for splits in (None, 1, 8):  # their own choice (1 here: 89 tiles x 8 KV heads), none, 8\n"
        "            check(case, kernel, tol=2e-2, splits=splits)\n"
        "    decode = make_case([1], [4000], 32, 8, 128, 16, dtype, rotary_dim=128)  # one row: 8 tiles\n"
        "    decode = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in decode.items()}\n"
        "    check(decode, functools.partial(KERNELS['one launch'], slots=264), tol=2e-2, splits=32)  # the plugin's\n"
        "print('ok')\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))  # test_paged_triton, and the helpers module above it
    env_code = f"import sys; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]\n" + code
    assert "ok" in _compiled(env_code, timeout=600).stdout
