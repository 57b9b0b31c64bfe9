"""The Triton Python-backend model llmc packages into `<repository>/<name>/1/model.py`.

Thin on purpose: the serving loop lives in `llmc.runtime.serving.loop` (a copy ships in this folder, so
the repository needs only the packages in its requirements.txt). `execute` hands each request to
the loop and returns at once; the loop's thread batches requests in flight and streams responses
through each request's response sender (the model is decoupled).
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the llmc runtime copied next to this file wins over any installed one

import triton_python_backend_utils as pb_utils  # noqa: E402

from llmc.runtime.serving.metrics import triton_metrics  # noqa: E402
from llmc.runtime.serving.loop import ServingLoop  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
DRAIN_SECONDS = 20.0  # below Triton's default 30 s stub timeout


class _Sink:
    """One request's response sender, in the shape the serving loop expects."""

    def __init__(self, sender):
        self.sender = sender

    def send(self, outputs, final):
        tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0)

    def error(self, message):
        self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)

    def is_cancelled(self):
        return self.sender.is_cancelled()

    def finish(self):
        self.sender.send(flags=FINAL)  # a cancelled request still needs its final flag to be released


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not config.get("model_transaction_policy", {}).get("decoupled"):
            raise pb_utils.TritonModelException(f"{args['model_name']}: config.pbtxt must set "
                                                "model_transaction_policy { decoupled: true } (llmc streams responses)")
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.loop = ServingLoop.from_manifest(HERE, triton_metrics(pb_utils, labels)).start()

    def execute(self, requests):
        for request in requests:
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            self.loop.submit(inputs, _Sink(request.get_response_sender()), request.request_id())
        return None

    def finalize(self):
        # unloading (a new version replaced this one, or the server stops): streams in flight may
        # finish first, so a version swap costs no request
        self.loop.drain(DRAIN_SECONDS)
        self.loop.stop()
