"""The plugins' kernels launched without TensorRT (plugins/gpu/ptx_launch.py): the arguments laid out in TensorRT's
order for an AOT plugin (inputs, int32 extras, outputs) match the parameters each compiled PTX entry declares, one
for one: checked on CPU against PTX compiled for sm_80 and sm_90 (in a child process: the interpreter, which the
kernel tests turn on, replaces compiling). On a GPU with CuPy (`cuda`), the fused plugin's PTX runs through the
driver with the plugin's own grid and computes the op's reference."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

os.environ["TRITON_INTERPRET"] = "1"  # as every kernel test file sets it before triton is imported
pytest.importorskip("triton", reason="the kernels need OpenAI Triton (installed by scripts/setup.sh)")

from llmc.plugins.gpu.ptx_launch import check_arguments, plugin_arguments  # noqa: E402

# LlmcFusedAttention: 11 inputs (the split workspace and counters last), extras (tokens, capacity), 5 outputs (the
# caches and split buffers aliased: plugins/trt/plugin.py)
FUSED = (11, 2, 5)
PAGED = (13, 4, 5)  # LlmcPagedAttention: 13 inputs, extras (rows, blocks a row, pool blocks, block size), 5 outputs

CHILD = r"""
import json
from llmc.plugins.gpu.kernels_aot import plugin_kernel
from llmc.plugins.gpu.paged_kernels_aot import paged_plugin_kernel
for capability in (80, 90):
    for splits in (1, 16):
        slots = 264 if splits > 1 else 0
        for which, kernel in (("fused", plugin_kernel(8, 2, 64, 0.125, "fp16", capability, rotary=True,
                                                      splits=splits, slots=slots)),
                              ("paged", paged_plugin_kernel(8, 2, 64, 0.125, "fp16", capability, rotary_dim=64,
                                                            splits=splits, slots=slots))):
            print(json.dumps({"which": which, "capability": capability, "splits": splits, "name": kernel.name,
                              "ptx": kernel.ptx}))
"""


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def _arguments(counts):
    inputs, extras, outputs = counts
    return plugin_arguments(range(0x1000, 0x1000 + inputs), range(1, extras + 1), range(0x2000, 0x2000 + outputs))


def test_the_launch_order_matches_every_compiled_plugin_entry(compiled):
    assert len(compiled) == 8
    for kernel in compiled:
        counts = FUSED if kernel["which"] == "fused" else PAGED
        check_arguments(kernel["ptx"], kernel["name"], _arguments(counts))
    split = [k for k in compiled if k["splits"] > 1]  # they merge in the launch: an atomic on the tile's counter
    assert len(split) == 4 and all("atom." in k["ptx"] for k in split)
    assert not any("atom." in k["ptx"] for k in compiled if k["splits"] == 1)


def test_a_launch_that_drifts_from_the_entry_is_refused_naming_the_parameter(compiled):
    kernel = next(k for k in compiled if k["which"] == "fused")
    inputs, extras, outputs = _arguments(FUSED)[:11], _arguments(FUSED)[11:13], _arguments(FUSED)[13:]
    with pytest.raises(ValueError, match=r"parameter 11 \(\w+, \.[su]32\) gets a uint64"):
        check_arguments(kernel["ptx"], kernel["name"], inputs + outputs + extras)  # extras last: not TensorRT's order
    with pytest.raises(ValueError, match="declares 18 parameters; the launch passes 17"):
        check_arguments(kernel["ptx"], kernel["name"], inputs[:-1] + extras + outputs)


GPU_CHILD = r"""
import numpy as np
import torch
from llmc.plugins.gpu.kernels_aot import plugin_kernel
from llmc.plugins.gpu.ptx_launch import PtxKernel, plugin_arguments
from llmc.plugins.op.attention import reference_attention

b, s, h, kvh, d, cap, slots = 2, 1, 8, 2, 64, 2048, 264
capability = torch.cuda.get_device_capability()
kernel = plugin_kernel(h, kvh, d, d ** -0.5, "fp16", 10 * capability[0] + capability[1], rotary=False, splits=8,
                       slots=slots)
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(b, s, h, d, device="cuda", dtype=torch.float16, generator=g)
k, v = (torch.randn(b, s, kvh, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
kc, vc = (torch.randn(b, kvh, cap, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
pos = torch.tensor([5, 1900], device="cuda", dtype=torch.int32)  # 2 x 2 tiles: 8 splits at 2048 keys
want = reference_attention(q, k, v, kc.clone(), vc.clone(), pos.long(), d ** -0.5)[0]
out = torch.empty_like(q)
unused = torch.zeros(1, device="cuda", dtype=torch.float16)  # cos, sin and sinks: the kernel reads none here
part = torch.empty(slots * 16 * (d + 2), device="cuda", dtype=torch.float32)
counters = torch.zeros(slots, device="cuda", dtype=torch.int32)
inputs = [t.data_ptr() for t in (q, k, v, kc, vc, pos, unused, unused, unused, part, counters)]
arguments = plugin_arguments(inputs, (s, cap), [out.data_ptr(), kc.data_ptr(), vc.data_ptr(), part.data_ptr(),
                                                counters.data_ptr()])
launched = PtxKernel(kernel.ptx, kernel.name, kernel.shared_mem)
for _ in range(3):  # the counters each launch leaves at zero serve the next
    launched.launch(kernel.grid(s, b, h, kvh, cap), kernel.num_warps * 32, arguments)
torch.cuda.synchronize()
np.testing.assert_allclose(out.float().cpu().numpy(), want.float().cpu().numpy(), atol=4e-3)
assert int(counters.abs().sum()) == 0
print("ok")
"""


@pytest.mark.cuda
def test_the_fused_plugin_ptx_runs_through_the_driver_as_the_reference():
    """The plugin's PTX compiled here for this GPU (in a child process: this module put the kernels in interpreter
    mode, which cannot compile), loaded through CuPy and launched with the plugin's grid and arguments."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here (the launch order is checked against the compiled PTX instead)")
    pytest.importorskip("cupy", reason="the PTX is loaded through CuPy's RawModule")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", GPU_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]
