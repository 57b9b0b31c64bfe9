"""Activation-aware weight scaling (AWQ, Lin et al., 2024) before weight-only rounding.

A few input channels of each linear layer carry most of the activation energy; quantization error
on their weights costs the most. For every smoothing site (smoothquant.py: a norm, or the MLP's up
projection, feeding linear layers) the weights' rows are multiplied by s and the producer divided by
s, with s = mean|X_j| ** alpha, alpha picked per site from a grid to minimize the error of the
layers' outputs on calibration activations when the scaled weights are rounded to `MatMulNBits`
codes (blocks along the input dimension, symmetric or not like the final codes:
blockwise.fake_quantize). The fp32 function is unchanged; only what rounding loses moves; the final
codes are chosen by blockwise.search.
Written here because ONNX Runtime's MatMulNBits quantizer has no AWQ (only RTN, HQQ, and GPTQ via
Intel Neural Compressor) and ModelOpt's ONNX AWQ needs CuPy and a GPU (its NumPy path calls
`.get()` on arrays).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from llmc.compiler.quantize.blockwise import fake_quantize
from llmc.compiler.quantize.calibrate import activation_statistics
from llmc.compiler.quantize.channel_scales import ChannelScales
from llmc.compiler.quantize.smoothquant import apply_scales, smoothable
from llmc.compiler.quantize.weight_file import WeightFile
from llmc.runtime.layout import KVLayout

ALPHAS = np.linspace(0.0, 1.0, 11)
TOKENS = 256  # calibration tokens per site used to score a scale
# output columns per weight used to score a scale: a column's error is its own (blocks run along the input), so a
# seeded sample, weighed by N / n, estimates the sum over all N; at 0.5B (the LM head's 151,936 columns a quarter of
# the work, gate/up's 4,864 two fifths) the search fell from 26.6 to 14.2 s
COLUMNS = 2048


def search_scale(x: np.ndarray, weights: list[np.ndarray], bits: int, block: int,
                 symmetric: bool = False, columns: int = COLUMNS) -> tuple[np.ndarray, float]:
    """The per-channel scale s (and its alpha) minimizing sum ||x W - (x / s) Q(W * s)||^2 over the weights
    (computed as x @ (Q(W * s) / s): the same product, one pass of fake_quantize), each weight's error estimated
    on at most `columns` of its columns."""
    mean = np.abs(x).mean(0) + 1e-8
    x = np.ascontiguousarray(x, dtype=np.float32)
    weights, shares = zip(*(sampled_columns(w, columns) for w in weights))
    reference = [x @ w for w in weights]
    # every alpha rounds into and multiplies out to the same buffers: fresh ones faulted in every page, eleven
    # times over the model's weights (at 0.5B the rounding's share of the search fell from ~17 to ~6 core-seconds)
    rounded = [np.empty(w.shape, np.float32) for w in weights]
    products = [np.empty_like(ref) for ref in reference]
    best = (np.inf, np.ones_like(mean), 0.0)
    for alpha in ALPHAS:
        s = mean ** alpha
        s = s / np.sqrt(s.max() * s.min())
        err = 0.0
        for ref, w, q, product, share in zip(reference, weights, rounded, products, shares):
            np.matmul(x, fake_quantize(w, bits, block, symmetric, row_scale=s, out=q), out=product)
            product -= ref
            flat = product.reshape(-1)
            err += share * float(np.dot(flat, flat))
        if err < best[0]:
            best = (err, s, float(alpha))
    return best[1].astype(np.float32), best[2]


def sampled_columns(w: np.ndarray, columns: int) -> tuple[np.ndarray, float]:
    """`w` [K, N], or `columns` of its N columns drawn without replacement (seeded: the same draw every build),
    and what a column of them stands for (N / n)."""
    n = w.shape[1]
    if n <= columns:
        return w, 1.0
    keep = np.sort(np.random.default_rng(0).choice(n, columns, replace=False))
    return np.ascontiguousarray(w[:, keep]), n / columns


@dataclass
class Awq:
    alphas: list[float]  # the alpha chosen per site
    importance: dict[str, np.ndarray]  # E[x_k^2] of every linear layer's input, as the scaled model sees it
    scales: ChannelScales  # what the scaling did to the activations (a LoRA branch reads them so)


def awq(model, layout: KVLayout, windows: list[np.ndarray], bits: int, block: int, *, symmetric: bool = False,
        num_threads: int = 0, progress: Callable[[int, int], None] | None = None,
        graph_file: Path | None = None, weights: WeightFile | None = None, segmented: bool = False) -> Awq:
    """Scale `model`'s weights in place for `bits`-bit block-wise quantization (`symmetric` codes or
    not). Returns the alphas and the importance blockwise.search weighs by, from the same calibration
    pass: scaling leaves the function unchanged, so only a site's own tensor changes (to x / s, its mean
    squares to E[x^2] / s^2). `graph_file`: the export `model` was loaded from (calibrate.run_tensors);
    `weights`: where `model`'s weights lie (weight_file.py; default: in the proto); `segmented`: the calibration
    pass runs `graph_file` a segment at a time (calibrate.activation_statistics).
    (AWQ's second step, a per-block clipping search, is blockwise.search's job.)"""
    weights = weights or WeightFile.of(model.graph)
    sites = smoothable(model.graph)
    initializers = {t.name: t for t in model.graph.initializer}
    found: dict[int, tuple[np.ndarray, float]] = {}  # site index -> (scale, alpha)

    def search_sites(tensor: str, x: np.ndarray) -> None:  # a tensor's rows are in: its sites' scales, then drop x
        for i, site in enumerate(sites):
            if site.tensor == tensor:
                found[i] = search_scale(x, [weights.array(initializers[r.input[1]]) for r in site.readers],
                                        bits, block, symmetric)
                if progress:
                    progress(len(found), len(sites), "AWQ scales searched (sites)")

    _, importance = activation_statistics(model, layout, windows, list(dict.fromkeys(s.tensor for s in sites)),
                                          TOKENS, num_threads=num_threads, graph_file=graph_file, progress=progress,
                                          segmented=segmented, complete=search_sites)
    scales, alphas = zip(*(found[i] for i in range(len(sites)))) if sites else ((), ())
    done = apply_scales(model, sites, list(scales), weights)
    for site, s in zip(sites, scales):
        importance[site.tensor] = importance[site.tensor] / np.square(s.astype(np.float64))
    return Awq(list(alphas), importance, done)
