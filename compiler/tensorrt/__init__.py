"""The TensorRT target: the ONNX a TensorRT engine is built from, the engine, and its check against
ONNX Runtime.

    stage.py          the tensorrt stage over artifacts: check(spec), cache_key_parts(spec),
                      make_engine(...) -> EngineModel, summary(engine), and TENSORRT, its declaration; a split
                      model (parallel.tensor) gets one engine per rank, rank{r}/model.plan
    prep.py           the ONNX prepared for TensorRT: the spec's precision through ModelOpt AutoCast
    profiles.py       the prefill and decode optimization profiles from `limits` (the dry run lists them too)
    engine.py         the build as small loaders: network_from_onnx, create_config, engine_from_network
    verify_engine.py  the engine vs ONNX Runtime, compared by Polygraphy
    compat.py         the rules TensorRT sets for Q/DQ graphs, checked on the ONNX alone

Nothing here imports TensorRT at import time (only where it builds), so the package loads on any
machine. Inside it, `import tensorrt` is absolute: it names NVIDIA's package, not this one.
"""
