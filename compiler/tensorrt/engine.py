"""The TensorRT engine build, composed of small loaders in Polygraphy's style: each is a callable
made from its options that does its work only when called, so a build is their composition

    engine_from_network(network_from_onnx(path), create_config(options, profiles, cache, progress),
                        save_timing_cache=cache)()

    network_from_onnx    a strongly typed network (types come from the graph: TensorRT 11 has no
                         precision flags) parsed from the ONNX prepared for it (prep.py); the
                         LlmcFusedAttention nodes become the AOT plugin (plugins/trt/plugin.py), a
                         tensor-parallel rank's DistCollective nodes IDistCollectiveLayers, checked
                         to be all there (collectives.py)
    create_config        memory pool limit, optimization level, hardware / version compatibility,
                         multi-device execution for a rank's engine (a preview feature in 10.16),
                         the prefill and decode profiles over the same KV-cache inputs (profiles.py),
                         the timing cache read from <output>/engine/timing.cache, a progress monitor
    engine_from_network  the serialized engine; the timing cache written back, so a rebuild of the
                         same network on the same GPU skips the tactic timing

`build_engine` composes them, writes `model.plan` and returns what the manifest records about it.
The loaders import TensorRT when called, never before; `plugin_capability` and the profile shapes
(profiles.py) are plain functions, tested on CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from llmc.compiler.spec import HardwareCompatibility, TensorRTSpec
from llmc.compiler.tensorrt import collectives as collective_checks
from llmc.compiler.tensorrt.profiles import Profile, profile_shapes, recorded_shapes
from llmc.errors import EngineError
from llmc.runtime.manifest import TensorRTInfo

ENGINE_NAME = "model.plan"
TIMING_CACHE = "timing.cache"
AMPERE = 80  # PTX for sm_80 runs on every later GPU (the driver compiles it forward)

Progress = Callable[[int, int], None]


class Network(NamedTuple):
    """A parsed network with what must outlive it until the build is done."""

    builder: Any  # trt.Builder
    network: Any  # trt.INetworkDefinition
    parser: Any  # trt.OnnxParser: holds the weights the network refers to
    logger: Any  # trt.Logger of the builder and parser
    name: str  # the ONNX file's name, for messages


class Config(NamedTuple):
    config: Any  # trt.IBuilderConfig
    monitor: Any  # the progress monitor the config reports to (None: no progress), kept alive with it


class Engine(NamedTuple):
    serialized: Any  # trt.IHostMemory
    inputs: list[str]  # the network's input names, in order


def plugin_capability(options: TensorRTSpec, gpu_capability: int) -> int:
    """The GPU generation the plugin's PTX is compiled for."""
    return AMPERE if options.hardware_compatibility is HardwareCompatibility.ampere_plus else gpu_capability


def network_inputs(network) -> list[str]:
    return [network.get_input(i).name for i in range(network.num_inputs)]


def network_from_onnx(path: Path, collectives: Sequence[dict] = ()) -> Callable[[], Network]:
    """A loader of the network TensorRT's ONNX parser makes from `path`; `collectives` are the graph's
    DistCollective nodes (collectives.expected_collectives), each of which must become a layer."""

    def load() -> Network:
        import tensorrt as trt

        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        network = builder.create_network(_network_flags(trt))
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise EngineError(f"TensorRT's ONNX parser rejected {path.name}: {errors}"
                              f"{collective_checks.parse_hint(trt, list(collectives))}")
        collective_checks.check_network(trt, network, list(collectives), path.name)
        return Network(builder, network, parser, logger, path.name)

    return load


def _network_flags(trt) -> int:
    """Strongly typed (TensorRT 11's only mode, a flag in 10) and the AOT plugin preferred, where named."""
    flags = 0
    for flag in ("STRONGLY_TYPED", "PREFER_AOT_PYTHON_PLUGINS"):
        if hasattr(trt.NetworkDefinitionCreationFlag, flag):
            flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, flag))
    return flags


