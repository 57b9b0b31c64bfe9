"""The OpenAI API's request bodies (the parameters llmc serves), its error body, and the mapping from
a request to the served model's inputs (TensorRT-LLM's tensor names, runtime/serving/tensors.py).

Value ranges (`top_p` 0, `temperature` -1, a prompt longer than the context, ...) are checked by the
served model, whose refusal names the tensor; `model_error` maps it to a 400 naming the OpenAI
parameter. What only the API knows (`n`, `logprobs` ranges, unsupported fields) is checked here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # choices per request: each is an independent request to the model
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat `top_logprobs` (runtime/decoding/logprobs.py's too)
MAX_CHOICES = 64  # prompts x n of one completions request: each is a request to the model
_INT32 = dict(ge=-2**31, lt=2**31)  # what the model's INT32 inputs hold: past it, a 400 rather than a wrapped cast
_FP32 = dict(ge=-3.4028234663852886e38, le=3.4028234663852886e38)  # FP32's finite range: past it, a 400, not inf


class OpenAIError(Exception):
    """An answer in OpenAI's error format: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """What both endpoints take. Unknown fields are kept aside (`model_extra`) and ignored, as
    OpenAI-compatible servers do, except other APIs' structured-output and function-calling fields,
    which are refused naming them (structured.py)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, **_INT32)
    temperature: float | None = Field(None, **_FP32)
    top_p: float | None = Field(None, **_FP32)
    seed: int | None = Field(None, ge=0, le=2**64 - 1 - MAX_N)  # choice i runs with seed + i (UINT64)
    stop: str | list[str] | None = None
    frequency_penalty: float | None = Field(None, **_FP32)
    presence_penalty: float | None = Field(None, **_FP32)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = Field(None, **_INT32)
    min_p: float | None = Field(None, **_FP32)
    repetition_penalty: float | None = Field(None, **_FP32)
    min_tokens: int | None = Field(None, **_INT32)
    # structured output (structured.py): OpenAI's response_format, vLLM's structured_outputs extra
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: str | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, **_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


def refuse_unsupported(req: _Common) -> None:
    """Fields OpenAI defines whose meaning llmc cannot honour: refused rather than ignored."""
    if req.logit_bias:
        raise OpenAIError(400, "logit_bias is not supported by llmc", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise OpenAIError(400, "suffix (insertion) is not supported by llmc", "suffix")
        if req.echo and req.logprobs is not None:
            raise OpenAIError(400, "echo with logprobs (prompt log probabilities) is not supported by llmc",
                              "logprobs")
    if isinstance(req, ChatRequest) and req.top_logprobs and not req.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream: true", "stream_options")


def model_inputs(req: _Common, choice: int = 0) -> dict:
    """The served model's optional inputs for one choice of `req` (choice i of n gets seed + i, so
    seeded choices differ but stay reproducible)."""
    max_tokens = req.max_completion_tokens if isinstance(req, ChatRequest) and req.max_completion_tokens else None
    params = dict(max_tokens=max_tokens or req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                  frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty, top_k=req.top_k,
                  min_p=req.min_p, repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
                  seed=None if req.seed is None else req.seed + choice,
                  stop_words=[req.stop] if isinstance(req.stop, str) else req.stop,
                  return_num_input_tokens=True, return_num_output_tokens=True)
    top = num_top_logprobs(req)
    if top is not None:
        params.update(return_log_probs=True, num_top_logprobs=top)
    if isinstance(req, ChatRequest):  # the rendered template writes its own BOS, as apply_chat_template expects
        params.update(add_special_tokens=False)
    return {k: v for k, v in params.items() if v is not None}


def num_top_logprobs(req: _Common) -> int | None:
    """None: no log probabilities asked; else how many alternatives per token."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


# the served model's tensor names -> the OpenAI parameter a refusal is about
_PARAMS = {"stop_words": "stop", "num_top_logprobs": "logprobs", "return_log_probs": "logprobs"}


def model_error(message: str, endpoint: Literal["chat", "completions"], guide_param: str | None = None) -> OpenAIError:
    """The served model's refusal (it names the tensor at fault) as an OpenAI error; a refused guide
    names `guide_param`, the field it came from (response_format, structured_outputs or tools)."""
    if message.startswith("busy, retry"):
        return OpenAIError(429, f"the model is busy; retry later ({message})", None, "rate_limit_exceeded")
    tensor = message.split(":", 1)[0] if ":" in message else None
    param = _PARAMS.get(tensor, tensor)
    if tensor in ("guided_decoding_guide", "guided_decoding_guide_type") and guide_param:
        return OpenAIError(400, f"{guide_param}: the engine cannot follow it: {message}", guide_param,
                           "invalid_parameter")
    if tensor == "text_input":
        param = "messages" if endpoint == "chat" else "prompt"
    elif tensor == "num_top_logprobs" and endpoint == "chat":
        param = "top_logprobs"
    return OpenAIError(400, message, param, "invalid_parameter")
