"""A model split over 2 ranks, served by a real Triton server beside the same model whole: the rank workers start
from inside Triton's Python backend, and every feature answers as the whole model does: greedy tokens (equal to
PyTorch), a prefix-cache hit, prompt-lookup speculation, beams, log probabilities and the OpenAI API. A rank killed
under load ends its stream with an error naming it, and the model serves again."""

import os
import signal
import time

import pytest

from checkpoints import byte_tokenizer
from checkpoints import TINY_SERVING_SPEC
from serving_rig import greedy_reference, serving_env

pytestmark = [pytest.mark.triton, pytest.mark.slow]
PROMPT = "Once upon a time, in a small village by the sea, there lived"
SERVING = {**TINY_SERVING_SPEC["serving"], "max_beam_width": 2}


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    import shutil

    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec
    from llmc.triton_server import TritonServer, assemble

    env = serving_env()  # skips without .venv-serving
    root = tmp_path_factory.mktemp("tp_serving")
    for name, ranks in (("whole", 1), ("split", 2)):  # both verified against PyTorch elsewhere
        spec = parse_spec({"name": name, "source": str(tiny_checkpoints["llama"]), **TINY_SERVING_SPEC,
                           "serving": SERVING, "speculative": {"method": "ngram", "num_tokens": 3},
                           "parallel": {"tensor": ranks}, "verify": {"enabled": False}})
        shutil.copytree(build(spec, output=root / name).repository / name, root / "repository" / name)
    with TritonServer(root / "repository", server_dir=assemble(root / "server"), serving_env=env,
                      log_path=root / "server.log") as server:
        yield server


def _rank_workers(server_pid: int) -> list[int]:
    """The rank worker processes under the server (started by a Python-backend stub)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"ort_group import rank_main" in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return [pid for pid in found if _descends(pid, server_pid)]


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        if pid == ancestor:
            return True
    return False


def test_the_split_model_answers_as_the_whole_one(served, tiny_checkpoints):
    from llmc.client import Client
    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec

    model = load_model(inspect_source(SourceSpec(path=tiny_checkpoints["llama"])))[0]
    want = greedy_reference(model, byte_tokenizer().encode(PROMPT).ids, 24, end_ids=(2,))
    whole, split = Client(served.grpc_url, "whole"), Client(served.grpc_url, "split")
    for _ in range(2):  # the second request is a prefix-cache hit (and prompt lookup speculates on both)
        assert split.complete(PROMPT, max_tokens=24).output_ids == want
    beams = [c.complete(PROMPT, max_tokens=12, beam_width=2) for c in (whole, split)]
    assert beams[0].beam_ids == beams[1].beam_ids and len(beams[1].beam_ids) == 2
    assert beams[0].cum_log_probs == pytest.approx(beams[1].cum_log_probs, abs=1e-3)
    assert len(_rank_workers(served.process.pid)) == 1


def test_the_openai_api_gives_the_same_log_probabilities(served):
    import openai

    from llmc.openai.server import OpenAIServer
    from llmc.triton_server import free_port

    with OpenAIServer([served.grpc_url], port=free_port()) as api:
        client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0)
        got = {name: client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
               for name in ("whole", "split")}
    assert got["whole"].choices[0].text == got["split"].choices[0].text
    whole, split = (got[n].choices[0].logprobs for n in ("whole", "split"))
    assert whole.token_logprobs == pytest.approx(split.token_logprobs, abs=1e-3)
    assert [sorted(t) for t in whole.top_logprobs] == [sorted(t) for t in split.top_logprobs]


def test_a_rank_killed_under_load_ends_its_stream_and_the_model_comes_back(served):
    import threading

    from llmc.client import Client
    from llmc.client.generation import GenerationError
    from llmc.soak import llmc_metrics

    client = Client(served.grpc_url, "split")
    want = client.complete(PROMPT, max_tokens=16).output_ids
    longest = Client(served.grpc_url, "whole").complete(PROMPT, max_tokens=64, end_id=-1).output_ids
    end_id = next(t for t in range(256) if t not in longest)  # no early end: the stream runs until the kill
    workers = _rank_workers(served.process.pid)
    assert len(workers) == 1
    metrics_url = f"http://127.0.0.1:{served.ports.metrics}"
    admitted = llmc_metrics(metrics_url, "split")["llmc_prompt_tokens_total"]
    # The rank stops first: a tiny model streams 64 tokens faster than a test can read one and signal, so a rank
    # stopped after the first token may find the stream already ended. Stopped, it holds the request's first step in
    # its first all-reduce, and the kill lands with the request surely in flight.
    os.kill(workers[0], signal.SIGSTOP)
    ended: list[BaseException | None] = []

    def run() -> None:
        try:
            for _ in client.generate(PROMPT, max_tokens=64, end_id=end_id):
                pass
            ended.append(None)
        except BaseException as err:  # noqa: BLE001 (the test thread checks what it was)
            ended.append(err)

    streaming = threading.Thread(target=run, daemon=True)
    streaming.start()
    deadline = time.monotonic() + 30
    while llmc_metrics(metrics_url, "split")["llmc_prompt_tokens_total"] == admitted:
        assert time.monotonic() < deadline, "the request was not admitted"
        time.sleep(0.05)
    os.kill(workers[0], signal.SIGKILL)
    streaming.join(timeout=60)
    assert ended and isinstance(ended[0], GenerationError), ended
    assert "rank 1" in str(ended[0])
    deadline = time.monotonic() + 60
    while True:  # the model loads its ranks again; requests meanwhile wait for it
        try:
            assert client.complete(PROMPT, max_tokens=16).output_ids == want
            break
        except GenerationError:
            assert time.monotonic() < deadline, "the split model did not come back"
            time.sleep(0.5)
    assert _rank_workers(served.process.pid) != workers
