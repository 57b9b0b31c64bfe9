"""The slot cache's OpenAI Triton attention kernel (plugins/gpu/one_launch.py, the whole op in one launch) against
the op's reference semantics: on CPU under TRITON_INTERPRET=1, compiled to PTX for sm_80/sm_90 without a GPU, and
on a GPU where one exists (marked `cuda`)."""

import os
import subprocess
import sys

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined: they run on NumPy here
pytest.importorskip("triton", reason="the kernels need OpenAI Triton (installed by scripts/setup.sh)")

import torch  # noqa: E402

from helpers import PLUGIN_CASES, all_pairs  # noqa: E402
from llmc.plugins.op.attention import reference_attention  # noqa: E402
from llmc.plugins.gpu.kernels_aot import PluginKernel, entry_params, one_launch_attention, trim_params  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _case(batch, new, heads, kv_heads, head_dim, capacity, positions, dtype, rotary, device="cpu", seed=0,
          rotary_dim=None):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    q, k, v = rand(batch, new, heads, head_dim), rand(batch, new, kv_heads, head_dim), rand(batch, new, kv_heads, head_dim)
    kc, vc = rand(batch, kv_heads, capacity, head_dim), rand(batch, kv_heads, capacity, head_dim)  # stale data
    cos = sin = None
    if rotary:
        angles = torch.rand(capacity, (rotary_dim or head_dim) // 2, generator=g) * 6
        cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    return q, k, v, kc, vc, torch.tensor(positions, dtype=torch.int64, device=device), cos, sin


KERNELS = {"one launch": one_launch_attention}
# each interpreted case costs seconds: the sweeps over these take every pair of values (all_pairs), not the product
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GQA = [(4, 4), (6, 2), (8, 1)]  # (heads, kv_heads): GQA ratios 1, 3, 8


def _compiled(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python with the kernels compiled, not interpreted (this module set
    TRITON_INTERPRET=1 before they were defined); fails the test on a non-zero exit."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _check(case, scale, kernel=one_launch_attention, features=(), **kwargs):
    """features: (head_sink, softcap, local_window_size), the op's attention features."""
    q, k, v, kc, vc, pos, cos, sin = case
    ref_out, ref_k, ref_v = reference_attention(q, k, v, kc, vc, pos, scale, cos, sin, *features)
    kc2, vc2 = kc.clone(), vc.clone()
    out = kernel(q, k, v, kc2, vc2, pos, scale, cos, sin, *features, **kwargs)
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(kc2.float(), ref_k.float(), atol=tol, rtol=tol)  # written in place, the rest kept
    torch.testing.assert_close(vc2.float(), ref_v.float(), atol=0, rtol=0)


@all_pairs(dtype=DTYPES, gqa=GQA, rotary=[False, True], kernel=list(KERNELS))
def test_prefill_matches_the_reference(dtype, gqa, rotary, kernel):
    # odd prompt length, rows at different positions (one continuing a prefix), capacity not a block multiple
    case = _case(2, 19, *gqa, 24, 53, [0, 21], dtype, rotary)
    _check(case, 24 ** -0.5, KERNELS[kernel])


@all_pairs(dtype=DTYPES, gqa=GQA, kernel=list(KERNELS))
def test_decode_matches_the_reference_for_rows_of_mixed_lengths(dtype, gqa, kernel):
    case = _case(3, 1, *gqa, 32, 150, [0, 37, 149], dtype, rotary=True, seed=1)
    _check(case, 32 ** -0.5, KERNELS[kernel])


FEATURES = {  # (sinks, softcap, window, rotary_dim of head_dim 16)
    "sinks": (True, 0.0, -1, None),
    "softcap": (False, 1.5, -1, None),
    "window": (False, 0.0, 7, None),
    "partial rotary": (False, 0.0, -1, 8),
    "all": (True, 2.0, 7, 8),
}


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("new, positions", [(13, [0, 21]), (1, [3, 40, 90])])  # prefill; decode
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_features_match_the_reference(feature, new, positions, kernel):
    """Sinks (spread over [-3, 5], from no share to most of a softmax), softcap, a window of 7 shorter than the
    prompt and than the decode rows (decode over 4 key splits: the early ones fall outside it),
    partial rotary, all together; GQA 3:1, rows at different positions."""
    sinks, softcap, window, rotary_dim = FEATURES[feature]
    case = _case(len(positions), new, 6, 2, 16, 100, positions, torch.float32, rotary=True, seed=4,
                 rotary_dim=rotary_dim)
    head_sink = torch.rand(6, generator=torch.Generator().manual_seed(5)) * 8 - 3 if sinks else None
    _check(case, 0.3, KERNELS[kernel], (head_sink, softcap, window), splits=4 if new == 1 else None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_all_features_in_half_precision(dtype, kernel):
    """Every feature at once in fp16/bf16 (sinks read as fp32 from a half-precision tensor), prefill and decode."""
    sinks, softcap, window, rotary_dim = FEATURES["all"]
    for new, positions in ((9, [0, 21]), (1, [3, 40])):
        case = _case(len(positions), new, 6, 2, 16, 64, positions, dtype, rotary=True, seed=6, rotary_dim=rotary_dim)
        head_sink = (torch.rand(6, generator=torch.Generator().manual_seed(7)) * 8 - 3).to(dtype)
        _check(case, 0.3, KERNELS[kernel], (head_sink, softcap, window))


@pytest.mark.parametrize("splits", [1, 2, 8])
def test_decode_gives_the_same_answer_however_the_keys_are_split(splits):
    case = _case(2, 1, 6, 3, 16, 200, [5, 190], torch.float32, rotary=False, seed=2)
    _check(case, 0.3, splits=splits)


@pytest.mark.parametrize("kernel", KERNELS)
def test_decode_steps_after_prefill_equal_one_prefill(kernel):
    attention = KERNELS[kernel]
    q, k, v, kc, vc, pos, cos, sin = _case(1, 9, 4, 2, 16, 32, [0], torch.float32, rotary=True, seed=3)
    whole = attention(q, k, v, kc.clone(), vc.clone(), pos, 0.25, cos, sin)
    kc2, vc2 = kc.clone(), vc.clone()
    attention(q[:, :5], k[:, :5], v[:, :5], kc2, vc2, pos, 0.25, cos, sin)
    steps = [attention(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], kc2, vc2, pos + i, 0.25, cos, sin)
             for i in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), whole[:, 5:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("capability", [80, 90])
def test_kernels_compile_to_ptx_without_a_gpu(capability):
    # each float type on each target, with and without the features, each type in one of the two forms per target
    types = ("torch.float16", "torch.bfloat16")[::1 if capability == 80 else -1]
    code = (
        "import torch\n"
        "from llmc.plugins.gpu.kernels_aot import compile_ptx\n"
        "from llmc.plugins.gpu.ptx import ptx_header\n"
        f"for dtype, features in (({types[0]}, {{}}),\n"
        f"                        ({types[1]}, dict(rotary_dim=32, softcap=50.0, window=128, sinks=True))):\n"
        f"    ptx = compile_ptx(9, 3, 64, dtype, {capability}, rotary=True, **features)\n"
        "    for name, text in ptx.items():\n"
        "        entry = name.removesuffix('_split')  # the split form: the one-launch kernel with SPLITS > 1\n"
        f"        assert '.target sm_{capability}' in text and f'.entry _{{entry}}' in text, name\n"
        "        assert ptx_header(text) == ('8.0', 'sm_" f"{capability}'), (name, ptx_header(text))\n"
        "print('ok', sorted(ptx))\n"
    )
    run = _compiled(code)
    assert "ok ['attention_one_launch', 'attention_one_launch_split']" in run.stdout


def test_plugin_cases_cover_both_forms_on_both_targets_and_every_float_type():
    assert {(cap, rotary) for cap, _, rotary in PLUGIN_CASES} == {(80, True), (80, False), (90, True), (90, False)}
    assert {dtype for _, dtype, _ in PLUGIN_CASES} == {"fp16", "bf16", "fp32"}


def test_plugin_kernel_has_tensorrt_aot_calling_convention():
    """11 input pointers (head_sink's too, read or not, and the split workspace and counters), 2 int32 extras, 5
    output pointers (the split buffers aliased last), nothing after (TensorRT passes exactly these), with and
    without rotary (partial; with softcap, else with sinks, a window and key splits) for sm_80 and for sm_90, and
    for each float type (helpers.PLUGIN_CASES: each type compiled once, not on both targets in both forms)."""
    code = (
        "from llmc.plugins.gpu.kernels_aot import entry_params, plugin_kernel\n"
        f"for cap, dtype, rotary in {PLUGIN_CASES!r}:  # fp32 D=128: configs.py's one stage\n"
        "    k = plugin_kernel(9, 3, 128, 0.125, dtype, cap, rotary=rotary, rotary_dim=64, sinks=not rotary,\n"
        "                      softcap=50.0 * rotary, window=-1 if rotary else 256,\n"
        "                      splits=1 if rotary else 16, slots=0 if rotary else 264)\n"
        "    types = [t for t, _ in entry_params(k.ptx, k.name)]\n"
        "    assert types == ['.u64'] * 11 + ['.u32'] * 2 + ['.u64'] * 5, types\n"
        "    assert f'.target sm_{cap}' in k.ptx and k.num_warps > 0 and 0 < k.shared_mem <= 48 * 1024\n"
        "    print('ok', cap, dtype, rotary)\n"
    )
    assert sum(line.startswith("ok ") for line in _compiled(code).stdout.splitlines()) == len(PLUGIN_CASES)


_PTX = """.visible .entry kern(
\t.param .u64 .ptr .global .align 1 kern_param_0,
\t.param .u32 kern_param_1,
\t.param .u64 .ptr .global .align 1 kern_param_2,
\t.param .u64 .ptr .global .align 1 kern_param_3
)
{
\tld.param.u64 %rd1, [kern_param_0];
\tld.param.u32 %r1, [kern_param_1];
\tld.param.u64 %rd2, [kern_param_2];
}
"""


def test_trim_params_drops_only_unused_trailing_parameters():
    trimmed = trim_params(_PTX, "kern", 3)
    assert [name for _, name in entry_params(trimmed, "kern")] == ["kern_param_0", "kern_param_1", "kern_param_2"]
    assert "kern_param_3" not in trimmed and trimmed.count("ld.param") == 3
    with pytest.raises(ValueError, match="reads its parameter kern_param_2"):
        trim_params(_PTX, "kern", 2)
    with pytest.raises(ValueError, match="no .entry other"):
        trim_params(_PTX, "other", 2)


def test_plugin_grid_covers_every_row_of_every_kv_group():
    kernel = PluginKernel("k", "", num_warps=4, shared_mem=0, block_m=16, splits=8, slots=264)
    # key splits: as many as 264 partials hold for the tiles, up to 8 (1 x 256, 57 x 3 tiles: none; 1 x 20: 8)
    for (tokens, batch, heads, kv_heads), splits in zip(((1, 32, 32, 8), (300, 1, 9, 3), (7, 5, 4, 4)), (1, 1, 8)):
        grid_x, grid_y, grid_z = kernel.grid(tokens, batch, heads, kv_heads, 32768)
        assert grid_y == batch * kv_heads and grid_z == splits
        assert (grid_x - 1) * 16 < tokens * (heads // kv_heads) <= grid_x * 16


@pytest.mark.cuda
def test_kernels_on_the_gpu_match_the_reference():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here (the kernels are checked under the interpreter and compiled to PTX instead)")
    code = (  # a fresh process: this module put the kernels in interpreter mode
        "import torch\n"
        "from llmc.plugins.op.attention import reference_attention\n"
        "from llmc.plugins.gpu.kernels_aot import one_launch_attention\n"
        "torch.manual_seed(0)\n"
        "for dtype in (torch.float16, torch.bfloat16):\n"
        "    for new, pos in ((300, [0, 700]), (1, [4095, 17])):\n"
        "        q = torch.randn(2, new, 32, 128, device='cuda', dtype=dtype)\n"
        "        k, v = (torch.randn(2, new, 8, 128, device='cuda', dtype=dtype) for _ in range(2))\n"
        "        kc, vc = (torch.randn(2, 8, 4096, 128, device='cuda', dtype=dtype) for _ in range(2))\n"
        "        p = torch.tensor(pos, device='cuda')\n"
        "        ref = reference_attention(q, k, v, kc, vc, p, 128 ** -0.5)[0]\n"
        "        for kernel, splits in ((one_launch_attention, {}),  # decode: 16 splits\n"
        "                               (one_launch_attention, {'splits': 1}),\n"
        "                               (one_launch_attention, {'splits': 5}),\n"
        "                               (one_launch_attention, {'splits': 16, 'slots': 264})):  # the plugin's\n"
        "            out = kernel(q, k, v, kc.clone(), vc.clone(), p, 128 ** -0.5, **splits)\n"
        "            torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)\n"
        "print('ok')\n"
    )
    assert "ok" in _compiled(code, timeout=600).stdout
