"""The plugin's PTX is what the deployed drivers and GPUs can read (plugins/gpu/ptx.py): PTX ISA 8.0, which
every CUDA 12 driver reads (Triton 3.9 on its own writes 9.4 for capability 90, past a CUDA 13.0 driver's
9.0), and the plain target (sm_90, not Triton's sm_90a, which runs on Hopper only). Checked on CPU: the
kernels compiled for both targets (in a child process: the other kernel tests turn Triton's interpreter
on), their headers read back, and the PTX assembled by the ptxas Triton ships for the GPUs it claims,
later ones included. The load-time check (runtime/runners/trt_ptx.py) names a driver or GPU too old or new."""

import json
import os
import subprocess
import sys

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # as every kernel test file sets it before triton is imported: the
# interpreter tests collected after this file need it (the compiles here run in a child without it)
pytest.importorskip("triton", reason="the kernels need OpenAI Triton (installed by scripts/setup.sh)")

from llmc.runtime.runners.trt_ptx import driver_isa, ptx_problem  # noqa: E402

CHILD = r"""
import json, subprocess, tempfile
from llmc.plugins.gpu.kernels_aot import plugin_kernel
from llmc.plugins.gpu.paged_kernels_aot import paged_plugin_kernel
from llmc.plugins.gpu.ptx import ptx_header

try:
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path  # the newest ptxas Triton ships (CUDA 13 for Triton 3.9)
except Exception:
    ptxas = None


def assembles(ptx, arch):
    if ptxas is None:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        run = subprocess.run([ptxas, f"-arch={arch}", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    return run.returncode == 0


for capability, archs in ((80, ("sm_80", "sm_90", "sm_120")), (90, ("sm_90", "sm_100", "sm_120"))):
    for kernel in (plugin_kernel(8, 2, 64, 0.125, "fp16", capability, rotary=True),
                   paged_plugin_kernel(8, 2, 64, 0.125, "fp16", capability, rotary_dim=64)):
        arch_specific = kernel.ptx.replace(f".target sm_{capability}", f".target sm_{capability}a", 1)
        print(json.dumps({"capability": capability, "kernel": kernel.name, "header": ptx_header(kernel.ptx),
                          "assembles": {arch: assembles(kernel.ptx, arch) for arch in archs},
                          "arch_specific_on_later": assembles(arch_specific, archs[-1])}), flush=True)
"""


def test_plugin_ptx_is_isa_8_0_for_the_plain_target_and_assembles_for_later_gpus():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 4, run.stdout
    for r in results:
        assert r["header"] == ["8.0", f"sm_{r['capability']}"], r
        if r["assembles"]["sm_90"] is None:
            continue  # no ptxas shipped with this Triton: the header is what is pinned
        assert all(r["assembles"].values()), r  # its own GPU, and later ones through the driver's JIT
        # the contrast that makes it matter: the arch-specific target Triton writes cannot go forward
        assert r["capability"] == 80 or r["arch_specific_on_later"] is False, r


def test_driver_isa_follows_the_cuda_version():
    assert [driver_isa(v) for v in (12000, 12040, 12060, 12080, 12090, 13000, 13010)] == [80, 84, 85, 87, 88, 90, 91]


def test_load_check_names_the_driver_or_gpu_too_old_or_too_new():
    assert ptx_problem("8.0", "sm_90", 12000, 90) is None  # the oldest CUDA 12 driver on Hopper
    assert ptx_problem("8.0", "sm_90", 13000, 120) is None  # plain targets run on later GPUs
    assert ptx_problem("8.0", "sm_80", 12080, 90) is None
    old_driver = ptx_problem("9.4", "sm_90a", 13000, 90)  # what Triton 3.9 wrote unasked, on the H200's driver
    assert "driver is too old" in old_driver and "9.4" in old_driver and "9.0" in old_driver and "13.0" in old_driver
    old_gpu = ptx_problem("8.0", "sm_90", 12080, 80)
    assert "GPU is too old" in old_gpu and "sm_90" in old_gpu and "8.0" in old_gpu
    new_gpu = ptx_problem("8.0", "sm_90a", 13000, 100)
    assert "GPU is too new" in new_gpu and "sm_90a" in new_gpu and "10.0" in new_gpu


def test_plain_target_rewrites_the_header_only_when_no_arch_specific_instruction_is_used():
    from llmc.plugins.gpu.ptx import plain_target, ptx_header

    ptx = ".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry k()\n{\n\tret;\n}\n"
    assert ptx_header(plain_target(ptx, "k")) == ("8.0", "sm_90")
    assert plain_target(ptx.replace("sm_90a", "sm_80"), "k") == ptx.replace("sm_90a", "sm_80")
    with pytest.raises(ValueError, match="k uses wgmma."):
        plain_target(ptx.replace("\tret;", "\twgmma.fence.sync.aligned;\n\tret;"), "k")
