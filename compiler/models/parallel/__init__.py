"""Tensor parallelism at export, Megatron style: which attention heads each of N ranks keeps, decided from the
config alone (heads.py), and a rank's share of any family's decoder (shard.py). Quantizing the ranks' graphs
together is compiler/quantize/ranks.py; running them, runtime/runners/parallel/."""
