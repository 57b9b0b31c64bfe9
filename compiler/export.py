"""Export stage: a HuggingFace causal LM -> an ONNX graph with explicit KV-cache inputs and outputs.

The graph follows optimum / onnxruntime-genai names: `input_ids`, `attention_mask`, `position_ids`,
`past_key_values.{i}.key|value` -> `logits`, `present.{i}.key|value`, KV shape
`[batch, kv_heads, seq, head_dim]`, named dynamic dims. It is exported with
`torch.onnx.export(dynamo=True)` at opset 23, where attention, rotary and RMSNorm become the standard
`Attention` / `RotaryEmbedding` / `RMSNormalization` ops. Weights go to external data only when the
model is too big for one protobuf (2 GB).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

from llmc.compiler.artifacts import ExportedModel, ModelInfo, TensorInfo, hash_outputs
from llmc.compiler.source import SUPPORTED_MODEL_TYPES
from llmc.errors import ExportError
from llmc.runtime.layout import KVLayout

OPSET = 23
ONNX_NAME = "model.onnx"
EXTERNAL_DATA_NAME = "model.onnx.data"
PROTOBUF_LIMIT = 2**31 - 2**26  # stay clear of protobuf's 2 GiB cap (graph structure needs room too)


def model_info(model, tokenizer) -> ModelInfo:
    c = model.config
    num_heads = c.num_attention_heads
    eos = c.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return ModelInfo(
        model_type=c.model_type,
        family=SUPPORTED_MODEL_TYPES[c.model_type],
        vocab_size=c.vocab_size,
        num_layers=c.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // num_heads,
        hidden_size=c.hidden_size,
        max_position_embeddings=c.max_position_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_ids=eos_ids,
        has_tokenizer=tokenizer is not None,
    )


def kv_layout(info: ModelInfo) -> KVLayout:
    return KVLayout(num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim)


def _wrapper(model, num_layers: int):
    import torch
    from transformers import DynamicCache

    class FlatKVDecoder(torch.nn.Module):
        """forward(input_ids, attention_mask, position_ids, past) with the cache as flat tensors."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, past):
            cache = DynamicCache(config=self.model.config)
            for i in range(num_layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True)
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    return FlatKVDecoder().eval()


def _example_inputs(info: ModelInfo, layout: KVLayout):
    import torch

    batch, seq, past_len = 2, 3, 4  # all > 1 so no dim is specialized to a constant
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, info.vocab_size, (batch, seq), generator=gen)
    attention_mask = torch.ones(batch, past_len + seq, dtype=torch.int64)
    position_ids = torch.arange(past_len, past_len + seq).expand(batch, seq).contiguous()
    past = tuple(torch.zeros(layout.shape(batch, past_len)) for _ in range(2 * layout.num_layers))
    return input_ids, attention_mask, position_ids, past


def _dynamic_shapes(layout: KVLayout):
    from torch.export import Dim

    batch, seq = Dim("batch"), Dim("sequence_length")
    past_len, total = Dim("past_sequence_length"), Dim("total_sequence_length")
    return {
        "input_ids": {0: batch, 1: seq},
        "attention_mask": {0: batch, 1: total},
        "position_ids": {0: batch, 1: seq},
        "past": tuple({0: batch, 2: past_len} for _ in range(2 * layout.num_layers)),
    }


def _quiet():
    """torch.onnx prints progress and warnings; keep them for the error message only."""
    stack = contextlib.ExitStack()
    buf = io.StringIO()
    stack.enter_context(contextlib.redirect_stdout(buf))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    for name in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript"):
        logger = logging.getLogger(name)
        level = logger.level
        logger.setLevel(logging.ERROR)
        stack.callback(logger.setLevel, level)
    return stack, buf


def export_onnx(model, info: ModelInfo, out_dir: Path, external_threshold: int = PROTOBUF_LIMIT) -> bool:
    """Write `out_dir/model.onnx` (+ `model.onnx.data` when over the threshold). Returns whether
    weights went to external data."""
    import onnx
    import torch

    layout = kv_layout(info)
    in_names = ["input_ids", "attention_mask", "position_ids", *layout.past_names()]
    out_names = ["logits", *layout.present_names()]
    stack, log = _quiet()
    try:
        with stack, torch.no_grad():
            program = torch.onnx.export(
                _wrapper(model, info.num_layers), _example_inputs(info, layout),
                dynamic_shapes=_dynamic_shapes(layout), input_names=in_names, output_names=out_names,
                opset_version=OPSET, dynamo=True, optimize=True, verbose=False, report=False,
            )
    except Exception as err:
        tail = "\n".join(log.getvalue().splitlines()[-20:])
        raise ExportError(f"torch.onnx.export failed for {info.model_type}: {err}\n{tail}".rstrip()) from err
    proto = program.model_proto
    weight_bytes = sum(t.ByteSize() for t in proto.graph.initializer)
    external = weight_bytes > external_threshold
    onnx.save_model(proto, out_dir / ONNX_NAME, save_as_external_data=external, all_tensors_to_one_file=True,
                    location=EXTERNAL_DATA_NAME, size_threshold=1024)
    return external


def tensor_infos(values) -> list[TensorInfo]:
    from onnx import helper

    infos = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
        infos.append(TensorInfo(name=v.name, dtype=helper.tensor_dtype_to_np_dtype(t.elem_type).name, shape=dims))
    return infos


def tool_versions() -> dict[str, str]:
    import onnx
    import onnxscript
    import torch
    import transformers

    import llmc

    return {"llmc": llmc.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "onnx": onnx.__version__, "onnxscript": onnxscript.__version__}


def export(model, tokenizer, out_dir: Path, *, source_hash: str, inputs_hash: str,
           external_threshold: int = PROTOBUF_LIMIT) -> ExportedModel:
    """Export `model` into `out_dir` and describe the result."""
    import onnx

    info = model_info(model, tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    external = export_onnx(model, info, out_dir, external_threshold)
    graph = onnx.load(str(out_dir / ONNX_NAME), load_external_data=False).graph
    files = [ONNX_NAME] + ([EXTERNAL_DATA_NAME] if external else [])
    artifact = ExportedModel(
        inputs_hash=inputs_hash, files=hash_outputs(out_dir, files), onnx=ONNX_NAME, opset=OPSET,
        source_hash=source_hash, model=info, kv_layout=kv_layout(info), inputs=tensor_infos(graph.input),
        outputs=tensor_infos(graph.output), external_data=external, versions=tool_versions(),
    )
    artifact.save(out_dir)
    return artifact
