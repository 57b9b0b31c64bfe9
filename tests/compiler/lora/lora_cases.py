"""What the LoRA tests share: adapters made by PEFT itself on a tiny checkpoint (both A and B random, so every
adapter visibly changes the logits), PEFT's logits for a prompt under one adapter or none, and one paged step of
a graph run on ONNX Runtime with each row's tokens in a slot."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from peft_adapters import make_adapter, peft_model  # noqa: F401 (make_adapter: the lora tests import it from here)

# per family: adapter A's targets, and adapter B (another rank, rsLoRA, a rank_pattern whose regex key picks one
# layer's module, an alpha_pattern) on fewer modules, so a fused site carries some modules' deltas and not others
ADAPTERS = {
    "llama": (dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                   "lm_head"]),  # untied: PEFT saves a copy of the head's weight beside the pair
              dict(target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                   rank_pattern={"down_proj": 2, r"layers\.1\.self_attn\.q_proj": 6}, alpha_pattern={"v_proj": 4})),
    "phi3": (dict(target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
             dict(target_modules=["qkv_proj", "down_proj"],
                  rank_pattern={"down_proj": 2, r"layers\.1\.self_attn\.qkv_proj": 6}, alpha_pattern={"qkv_proj": 4})),
    # GPT-2's Conv1D: weights [in, out], PEFT's fan_in_fan_out
    "gpt2": (dict(target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True),
             dict(target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                  rank_pattern={"c_fc": 2, r"h\.1\.attn\.c_attn": 6}, alpha_pattern={"c_attn": 4})),
}
RANK_A = dict(r=4, lora_alpha=8)
RANK_B = dict(r=8, lora_alpha=16, use_rslora=True)


def family_adapters(family: str, checkpoint: Path, root: Path) -> tuple[Path, Path]:
    a, b = ADAPTERS[family]
    return (make_adapter(checkpoint, root / "a", seed=1, **RANK_A, **a),
            make_adapter(checkpoint, root / "b", seed=2, **RANK_B, **b))


def peft_logits(checkpoint: Path, adapters: dict[str, Path], runs: list[tuple[list[int], str | None]]) -> list:
    """PEFT's logits [tokens, vocab] for each (token ids, adapter name or None), the adapters loaded from their
    folders by PEFT (PeftModel.from_pretrained / load_adapter)."""
    return model_logits(peft_model(checkpoint, adapters), runs)


def model_logits(model, runs: list[tuple[list[int], str | None]]) -> list:
    """A PEFT model's logits [tokens, vocab] for each (token ids, adapter name or None: its adapters disabled)."""
    import torch

    out = []
    with torch.no_grad():
        for ids, name in runs:
            if name is None:
                with model.disable_adapter():
                    out.append(model(torch.tensor([ids])).logits[0].numpy())
            else:
                model.set_adapter(name)
                out.append(model(torch.tensor([ids])).logits[0].numpy())
    return out


class PagedSteps:
    """Rows stepped through a paged graph on ONNX Runtime, their KV pools carried from step to step; every
    token of a row gets logits. `extra`: feeds besides the step's own (the LoRA stacks)."""

    def __init__(self, onnx_path: Path, layout, num_blocks: int = 32):
        from llmc.runtime.runners.ort import make_session

        self.session, self.layout, self.num_blocks = make_session(onnx_path, num_threads=2), layout, num_blocks
        self.pools = {n: np.zeros(layout.block_shape(num_blocks), np.float32) for n in layout.past_names()}
        self.past: dict[int, int] = {}

    def step(self, rows: list[tuple[int, list[int]]], extra: dict | None = None) -> list[np.ndarray]:
        """rows: (row id, new tokens); a row id keeps its blocks and past across steps."""
        from llmc.runtime.runners.paged import RowStep, pack

        per_row = 4  # blocks a row owns: 4 * block_size tokens at most
        steps = [RowStep(ids, self.past.get(r, 0), list(range(r * per_row, (r + 1) * per_row)), num_logits=len(ids))
                 for r, ids in rows]
        packed = pack(steps, block_size=self.layout.block_size, num_blocks=self.num_blocks, max_num_tokens=256,
                      vocab_size=256, sequence_lengths=bool(self.layout.step_inputs))
        names = [o.name for o in self.session.get_outputs()]
        outs = dict(zip(names, self.session.run(None, {**packed.feeds(), **self.pools, **(extra or {})})))
        self.outputs = outs  # every output of the last step, by name
        self.pools = {p: outs[q] for p, q in zip(self.layout.past_names(), self.layout.present_names())}
        for r, ids in rows:
            self.past[r] = self.past.get(r, 0) + len(ids)
        ends = np.cumsum([len(ids) for _, ids in rows])
        return [outs["logits"][end - len(ids):end] for end, (_, ids) in zip(ends, rows)]
