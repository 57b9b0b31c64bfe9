"""Engine stage: a TensorRT engine from the ONNX prepared for it (prep.py).

    strongly typed network  types come from the graph (TensorRT 11 has no precision flags)
    ONNX parser             LlmcFusedAttention nodes become the AOT plugin (plugins/trt_plugin.py)
    two profiles            prefill (one row, many tokens) and decode (many rows, one token), over
                            the same KV-cache inputs, from `limits` (plan.profiles)
    builder config          memory pool limit, optimization level, hardware / version compatibility
    timing cache            read from and written back to <output>/timing.cache, so a rebuild of
                            the same network on the same GPU skips the tactic timing

Everything below `build_engine` needs TensorRT and a GPU; the pieces that do not (profile shapes
per network input, the compatibility options) are plain functions, tested on CPU.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Callable

from llmc.compiler.plan import Profile
from llmc.compiler.spec import HardwareCompatibility, TensorRTSpec
from llmc.errors import EngineError
from llmc.runtime.manifest import TensorRTInfo

ENGINE_NAME = "model.plan"
TIMING_CACHE = "timing.cache"
AMPERE = 80  # PTX for sm_80 runs on every later GPU (the driver compiles it forward)

Shapes = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def profile_shapes(profile: Profile, inputs: list[str]) -> dict[str, Shapes]:
    """The (min, opt, max) shape of every network input under `profile`, whose keys may be
    patterns (`past_key_values.*`); an input no key matches is an error naming it."""
    shapes = {}
    for name in inputs:
        match = next((shape for key, shape in profile.shapes.items() if fnmatch.fnmatchcase(name, key)), None)
        if match is None:
            raise EngineError(f"profile {profile.name}: no shape for the network input {name!r} "
                              f"(the profile covers {sorted(profile.shapes)})")
        shapes[name] = match
    return shapes


def plugin_capability(options: TensorRTSpec, gpu_capability: int) -> int:
    """The GPU generation the plugin's PTX is compiled for."""
    return AMPERE if options.hardware_compatibility is HardwareCompatibility.ampere_plus else gpu_capability


def _configure(trt, builder, options: TensorRTSpec):
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gib * 2**30))
    config.builder_optimization_level = options.optimization_level
    if options.hardware_compatibility is not HardwareCompatibility.none:
        level = {HardwareCompatibility.ampere_plus: trt.HardwareCompatibilityLevel.AMPERE_PLUS,
                 HardwareCompatibility.same_compute_capability:
                     trt.HardwareCompatibilityLevel.SAME_COMPUTE_CAPABILITY}[options.hardware_compatibility]
        config.hardware_compatibility_level = level
    if options.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    return config


def _progress_monitor(trt, progress: Callable[[int, int], None] | None):
    """TensorRT's build phases reported as steps of the outermost phase."""
    if progress is None:
        return None

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.top, self.total = None, 0

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None and self.top is None:
                self.top, self.total = phase_name, num_steps
                progress(0, num_steps)

        def step_complete(self, phase_name, step):
            if phase_name == self.top:
                progress(step + 1, self.total)
            return True  # keep building

        def phase_finish(self, phase_name):
            if phase_name == self.top:
                self.top = None

    return Monitor()


def build_engine(onnx_path: Path, profiles: list[Profile], options: TensorRTSpec, precision: str, out_dir: Path,
                 timing_cache: Path | None = None, progress: Callable[[int, int], None] | None = None) -> TensorRTInfo:
    """Build `out_dir/model.plan` from `onnx_path`; returns what the manifest records about it."""
    import tensorrt as trt

    from llmc.plugins import trt_plugin
    from llmc.runtime.trt_runner import gpu_identity

    gpu, capability = gpu_identity()
    trt_plugin.set_target_capability(plugin_capability(options, capability))
    trt_plugin.register()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    for flag in ("STRONGLY_TYPED", "PREFER_AOT_PYTHON_PLUGINS"):  # TensorRT 11: strongly typed is the only mode
        if hasattr(trt.NetworkDefinitionCreationFlag, flag):
            flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, flag))
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {errors}")
    config = _configure(trt, builder, options)
    inputs = [network.get_input(i).name for i in range(network.num_inputs)]
    recorded = {}
    for profile in profiles:
        shapes = profile_shapes(profile, inputs)
        opt_profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            opt_profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(opt_profile)
        recorded[profile.name] = {name: [list(s) for s in shape] for name, shape in shapes.items()}
    if timing_cache is not None:
        cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
    monitor = _progress_monitor(trt, progress)
    if monitor is not None:
        config.progress_monitor = monitor
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineError(f"TensorRT could not build an engine from {onnx_path.name} (see the log above); try a larger "
                          "tensorrt.workspace_gib or lower limits")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ENGINE_NAME).write_bytes(memoryview(serialized))
    if timing_cache is not None:
        tmp = timing_cache.with_suffix(".tmp")
        tmp.write_bytes(memoryview(config.get_timing_cache().serialize()))
        tmp.replace(timing_cache)
    return TensorRTInfo(version=trt.__version__, gpu=gpu, compute_capability=f"{capability // 10}.{capability % 10}",
                        hardware_compatibility=options.hardware_compatibility.value,
                        version_compatible=options.version_compatible, precision=precision, profiles=recorded)
