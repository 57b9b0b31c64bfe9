"""The serving engine. Imports no torch and no transformers: numpy and ONNX Runtime only."""
