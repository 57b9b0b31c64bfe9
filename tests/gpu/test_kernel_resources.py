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

The same compiled kernels show how their key loops were pipelined (plugins/gpu/pipelining.py, from Triton's
IR): every configuration of 3 stages or more keeps key tiles in flight while it computes one, which the paged
kernel that reads only the cache did not at the stage counts it was tuned at on the H200 (its block-table read
took the stages); and a PyTorch launch's paged kernel, its block size a compile-time constant, divides nothing.

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

from llmc.plugins.gpu.configs import (HOPPER_DECODE, PREFILL_CONFIGS, SHARED_LIMITS, attention_config,  # noqa: E402
                                      block_d)

HEAD_SIZES = (64, 80, 96, 128, 256)
# the kernels that read an fp8 cache (plugins/gpu/fp8.py), compiled over one too: the configurations are the
# queries' (an fp8 cache's tiles take half the bytes of fp16's, so this bounds nothing new unless the
# conversions cost shared memory, which the compiled figure would show)
FP8_KERNELS = ("attention_one_launch", "attention_one_launch_split", "paged_write", "paged_attention",
               "paged_attention_split", "paged_attention_one_launch", "paged_attention_one_launch_split")
PLUGIN_LIMIT = 48 * 1024

CHILD = r"""
import json, sys
import torch
from llmc.plugins.gpu.configs import block_d
from llmc.plugins.gpu.kernels_aot import _compile, kernel_sources, plugin_kernel
from llmc.plugins.gpu.paged_kernels_aot import paged_kernel_sources, paged_plugin_kernel
from llmc.plugins.gpu.pipelining import key_pipelining

widest = {}  # (kernel, config) -> the widest-row case that gets it
for head in HEAD_SIZES:
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        kernels = {**kernel_sources(32, 8, head, dtype, rotary=True),
                   **paged_kernel_sources(32, 8, head, dtype, rotary_dim=head)}
        if head == 256 and dtype != torch.bfloat16:  # over fp8 caches (bytes; per-KV-head scales), where shared
            # memory is largest (head 256; fp16 and fp32 queries): the kernels that read them
            fp8 = {**kernel_sources(32, 8, head, dtype, rotary=True, fp8_kv=True),
                   **paged_kernel_sources(32, 8, head, dtype, rotary_dim=head, fp8_kv=True)}
            kernels.update({name + " fp8": fp8[name] for name in FP8_KERNELS})
        for name, (fn, signature, constexprs, config) in kernels.items():
            row = block_d(head) * dtype.itemsize
            if (name, config) not in widest or row > widest[name, config][0]:
                widest[name, config] = (row, head, str(dtype), fn, signature, constexprs)
for capability in (80, 90):
    for (name, config), (row, head, dtype, fn, signature, constexprs) in widest.items():
        compiled = _compile(fn, signature, constexprs, capability, aligned=True, **config.launch())
        pipelining = key_pipelining(compiled.asm["ttgir"], config.block_n, block_d(head))
        print(json.dumps({"kernel": name, "stages": config.num_stages, "head": head, "dtype": dtype,
                          "capability": capability, "shared": compiled.metadata.shared,
                          "overlapped": pipelining.overlapped, "pipelining": pipelining}), flush=True)
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
    for paged in (True, False):
        rows = sorted({(block_d(h) * size, attention_config(h, size, paged=paged).num_stages)
                       for h in HEAD_SIZES for size in (2, 4)})
        stages = [s for _, s in rows]
        assert stages == sorted(stages, reverse=True), (paged, rows)
    assert attention_config(80, 2, paged=False) == attention_config(96, 2, paged=False) == attention_config(
        128, 2, paged=False)


def test_every_kernel_fits_sm80_and_sm90_shared_memory_at_every_head_size():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"HEAD_SIZES = {HEAD_SIZES!r}\nFP8_KERNELS = {FP8_KERNELS!r}\n" + CHILD
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kernels = {r["kernel"] for r in results}
    splits = {"attention_one_launch_split", "paged_attention_split", "paged_attention_one_launch_split"}
    fp8 = {name + " fp8" for name in FP8_KERNELS}
    assert {"attention_one_launch", "paged_attention", "paged_attention_one_launch"} | splits | fp8 <= kernels, kernels
    over = [r for r in results if r["shared"] > (PLUGIN_LIMIT if r["kernel"].startswith("plugin")
                                                 else SHARED_LIMITS[r["capability"]])]
    assert not over, over
    # every key loop given 3 stages or more keeps key tiles in flight while it computes one (pipelining.py: the
    # paged kernel that reads only the cache did not at 3, for its block table; fewer stages are the widest
    # rows' fallbacks, for shared memory); the cache write has no key loop
    serial = [r for r in results if not r["kernel"].startswith(("plugin", "paged_write")) and r["stages"] >= 3
              and not r["overlapped"]]
    assert not serial, serial
    assert {r["kernel"] for r in results if r.get("overlapped")} >= {"attention_one_launch", "paged_attention",
                                                                     "paged_attention_split",
                                                                     "paged_attention_one_launch"}, results
    # the case the H200 failed on (fp16, head_dim 256, 3 stages: 270336 bytes) now gets one stage, whose widest
    # row (fp32 256) was compiled for both targets
    assert attention_config(256, 2, paged=False).num_stages == 1
    assert {(r["capability"], r["head"], r["dtype"]) for r in results
            if r["kernel"] == "attention_one_launch" and r["stages"] == 1} == {(80, 256, "torch.float32"),
                                                                              (90, 256, "torch.float32")}, results
    print("\n".join(f"{r['capability']} {r['kernel']} stages={r.get('stages', '-')} head={r['head']} {r['dtype']}: "
                    f"{r['shared']}" for r in results))


def test_hopper_takes_the_decode_configurations_measured_there_and_nothing_else_does():
    for paged in (True, False):
        assert attention_config(128, 2, paged=paged, capability=90) == HOPPER_DECODE[paged]
        assert attention_config(64, 2, paged=paged, capability=100) == HOPPER_DECODE[paged]
        for other in (attention_config(128, 2, paged=paged, capability=80),  # an A100: unmeasured
                      attention_config(128, 2, paged=paged),  # the plugins' compiles, the interpreter
                      attention_config(256, 2, paged=paged, capability=90),  # wider heads: not measured there
                      attention_config(128, 4, paged=paged, capability=90)):  # fp32
            assert other != HOPPER_DECODE[paged] and other.block_n == 32


HOPPER_CHILD = r"""
import json
import re
import torch
from llmc.plugins.gpu.configs import HOPPER_DECODE, KernelConfig
from llmc.plugins.gpu.kernels_aot import _compile, kernel_sources
from llmc.plugins.gpu.paged_kernels_aot import paged_kernel_sources
from llmc.plugins.gpu.pipelining import key_pipelining

