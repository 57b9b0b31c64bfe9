"""The LoRA serving tests' shared build: the tiny Llama with two PEFT adapters made by PEFT itself (A: rank 4 on
every projection; B: rank 8 with rsLoRA, a rank_pattern and an alpha_pattern, on fewer modules), built once per test
run into a folder every xdist worker sees (shared_builds.py's pattern), and PEFT's own greedy tokens to compare with.
A also targets the untied LM head (PEFT saves a copy of its weight, which must be the base's).
"""

from __future__ import annotations

from pathlib import Path

from peft_adapters import make_adapter, peft_model  # noqa: F401 (make_adapter: the lora tests import it from here)
from shared_builds import exclusive, shared_dir

ADAPTER_A = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj", "lm_head"])  # the untied head: a copy saved too
ADAPTER_B = dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                 rank_pattern={"down_proj": 2, r"layers\.1\.self_attn\.q_proj": 6}, alpha_pattern={"v_proj": 4})
SPEC = {"limits": {"max_batch_size": 4, "max_seq_len": 128, "max_num_tokens": 64},
        "serving": {"default_max_tokens": 16, "max_queue_size": 64},
        "lora": {"max_slots": 2, "max_rank": 16, "max_host_adapters": 2}}


def two_adapters(checkpoint: Path, root: Path) -> dict[str, str]:
    """Adapters A and B made by PEFT on `checkpoint` in `root`: {name: folder}, as a spec's `adapters:` takes them."""
    return {"a": str(make_adapter(checkpoint, root / "a", 1, **ADAPTER_A)),
            "b": str(make_adapter(checkpoint, root / "b", 2, **ADAPTER_B))}


def lora_build(tmp_path_factory, checkpoint: Path):
    """(the build's version folder, {adapter name: its PEFT folder}): made by the first worker that asks."""
    from llmc.compiler import build
    from llmc.compiler.repository.package import VERSION
    from llmc.compiler.spec import parse_spec

    root = shared_dir(tmp_path_factory) / "lora-build"
    adapters = {"a": root / "adapters" / "a", "b": root / "adapters" / "b"}
    out = root / "tiny_lora"
    with exclusive(root.with_name("lora-build.lock")):
        if not (out / "model_repository").is_dir():
            make_adapter(checkpoint, adapters["a"], 1, **ADAPTER_A)
            make_adapter(checkpoint, adapters["b"], 2, **ADAPTER_B)
            spec = parse_spec({"name": "tiny_lora", "source": str(checkpoint), **SPEC,
                               "adapters": {k: str(v) for k, v in adapters.items()}})
            build(spec, output=out)
    return out / "model_repository" / "tiny_lora" / VERSION, adapters


def peft_greedy(checkpoint: Path, adapters: dict[str, Path], runs: list[tuple[list[int], str | None]],
                max_new_tokens: int) -> list[list[int]]:
    """PEFT's `generate` (greedy) for each (prompt ids, adapter name or None): its new tokens."""
    import torch

    model = peft_model(checkpoint, adapters)
    out = []
    with torch.no_grad():
        for ids, name in runs:
            kwargs = dict(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            if name is None:  # set_adapter / disable_adapter, not adapter_names: PEFT's expert LoRA has no mixed batch
                with model.disable_adapter():
                    out.append(model.generate(**kwargs)[0, len(ids):].tolist())
            else:
                model.set_adapter(name)
                out.append(model.generate(**kwargs)[0, len(ids):].tolist())
    return out


def engine_greedy(engine, requests: list[tuple[list[int], str | None]], max_tokens: int) -> list[list[int]]:
    """The engine's greedy tokens for each (prompt ids, adapter name or None), all sent at once into an idle engine
    and stepped until done: one mixed batch."""
    from llmc.runtime.decoding.sampling import SamplingParams

    assert len(engine.core._active) == 0
    out: dict[str, list[int]] = {}
    for i, (ids, name) in enumerate(requests):
        engine.add_request(f"q{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), adapter=name)
    while engine.has_work:
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return [out[f"q{i}"] for i in range(len(requests))]
