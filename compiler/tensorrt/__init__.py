"""The TensorRT target: the ONNX a TensorRT engine is built from, the engine, and its check against
ONNX Runtime.

    prep.py           the ONNX prepared for TensorRT: the spec's precision through ModelOpt AutoCast
    engine.py         the engine build
    verify_engine.py  the engine vs ONNX Runtime, compared by Polygraphy
    compat.py         the rules TensorRT sets for Q/DQ graphs, checked on the ONNX alone

Nothing here imports TensorRT at import time (only where it builds), so the package loads on any
machine. Inside it, `import tensorrt` is absolute: it names NVIDIA's package, not this one.
"""
