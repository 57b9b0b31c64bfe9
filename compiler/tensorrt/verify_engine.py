"""The engine against ONNX Runtime: both runners driven the way serving drives them (graph/greedy.py's
runner_greedy: each prompt prefilled into its slot, then every row decoding in one batch), their
logits compared by Polygraphy's comparator at the engine precision's tolerance (`compare_runners`;
`verify_engine` runs it on the verify prompts and raises VerifyError when the comparator rejects).

The ONNX Runtime side runs the graph the engine was built from when ONNX Runtime can run it (the
reference lowering, Q/DQ graphs); a plugin graph is compared with the same checkpoint's fused export. A split
model's rank engines run together (TrtTensorParallelRunner: one GPU each) against the whole model's fused export.
Logits are compared for every prompt position and every decode step up to a row's first greedy
divergence (later steps see different tokens); the greedy agreement is reported alongside. An engine built with the
spec's LoRA adapters (`EngineLora`) is compared on the base rows and then on each adapter's, against ONNX Runtime
running the reference graph with the same branch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from llmc.compiler.artifacts import ExportedModel, QuantizedModel, VerifyCase
from llmc.compiler.graph.greedy import runner_greedy
from llmc.compiler.graph.verify import compare
from llmc.compiler.spec import BuildSpec
from llmc.compiler.stage import ticker
from llmc.errors import VerifyError
from llmc.runtime.layout import KVLayout
from llmc.runtime.lora.sites import Site
from llmc.runtime.lora.stacks import AdapterWeights
from llmc.runtime.manifest import TensorRTInfo
from llmc.runtime.runners.protocol import Runner

# (atol, rtol) on logits: fp32 engines still use TF32 tensor cores; fp16/bf16 carry their rounding
# through every layer. Starting points, to be re-measured on GPU builds (no GPU was lent so far).
ENGINE_TOLERANCE = {"fp32": (2e-2, 1e-3), "fp16": (0.25, 0.02), "bf16": (1.0, 0.05)}


def compare_runners(reference: Runner, candidate: Runner, prompts: list[list[int]], steps: int, precision: str,
                    names: tuple[str, str] = ("onnxruntime", "tensorrt"),
                    tick: Callable[[], None] = lambda: None,
                    adapters: Sequence[AdapterWeights | None] | None = None) -> tuple[VerifyCase, bool]:
    """(the greedy/logit comparison, whether Polygraphy's comparator accepts the logits); `adapters`: each row's
    LoRA adapter, for runners with the LoRA branch."""
    from polygraphy.comparator import Comparator, CompareFunc, RunResults
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.logger import G_LOGGER

    atol, rtol = ENGINE_TOLERANCE[precision]
    refs = runner_greedy(reference, prompts, steps, tick, adapters)
    cands = runner_greedy(candidate, prompts, steps, tick, adapters)
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


def reference_graph(source: ExportedModel | QuantizedModel, source_dir: Path, exported: ExportedModel, torch_model,
                    tokenizer, scratch: Path, source_hash: str) -> tuple[Path, KVLayout]:
    """The graph ONNX Runtime runs for the comparison: the one the engine was built from when ONNX
    Runtime can run it, else (the plugin node) the same checkpoint's fused export, written to `scratch`."""
    if exported.lowering.runs_on_onnxruntime:
        return source_dir / source.onnx, source.kv_layout
    from llmc.compiler.graph import export as export_stage
    from llmc.plugins.op.lowering import Lowering

    ref = export_stage.export(torch_model, tokenizer, scratch, lowering=Lowering.fused, source_hash=source_hash,
                              inputs_hash="engine-reference")
    return scratch / ref.onnx, ref.kv_layout


def engine_runner(plans: list[Path], layout: KVLayout, info: TensorRTInfo, lora=None, **sizes) -> Runner:
    """The runner of the engine `plans` (one per rank: a split model's run together, TrtTensorParallelRunner);
    `lora`: (sites, max_slots, max_rank) of an engine built with the LoRA branch (one rank: adapters refuse a
    split)."""
    if len(plans) > 1:
        from llmc.runtime.runners.parallel.trt_group import TrtTensorParallelRunner

        return TrtTensorParallelRunner(plans, layout, info=info, **sizes)
    from llmc.runtime.runners.trt import TrtRunner

    return TrtRunner(plans[0], layout, info=info, lora=lora, **sizes)


@dataclass(frozen=True)
class EngineLora:
    """The spec's adapters as an engine takes them (compiler/tensorrt/stage.py): the sites its branch was built
    with, the limits its profiles cover, each adapter's arrays; and the sites of the ONNX Runtime reference's LoRA
    graph (`reference_sites`: the same names, found on that graph)."""

    sites: list[Site]
    max_slots: int
    max_rank: int
    adapters: dict[str, AdapterWeights]
    reference_sites: list[Site] | None = None

    @property
    def runner(self) -> tuple[list[Site], int, int]:
        return self.sites, self.max_slots, self.max_rank


def verify_engine(plans: list[Path], layout: KVLayout, info: TensorRTInfo, reference: tuple[Path, KVLayout],
                  tokenizer, vocab_size: int, spec: BuildSpec,
                  progress: Callable[[int, int], None] | None = None, lora: EngineLora | None = None) -> str:
    """The engine `plans` (each rank's, in rank order) vs ONNX Runtime running `reference` on the verify prompts, at
    the serving limits; the summary line, or VerifyError when Polygraphy rejects the engine's logits. `lora`: the
    engine has the LoRA branch and `reference` is a LoRA graph: the base rows, then each adapter's, compared."""
    from llmc.compiler.graph.verify import prompt_ids
    from llmc.runtime.runners.ort import OrtRunner

    steps, lim, precision = spec.verify.decode_steps, spec.limits, spec.precision.value
    prompts = [p[:lim.max_seq_len - steps] for p in prompt_ids(tokenizer, vocab_size)[:lim.max_batch_size]]
    ort = OrtRunner(reference[0], reference[1], max_batch=len(prompts), capacity=lim.max_seq_len,
                    num_threads=spec.serving.num_threads, lora=lora.reference_sites if lora else None)
    try:
        trt = engine_runner(plans, layout, info, lora=lora.runner if lora else None, max_batch=len(prompts),
                            capacity=lim.max_seq_len, max_num_tokens=lim.max_num_tokens)
    except BaseException:
        ort.close()
        raise
    runs = [(None, None)] + [(name, [w] * len(prompts)) for name, w in (lora.adapters.items() if lora else ())]
    tick = ticker(progress, 2 * steps * len(runs))
    results = []
    try:
        for name, adapters in runs:
            results.append((name, *compare_runners(ort, trt, prompts, steps, precision, tick=tick, adapters=adapters)))
    finally:  # the engine's KV cache and contexts hold GPU memory the build's next steps may need
        trt.close()
        ort.close()
    atol, rtol = ENGINE_TOLERANCE[precision]
    split = f"{len(plans)} rank engines together " if len(plans) > 1 else ""
    _, case, accepted = results[0]
    summary = (f"{split}vs ONNX Runtime: greedy tokens {case.token_agreement:.0%} equal over {steps} steps, "
               f"max |Δlogit| {case.max_abs_logit_diff:.2e} (Polygraphy atol {atol}, rtol {rtol}: "
               f"{'passed' if accepted else 'FAILED'})")
    summary += "".join(f"; adapter {name}: greedy tokens {c.token_agreement:.0%} equal, max |Δlogit| "
                       f"{c.max_abs_logit_diff:.2e} ({'passed' if ok else 'FAILED'})" for name, c, ok in results[1:])
    if not all(ok for _, _, ok in results):
        raise VerifyError(f"engine verification failed: {summary}")
    return summary
