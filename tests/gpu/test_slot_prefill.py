"""The slot cache's prefill kernel (plugins/gpu/slot_prefill.py), the TensorRT plugin's second tactic, against the
op's reference (`reference_attention`) under TRITON_INTERPRET=1: prompts of several tiles at rows with and without
a cached prefix (so both key parts and the diagonal meet), every attention feature, GQA ratios, the plugin's tile
sizes, fp8 caches; and compiled ahead of time for the plugin: within its shared memory, in its calling convention,
for sm_80 and sm_90 (the latter as sm_80's PTX: no `wgmma`)."""

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined: they run on NumPy here
pytest.importorskip("triton", reason="the kernels need OpenAI Triton (installed by scripts/setup.sh)")

import torch  # noqa: E402

from helpers import all_pairs  # noqa: E402
from llmc.plugins.gpu.configs import KernelConfig  # noqa: E402
from llmc.plugins.gpu.slot_prefill import PLUGIN_PREFILL_CONFIGS, slot_prefill  # noqa: E402
from test_fp8_kv import check_slot  # noqa: E402
from test_kernels import FEATURES, _case, _check, _compiled  # noqa: E402

CONFIGS = {f"{c.block_m}x{c.block_n}": c for c in PLUGIN_PREFILL_CONFIGS[1:]}  # 64 x 32 (1 stage), 32 x 32, 16 x 32


def _features(feature, dtype, heads):
    sinks, softcap, window, rotary_dim = FEATURES[feature]
    head_sink = (torch.rand(heads, generator=torch.Generator().manual_seed(9)) * 8 - 3).to(dtype) if sinks else None
    return (head_sink, softcap, window), rotary_dim


# every pair of (feature, dtype, GQA ratio, tiles); ~1-2 s a case interpreted
@all_pairs(feature=list(FEATURES), dtype=[torch.float32, torch.float16, torch.bfloat16],
           gqa=[(6, 2), (8, 1), (4, 4)], config=list(CONFIGS))
def test_prefill_matches_the_reference(feature, dtype, gqa, config):
    # 70 new tokens (several tiles, a partial last one) on a fresh row and after 37 cached ones
    features, rotary_dim = _features(feature, dtype, gqa[0])
    case = _case(2, 70, *gqa, 16, 160, [0, 37], dtype, rotary=True, seed=5, rotary_dim=rotary_dim)
    _check(case, 0.3, slot_prefill, features, config=CONFIGS[config])


def test_a_chunk_after_a_long_prefix_with_a_window_shorter_than_it():
    """100 new tokens after 1,000 cached: the cached part in whole blocks, a window of 40 that starts inside the
    new tokens for the later tiles and inside the cache for the first."""
    case = _case(1, 100, 4, 2, 16, 1200, [1000], torch.float32, rotary=True, seed=6)
    _check(case, 0.25, slot_prefill, (None, 0.0, 40))


def test_decode_rows_too():
    """One token a row (the decode profile may time this tactic too): rows at 0, 37 and 149 cached tokens."""
    case = _case(3, 1, 8, 2, 32, 150, [0, 37, 149], torch.float16, rotary=True, seed=1)
    _check(case, 32 ** -0.5, slot_prefill, config=CONFIGS["16x32"])


@pytest.mark.parametrize("feature", ["all", "sinks"])
def test_prefill_over_an_fp8_cache_writes_the_references_bytes(feature):
    features, rotary_dim = _features(feature, torch.float16, 6)
    case = _case(2, 40, 6, 2, 16, 96, [0, 21], torch.float16, rotary=True, seed=7, rotary_dim=rotary_dim)
    check_slot(case, 0.3, features, kernel=slot_prefill)


