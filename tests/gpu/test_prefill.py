"""The FlashAttention-2-form prefill over the paged cache (plugins/gpu/prefill.py) against the contract's reference
(`reference_paged_attention`) under TRITON_INTERPRET=1: prompt chunks of 16-64 queries after hundreds to
thousands of cached tokens, beside fresh prompts and decode rows in the same launch, over shuffled blocks.

The key loop's three parts (window-masked, unmasked, diagonal) meet at block boundaries that move with the tile
size, the past and the window, so the sweep varies all three: a gap or an overlap between the parts, or a mask
missing where a tile is cut, changes the output. The tile sizes are the interpreter's choice (PREFILL_CONFIGS'
first, 128 x 128) and smaller ones (several tiles a row, several diagonal blocks)."""

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined: they run on NumPy here
pytest.importorskip("triton", reason="the kernels need OpenAI Triton (installed by scripts/setup.sh)")

import torch  # noqa: E402

from helpers import all_pairs  # noqa: E402
from llmc.plugins.gpu.configs import PREFILL_CONFIGS, KernelConfig  # noqa: E402
from llmc.plugins.gpu.prefill import paged_prefill  # noqa: E402
from llmc.plugins.op.attention import reference_paged_attention  # noqa: E402
from test_paged_triton import SINKS, make_case  # noqa: E402

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
CONFIGS = {"128x128": PREFILL_CONFIGS[90][0], "16x64": KernelConfig(16, 64, 4, 1), "32x32": KernelConfig(32, 32, 4, 1)}
OPTIONS = {
    "causal": {},
    # a window shorter than a chunk and than the past: every part meets
    "window 37 + softcap + sinks": {"local_window_size": 37, "softcap": 2.0, "head_sink": SINKS[:4]},
    "not causal": {"is_causal": False},
}
K_SCALE, V_SCALE = torch.tensor([0.02, 0.5]), torch.tensor([0.01, 0.25])


def run(case, config, kv="native", **options):
    """The kernel's output and caches against the reference's, fed the same caches (fp8 ones with their scales)."""
    scales = {}
    if kv == "fp8":
        case = {**case, **{n: case[n].float().clamp(-448, 448).to(torch.float8_e4m3fn)
                           for n in ("key_cache", "value_cache")}}
        scales = {"k_scale": K_SCALE, "v_scale": V_SCALE}
    fresh = {n: v.clone() if n.endswith("_cache") else v for n, v in case.items()}
    ref = reference_paged_attention(**{n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in case.items()},
                                    **options, **scales)
    out, key_cache, value_cache = paged_prefill(**fresh, **options, **scales, config=config)
    tol = TOLERANCE[case["query"].dtype]
    torch.testing.assert_close(out.float(), ref[0].float(), atol=tol, rtol=tol)
    assert torch.equal(value_cache.view(torch.uint8), ref[2].view(torch.uint8)), "values written unlike the reference"
    if kv == "fp8":
        assert torch.equal(key_cache.view(torch.uint8), ref[1].view(torch.uint8)), "keys written unlike the reference"
    else:  # rotated keys in bf16: the interpreter's cast truncates (test_paged_triton.check's tolerance)
        torch.testing.assert_close(key_cache.float(), ref[1].float(), atol=tol, rtol=tol)


# every pair of (tiles, options, dtype, cache type); each case 2-4 s interpreted
@all_pairs(config=list(CONFIGS), options=list(OPTIONS), dtype=[torch.float32, torch.float16, torch.bfloat16],
           kv=["native", "fp8"])
def test_chunks_after_long_pasts_match_the_reference(config, options, dtype, kv):
    # a 40-token chunk after 300 cached, a decode row, an empty row, a fresh 23-token prompt
    case = make_case([40, 1, 0, 23], [300, 7, 3, 0], 4, 2, 16, 16, dtype, rotary_dim=16, seed=21)
    extra = {n: v.to(dtype) if isinstance(v, torch.Tensor) else v for n, v in OPTIONS[options].items()}
    run(case, CONFIGS[config], kv, scale=0.3, **extra)


def test_a_chunk_of_64_after_2000_tokens():
    """Two 32-query tiles, each with 31 unmasked key blocks of 64 and its diagonal; MQA, head 32, fp16."""
    case = make_case([64], [2000], 2, 1, 32, 32, torch.float16, rotary_dim=32, seed=22)
    run(case, KernelConfig(32, 64, 4, 1))


def test_unmapped_blocks_in_the_unmasked_part_are_masked():
    """Block-table holes inside a long past (the unmasked part masks only by them) are read as nothing."""
    case = make_case([20, 9], [400, 130], 4, 2, 16, 16, torch.float32, rotary_dim=16, seed=23,
                     holes=[(0, 3, -1), (0, 11, 10 ** 6), (1, 2, -1)])
    run(case, KernelConfig(16, 64, 4, 1))


@pytest.mark.cuda
def test_prefill_on_the_gpu_matches_the_reference():
    """Compiled and autotuned on a GPU (fitting_configs, then triton.autotune): a 300-token chunk after 1,700
    cached and a fresh 200-token prompt, head sizes 128 and 256, fp16/bf16 and an fp8 cache."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here (the prefill kernel is checked under the interpreter and compiled instead)")
    from test_kernels import _compiled

    code = (  # a fresh process: this module put the kernels in interpreter mode
        "import sys, torch\n"
        f"sys.path[:0] = {[os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]!r}\n"
        "from llmc.plugins.gpu.prefill import paged_prefill\n"  # compiled: before the test module, which sets
        "from llmc.plugins.op.attention import reference_paged_attention\n"  # TRITON_INTERPRET for later kernels
        "from test_paged_triton import make_case\n"
        "for head in (128, 256):\n"
        "    for dtype, kv in ((torch.float16, None), (torch.bfloat16, None), (torch.float16, torch.float8_e4m3fn)):\n"
        "        case = make_case([300, 200], [1700, 0], 8, 2, head, 16, dtype, rotary_dim=head, seed=1)\n"
        "        scales = {}\n"
        "        if kv is not None:\n"
        "            case.update({n: case[n].float().to(kv) for n in ('key_cache', 'value_cache')})\n"
        "            scales = {'k_scale': torch.tensor([0.02, 0.5]), 'v_scale': torch.tensor([0.01, 0.25])}\n"
        "        ref = reference_paged_attention(**{n: v.clone() if isinstance(v, torch.Tensor) else v\n"
        "                                          for n, v in case.items()}, **scales)[0]\n"
        "        gpu = {n: v.cuda() if isinstance(v, torch.Tensor) else v for n, v in {**case, **scales}.items()}\n"
        "        out = paged_prefill(**gpu)[0]\n"
        "        torch.testing.assert_close(out.float().cpu(), ref.float(), atol=3e-2, rtol=3e-2)\n"
        "print('ok')\n"
    )
    assert "ok" in _compiled(code, timeout=600).stdout
