"""A PEFT LoRA adapter read from its folder and checked: what llmc serves of it, with PEFT's exact semantics.

A folder holds `adapter_config.json` (PEFT's LoraConfig) and `adapter_model.safetensors` (the tensors, keys
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]). PEFT computes, for each
target module, y = base(x) + scaling * B(A(x)), scaling = alpha / r, or alpha / sqrt(r) with `use_rslora`,
where r and alpha are the module's own: `rank_pattern` and `alpha_pattern` keys match a module name as PEFT's
`get_pattern_key` matches them (a key is a regex that must match the whole name or a suffix after a '.'),
reused here, not re-implemented. The config is read with PEFT's own `PeftConfig.from_pretrained` and the
tensors with its `load_peft_weights`, once the files are known to be there (both would otherwise ask the Hub).

What llmc does not serve is refused at load, naming the field: DoRA, `modules_to_save`, trained biases, and
the other PEFT variants whose forward is not the plain one above (REFUSED). The checks against the base model
(shapes, the modules it has, a tied LM head) are base.py's; the rank limit is the caller's.

An adapter on the LM head carries a copy of the head's weight (PEFT's `save_embedding_layers`, on by default when
`lm_head` is a target), which PEFT loads in place of the base's. llmc shares the base's weights, so it serves such
an adapter only when the copy is the base's own: each copy's `weight_digest` (its values as float32, so a bf16 copy
of a bf16 checkpoint loaded in fp32 matches) is checked against the base head's.

`target_parameters` on a mixture's 3-D expert weights (experts.py) nests one wrapper per parameter on the experts
module (keys `...mlp.experts[.base_layer]*.lora_A.weight`); its pairs are read against the base's expert parameters
into one ModuleLora per parameter, every expert's pair in it.

An adapter's identity is its name and `digest`: a sha256 over its config and its tensors (names, dtypes,
shapes, bytes), so an adapter reloaded under the same name with other weights is another adapter.
Written here: PEFT has no validation pass short of building the whole PeftModel on the base.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmc.compiler.hashing import sha256_file
from llmc.errors import SourceError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")

# LoraConfig fields whose non-default value changes the forward (or trains what is not a LoRA pair): refused
REFUSED = {
    "use_dora": "DoRA (weight-decomposed LoRA) rescales the base weight per column; llmc serves plain LoRA",
    "modules_to_save": "modules_to_save replaces whole base modules per adapter; llmc shares the base's weights",
    "lora_bias": "lora_bias adds a trained bias to lora_B",
    "trainable_token_indices": "trainable_token_indices retrains embedding rows",
    "layer_replication": "layer_replication duplicates base layers",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) switches on mid-sequence",
    "use_qalora": "QA-LoRA pools the input by groups",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routes between several LoRAs per token",
    "megatron_config": "Megatron-parallel LoRA layers",
    "kasa_config": "KaSA truncates the base weight's singular values and scales between A and B",
    "monteclora_config": "MonteCLoRA samples the LoRA weights",
}
_BASE_LAYER = re.compile(r"^base_model\.model\.(?P<module>.+)\.base_layer\.weight$")
_WRAPPED = re.compile(r"(\.base_layer)+$")  # PEFT's nesting of parameter wrappers on one module (experts)


class AdapterError(SourceError):
    """A LoRA adapter that cannot be served on this base: the message names the adapter and the field."""


@dataclass(frozen=True)
class ModuleLora:
    """One target module's pair as PEFT stores it: a [r, in], b [out, r]; its delta is scaling * x a^T b^T. An expert
    parameter's (experts.py) has every expert's pair: a [E, r, in], b [E, out, r]."""

    module: str  # the base model's module name, as PEFT keys it (model.layers.0.self_attn.q_proj), or parameter's
    a: np.ndarray
    b: np.ndarray
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[-2]


@dataclass(frozen=True)
class Adapter:
    name: str
    folder: Path
    digest: str  # sha256 over the config and the tensors: with the name, the adapter's identity
    modules: dict[str, ModuleLora]
    copies: dict[str, str] = field(default_factory=dict)  # module -> weight_digest of its saved base weight

    @property
    def identity(self) -> tuple[str, str]:
        return self.name, self.digest

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def read_adapter(name: str, folder: Path, *, max_rank: int, experts: dict | None = None) -> Adapter:
    """The adapter in `folder`, its config and tensors checked (not yet against a base: base.check_against). `experts`:
    the base's expert parameters (experts.expert_params), which an adapter with `target_parameters` is read against."""
    import torch
    from peft import PeftConfig
    from peft.utils.save_and_load import load_peft_weights

    folder = Path(folder)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / file).is_file():
            extra = " (a pickled adapter_model.bin is not read: save it with safe_serialization)" \
                if file == WEIGHTS_FILE and (folder / "adapter_model.bin").is_file() else ""
            raise AdapterError(f"adapter {name!r}: {folder / file} is missing; a PEFT adapter folder holds "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE}{extra}")
    try:
        config = PeftConfig.from_pretrained(str(folder))
    except Exception as err:  # PEFT raises ValueError/TypeError on a config it cannot build
        raise AdapterError(f"adapter {name!r}: {folder / CONFIG_FILE} is not a PEFT config PEFT reads: {err}") from err
    kind = getattr(config.peft_type, "value", config.peft_type)
    if kind != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type is {kind}; llmc serves LORA adapters")
    _refuse_variants(name, config)
    tensors = load_peft_weights(str(folder), device="cpu")

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    copies: dict[str, str] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        base_layer = _BASE_LAYER.match(key)
        if base_layer is not None:  # PEFT's save_embedding_layers: a targeted (or resized) embedding or LM head
            copies[base_layer["module"]] = weight_digest(tensor)  # served only as the base's own (base.py)
            continue
        if match is None:
            raise AdapterError(f"adapter {name!r}: tensor {key} is not a LoRA A/B weight (embedding LoRA, DoRA "
                               f"magnitudes and trained biases are not served)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no lora_A/lora_B weights")

    wrapped = {m: p for m, p in pairs.items() if _WRAPPED.search(m) or m in (experts or {})}
    modules = _expert_loras(name, config, wrapped, experts or {}, max_rank)
    for module, pair in sorted(pairs.items()):
        if module in wrapped:
            continue
        for which in "AB":
            if which not in pair:
                raise AdapterError(f"adapter {name!r}: tensor base_model.model.{module}.lora_{which}.weight is "
                                   f"missing (its lora_{'BA'[which == 'B']} is there)")
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"adapter {name!r}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                               f"are not a [r, in], [out, r] pair")
        scaling = _scaling(name, config, module, a.shape[0], max_rank)
        modules[module] = ModuleLora(module, a.float().numpy(), b.float().numpy(), float(scaling))
    unpaired = sorted(set(copies) - set(modules))
    if unpaired:
        raise AdapterError(f"adapter {name!r}: tensor base_model.model.{unpaired[0]}.base_layer.weight is a copy of "
                           f"the base's {unpaired[0]} weight, which has no LoRA pair here (a resized or retrained "
                           f"embedding); llmc serves adapters that share the base's weights")
    return Adapter(name, folder, _digest(folder, tensors), modules, copies)


