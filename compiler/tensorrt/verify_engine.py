"""The engine against ONNX Runtime: both runners driven the way serving drives them (verify.py's
runner_greedy: each prompt prefilled into its slot, then every row decoding in one batch), their
logits compared by Polygraphy's comparator at the engine precision's tolerance.

The ONNX Runtime side runs the graph the engine was built from when ONNX Runtime can run it (the
reference lowering, Q/DQ graphs); a plugin graph is compared with the same checkpoint's fused export.
Logits are compared for every prompt position and every decode step up to a row's first greedy
divergence (later steps see different tokens); the greedy agreement is reported alongside.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from llmc.compiler.artifacts import VerifyCase
from llmc.compiler.verify import compare, runner_greedy

# (atol, rtol) on logits: fp32 engines still use TF32 tensor cores; fp16/bf16 carry their rounding
# through every layer. Starting points, to be re-measured on GPU builds (no GPU was lent so far).
ENGINE_TOLERANCE = {"fp32": (2e-2, 1e-3), "fp16": (0.25, 0.02), "bf16": (1.0, 0.05)}


def compare_runners(reference, candidate, prompts: list[list[int]], steps: int, precision: str,
                    names: tuple[str, str] = ("onnxruntime", "tensorrt"),
                    tick: Callable[[], None] = lambda: None) -> tuple[VerifyCase, bool]:
    """(the greedy/logit comparison, whether Polygraphy's comparator accepts the logits)."""
    from polygraphy.comparator import Comparator, CompareFunc, RunResults
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.logger import G_LOGGER

    atol, rtol = ENGINE_TOLERANCE[precision]
    refs = runner_greedy(reference, prompts, steps, tick)
    cands = runner_greedy(candidate, prompts, steps, tick)
    case = compare(f"batch-{len(prompts)}", refs, cands, prompts, steps, atol)
    results = RunResults()
    for name, decoded in zip(names, (refs, cands)):
        iterations = []
        for row, (prefill, last) in enumerate(decoded):
            end = case.first_divergence[row]
            compared = np.stack(last[:steps if end is None else end + 1])  # [steps compared, V]
            iterations.append(IterationResult({"prefill_logits": prefill.astype(np.float32),
                                               "decode_logits": compared.astype(np.float32)}, runner_name=name))
        results.add(iterations, runner_name=name)
    with G_LOGGER.verbosity(G_LOGGER.CRITICAL):
        accuracy = Comparator.compare_accuracy(
            results, compare_func=CompareFunc.simple(atol={"": atol}, rtol={"": rtol}, check_shapes=True))
    return case, bool(accuracy)
