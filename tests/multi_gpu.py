"""What the multi-GPU TensorRT tests need and this machine may lack: TensorRT, `world` GPUs, NCCL."""

import pytest

from llmc.compiler.tensorrt.stage import tensorrt_missing


def missing(world: int) -> str | None:
    """What is missing for `world` ranks' TensorRT engines to meet in NCCL, or None."""
    lacking = tensorrt_missing()
    if lacking:
        return lacking
    import torch

    if torch.cuda.device_count() < world:
        return f"{world} GPUs (this machine has {torch.cuda.device_count()})"
    from llmc.runtime.runners.trt import EngineLoadError
    from llmc.runtime.runners.parallel.trt_rank import Nccl

    try:
        Nccl()
    except EngineLoadError:
        return "NCCL (libnccl.so.2)"
    return None


def marks(world: int) -> list:
    """The module marks of a test that needs them: tensorrt, cuda, skipped with what is missing."""
    lacking = missing(world)
    return [pytest.mark.tensorrt, pytest.mark.cuda,
            pytest.mark.skipif(lacking is not None, reason=f"needs TensorRT, {world} GPUs and NCCL: this machine "
                                                           f"lacks {lacking}")]