def test_the_plugin_prefill_kernel_fits_a_plugin_launch_in_its_calling_convention():
    """Compiled for the plugin (kernels_aot.plugin_prefill_kernel): the largest tiles within 48 KiB, 11 input
    pointers, 2 int32 extras, 5 output pointers (the one-launch kernel's), `mma.sync` dots, and for sm_90 the
    sm_80 PTX (64-row tiles would get Hopper's arch-specific `wgmma`)."""
    code = (
        "from llmc.plugins.gpu.kernels_aot import entry_params, plugin_prefill_kernel\n"
        "for cap in (80, 90):\n"
        "    for d, dtype, rows in ((128, 'fp16', 64), (128, 'bf16', 64), (256, 'fp16', 32)):\n"
        "        k = plugin_prefill_kernel(32, 8, d, 0.1, dtype, cap, rotary=True, rotary_dim=64, window=512,\n"
        "                                  softcap=30.0, sinks=True)\n"
        "        types = [t for t, _ in entry_params(k.ptx, k.name)]\n"
        "        assert types == ['.u64'] * 11 + ['.u32'] * 2 + ['.u64'] * 5, types\n"
        "        assert (k.block_m, k.prefill) == (rows, True) and 0 < k.shared_mem <= 48 * 1024, k\n"
        "        assert '.target sm_80' in k.ptx and 'mma.sync' in k.ptx and 'wgmma' not in k.ptx\n"
        "        assert k.grid(300, 2, 32, 8, 4096) == (-(-300 // rows), 64, 1)\n"
        "print('ok')\n"
    )
    assert "ok" in _compiled(code, timeout=600).stdout


@pytest.mark.cuda
def test_the_prefill_tactics_ptx_runs_through_the_driver_as_the_reference():
    """On a GPU with CuPy: the plugin's prefill PTX launched as TensorRT launches the tactic (ptx_launch.py), a
    300-token prompt after 700 cached tokens, against the op's reference."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here (the kernel is checked under the interpreter and compiled instead)")
    pytest.importorskip("cupy", reason="the PTX is loaded through CuPy's RawModule")
    code = (
        "import numpy as np, torch\n"
        "from llmc.plugins.gpu.kernels_aot import plugin_prefill_kernel\n"
        "from llmc.plugins.gpu.ptx_launch import PtxKernel, plugin_arguments\n"
        "from llmc.plugins.op.attention import reference_attention\n"
        "b, s, h, kvh, d, cap = 1, 300, 8, 2, 128, 1024\n"
        "major, minor = torch.cuda.get_device_capability()\n"
        "kernel = plugin_prefill_kernel(h, kvh, d, d ** -0.5, 'fp16', 10 * major + minor, rotary=False)\n"
        "g = torch.Generator(device='cuda').manual_seed(0)\n"
        "q = torch.randn(b, s, h, d, device='cuda', dtype=torch.float16, generator=g)\n"
        "k, v = (torch.randn(b, s, kvh, d, device='cuda', dtype=torch.float16, generator=g) for _ in range(2))\n"
        "kc, vc = (torch.randn(b, kvh, cap, d, device='cuda', dtype=torch.float16, generator=g) for _ in range(2))\n"
        "pos = torch.tensor([700], device='cuda', dtype=torch.int32)\n"
        "want = reference_attention(q, k, v, kc.clone(), vc.clone(), pos.long(), d ** -0.5)[0]\n"
        "out = torch.empty_like(q)\n"
        "unused = torch.zeros(1, device='cuda', dtype=torch.float16)\n"
        "split = torch.zeros(1, device='cuda', dtype=torch.float32), torch.zeros(1, device='cuda', dtype=torch.int32)\n"
        "inputs = [t.data_ptr() for t in (q, k, v, kc, vc, pos, unused, unused, unused, *split)]\n"
        "outputs = [t.data_ptr() for t in (out, kc, vc, *split)]\n"
        "PtxKernel(kernel.ptx, kernel.name, kernel.shared_mem).launch(kernel.grid(s, b, h, kvh, cap),\n"
        "                                                             kernel.num_warps * 32,\n"
        "                                                             plugin_arguments(inputs, (s, cap), outputs))\n"
        "torch.cuda.synchronize()\n"
        "np.testing.assert_allclose(out.float().cpu().numpy(), want.float().cpu().numpy(), atol=4e-3)\n"
        "print('ok')\n"
    )
    assert "ok" in _compiled(code, timeout=600).stdout
