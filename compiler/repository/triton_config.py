"""config.pbtxt for a packaged model, built as tritonclient's `ModelConfig` protobuf and printed
with protobuf's text_format (no string templates).

Tensor names and types come from `llmc.runtime.serving.tensors` (TensorRT-LLM's names, see DESIGN.md), so
tritonclient, the HTTP generate endpoints and Triton's OpenAI-compatible frontend work unchanged.
The model is decoupled (responses stream); batching happens inside the runtime, so Triton's own
batching is off (`max_batch_size: 0`, scalars have shape [1]).
"""

from __future__ import annotations

import json

from llmc.runtime.serving.tensors import ADAPTERS_PARAMETER, OUTPUTS, SCALARS, TEXTS

_TYPES = {"BYTES": "TYPE_STRING", "INT32": "TYPE_INT32", "UINT64": "TYPE_UINT64", "FP32": "TYPE_FP32",
          "BOOL": "TYPE_BOOL"}


EXECUTION_ENV = "EXECUTION_ENV_PATH"  # the Python backend's parameter naming a packed environment to run the model in


def model_config(name: str, *, instances: int = 1, gpu: bool = False, chat_template: str | None = None,
                 max_beam_width: int = 1, execution_env: str | None = None, adapters: list[str] | None = None):
    """`chat_template`: the recorded template as JSON, carried as the `chat_template` parameter so the
    OpenAI frontend reads it over gRPC (llmc/chat_template.py). `max_beam_width` is carried as
    TensorRT-LLM's parameter of that name (a string, as TensorRT-LLM's config.pbtxt has it).
    `execution_env`: the packed environment's path in the version folder (`1/serving_env.tar.gz`),
    given to Triton through $$TRITON_MODEL_DIRECTORY, its local copy of the model. `adapters`: the LoRA adapters'
    names as a JSON list, the `lora_adapters` parameter the OpenAI frontend lists them from (docs/lora.md)."""
    from tritonclient.grpc import model_config_pb2 as mc

    cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
    cfg.model_transaction_policy.decoupled = True
    cfg.input.add(name="text_input", data_type=mc.TYPE_STRING, dims=[1])
    for tensor, (datatype, _) in SCALARS.items():
        cfg.input.add(name=tensor, data_type=mc.DataType.Value(_TYPES[datatype]), dims=[1], optional=True)
    cfg.input.add(name="stop_words", data_type=mc.TYPE_STRING, dims=[-1], optional=True)
    for tensor in TEXTS:
        cfg.input.add(name=tensor, data_type=mc.TYPE_STRING, dims=[1], optional=True)
    for tensor, (datatype, dims) in OUTPUTS.items():
        cfg.output.add(name=tensor, data_type=mc.DataType.Value(_TYPES[datatype]), dims=dims)
    kind = mc.ModelInstanceGroup.KIND_GPU if gpu else mc.ModelInstanceGroup.KIND_CPU
    cfg.instance_group.add(kind=kind, count=instances)
    if chat_template is not None:
        cfg.parameters["chat_template"].string_value = chat_template
    cfg.parameters["max_beam_width"].string_value = str(max_beam_width)
    if adapters:
        cfg.parameters[ADAPTERS_PARAMETER].string_value = json.dumps(sorted(adapters))
    if execution_env is not None:
        cfg.parameters[EXECUTION_ENV].string_value = f"$$TRITON_MODEL_DIRECTORY/{execution_env}"
    return cfg


def render(cfg) -> str:
    from google.protobuf import text_format

    return text_format.MessageToString(cfg)


def parse(text: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    return text_format.Parse(text, mc.ModelConfig())
