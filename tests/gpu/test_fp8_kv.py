"""FP8 (e4m3) KV caches with per-KV-head scales (plugins/gpu/fp8.py) in the slot one-launch kernel and both paged
paths, split and unsplit, against the op's references fed the same fp8 caches and scales, under TRITON_INTERPRET=1.

The stale cache contents are fp8 too, so the kernels read fp8 entries they did not write as well as the new
ones. Every entry a kernel writes holds the reference's byte (the slot kernel rounds rotated keys to the inputs'
type first, as the reference does; under the interpreter its bf16 rounding is by hand: fp8.py `in_type`). A
reference with a wrong scale must fail these checks (the last tests)."""

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined: they run on NumPy here
pytest.importorskip("triton", reason="the kernels need OpenAI Triton (installed by scripts/setup.sh)")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from helpers import all_pairs  # noqa: E402
from llmc.plugins.gpu.fp8 import FP8, NATIVE, fp8_decode, fp8_encode, fp8_mode  # noqa: E402
from llmc.plugins.gpu.one_launch import one_launch_attention  # noqa: E402
from llmc.plugins.op.attention import reference_attention, reference_paged_attention  # noqa: E402
from test_kernels import FEATURES, _case  # noqa: E402
from test_paged_triton import KERNELS as PAGED, SINKS, make_case  # noqa: E402

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
K_SCALE, V_SCALE = torch.tensor([0.02, 0.5]), torch.tensor([0.01, 0.25])  # one per KV head (2 in every case)


