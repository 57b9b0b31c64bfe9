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