def _expert_loras(name: str, config, wrapped: dict, experts: dict, max_rank: int) -> dict[str, ModuleLora]:
    """The pairs PEFT's `target_parameters` put on expert parameters, each an expert parameter's (a [E, r, in], b
    [E, out, r]). PEFT wraps the parameters of one module it matches in that module's order, each wrapper around the
    last, so the first is the innermost: its keys carry the most `.base_layer` (peft/tuners/tuners_utils.py:
    _inject_parameters); of n matched, the i-th is at depth n - 1 - i."""
    by_module: dict[str, dict[int, dict]] = {}
    for key, pair in wrapped.items():
        match = _WRAPPED.search(key)
        depth = (len(match[0]) // len(".base_layer")) if match else 0
        by_module.setdefault(_WRAPPED.sub("", key), {})[depth] = pair
    targets = sorted(set(config.target_parameters or ()))
    loras = {}
    for module, nested in sorted(by_module.items()):
        if module not in experts:
            raise AdapterError(f"adapter {name!r}: tensors base_model.model.{module}.lora_A/B are on no expert "
                               f"parameters of this base (target_parameters {targets}: llmc serves LoRA on a "
                               f"mixture's experts.gate_up_proj and experts.down_proj)")
        matched = [p for p in sorted(experts[module], key=lambda p: p.order)
                   if p.key in targets or any(p.key.endswith(f".{t}") for t in targets)]
        if sorted(nested) != list(range(len(matched))):
            raise AdapterError(f"adapter {name!r}: {module} holds {len(nested)} wrapped LoRA pairs, but "
                               f"target_parameters {targets} match {[p.key for p in matched] or 'none'} of its "
                               f"expert parameters (a parameter llmc serves no LoRA on, or another base)")
        for i, param in enumerate(matched):
            pair = nested[len(matched) - 1 - i]
            if set(pair) != {"A", "B"}:
                raise AdapterError(f"adapter {name!r}: {param.key}: lora_A or lora_B is missing")
            a, b, e = pair["A"], pair["B"], param.experts
            r = a.shape[0] // e
            if a.ndim != 2 or b.ndim != 2 or a.shape != (r * e, param.in_features) or \
                    b.shape != (param.out_features, r * e) or r < 1:
                raise AdapterError(f"adapter {name!r}: {param.key}: lora_A {tuple(a.shape)} and lora_B "
                                   f"{tuple(b.shape)} are not the pair of {e} experts mapping {param.in_features} -> "
                                   f"{param.out_features} ([E*r, in], [out, r*E]): the adapter was made for another "
                                   f"base")
            loras[param.key] = ModuleLora(param.key, a.float().reshape(e, r, -1).numpy(),
                                          b.float().reshape(b.shape[0], r, e).permute(2, 0, 1).numpy(),
                                          _scaling(name, config, param.key, r, max_rank))
    return loras


def _scaling(name: str, config, module: str, rank: int, max_rank: int) -> float:
    """PEFT's scaling of `module`'s pair (peft/tuners/lora/model.py: _create_and_replace), its rank checked against
    the config's and `max_rank`."""
    from peft.utils.other import get_pattern_key

    r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
    alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
    field = "rank_pattern" if r != config.r else "r"
    if rank != r:
        raise AdapterError(f"adapter {name!r}: {module} has rank {rank} in its tensors but {field} gives it {r}")
    if r > max_rank:
        raise AdapterError(f"adapter {name!r}: {module} has rank {r} ({field}), above lora.max_rank "
                           f"({max_rank}); raise lora.max_rank or use a smaller adapter")
    return alpha / math.sqrt(r) if config.use_rslora else alpha / r


def weight_digest(tensor) -> str:
    """sha256 over a weight's values as float32 (C order, little-endian), a block of rows at a time: equal for
    equal values whatever dtype each copy was saved in, where float32 holds them exactly (bf16, fp16)."""
    import torch

    h = hashlib.sha256(f"{tuple(tensor.shape)}".encode())
    flat = tensor.detach().reshape(tensor.shape[0] if tensor.ndim else 1, -1)
    for start in range(0, flat.shape[0], 4096):
        h.update(flat[start:start + 4096].to(torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes())
    return h.hexdigest()


def _refuse_variants(name: str, config) -> None:
    for field, why in REFUSED.items():
        if getattr(config, field, None):
            raise AdapterError(f"adapter {name!r}: {field} is set ({getattr(config, field)!r}): {why}")
    if config.bias != "none":
        raise AdapterError(f"adapter {name!r}: bias is {config.bias!r}: trained biases change the base model's "
                           f"biases; llmc serves adapters with bias 'none'")


def _digest(folder: Path, tensors) -> str:
    """sha256 over the config (as JSON, keys sorted) and every tensor's name, dtype, shape and bytes."""
    import torch

    h = hashlib.sha256()
    config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    h.update(json.dumps(config, sort_keys=True).encode())
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(f"\n{key} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def adapter_files(spec) -> dict:
    """Each of the spec's adapters' files, hashed: what keys a stage that reads them (verify-adapters, the TensorRT
    engine's)."""
    def digest(path: Path) -> str:
        return sha256_file(path) if path.is_file() else "missing"

    return {name: {f: digest(Path(folder) / f) for f in (CONFIG_FILE, WEIGHTS_FILE)}
            for name, folder in sorted(spec.adapters.items())}
