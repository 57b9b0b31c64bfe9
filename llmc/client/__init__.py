"""Call a served llmc model over gRPC (tritonclient): text chunks stream back as they are made.

    from llmc.client import Client
    with Client("127.0.0.1:8001") as client:
        for chunk in client.generate("The capital of France is", max_tokens=32):
            print(chunk, end="", flush=True)

`AsyncClient` is the same for asyncio (`async for chunk in client.generate(...)`). Sampling
parameters are the served model's optional inputs (`max_tokens`, `temperature`, `top_p`, `top_k`,
`min_p`, penalties, `seed`, `min_tokens`, `end_id`, `stop_words`, ...). Every failure, a refused
request, an unreachable server or a missing model, raises `GenerationError` with the server's message:
`Refused` when the served model answered with an error, `Unreachable` when the transport failed.
Beam search: `client.complete(prompt, beam_width=4, length_penalty=..., early_stopping=...)`
returns a Generation whose `beams`, `beam_ids` and `cum_log_probs` hold every beam, best first.
Leaving a stream early ends the request on the server in band: a stop request under the same
request id, then the stream closes with nothing pending (closing a stream with a request in flight
can crash Triton 2.51, see runtime/serving/loop.py); a server that does not answer the stop within
`STOP_SECONDS` gets its stream cancelled instead (llmc/client/stream.py, which the OpenAI frontend
uses too).

Several replicas: pass a list of addresses (or "host:port,host:port"). Requests start on them in
turn; one that fails before its first response is tried once more on another replica, and a
stream that fails after it ends with GenerationError (llmc/client/replicas.py).

The package: sync.py (Client), aio.py (AsyncClient), stream.py (one request on its stream, and the
in-band stop), generation.py (the request's tensors, `Generation`, the errors), replicas.py. It
imports tritonclient and numpy only (pyproject.toml's import contract).
"""

from llmc.client.aio import AsyncClient
from llmc.client.generation import (Generation, GenerationError, Refused, Unreachable, ends, from_model, make_inputs,
                                    message, pick_model, stop_inputs)
from llmc.client.stream import STOP_SECONDS
from llmc.client.sync import Client

__all__ = ["Client", "AsyncClient", "Generation", "GenerationError", "Refused", "Unreachable", "STOP_SECONDS",
           "make_inputs", "stop_inputs", "ends", "from_model", "message", "pick_model"]
