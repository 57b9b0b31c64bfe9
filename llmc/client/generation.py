"""One request's tensors and responses, shared by llmc's clients: the input tensors of a generate
request (and of the stop request that ends one early), and `Generation`, which gathers a stream's
responses. Imports numpy and the served tensors' table only (tritonclient is passed in)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from llmc.runtime.serving.tensors import SCALARS, TEXTS

_NUMPY = {"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_}
_NOT_PARAMETERS = {"stream", "stop"}  # model inputs the client sets itself


class GenerationError(RuntimeError):
    """The server refused or failed a request (its message), or could not be reached."""


class Refused(GenerationError):
    """The served model answered the request with an error: its message as it is (it names the input
    at fault, or says the model is busy)."""


class Unreachable(GenerationError):
    """The transport failed: the server went away, or the stream broke or ended early."""


@dataclass
class Generation:
    """One request's stream: iterate for text chunks; afterwards `text`, `finish_reason` and
    `output_ids` hold the whole result. A beam request (beam_width > 1) gets one response at its end:
    `beams`, `beam_ids` and `cum_log_probs` hold every beam, best first, and `text` / `output_ids`
    the best one."""

    chunks: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_input_tokens: int | None = None  # when requested with return_num_input_tokens=True
    done: bool = False  # the final response (or an error) has arrived
    beams: list[str] | None = None  # beam search: each beam's text, best first
    beam_ids: list[list[int]] | None = None  # each beam's generated ids (sequence_length of them)
    cum_log_probs: list[float] | None = None  # each beam's summed log-probability

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def take(self, result, error) -> str:
        """Add one streamed response and return its text; an error response raises Refused."""
        if error is not None:
            self.done = True
            raise Refused(message(error))
        chunk = self._add(result)
        self.done = is_final(result)
        return chunk

    def _add(self, result) -> str:
        text = result.as_numpy("text_output")
        lengths = result.as_numpy("sequence_length")
        if lengths is not None:  # a beam request's one response: [W] texts, [W, longest] ids
            self.beams = [t.decode("utf-8") for t in text.reshape(-1)]
            ids = result.as_numpy("output_ids").reshape(len(self.beams), -1)
            self.beam_ids = [row[:n].tolist() for row, n in zip(ids, lengths.reshape(-1))]
            self.cum_log_probs = result.as_numpy("cum_log_probs").reshape(-1).tolist()
            chunk, self.output_ids = self.beams[0], list(self.beam_ids[0])
        else:
            chunk = b"".join(text.reshape(-1)).decode("utf-8") if text is not None else ""
            ids = result.as_numpy("output_ids")
            if ids is not None:
                self.output_ids += ids.reshape(-1).tolist()
        count = result.as_numpy("num_input_tokens")
        if count is not None:
            self.num_input_tokens = int(count.reshape(-1)[0])
        reason = result.as_numpy("finish_reason")
        if reason is not None:
            self.finish_reason = reason.reshape(-1)[0].decode()
        self.chunks.append(chunk)
        return chunk


def make_inputs(grpc_module, prompt: str, stream: bool, params: dict) -> list:
    """The request's input tensors; unknown parameter names raise TypeError listing the known ones."""
    def tensor(name, datatype, array):
        t = grpc_module.InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array)
        return t

    tensors = [tensor("text_input", "BYTES", np.array([prompt.encode("utf-8")], dtype=np.object_)),
               tensor("stream", "BOOL", np.array([stream]))]
    for name, value in params.items():
        if value is None:
            continue
        if name == "early_stopping" and not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"early_stopping: the served model takes true or false (TensorRT-LLM's BOOL); got {value!r}")
        if name == "stop_words":
            words = [value] if isinstance(value, str) else list(value)
            tensors.append(tensor(name, "BYTES", np.array([w.encode("utf-8") for w in words], dtype=np.object_)))
        elif name in TEXTS:  # structured output: the guide's type and text (a schema or choices may be given as is)
            if name == "guided_decoding_guide" and isinstance(value, (dict, list)):
                value = json.dumps(value)
            if not isinstance(value, str):
                raise TypeError(f"{name}: a string; got {type(value).__name__}")
            tensors.append(tensor(name, "BYTES", np.array([value.encode("utf-8")], dtype=np.object_)))
        elif name in SCALARS and name not in _NOT_PARAMETERS:
            datatype = SCALARS[name][0]
            with np.errstate(over="ignore"):  # a float past FP32's range becomes inf: refused below, by name
                array = np.array([value], dtype=_NUMPY[datatype])
            if array.dtype.kind == "f" and not np.isfinite(array).all() and np.isfinite(value):
                raise ValueError(f"{name}: {value!r} does not fit the model's {datatype} input")
            tensors.append(tensor(name, datatype, array))
        else:
            known = sorted(set(SCALARS) - _NOT_PARAMETERS | {"stop_words", *TEXTS})
            raise TypeError(f"unknown generation parameter {name!r}; known: {', '.join(known)}")
    return tensors


def stop_inputs(grpc_module) -> list:
    """A stop request's inputs (it ends the request sent under the same request id)."""
    tensors = []
    for name, datatype, value in (("text_input", "BYTES", np.array([b""], dtype=np.object_)),
                                  ("stop", "BOOL", np.array([True]))):
        tensors.append(grpc_module.InferInput(name, [1], datatype))
        tensors[-1].set_data_from_numpy(value)
    return tensors


def ends(result, error) -> bool:
    """The response is some request's last: an error or a final response."""
    return error is not None or is_final(result)


def is_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def pick_model(index: list[str], url: str) -> str:
    if len(index) == 1:
        return index[0]
    if not index:
        raise GenerationError(f"{url}: the server has no ready model")
    raise GenerationError(f"{url}: several models are ready ({', '.join(sorted(index))}); pass model=")


def message(err) -> str:
    return err.message() if hasattr(err, "message") and callable(err.message) else str(err)


def from_model(error) -> bool:
    """An error the served model answered with (its message as it is), not a transport failure
    (those carry a gRPC status)."""
    return not (hasattr(error, "status") and callable(error.status) and error.status())
