"""An adapter checked against the base model it is to be served on (adapter.py reads it): the modules and expert
parameters it names must be the base's, with the base's shapes, and have a LoRA site in the served graph; an adapter
on a tied LM head is refused, and one carrying a copy of the head's weight is served only when that copy is the
base's own (its weight_digest).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmc.compiler.lora.adapter import Adapter, AdapterError, weight_digest


@dataclass(frozen=True)
class BaseLinears:
    """The base model's linear modules an adapter may name: module name -> (in, out), a mixture's expert parameters
    among them (by the parameter's name); the LM head's name when it is tied to the input embeddings (None
    otherwise); and the digest of an untied head's weight (weight_digest), which an adapter's copy of it must match
    (None: not known, and no copy is served)."""

    shapes: dict[str, tuple[int, int]]
    tied_head: str | None
    head_digest: str | None = None

    @classmethod
    def of(cls, hf_model, head_digest: str | None = None) -> "BaseLinears":
        """`hf_model`'s linears; `head_digest`: its untied head's, when its weights are not here (the meta device),
        else computed from them."""
        from torch import nn
        from transformers.pytorch_utils import Conv1D

        from llmc.compiler.lora.experts import expert_params

        params = [p for listed in expert_params(hf_model).values() for p in listed]
        shapes = {p.key: (p.in_features, p.out_features) for p in params}
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
                               f"model: the adapter was made for another base, or its target_parameters name a "
                               f"parameter llmc serves no LoRA on (a router's weight)")
        want_in, want_out = base.shapes[module]
        got_in, got_out = lora.a.shape[-1], lora.b.shape[-2]
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
