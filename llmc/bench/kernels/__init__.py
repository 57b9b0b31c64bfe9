"""Kernel benchmarks: one op or kernel against ONNX Runtime's own on the same work, no model around it."""
