"""The checkpoint's own PyTorch model with its decoder layers read one at a time (a streamed build's model).

The model is built from its config with its parameters on the meta device (accelerate's `init_empty_weights`;
buffers such as RoPE's frequencies are computed for real). What every layer shares (embeddings, final norm, LM
head) is read with the first layer (at 8B, 3.9 GiB at fp32: a verify's candidate runs before any is needed); a
decoder layer's tensors are read from the checkpoint (tensors.py: a memory map) when
`load_layer` asks, and dropped back to meta by `release_layer`. Loading goes through transformers' own
`convert_and_load_state_dict_in_model` with the model's own conversion mapping, so renames and conversions
(a mixture's experts fused into one tensor) and the cast to float32 are transformers', applied to one layer's
tensors. `streaming()` runs the model's own forward layer by layer: each layer is read before it runs and
dropped after, so a forward holds one layer at a time.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from llmc.compiler.stream.tensors import CheckpointTensors, checkpoint_tensors, layer_of
from llmc.errors import SourceError, UnsupportedError

def refusal(info) -> str | None:
    """Why `info` (source.SourceInfo) cannot be read a layer at a time; None when it can."""
    from llmc.compiler.models.config import TEXT_PARTS

    if info.uses_pickle:
        return "its weights are pickle files (convert them to safetensors)"
    if info.model_type in TEXT_PARTS:
        return f"it is a multimodal {info.model_type} checkpoint (its text model is cut out of the whole model)"
    if info.quant_method is not None:
        return f"its weights are quantized ({info.quant_method}); they are dequantized by a whole-model load"
    return None


class StreamedModel:
    """An HF causal LM (`.model`, eval mode, float32) whose decoder layers hold their weights only while loaded."""

    def __init__(self, info, tensors: CheckpointTensors | None = None):
        import torch
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.utils import logging as hf_logging

        reason = refusal(info)
        if reason is not None:
            raise UnsupportedError(f"{info.path}: cannot be built layer by layer: {reason}; set "
                                   "`source.load: whole`")
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.info, self.tensors = info, tensors or checkpoint_tensors(info)
        config = _config(info)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.model = model.eval()
        self.layers = _layer_list(model, config.num_hidden_layers)
        self._config = LoadStateDictConfig(dtype=torch.float32, weight_mapping=get_model_conversion_mapping(model),
                                           dtype_plan=model._get_dtype_plan(torch.float32))
        self._keys: dict[int | None, list[str]] = {}
        for key in self.tensors.keys():
            self._keys.setdefault(layer_of(key), []).append(key)
        extra = sorted(i for i in self._keys if i is not None and not 0 <= i < len(self.layers))
        if extra:
            raise SourceError(f"{info.path}: tensors of layer {extra[0]}, but the config has {len(self.layers)} layers")
        self.loaded: set[int] = set()
        self._shared = False
        self._meta = {i: _meta_state(self.layers[i]) for i in range(len(self.layers))}

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def load_shared(self) -> None:
        """What every layer shares (embeddings, final norm, LM head), read once: before the first layer."""
        if not self._shared:
            self._load(self._keys.get(None, []), self.model)
            self.model.tie_weights()
            self._shared = True

    def load_layer(self, i: int) -> None:
        self.load_shared()
        if i in self.loaded:
            return
        keys = self._keys.get(i, [])
        if not keys:
            raise SourceError(f"{self.info.path}: no tensors for layer {i}")
        self._load(keys, self.model)
        missing = [n for n, t in _named_tensors(self.layers[i]) if t.device.type == "meta"]
        if missing:
            self.release_layer(i)
            raise SourceError(f"{self.info.path}: layer {i} has no {missing[0]} in the checkpoint")
        self.loaded.add(i)

    def release_layer(self, i: int) -> None:
        """Layer `i`'s weights back to the meta device (their memory freed)."""
        import torch

        layer = self.layers[i]
        for name, meta in self._meta[i].items():
            owner, _, attr = name.rpartition(".")
            module = layer.get_submodule(owner) if owner else layer
            if attr in module._parameters:
                module._parameters[attr] = torch.nn.Parameter(meta, requires_grad=False)
            else:
                module._buffers[attr] = meta
        self.loaded.discard(i)

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        """Inside, the model's forward reads each decoder layer before it runs and drops it after."""
        self.load_shared()
        handles = []
        for i, layer in enumerate(self.layers):
            handles.append(layer.register_forward_pre_hook(lambda module, args, i=i: self.load_layer(i)))
            handles.append(layer.register_forward_hook(lambda module, args, out, i=i: self.release_layer(i)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for i in list(self.loaded):
                self.release_layer(i)

    def _load(self, keys: list[str], model) -> None:
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        state = {k: self.tensors.load(k) for k in keys}
        try:
            convert_and_load_state_dict_in_model(model, state, self._config)
        except Exception as err:
            raise SourceError(f"{self.info.path}: could not load {keys[0]} and {len(keys) - 1} more: {err}") from err


def _config(info):
    from transformers import AutoConfig

    try:
        if info.kind == "gguf":
            from llmc.compiler.gguf_reader import one_parse

            with one_parse():
                return AutoConfig.from_pretrained(str(info.path.parent), gguf_file=info.path.name,
                                                  local_files_only=True)
        return AutoConfig.from_pretrained(str(info.path), trust_remote_code=False, local_files_only=True)
    except Exception as err:
        raise SourceError(f"{info.path}: could not read the config: {err}") from err


def _layer_list(model, num_layers: int):
    """The model's decoder layers: its ModuleList of `num_hidden_layers` modules (`model.layers`, GPT-2's
    `transformer.h`)."""
    import torch

    found = [m for _, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers
             and all(type(x) is type(m[0]) for x in m)]
    if not found:
        raise UnsupportedError(f"{type(model).__name__}: no list of {num_layers} decoder layers to stream")
    return found[0]


def _named_tensors(module):
    return [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if b is not None)]


def _meta_state(layer) -> dict:
    """Layer's parameters (and buffers read from the checkpoint) as meta tensors of their shapes."""
    import torch

    return {name: torch.empty_like(t, device="meta") for name, t in _named_tensors(layer) if t.device.type == "meta"}
