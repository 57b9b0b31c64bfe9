"""PEFT's forward of one adapter on the checkpoint's own PyTorch model, added by hooks: the reference the build's
adapter check (verify.py) runs, whole or a layer at a time (stream/model.py).

    a target Linear          y = base(x) + scaling * B(A(x))               (peft/tuners/lora/layer.py: Linear, unmerged)
    a target expert weight   W_e + scaling * B_e A_e while its module runs  (ParamWrapper; [E, in, out] where the
                                                                            experts module is_transposed, gpt-oss)

Written here rather than wrapping the model in PEFT's PeftModel: PEFT swaps each target module for its own, which
moves the module's weight under `base_layer`. The streamed model loads each layer's weights by the checkpoint's names
and the later stages read the same model object, so neither may see it renamed. The hooks add the same arithmetic,
in PEFT's order (x A^T, then B^T, then the scaling), and come off whole. The tests compare the LoRA graph with PEFT
itself (tests/compiler/lora/test_peft_parity.py); this is what the build can run without building a PeftModel.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from llmc.compiler.lora.adapter import Adapter, ModuleLora


@contextlib.contextmanager
def peft_forward(model, adapter: Adapter) -> Iterator[None]:
    """Inside, `model` (the HF model: a StreamedModel's `.model` too) computes as PEFT's model with `adapter`
    active. Every module the adapter names must be there (base.check_against has checked it)."""
    modules = dict(model.named_modules())
    handles = []
    try:
        for name, lora in adapter.modules.items():
            if lora.a.ndim == 3:  # an expert parameter's pair: model.layers.0.mlp.experts.gate_up_proj
                owner, _, param = name.rpartition(".")
                handles += _expert_hooks(modules[owner], param, lora)
            else:
                handles.append(modules[name].register_forward_hook(_linear_hook(lora)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _linear_hook(lora: ModuleLora):
    import torch

    a, b = torch.from_numpy(lora.a), torch.from_numpy(lora.b)  # [r, in], [out, r]

    def hook(module, args, output):
        x = args[0] if args else None
        if x is None:
            raise ValueError(f"{lora.module}: its forward took no positional input for the LoRA branch")
        return output + ((x.to(a.dtype) @ a.T) @ b.T * lora.scaling).to(output.dtype)

    return hook


def _expert_hooks(module, param: str, lora: ModuleLora) -> list:
    """W + the pair's delta for the length of `module`'s forward, W itself again after (the streamed model may have
    loaded W just before: the delta is added to whatever W is there when the module runs)."""
    import torch

    delta = torch.bmm(torch.from_numpy(lora.b), torch.from_numpy(lora.a)) * lora.scaling  # [E, out, in]
    if getattr(module, "is_transposed", False):
        delta = delta.transpose(1, 2).contiguous()  # [E, in, out]
    saved = []

    def before(mod, args):
        weight = getattr(mod, param)
        if tuple(weight.shape) != tuple(delta.shape):
            raise ValueError(f"{lora.module}: the weight is {list(weight.shape)}, the adapter's delta "
                             f"{list(delta.shape)}")
        saved.append(weight.data)
        weight.data = weight.data + delta.to(weight.dtype)

    def after(mod, args, output):
        if saved:  # always_call: W itself again even where the forward raised
            getattr(mod, param).data = saved.pop()

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after, always_call=True)]
