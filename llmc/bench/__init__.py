"""llmc's benchmarks: one harness, one module per question, run as `python -m llmc.bench NAME [args]`.

    python -m llmc.bench --list                 # every benchmark, by group
    python -m llmc.bench sizes --help           # one benchmark's arguments

Groups (registry.py): kernels/ (one op or kernel against ONNX Runtime's), engine/ (a graph or engine
choice, in process), serving/ (through a real Triton server), compare/ (the peers group: llmc against its
peers on one checkpoint), sizes/ (random-weight checkpoints of real models' shapes). The library the benchmarks
share: harness.py (passes, turns, medians of per-pass ratios, JSON), builds.py (the build cache),
checkpoints.py (sized checkpoints), peers.py (onnxruntime-genai, llama.cpp, HF transformers as
plug-ins), streams.py (concurrent streams at size). load.py is `llmc bench`'s load generator.

Nothing heavy is imported here: the CLI's `llmc bench` and llmc/soak.py import load.py through this package.
"""
