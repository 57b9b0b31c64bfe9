"""Verify stage: the exported graph on ONNX Runtime against the PyTorch model it came from.

Two cases, each a prefill and `decode_steps` greedy steps feeding present -> past: batch 1, and a
left-padded batch of three prompts of different lengths. Each side decodes on its own greedy
tokens; logits are compared at every prompt position and at every step up to a row's first
divergence. The case passes when the greedy tokens agree everywhere and the largest |Δlogit| is
within the spec's tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from llmc.compiler.artifacts import ExportedModel, VerifyCase, VerifyReport
from llmc.runtime.onnx_session import OrtDecoder

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
)
RANDOM_PROMPT_LENGTHS = (7, 13, 4)  # used when the source has no tokenizer

Progress = Callable[[int, int], None]


def prompt_ids(tokenizer, vocab_size: int) -> list[list[int]]:
    if tokenizer is not None:
        return [tokenizer(p)["input_ids"] for p in PROMPTS]
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab_size, n).tolist() for n in RANDOM_PROMPT_LENGTHS]


def left_pad(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    return ids, mask


def positions(mask: np.ndarray) -> np.ndarray:
    return np.clip(np.cumsum(mask, axis=1) - 1, 0, None)


def greedy_decode(step, empty_past, ids: np.ndarray, mask: np.ndarray, steps: int,
                  on_step: Callable[[], None]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Prefill + `steps` greedy decode steps. Returns the prefill logits and each step's last logits."""
    logits, past = step(ids, mask, positions(mask), empty_past(ids.shape[0]))
    prefill, last = logits, [logits[:, -1]]
    for _ in range(steps - 1):
        token = last[-1].argmax(-1)[:, None]
        mask = np.concatenate([mask, np.ones_like(token)], axis=1)
        logits, past = step(token, mask, positions(mask)[:, -1:], past)
        last.append(logits[:, -1])
        on_step()
    on_step()
    return prefill, last


def torch_stepper(model):
    """The PyTorch model behind the same step interface as the ONNX Runtime decoder."""
    import torch
    from transformers import DynamicCache

    def step(ids, mask, pos, cache):
        with torch.no_grad():
            out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                        position_ids=torch.from_numpy(pos), past_key_values=cache, use_cache=True)
        return out.logits.float().numpy(), out.past_key_values

    return step, lambda batch: DynamicCache(config=model.config)


def compare(name: str, ref, cand, mask: np.ndarray, prompts: list[list[int]], steps: int, tolerance: float) -> VerifyCase:
    (ref_prefill, ref_last), (cand_prefill, cand_last) = ref, cand
    valid = mask.astype(bool)
    diff = float(np.abs(ref_prefill[valid] - cand_prefill[valid]).max())
    ref_tokens = np.stack([l.argmax(-1) for l in ref_last], axis=1)
    cand_tokens = np.stack([l.argmax(-1) for l in cand_last], axis=1)
    first_divergence: list[int | None] = []
    for row in range(ref_tokens.shape[0]):
        differ = np.nonzero(ref_tokens[row] != cand_tokens[row])[0]
        end = int(differ[0]) if differ.size else steps
        first_divergence.append(int(differ[0]) if differ.size else None)
        # step k's logits depend on tokens < k only, so they are comparable through `end`
        for k in range(min(end + 1, steps)):
            diff = max(diff, float(np.abs(ref_last[k][row] - cand_last[k][row]).max()))
    agreement = float((ref_tokens == cand_tokens).mean())
    return VerifyCase(name=name, batch=len(prompts), prompt_lengths=[len(p) for p in prompts], decode_steps=steps,
                      max_abs_logit_diff=diff, token_agreement=agreement, first_divergence=first_divergence,
                      passed=agreement == 1.0 and diff <= tolerance)


def verify(exported: ExportedModel, export_dir: Path, model, tokenizer, out_dir: Path, *, inputs_hash: str,
           steps: int = 32, tolerance: float = 1e-3, num_threads: int = 0,
           progress: Progress | None = None) -> VerifyReport:
    """Run both models on the verify prompts and write `out_dir/verify.json`. The report is falsy
    when a case failed; raising is the caller's decision."""
    decoder = OrtDecoder(export_dir / exported.onnx, exported.kv_layout, num_threads)
    ref_step, ref_past = torch_stepper(model)
    prompts = prompt_ids(tokenizer, exported.model.vocab_size)
    cases_in = [("batch-1", prompts[:1]), ("padded-batch-3", prompts)]
    total, done = 2 * steps * len(cases_in), 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    cases = []
    for name, batch in cases_in:
        ids, mask = left_pad(batch)
        ref = greedy_decode(ref_step, ref_past, ids, mask, steps, tick)
        cand = greedy_decode(decoder.step, decoder.empty_past, ids, mask, steps, tick)
        cases.append(compare(name, ref, cand, mask, batch, steps, tolerance))
    report = VerifyReport(
        inputs_hash=inputs_hash, reference=f"pytorch ({exported.model.model_type}, fp32)",
        candidate="onnxruntime CPUExecutionProvider", tolerance=tolerance,
        max_abs_logit_diff=max(c.max_abs_logit_diff for c in cases), cases=cases, passed=all(c.passed for c in cases),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    report.save(out_dir)
    return report
