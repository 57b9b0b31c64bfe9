"""Peer benchmarks: llmc against HF transformers, onnxruntime-genai and llama.cpp on one checkpoint."""
