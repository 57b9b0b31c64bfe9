"""A checkpoint read a layer at a time, for builds whose model does not fit in memory (`source.load: layers`).

    tensors.py       one tensor at a time from safetensors shards (memory-mapped), the protocol GGUF shares
    gguf_tensors.py  one tensor at a time from a GGUF file, named and processed as transformers loads it
    model.py         the checkpoint's own PyTorch model, its decoder layers loaded and dropped one at a time

The stages that use it live with their stage: the streamed export (graph/streamed_export.py) and verify's
streamed reference (graph/streamed_reference.py).
"""
