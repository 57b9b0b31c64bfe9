"""The ONNX graph: exported from a HuggingFace checkpoint, and verified against it.

    export.py         the export stage (EXPORT): the checkpoint -> ONNX with an explicit KV cache
    decoder.py        the HF model rebuilt around llmc::attention (what is exported)
    paged_decoder.py  the paged form: KV block pools and block tables
    kv_cache.py       the paged graph's KV cache dtypes (fp32, fp16, int8 with calibrated scales)
    passes.py         graph passes on the exported ONNX (fusions, deduplication, MatMulNBits merges)
    verify.py         the verify stage (VERIFY): the export on ONNX Runtime against PyTorch
"""
