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
(shapes, the modules it has, a tied LM head) are `check_against`; the rank limit is the caller's.

An adapter on the LM head carries a copy of the head's weight (PEFT's `save_embedding_layers`, on by default when
`lm_head` is a target), which PEFT loads in place of the base's. llmc shares the base's weights, so it serves such
an adapter only when the copy is the base's own: each copy's `weight_digest` (its values as float32, so a bf16 copy
of a bf16 checkpoint loaded in fp32 matches) is checked against the base head's.

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
    "target_parameters": "target_parameters puts LoRA on raw parameters (mixture-of-experts weights), "
                         "not on linear modules",
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


class AdapterError(SourceError):
    """A LoRA adapter that cannot be served on this base: the message names the adapter and the field."""


@dataclass(frozen=True)
class ModuleLora:
    """One target module's pair as PEFT stores it: a [r, in], b [out, r]; its delta is scaling * x a^T b^T."""

    module: str  # the base model's module name, as PEFT keys it (model.layers.0.self_attn.q_proj)
    a: np.ndarray
    b: np.ndarray
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


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


def read_adapter(name: str, folder: Path, *, max_rank: int) -> Adapter:
    """The adapter in `folder`, its config and tensors checked (not yet against a base: check_against)."""
    import torch
    from peft import PeftConfig
    from peft.utils.other import get_pattern_key
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
            copies[base_layer["module"]] = weight_digest(tensor)  # served only as the base's own (check_against)
            continue
        if match is None:
            raise AdapterError(f"adapter {name!r}: tensor {key} is not a LoRA A/B weight (embedding LoRA, DoRA "
                               f"magnitudes and trained biases are not served)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no lora_A/lora_B weights")

    modules = {}
    for module, pair in sorted(pairs.items()):
        for which in "AB":
            if which not in pair:
                raise AdapterError(f"adapter {name!r}: tensor base_model.model.{module}.lora_{which}.weight is "
                                   f"missing (its lora_{'BA'[which == 'B']} is there)")
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"adapter {name!r}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                               f"are not a [r, in], [out, r] pair")
        # PEFT's own rule for this module's rank and alpha (peft/tuners/lora/model.py: _create_and_replace)
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
        field = "rank_pattern" if r != config.r else "r"
        if a.shape[0] != r:
            raise AdapterError(f"adapter {name!r}: {module} has rank {a.shape[0]} in its tensors but {field} "
                               f"gives it {r}")
        if r > max_rank:
            raise AdapterError(f"adapter {name!r}: {module} has rank {r} ({field}), above lora.max_rank "
                               f"({max_rank}); raise lora.max_rank or use a smaller adapter")
        scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        modules[module] = ModuleLora(module, a.float().numpy(), b.float().numpy(), float(scaling))
    unpaired = sorted(set(copies) - set(modules))
    if unpaired:
        raise AdapterError(f"adapter {name!r}: tensor base_model.model.{unpaired[0]}.base_layer.weight is a copy of "
                           f"the base's {unpaired[0]} weight, which has no LoRA pair here (a resized or retrained "
                           f"embedding); llmc serves adapters that share the base's weights")
    return Adapter(name, folder, _digest(folder, tensors), modules, copies)


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


@dataclass(frozen=True)
class BaseLinears:
    """The base model's linear modules an adapter may name: module name -> (in, out); the LM head's name when it
    is tied to the input embeddings (None otherwise); and the digest of an untied head's weight (weight_digest),
    which an adapter's copy of it must match (None: not known, and no copy is served)."""

    shapes: dict[str, tuple[int, int]]
    tied_head: str | None
    head_digest: str | None = None

    @classmethod
    def of(cls, hf_model, head_digest: str | None = None) -> "BaseLinears":
        """`hf_model`'s linears; `head_digest`: its untied head's, when its weights are not here (the meta device),
        else computed from them."""
        from torch import nn
        from transformers.pytorch_utils import Conv1D

        shapes = {}
        for module_name, module in hf_model.named_modules():
            if isinstance(module, nn.Linear):
                shapes[module_name] = (module.in_features, module.out_features)
            elif isinstance(module, Conv1D):  # GPT-2's: weight [in, out], the transpose of nn.Linear's
                shapes[module_name] = tuple(module.weight.shape)
        head = hf_model.get_output_embeddings()
        tied = tied_head(hf_model)
        head_name = next((n for n, m in hf_model.named_modules() if m is head), None) if tied else None
        if head_digest is None and head is not None and not tied and not head.weight.is_meta:
            head_digest = weight_digest(head.weight)
        return cls(shapes, head_name, head_digest)


def tied_head(hf_model) -> bool:
    """Whether `hf_model`'s LM head is its input embeddings: the same parameter, or (a model built on the meta
    device, where transformers does not tie them) a config that ties them."""
    head, embeddings = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    if head is None or embeddings is None:
        return False
    config = hf_model.config.get_text_config() if hasattr(hf_model.config, "get_text_config") else hf_model.config
    return head.weight is embeddings.weight or bool(getattr(config, "tie_word_embeddings", False))


def check_against(adapter: Adapter, base: BaseLinears, served: set[str]) -> None:
    """Refuse an adapter made for another base (a module it lacks, a shape that differs), one on a tied LM
    head, and one on a module the graph has no LoRA site for (`served`: the modules the sites cover)."""
    for module, lora in adapter.modules.items():
        if base.tied_head is not None and module == base.tied_head:
            raise AdapterError(f"adapter {adapter.name!r}: target_modules includes {module}, the LM head, which this "
                               f"model ties to its input embeddings; an adapter on a tied lm_head is not served")
        if module not in base.shapes:
            raise AdapterError(f"adapter {adapter.name!r}: target module {module} is no linear layer of this base "
                               f"model: the adapter was made for another base")
        want_in, want_out = base.shapes[module]
        got_in, got_out = lora.a.shape[1], lora.b.shape[0]
        if (got_in, got_out) != (want_in, want_out):
            raise AdapterError(f"adapter {adapter.name!r}: {module} maps {got_in} -> {got_out} features, the base's "
                               f"{module} {want_in} -> {want_out}: the adapter was made for another base")
        if module not in served:
            raise AdapterError(f"adapter {adapter.name!r}: target module {module} has no LoRA site in the graph "
                               f"(llmc serves adapters on the attention and MLP projections of dense layers, and "
                               f"on an untied LM head)")
    check_copies(adapter, base.head_digest)


def check_copies(adapter: Adapter, head_digest: str | None) -> None:
    """Refuse an adapter whose saved copy of a base weight is not the base's own LM head weight (`head_digest`:
    the served base's untied head's weight_digest; None: there is none, or it is not known)."""
    for module, digest in sorted(adapter.copies.items()):
        if head_digest is None:
            raise AdapterError(f"adapter {adapter.name!r}: it holds a copy of the base's {module} weight, and this "
                               f"model has no untied LM head to check it against; llmc serves adapters that share "
                               f"the base's weights")
        if digest != head_digest:
            raise AdapterError(f"adapter {adapter.name!r}: its copy of {module}'s weight (base_layer.weight) differs "
                               f"from this base's; PEFT would load that copy in place of the base's head, and llmc "
                               f"shares the base's weights (the adapter was made for another base, or retrained "
                               f"the head)")