# the widest rows HOPPER_DECODE is used for (16-bit, head 128; head 80 and 96 take its tiles), compiled for sm_90
# as a PyTorch launch specializes them (aligned): the fresh kernels and the cached-only paged one
for fp8 in (False, True):
    kernels = {**kernel_sources(32, 8, 128, torch.float16, rotary=True, fp8_kv=fp8),
               **paged_kernel_sources(32, 8, 128, torch.float16, rotary_dim=128, fp8_kv=fp8)}
    for name, paged in (("attention_one_launch_split", False), ("paged_attention_one_launch_split", True),
                        ("paged_attention_split", True)):
        fn, signature, constexprs, _ = kernels[name]
        config = HOPPER_DECODE[paged]
        constexprs = {**constexprs, "BLOCK_N": config.block_n}
        compiled = _compile(fn, signature, constexprs, 90, aligned=True, **config.launch())
        pipelining = key_pipelining(compiled.asm["ttgir"], config.block_n, 128)
        print(json.dumps({"kernel": name, "fp8": fp8, "shared": compiled.metadata.shared,
                          "overlapped": pipelining.overlapped, "pipelining": pipelining}), flush=True)
# the cached-only kernel as it was tuned on the H200 (3 stages: the block table's level took the stages its key and
# value copies needed), which the check must tell apart
fn, signature, constexprs, _ = kernels["paged_attention_split"]
config = KernelConfig(16, 128, 8, 3)
compiled = _compile(fn, signature, {**constexprs, "BLOCK_N": 128}, 90, aligned=True, **config.launch())
print(json.dumps({"kernel": "paged_attention_split at 3 stages", "shared": compiled.metadata.shared,
                  "pipelining": key_pipelining(compiled.asm["ttgir"], 128, 128)}), flush=True)
