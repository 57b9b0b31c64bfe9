"""A served request, parsed from its Triton input tensors (TensorRT-LLM names, see DESIGN.md).

Every problem raises `RequestError` whose message names the tensor, so the client gets an answer
it can act on; nothing here touches the engine. Scalars may come with shape [], [1] or [1, 1]
(Triton adds a batch dimension); `stop_words` is a BYTES list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
from pydantic import ValidationError

from llmc.runtime.decoding.grammar import GUIDE_TYPES, Guide
from llmc.runtime.decoding.logprobs import MAX_TOP_LOGPROBS
from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.serving.tensors import GUIDE_TEXTS, LORA_NAME, SCALARS


class RequestError(ValueError):
    """A request the server refuses; the message is sent back as the response's error."""


@dataclass(frozen=True)
class Limits:
    max_seq_len: int
    default_max_tokens: int
    max_stop_words: int
    max_beam_width: int = 1  # serving.max_beam_width


_KINDS = {"INT32": "iu", "UINT64": "ui", "FP32": "f", "BOOL": "b"}  # numpy kinds each accepts


@dataclass(frozen=True)
class Request:
    prompt: str
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = True
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_log_probs: bool = False
    num_top_logprobs: int = 0  # with return_log_probs: the N most likely alternatives per token
    add_special_tokens: bool = True  # false for a prompt rendered from a chat template (decoding/tokenizer.py)
    guide: Guide | None = None  # structured output: compiled off the engine thread (loop.py)
    lora_name: str | None = None  # the LoRA adapter it runs under (None: the base model); the engine resolves it
    lora_task_id: int | None = None  # TensorRT-LLM's name for a loaded adapter (lora_admin.py resolves it)


def _text(value, name: str) -> str:
    raw = value if isinstance(value, (bytes, bytearray)) else str(value).encode()
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequestError(f"{name}: not valid UTF-8 ({err.reason} at byte {err.start})") from None


def _scalar(array: np.ndarray, name: str, datatype: str):
    array = np.asarray(array)
    if array.size != 1 or array.ndim > 2:
        raise RequestError(f"{name}: expected one value (shape [1]), got shape {list(array.shape)}")
    if array.dtype.kind not in _KINDS[datatype]:
        raise RequestError(f"{name}: wrong dtype {array.dtype}; expected {datatype}")
    return array.reshape(()).item()


def is_stop(inputs: Mapping[str, np.ndarray]) -> bool:
    """A stop request (`stop` true): it asks to end the live request that has its request id; its
    other inputs are ignored. The in-band way to cancel (closing the gRPC stream instead races
    Triton 2.51's cancellation handling, which can crash the server: see loop.py)."""
    return "stop" in inputs and bool(_scalar(inputs["stop"], "stop", "BOOL"))


def parse_request(inputs: Mapping[str, np.ndarray], limits: Limits) -> Request:
    if "text_input" not in inputs:
        raise RequestError("text_input: required input is missing")
    text = np.asarray(inputs["text_input"])
    if text.size != 1 or text.dtype.kind not in "OSU":
        raise RequestError(f"text_input: expected one BYTES value, got {text.dtype} of shape {list(text.shape)}")
    prompt = _text(text.reshape(()).item(), "text_input")
    if not prompt:
        raise RequestError("text_input: the prompt is empty")
    values = {name: _scalar(inputs[name], name, datatype) for name, (datatype, _) in SCALARS.items() if name in inputs}
    fields = {SCALARS[n][1]: v for n, v in values.items() if SCALARS[n][1] is not None}
    width = values.get("beam_width", 1)
    if width > limits.max_beam_width:
        raise RequestError(f"beam_width: at most {limits.max_beam_width} on this model (serving.max_beam_width); "
                           f"got {width}")
    if width > 1 and values.get("return_log_probs"):
        raise RequestError(f"return_log_probs: not with beam search (beam_width {width}); cum_log_probs gives each "
                           "beam's summed log-probability")
    fields.setdefault("max_tokens", limits.default_max_tokens)
    if not 1 <= fields["max_tokens"] <= limits.max_seq_len:
        raise RequestError(f"max_tokens: must be between 1 and {limits.max_seq_len} (got {fields['max_tokens']})")
    if "end_id" in values:
        fields["end_ids"] = (values["end_id"],)
    if "stop_words" in inputs:
        words = [_text(w, "stop_words") for w in np.asarray(inputs["stop_words"]).reshape(-1)]
        if len(words) > limits.max_stop_words:
            raise RequestError(f"stop_words: at most {limits.max_stop_words} allowed (got {len(words)})")
        fields["stop_words"] = tuple(w for w in words if w)
    try:
        params = SamplingParams(**fields)
    except ValidationError as err:
        first = err.errors()[0]
        if not first["loc"]:  # a check across fields: its message names the field at fault
            raise RequestError(first["msg"].removeprefix("Value error, ")) from None
        where = ".".join(map(str, first["loc"]))
        raise RequestError(f"{where}: {first['msg'].removeprefix('Value error, ')} (got {first.get('input')!r})") from None
    flags = {n: bool(values[n]) for n in ("stream", "exclude_input_in_output", "return_num_input_tokens",
                                          "return_num_output_tokens", "return_log_probs", "add_special_tokens")
             if n in values}
    top = values.get("num_top_logprobs", 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(f"num_top_logprobs: must be between 0 and {MAX_TOP_LOGPROBS} (got {top})")
    if top and not flags.get("return_log_probs"):
        raise RequestError("num_top_logprobs: needs return_log_probs true")
    return Request(prompt=prompt, params=params, num_top_logprobs=top, guide=_guide(inputs, width),
                   lora_name=_lora_name(inputs), lora_task_id=values.get("lora_task_id"), **flags)


def _one_text(inputs: Mapping[str, np.ndarray], name: str) -> str | None:
    if name not in inputs:
        return None
    array = np.asarray(inputs[name])
    if array.size != 1 or array.dtype.kind not in "OSU":
        raise RequestError(f"{name}: expected one BYTES value, got {array.dtype} of shape {list(array.shape)}")
    return _text(array.reshape(()).item(), name)


def _lora_name(inputs: Mapping[str, np.ndarray]) -> str | None:
    """The adapter the request names (lora_name), or None; an empty name is refused (leave the input out for the
    base model)."""
    name = _one_text(inputs, LORA_NAME)
    if name is not None and not name:
        raise RequestError(f"{LORA_NAME}: empty; name an adapter of this model, or leave {LORA_NAME} out for the base "
                           "model")
    return name


def _guide(inputs: Mapping[str, np.ndarray], beam_width: int) -> Guide | None:
    """The request's guide (guided_decoding_guide_type and guided_decoding_guide), or None."""
    texts = {name: text for name in GUIDE_TEXTS if (text := _one_text(inputs, name)) is not None}
    kind, guide = texts.get("guided_decoding_guide_type"), texts.get("guided_decoding_guide")
    if kind is None:
        if guide is not None:
            raise RequestError("guided_decoding_guide: needs guided_decoding_guide_type (one of "
                               f"{', '.join(GUIDE_TYPES)})")
        return None
    if kind not in GUIDE_TYPES:
        raise RequestError(f"guided_decoding_guide_type: {kind!r} is not one of {', '.join(GUIDE_TYPES)}")
    if kind != "json" and not guide:
        raise RequestError(f"guided_decoding_guide: a {kind} guide needs its text (only json takes none)")
    if beam_width > 1:
        raise RequestError(f"guided_decoding_guide_type: not with beam search (beam_width {beam_width}); a guided "
                           "request takes beam_width 1")
    return Guide(kind, guide or "")
