"""Size benchmarks: random-weight checkpoints with real models' shapes (checkpoints.py), built and measured."""