@triton.jit
def _round_trip(x_ptr, code_ptr, back_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(code_ptr + i, fp8_encode(tl.load(x_ptr + i)))
    tl.store(back_ptr + i, fp8_decode(tl.load(code_ptr + i)))


def test_hand_written_e4m3_equals_pytorchs_cast_at_every_code_and_tie():
    """Every finite code decodes to PyTorch's value; encoding every code, every midpoint between neighbours (ties
    to even), values past 448 (saturated), subnormals and random values gives PyTorch's byte."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[~values.isnan()].sort().values
    x = torch.cat([values, (values[1:] + values[:-1]) / 2, torch.randn(1500, generator=torch.Generator().manual_seed(0)) * 40,
                   torch.tensor([449.0, 500.0, -1e6, 1e-9, 2 ** -10, 3 * 2 ** -10, -0.0])])
    x = torch.cat([x, torch.zeros(2048 - x.numel())])
    codes, back = torch.empty(2048, dtype=torch.uint8), torch.empty(2048)
    _round_trip[(1,)](x, codes, back, 2048)
    want = x.clamp(-448, 448).to(FP8)
    assert torch.equal(codes, want.view(torch.uint8))
    assert torch.equal(back, want.float())


def fp8_copy(cache: torch.Tensor) -> torch.Tensor:
    """A stale cache as fp8 (its float values, which stay well within +-448 at these scales' ranges)."""
    return cache.float().clamp(-448, 448).to(FP8)


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor):
    """Two fp8 caches hold the same bytes: every entry written as the reference writes it, the rest kept."""
    assert got.dtype == want.dtype == FP8
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    assert not differ.any(), f"{int(differ.sum())} of {differ.numel()} cache entries differ"


def check_slot(case, scale, features=(), splits=None, ref_scales=(K_SCALE, V_SCALE), kernel=one_launch_attention):
    q, k, v, kc, vc, pos, cos, sin = case
    kc, vc = fp8_copy(kc), fp8_copy(vc)
    ref_out, ref_k, ref_v = reference_attention(q, k, v, kc, vc, pos, scale, cos, sin, *features,
                                                k_scale=ref_scales[0], v_scale=ref_scales[1])
    kc2, vc2 = kc.clone(), vc.clone()
    out = kernel(q, k, v, kc2, vc2, pos, scale, cos, sin, *features, k_scale=K_SCALE, v_scale=V_SCALE,
                 **({"splits": splits} if kernel is one_launch_attention else {}))
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    assert_same_bytes(vc2, ref_v)
    assert_same_bytes(kc2, ref_k)


# every pair of (splits, feature, dtype, prefill or decode); ~1-2 s a case interpreted ("all": partial
# rotary, softcap, window and sinks together)
@all_pairs(splits=[1, 3], feature=["window", "all"], dtype=[torch.float32, torch.float16, torch.bfloat16],
           step=["prefill", "decode"])
def test_slot_one_launch_over_an_fp8_cache_matches_the_reference(splits, feature, dtype, step):
    sinks, softcap, window, rotary_dim = FEATURES[feature]
    new, positions = (9, [0, 21]) if step == "prefill" else (1, [3, 40, 90])
    case = _case(len(positions), new, 6, 2, 16, 100, positions, dtype, rotary=True, seed=12, rotary_dim=rotary_dim)
    head_sink = (torch.rand(6, generator=torch.Generator().manual_seed(9)) * 8 - 3).to(dtype) if sinks else None
    check_slot(case, 0.3, (head_sink, softcap, window), splits=splits)


PAGED_OPTIONS = {"plain": {}, "sinks": {"head_sink": SINKS}, "softcap + window": {"softcap": 2.0,
                                                                                  "local_window_size": 40}}


def check_paged(case, kernel, splits, ref_scales=(K_SCALE, V_SCALE), **options):
    case = {**case, "key_cache": fp8_copy(case["key_cache"]), "value_cache": fp8_copy(case["value_cache"])}
    fresh = {n: v.clone() if n.endswith("_cache") and v is not None else v for n, v in case.items()}
    ref = reference_paged_attention(**{n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in case.items()},
                                    **options, k_scale=ref_scales[0], v_scale=ref_scales[1])
    out, key_cache, value_cache = kernel(**fresh, **options, splits=splits, k_scale=K_SCALE, v_scale=V_SCALE)
    tol = TOLERANCE[case["query"].dtype]
    torch.testing.assert_close(out.float(), ref[0].float(), atol=tol, rtol=tol)
    assert_same_bytes(value_cache, ref[2])
    assert_same_bytes(key_cache, ref[1])


@all_pairs(kernel=list(PAGED), splits=[1, 3], options=list(PAGED_OPTIONS),
           dtype=[torch.float32, torch.float16, torch.bfloat16])
def test_paged_over_an_fp8_cache_matches_the_reference(kernel, splits, options, dtype):
    # decode rows at 151 and 71 keys over shuffled 8-token blocks, an empty row, a 5-token chunk after 40
    case = make_case([1, 0, 5, 1], [150, 3, 40, 70], 6, 2, 16, 8, dtype, rotary_dim=16, seed=13)
    extra = {n: v.to(dtype) if isinstance(v, torch.Tensor) else v for n, v in PAGED_OPTIONS[options].items()}
    check_paged(case, PAGED[kernel], splits, scale=0.3, **extra)


@pytest.mark.parametrize("wrong", ["key", "value"])
def test_a_reference_with_a_wrong_scale_fails_the_slot_check(wrong):
    """The check can fail: the reference reading and writing with a scale 1.25x the kernel's, on one side."""
    case = _case(2, 1, 6, 2, 16, 64, [3, 40], torch.float32, rotary=True, seed=14)
    scales = (K_SCALE * 1.25, V_SCALE) if wrong == "key" else (K_SCALE, V_SCALE * 1.25)
    with pytest.raises(AssertionError):
        check_slot(case, 0.3, ref_scales=scales)


@pytest.mark.parametrize("kernel", PAGED)
def test_a_reference_with_a_wrong_scale_fails_the_paged_check(kernel):
    case = make_case([1, 4], [30, 9], 6, 2, 16, 8, torch.float16, rotary_dim=16, seed=15)
    with pytest.raises(AssertionError):
        check_paged(case, PAGED[kernel], 1, ref_scales=(K_SCALE, V_SCALE * torch.tensor([1.0, 1.25])))


def test_an_fp8_cache_without_scales_is_refused():
    case = _case(1, 1, 2, 2, 16, 8, [3], torch.float16, rotary=False)
    q, k, v, kc, vc, pos, _, _ = case
    with pytest.raises(AssertionError, match="k_scale and v_scale"):
        one_launch_attention(q, k, v, fp8_copy(kc), fp8_copy(vc), pos, 0.3)


def test_the_cache_is_read_by_hand_off_the_gpu_and_under_the_interpreter(monkeypatch):
    assert fp8_mode(torch.device("cpu")) == 1 != NATIVE
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_mode(torch.device("cuda")) == 1  # this module's kernels were made interpreted
    assert fp8_mode(torch.device("cuda"), interpreted=False) == NATIVE  # Hopper's conversion
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert fp8_mode(torch.device("cuda"), interpreted=False) == 1  # an A100 has none


@pytest.mark.cuda
def test_fp8_kv_on_the_gpu_matches_the_reference():
    """Compiled on a GPU: decode over fp8 caches of 4,096 keys, head sizes 128 and 256, split and unsplit, in the
    slot one-launch kernel and both paged paths, against the references fed the same caches."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here (the fp8 kernels are checked under the interpreter and compiled instead)")
    from test_kernels import _compiled

    code = (  # a fresh process: this module put the kernels in interpreter mode
        "import sys, torch\n"
        f"sys.path[:0] = {[os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]!r}\n"
        "import llmc.plugins.gpu.paged_kernels_aot\n"  # every kernel compiled: imported before the test modules,
        "from llmc.plugins.gpu.one_launch import one_launch_attention\n"
        "from llmc.plugins.op.attention import reference_attention, reference_paged_attention\n"  # which set
        "from test_kernels import _case\n"  # TRITON_INTERPRET for the kernels defined after them
        "from test_paged_triton import KERNELS, make_case\n"
        "f8 = torch.float8_e4m3fn\n"
        "ks, vs = torch.tensor([0.02, 0.5]), torch.tensor([0.01, 0.25])\n"
        "for head in (128, 256):\n"
        "    for splits in (1, 8):\n"
        "        q, k, v, kc, vc, pos, cos, sin = _case(2, 1, 8, 2, head, 4096, [4095, 17], torch.float16, True)\n"
        "        kc, vc = kc.float().to(f8), vc.float().to(f8)\n"
        "        ref = reference_attention(q, k, v, kc, vc, pos, 0.1, cos, sin, k_scale=ks, v_scale=vs)[0]\n"
        "        g = [t.cuda() for t in (q, k, v, kc, vc, pos, cos, sin)]\n"
        "        out = one_launch_attention(*g[:6], 0.1, *g[6:], splits=splits, k_scale=ks.cuda(), v_scale=vs.cuda())\n"
        "        torch.testing.assert_close(out.float().cpu(), ref.float(), atol=2e-2, rtol=2e-2)\n"
        "        case = make_case([1, 1, 7], [4000, 9, 600], 8, 2, head, 16, torch.float16, rotary_dim=head)\n"
        "        case.update({n: case[n].float().to(f8) for n in ('key_cache', 'value_cache')})\n"
        "        ref = reference_paged_attention(**{n: x.clone() if isinstance(x, torch.Tensor) else x\n"
        "                                          for n, x in case.items()}, k_scale=ks, v_scale=vs)[0]\n"
        "        for kernel in KERNELS.values():\n"
        "            gpu = {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in case.items()}\n"
        "            out = kernel(**gpu, splits=splits, k_scale=ks.cuda(), v_scale=vs.cuda())[0]\n"
        "            torch.testing.assert_close(out.float().cpu(), ref.float(), atol=2e-2, rtol=2e-2)\n"
        "print('ok')\n"
    )
    assert "ok" in _compiled(code, timeout=600).stdout
