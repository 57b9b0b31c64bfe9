"""The ONNX graph: exported from a HuggingFace checkpoint, and verified against it.

    export.py         the export stage (EXPORT): the checkpoint -> ONNX with an explicit KV cache
    files.py          model.onnx and its external weights file: written, and read back
    kv_cache.py       the paged graph's KV cache dtypes (fp32, fp16, int8 with calibrated scales)
    passes.py         graph passes on the exported ONNX (fusions, deduplication, MatMulNBits merges)
    verify.py         the verify stage (VERIFY): the export on ONNX Runtime against PyTorch

The modules torch.onnx traces are compiler/models/ (the HF model rebuilt around llmc::attention, one
file per family) and compiler/paged_decoder.py (its paged form): the exported graph records their
module and file in its nodes' metadata (namespace, class_hierarchy, stack_trace), so moving them
changes model.onnx's bytes (not its graph).
"""
