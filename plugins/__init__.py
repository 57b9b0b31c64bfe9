"""The fused attention op (torch reference, ONNX lowerings, kernels). Imports neither compiler nor runtime."""