def create_config(options: TensorRTSpec, profiles: list[Profile], timing_cache: Path | None = None,
                  progress: Progress | None = None, multi_device: bool = False) -> Callable[[Any, Any], Config]:
    """A loader of the builder config for (builder, network): `options`, one optimization profile
    per entry of `profiles` (every network input needs a shape in each), the timing cache read from
    `timing_cache` (empty when the file is not there yet), `progress` called as the build goes, and
    `multi_device` for a tensor-parallel rank's network (its collectives)."""

    def load(builder, network) -> Config:
        import tensorrt as trt

        config = builder.create_builder_config()
        _set_options(trt, config, options)
        if multi_device:
            collective_checks.enable_multi_device(trt, config)
        inputs = network_inputs(network)
        for profile in profiles:
            opt_profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in profile_shapes(profile, inputs).items():
                opt_profile.set_shape(name, lo, opt, hi)
            config.add_optimization_profile(opt_profile)
        if timing_cache is not None:
            cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
            config.set_timing_cache(cache, ignore_mismatch=False)
        monitor = _progress_monitor(trt, progress)
        if monitor is not None:
            config.progress_monitor = monitor
        return Config(config, monitor)

    return load


def _set_options(trt, config, options: TensorRTSpec) -> None:
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gib * 2**30))
    config.builder_optimization_level = options.optimization_level
    if options.hardware_compatibility is not HardwareCompatibility.none:
        level = {HardwareCompatibility.ampere_plus: trt.HardwareCompatibilityLevel.AMPERE_PLUS,
                 HardwareCompatibility.same_compute_capability:
                     trt.HardwareCompatibilityLevel.SAME_COMPUTE_CAPABILITY}[options.hardware_compatibility]
        config.hardware_compatibility_level = level
    if options.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)


def _progress_monitor(trt, progress: Progress | None):
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


def engine_from_network(network: Callable[[], Network], config: Callable[[Any, Any], Config],
                        save_timing_cache: Path | None = None) -> Callable[[], Engine]:
    """A loader of the serialized engine built from the `network` loader's network with the
    `config` loader's config; the config's timing cache (create_config's `timing_cache`) is written
    to `save_timing_cache` after the build."""

    def load() -> Engine:
        net = network()
        built = config(net.builder, net.network)
        serialized = net.builder.build_serialized_network(net.network, built.config)
        if serialized is None:
            raise EngineError(f"TensorRT could not build an engine from {net.name} (see the log above); try a "
                              "larger tensorrt.workspace_gib or lower limits")
        if save_timing_cache is not None:
            tmp = save_timing_cache.with_suffix(".tmp")
            tmp.write_bytes(memoryview(built.config.get_timing_cache().serialize()))
            tmp.replace(save_timing_cache)
        return Engine(serialized, network_inputs(net.network))

    return load


def build_engine(onnx_path: Path, profiles: list[Profile], options: TensorRTSpec, precision: str, out_dir: Path,
                 timing_cache: Path | None = None, progress: Progress | None = None,
                 collectives: Sequence[dict] = ()) -> TensorRTInfo:
    """Build `out_dir/model.plan` from `onnx_path`; returns what the manifest records about it.
    `timing_cache` (None: none) is read before the build and written back after it; `collectives` are a
    tensor-parallel rank's DistCollective nodes (collectives.expected_collectives of `onnx_path`)."""
    import tensorrt as trt

    from llmc.plugins.gpu.ptx import PTX_ISA, isa_text, ptx_target
    from llmc.plugins.trt import plugin as trt_plugin
    from llmc.runtime.runners.trt import gpu_identity

    gpu, capability = gpu_identity()
    target = plugin_capability(options, capability)
    trt_plugin.set_target_capability(target)
    trt_plugin.register()  # before parsing: the parser maps LlmcFusedAttention nodes to it
    build = engine_from_network(network_from_onnx(onnx_path, collectives),
                                create_config(options, profiles, timing_cache, progress, bool(collectives)),
                                save_timing_cache=timing_cache)
    engine = build()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ENGINE_NAME).write_bytes(memoryview(engine.serialized))
    return TensorRTInfo(version=trt.__version__, gpu=gpu, compute_capability=f"{capability // 10}.{capability % 10}",
                        hardware_compatibility=options.hardware_compatibility.value,
                        version_compatible=options.version_compatible, precision=precision,
                        profiles=recorded_shapes(profiles, engine.inputs),
                        # what the plugin's PTX was compiled for (plugins/gpu/ptx.py): the load check reads them
                        plugin_ptx_isa=isa_text(PTX_ISA), plugin_ptx_target=ptx_target(target))