# the unsplit cached-only kernel as a PyTorch launch compiles it, its block size a constant (PAGE), and as a plugin
# does (PAGE 0: the block size a run-time scalar): the PTX's integer divisions and remainders
fn, signature, constexprs, _ = kernels["paged_attention"]
config = HOPPER_DECODE[True]
for page in (16, 0):
    compiled = _compile(fn, signature, {**constexprs, "BLOCK_N": config.block_n, "PAGE": page}, 90, aligned=True,
                        **config.launch())
    print(json.dumps({"kernel": "paged_attention", "page": page,
                      "divisions": len(re.findall(r"\b(?:div|rem)\.[su]", compiled.asm["ptx"]))}), flush=True)
"""


def test_hoppers_decode_configurations_fit_its_shared_memory_and_keep_key_tiles_in_flight():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", HOPPER_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    *results, serial, constant, run_time = results
    assert len(results) == 6
    assert all(0 < r["shared"] <= SHARED_LIMITS[90] for r in results), results
    assert all(r["overlapped"] for r in results), results  # each keeps key tiles in flight (pipelining.py)
    assert serial["pipelining"] == [1, 0], serial  # one buffer, waited for in full at every step
    # a key's block and offset: two divisions by a run-time block size (tens of instructions each), none by PAGE's
    assert constant["divisions"] == 0 and run_time["divisions"] >= 2, (constant, run_time)


PREFILL_CHILD = r"""
import json
import torch
from llmc.plugins.gpu.configs import PREFILL_CONFIGS
from llmc.plugins.gpu.prefill import compiled_facts, fitting_configs

# shared memory grows with the head at a fixed configuration, and head 256 is where the lists meet the limits:
# fp16 there on both generations, an fp8 cache on Hopper's list, and fp32 (which takes the last tile only)
for capability, dtype, fp8 in ((80, torch.float16, False), (90, torch.float16, False), (90, torch.float16, True),
                               (80, torch.float32, False), (90, torch.float32, False)):
    kept = fitting_configs(capability, 256, dtype, fp8)
    configs = PREFILL_CONFIGS[capability][-1:] if dtype == torch.float32 else PREFILL_CONFIGS[capability]
    for config in configs:
        shared, pipelining = compiled_facts(capability, 256, dtype, fp8, config)
        print(json.dumps({"capability": capability, "dtype": str(dtype), "fp8": fp8,
                          "config": list(config.__dict__.values()), "kept": config in kept, "shared": shared,
                          "overlapped": pipelining.overlapped, "pipelining": pipelining}), flush=True)
"""


def test_prefill_configurations_are_pruned_by_the_shared_memory_they_compile_to():
    """Each generation's prefill tiles (configs.PREFILL_CONFIGS) compiled for that target at head 256 (to PTX:
    prefill.compiled_shared): fitting_configs keeps exactly those within the limit, keeps one at least in every
    case (the last of each list), and drops Hopper's 128 x 128 (460,800 bytes at fp16, 5 stages)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", PREFILL_CHILD], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(PREFILL_CONFIGS[80]) + 2 * len(PREFILL_CONFIGS[90]) + 2, results  # fp32: the last
    for r in results:
        assert r["kept"] == (r["shared"] <= SHARED_LIMITS[r["capability"]]), r
        assert r["overlapped"] or r["config"][3] < 3, r  # the key tiles in flight (pipelining.py)
    cases = {(r["capability"], r["dtype"], r["fp8"]) for r in results}
    for case in cases:
        assert [r for r in results if (r["capability"], r["dtype"], r["fp8"]) == case][-1]["kept"], case
    assert [r["kept"] for r in results if r["capability"] == 90 and r["dtype"] == "torch.float16"
            and not r["fp8"] and r["config"][:2] == [128, 128]] == [False]
    print("\n".join(f"sm_{r['capability']} prefill {r['config']} head=256 {r['dtype']}{' fp8 KV' if r['fp8'] else ''}"
                    f": {r['shared']}{'' if r['kept'] else ' (pruned)'}" for r in results))
