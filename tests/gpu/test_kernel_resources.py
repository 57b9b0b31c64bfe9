"""Every attention kernel fits the GPUs it is compiled for, at every head size the families use (64, 80, 96,
128, 256): the shared memory each compiled kernel states stays within sm_80's and sm_90's per-block limits,
for every configuration plugins/gpu/configs.py may give it. Checked on CPU: Triton compiles for a target
without a GPU (in a child process: the interpreter, which the other kernel tests turn on, replaces compiling).

A kernel is compiled as a launch from PyTorch specializes it (16-byte-aligned pointers), the form whose
loads Triton buffers across pipeline stages: on an H200, head_dim 256 failed there with "out of resource:
shared memory, Required: 270336, Hardware limit: 232448" while the plugin's compile stated 40 KiB. The
plugin's own form (no alignment facts) must also fit the 48 KiB a plugin launch gets. The split-KV forms
(plugins/gpu/split_kv.py: the one-launch and paged kernels with a third grid axis of key splits and their
merge) are compiled as their PyTorch launches get them.

To keep it to a few dozen compiles: shared memory grows with the tile row (BLOCK_D x element size) at a
fixed configuration, and configs.py never raises the stage count as rows widen (test_stages_never_grow_...),
so the widest row that gets each configuration is that configuration's largest footprint; only those are
compiled, per kernel and target. Head sizes 80 and 96 run in 128's tiles."""

import json
import os
import subprocess
import sys

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # as every kernel test file sets it before triton is imported: the
# interpreter tests collected after this file need it (the compiles here run in a child without it)
pytest.importorskip("triton", reason="the kernels need OpenAI Triton (installed by scripts/setup.sh)")

from llmc.plugins.gpu.configs import SHARED_LIMITS, attention_config, block_d  # noqa: E402

HEAD_SIZES = (64, 80, 96, 128, 256)
PLUGIN_LIMIT = 48 * 1024

CHILD = r"""
import json, sys
import torch
from llmc.plugins.gpu.configs import block_d
from llmc.plugins.gpu.kernels_aot import _compile, kernel_sources, plugin_kernel
from llmc.plugins.gpu.paged_kernels_aot import paged_kernel_sources, paged_plugin_kernel

widest = {}  # (kernel, config) -> the widest-row case that gets it
for head in HEAD_SIZES:
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        kernels = {**kernel_sources(32, 8, head, dtype, rotary=True),
                   **paged_kernel_sources(32, 8, head, dtype, rotary_dim=head)}
        for name, (fn, signature, constexprs, config) in kernels.items():
            row = block_d(head) * dtype.itemsize
            if (name, config) not in widest or row > widest[name, config][0]:
                widest[name, config] = (row, head, str(dtype), fn, signature, constexprs)
for capability in (80, 90):
    for (name, config), (row, head, dtype, fn, signature, constexprs) in widest.items():
        shared = _compile(fn, signature, constexprs, capability, aligned=True, **config.launch()).metadata.shared
        print(json.dumps({"kernel": name, "stages": config.num_stages, "head": head, "dtype": dtype,
                          "capability": capability, "shared": shared}), flush=True)
# the plugin forms at the widest fp16 row (fewer stages there, but unaligned they buffer nothing anyway):
# each call raises past the 48 KiB a plugin launch gets
for head, dtype in ((256, "fp16"),):
    for capability in (80, 90):
        for kernel in (plugin_kernel(32, 8, head, 0.125, dtype, capability, rotary=True),
                       paged_plugin_kernel(32, 8, head, 0.125, dtype, capability, rotary_dim=head)):
            print(json.dumps({"kernel": "plugin " + kernel.name, "head": head, "dtype": dtype,
                              "capability": capability, "shared": kernel.shared_mem}), flush=True)
"""


def test_stages_never_grow_as_tile_rows_widen():
    for fresh in (True, False):
        rows = sorted({(block_d(h) * size, attention_config(h, size, fresh=fresh).num_stages)
                       for h in HEAD_SIZES for size in (2, 4)})
        stages = [s for _, s in rows]
        assert stages == sorted(stages, reverse=True), (fresh, rows)
    assert attention_config(80, 2, fresh=True) == attention_config(96, 2, fresh=True) == attention_config(128, 2,
                                                                                                         fresh=True)


def test_every_kernel_fits_sm80_and_sm90_shared_memory_at_every_head_size():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"HEAD_SIZES = {HEAD_SIZES!r}\n" + CHILD
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kernels = {r["kernel"] for r in results}
    splits = {"attention_one_launch_split", "paged_attention_split", "paged_attention_one_launch_split"}
    assert {"prefill", "decode_split", "attention_one_launch", "paged_attention",
            "paged_attention_one_launch"} | splits <= kernels, kernels
    over = [r for r in results if r["shared"] > (PLUGIN_LIMIT if r["kernel"].startswith("plugin")
                                                 else SHARED_LIMITS[r["capability"]])]
    assert not over, over
    # the case the H200 failed on (fp16, head_dim 256, 3 stages: 270336 bytes) now gets one stage, whose widest
    # row (fp32 256) was compiled for both targets
    assert attention_config(256, 2, fresh=True).num_stages == 1
    assert {(r["capability"], r["head"], r["dtype"]) for r in results
            if r["kernel"] == "attention_one_launch" and r["stages"] == 1} == {(80, 256, "torch.float32"),
                                                                              (90, 256, "torch.float32")}, results
    print("\n".join(f"{r['capability']} {r['kernel']} stages={r.get('stages', '-')} head={r['head']} {r['dtype']}: "
                    f"{r['shared']}" for r in results))
