"""Static Q/DQ quantization (`int8`, `fp8`) for TensorRT, through NVIDIA ModelOpt's ONNX quantizer.

ModelOpt places the QuantizeLinear/DequantizeLinear pairs the way TensorRT wants them: on both
inputs of every linear-layer MatMul (the LM head included once `untie_lm_head` has made its weight
an initializer), symmetric with zero point 0, weights per output channel and stored already
quantized (`dq_only`: int8 or float8e4m3fn initializers behind a DequantizeLinear), activations per
tensor. Its own calibration pass is only used for placement (one sample); the activation scales are
then set from llmc's calibration (calibrate.py, over all samples, with the spec's method), because
ModelOpt offers max and entropy only and ignores a calibration cache in fp8 mode.
Scale = amax / 127 (int8) or amax / 448 (the largest float8e4m3fn).
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from pathlib import Path

import numpy as np

from llmc.compiler.quantize.calibrate import Calibration, feeds
from llmc.compiler.spec import QuantMode
from llmc.errors import QuantizationError
from llmc.runtime.layout import KVLayout

QMAX = {QuantMode.int8: 127.0, QuantMode.fp8: 448.0}


class _OneSample:
    """The CalibrationDataReader ModelOpt calls (it also wants get_first and rewind)."""

    def __init__(self, sample: dict[str, np.ndarray]):
        self.sample, self._given = sample, False

    def get_next(self):
        if self._given:
            return None
        self._given = True
        return self.sample

    def get_first(self):
        return self.sample

    def rewind(self):
        self._given = False


def place_qdq(source: Path, mode: QuantMode, layout: KVLayout, sample: np.ndarray, external: bool):
    """ModelOpt's Q/DQ graph for `source` (fp32 kept as the high precision); returns the ModelProto."""
    import onnx
    from modelopt.onnx.quantization import quantize as modelopt_quantize

    with tempfile.TemporaryDirectory(prefix="llmc-qdq-") as tmp:
        output = Path(tmp) / "qdq.onnx"
        captured = io.StringIO()
        try:
            with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
                modelopt_quantize(
                    str(source), quantize_mode=mode.value, calibration_data_reader=_OneSample(feeds(layout, sample)),
                    calibration_method="max", calibration_eps=["cpu"], op_types_to_quantize=["MatMul"],
                    high_precision_dtype="fp32", dq_only=True, use_external_data_format=external,
                    output_path=str(output), log_level="CRITICAL")
        except Exception as err:  # ModelOpt raises bare asserts and ValueErrors; keep its output for the user
            raise QuantizationError(f"ModelOpt could not quantize {source} ({mode.value}): {err!r}\n"
                                    f"{captured.getvalue()[-2000:]}") from err
        finally:
            for name in ("modelopt", "modelopt.onnx"):
                logging.getLogger(name).handlers.clear()
        return onnx.load(str(output))


def set_activation_scales(graph, calibration: Calibration, mode: QuantMode) -> int:
    """Overwrite the scale of every activation QuantizeLinear with calibrated amax / QMAX[mode]."""
    from onnx import numpy_helper

    initializers = {t.name: t for t in graph.initializer}
    done = 0
    for node in graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] not in calibration.amax:
            continue
        scale = max(calibration.amax[node.input[0]], 1e-8) / QMAX[mode]
        initializers[node.input[1]].CopyFrom(numpy_helper.from_array(np.array(scale, dtype=np.float32), node.input[1]))
        done += 1
    return done
