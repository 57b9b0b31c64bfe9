"""The OpenAI frontend's backends (llmc/openai/backends.py) without a server."""

import numpy as np


def test_outputs_read_in_one_pass_equal_tritonclients_as_numpy():
    """backends._Outputs (one pass, BYTES decoded by hand) gives what InferResult.as_numpy gives."""
    from tritonclient.grpc import service_pb2
    from tritonclient.grpc._infer_result import InferResult

    from llmc.openai.backends import _Outputs

    response = service_pb2.ModelInferResponse()
    for name, datatype, shape, raw in (
            ("text_output", "BYTES", [1], b"\x07\x00\x00\x00 Paris\xc3"),
            ("token_texts", "BYTES", [2], b"\x02\x00\x00\x00ab\x00\x00\x00\x00"),
            ("output_ids", "INT32", [2], np.array([42, 7], np.int32).tobytes()),
            ("top_log_probs", "FP32", [2, 3], np.arange(6, dtype=np.float32).tobytes())):
        response.outputs.add(name=name, datatype=datatype, shape=shape)
        response.raw_output_contents.append(raw)
    result = InferResult(response)
    for name in ("text_output", "token_texts", "output_ids", "top_log_probs"):
        expected, got = result.as_numpy(name), _Outputs(result).as_numpy(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape and (got == expected).all(), name
    assert _Outputs(result).as_numpy("finish_reason") is None


def test_a_server_is_marked_down_by_failed_checks_in_a_row_or_a_not_ready_answer():
    """One check past its timeout on a busy host keeps the server and its models (every request 503 until the next
    check was the cost, with the server up); UNHEALTHY_AFTER failures in a row, or a not-ready answer, mark it down;
    a good check counts from zero again."""
    import asyncio
    from types import SimpleNamespace

    from llmc.openai.backends import UNHEALTHY_AFTER, Backend

    class Client:
        def __init__(self):
            self.answers = []  # per check: True / False (ready or not), or an exception to raise

        async def is_server_ready(self, client_timeout):
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        async def get_model_repository_index(self, client_timeout):
            return SimpleNamespace(models=[])

    backend, client = Backend("127.0.0.1:1"), Client()
    backend.client = client

    def after(*answers) -> list[bool]:
        client.answers = list(answers)
        states = []
        for _ in answers:
            asyncio.run(backend.check())
            states.append(backend.healthy)
        return states

    slow = TimeoutError("Deadline Exceeded")
    assert after(slow, True) == [False, True]  # never up: stays down until a check succeeds
    assert UNHEALTHY_AFTER == 2
    assert after(slow, True, slow, True) == [True, True, True, True]  # one slow check at a time: still up
    assert after(slow, slow, True) == [True, False, True]
    assert after(False) == [False]  # not ready: down at once
