"""Static modes (`int8`, `fp8`: Q/DQ for TensorRT, W8A8).

Made: the activation ranges, calibrated on the spec's calibration text (calibrate.py) after
SmoothQuant when it applies (smoothquant.py), or reused from the last build when the graph, the
samples and the method are the same. Converted: NVIDIA ModelOpt places Q/DQ and the ranges become its
activation scales (qdq.py). They quantize the reference lowering (plain ONNX: TensorRT reads it, and
ONNX Runtime runs it to calibrate and to measure quality); fp8 is measured with ONNX Runtime's graph
optimizations off, as a reference path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.compiler.graph.files import ONNX_NAME, load_graph, save_model
from llmc.compiler.graph.passes import deduplicate_initializers
from llmc.compiler.hashing import hash_json
from llmc.compiler.quantize.calibrate import Calibration, calibrate, calibration_key
from llmc.compiler.quantize.handler import Job, Quantized, calibration_windows, untie_lm_head
from llmc.compiler.quantize.smoothquant import smooth
from llmc.compiler.spec import QuantizationSpec, QuantMode
from llmc.errors import QuantizationError, UnsupportedError


@dataclass
class Calibrated:
    """The graph to place Q/DQ on (saved under the job's scratch folder) and its activation ranges."""

    graph: Path
    external: bool  # the graph keeps its weights in an external data file
    sample: np.ndarray  # the one sample ModelOpt's placement pass runs
    calibration: Calibration


@dataclass(frozen=True)
class StaticQDQ:
    mode: QuantMode
    bits: int = 8

    def check(self, spec: QuantizationSpec) -> None:
        try:
            import modelopt.onnx.quantization  # noqa: F401
        except ImportError as err:
            raise UnsupportedError(
                f"quantization.mode: {spec.mode.value} needs NVIDIA ModelOpt's ONNX quantizer "
                f"({err.name} is missing); install llmc with the `quantize` extra") from None

    def calibrates(self, spec: QuantizationSpec) -> bool:
        return True

    def tools(self) -> dict[str, str | None]:
        import importlib.metadata

        return {"modelopt": importlib.metadata.version("nvidia-modelopt")}

    def make_quantized(self, job: Job) -> Calibrated:
        spec, exported = job.spec, job.exported
        windows = calibration_windows(spec, job.tokenizer)
        model = load_graph(job.source)
        untie_lm_head(model.graph)
        if spec.smoothed:
            smooth(model, exported.kv_layout, windows, spec.smoothquant_alpha, num_threads=job.num_threads,
                   progress=job.progress)
        external = save_model(model, job.work)
        graph = hash_json({"export": exported.files, "smoothquant": spec.smoothed and spec.smoothquant_alpha})
        key = calibration_key(graph, windows, spec.calibration.method.value)
        calibration = Calibration.load_cached(job.previous, key) if job.previous is not None else None
        if calibration is None:
            calibration = calibrate(model, exported.kv_layout, windows, spec.calibration.method.value, key=key,
                                    num_threads=job.num_threads, progress=job.progress)
        return Calibrated(job.work / ONNX_NAME, external, windows[0], calibration)

    def convert_for_runtime(self, made: Calibrated, job: Job) -> Quantized:
        from llmc.compiler.quantize.qdq import place_qdq, set_activation_scales

        spec, cal = job.spec, made.calibration
        proto = deduplicate_initializers(place_qdq(made.graph, self.mode, job.exported.kv_layout, made.sample,
                                                   made.external))
        if set_activation_scales(proto.graph, cal, self.mode) == 0:
            raise QuantizationError(f"quantization.mode {self.mode.value}: no activation was quantized "
                                    f"(the graph has no linear layer ModelOpt could place Q/DQ on)")
        kind = "int8" if self.mode is QuantMode.int8 else "float8e4m3fn"
        method = (f"ModelOpt Q/DQ ({kind}): weights per output channel, symmetric, stored quantized behind "
                  f"DequantizeLinear; activations per tensor, symmetric (zero point 0); on both inputs of every "
                  f"linear-layer MatMul, LM head included"
                  + (f"; SmoothQuant alpha {spec.smoothquant_alpha}" if spec.smoothed else ""))
        note = f"{cal.method} over {cal.samples} sample(s) of {cal.seq_len} tokens from {spec.calibration.data}"
        return Quantized(proto, method, note, calibration=cal, optimize=self.mode is not QuantMode.fp8)
