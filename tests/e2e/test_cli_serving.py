"""`llmc serve`, `llmc generate` and `llmc bench` as a user runs them: real processes, real Triton."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from llmc.supervisor import children as children_of
from llmc.triton_server import free_port, free_ports
from serving_rig import SERVING_ENV, serving_env, shm, stub_shm_regions

LLMC = Path(sys.executable).parent / "llmc"
pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    serving_env()  # skips without .venv-serving
    cache = tmp_path_factory.mktemp("cache")
    return {**os.environ, "COLUMNS": "200", "LLMC_SERVING_ENV": str(SERVING_ENV), "XDG_CACHE_HOME": str(cache)}


def _llmc(*args, env):
    return subprocess.run([str(LLMC), *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def test_serve_generate_and_sigterm_stop_clean(tiny_build, env, tmp_path):
    ports = free_ports(4)  # drawn together: distinct
    log = open(tmp_path / "serve.err", "w+")
    serve = subprocess.Popen([str(LLMC), "serve", tiny_build.output, "--http-port", str(ports[0]), "--grpc-port",
                              str(ports[1]), "--metrics-port", str(ports[2]), "--openai-port", str(ports[3])],
                             stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while "Ctrl-C to stop" not in (tmp_path / "serve.err").read_text():
            assert serve.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.err").read_text()
            time.sleep(0.2)
        banner = (tmp_path / "serve.err").read_text()
        assert f"127.0.0.1:{ports[1]}" in banner and "/v2/models/tiny/generate" in banner
        children = set(children_of(serve.pid))
        assert children  # tritonserver
        regions = stub_shm_regions(serve.pid)
        assert regions and regions <= shm()  # the stubs' regions, as /dev/shm names them

        url = f"127.0.0.1:{ports[1]}"
        res = _llmc("generate", "--url", url, "hello", "--max-tokens", "6", env=env)
        assert res.returncode == 0, res.stderr
        assert "finish_reason: length, 6 tokens" in res.stderr and res.stdout.endswith("\n")
        res = _llmc("generate", "--url", url, "hello", "--guide-type", "regex", "--guide", "[0-9]{3}-[a-z]{2}", env=env)
        assert res.returncode == 0, res.stderr
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}\n", res.stdout) and "finish_reason: stop" in res.stderr
        res = _llmc("generate", "--url", url, "hello", "--guide-type", "regex", "--guide", "a((", env=env)
        assert res.returncode == 8 and "guided_decoding_guide" in res.stderr and "Traceback" not in res.stderr
        res = _llmc("generate", "--url", url, "hello", "--top-p", "3", env=env)
        assert res.returncode == 8 and "top_p" in res.stderr and "Traceback" not in res.stderr
        res = _llmc("generate", "--url", url, "hello", "--chat", env=env)  # the tiny model has no template
        assert res.returncode == 8 and "no chat template" in res.stderr and "Traceback" not in res.stderr
        assert f"http://127.0.0.1:{ports[3]}/v1" in banner  # the OpenAI API beside it
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[3]}/v1/models", timeout=10) as r:
            assert [m["id"] for m in json.load(r)["data"]] == ["tiny"]

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert "stopped" in (tmp_path / "serve.err").read_text()
    time.sleep(0.5)
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]  # no stray server or stub
    assert regions & shm() == set()  # removed with the stubs


def test_serve_refuses_a_busy_port_and_a_folder_without_a_repository(tiny_build, env, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        busy = s.getsockname()[1]
        res = _llmc("serve", tiny_build.output, "--http-port", busy, env=env)
    assert res.returncode == 8 and f"port {busy}" in res.stderr and "--http-port" in res.stderr
    res = _llmc("serve", tmp_path, env=env)
    assert res.returncode == 8 and "no model repository" in res.stderr


def test_generate_without_a_server_is_one_line(env):
    res = _llmc("generate", "--url", f"127.0.0.1:{free_port()}", "hi", env=env)
    assert res.returncode == 8 and "cannot reach the server" in res.stderr and "Traceback" not in res.stderr


def test_bench_runs_a_baseline_and_concurrent_streams(tiny_build, env, tmp_path):
    res = _llmc("bench", tiny_build.output, "--concurrency", "3", "--requests", "6", "--max-tokens", "8",
                "--prompt-words", "10", "--json", tmp_path / "bench.json", env=env)
    assert res.returncode == 0, res.stderr
    assert "x the first run's" in res.stdout and "TTFT" in res.stdout
    results = json.loads((tmp_path / "bench.json").read_text())
    seq, conc = results["sequential"], results["3 concurrent"]
    assert (seq["errors"], conc["errors"]) == (0, 0) and conc["requests"] == 6
    assert conc["output_tokens"] == 6 * 8 and seq["prompt_tokens_mean"] > 10
    assert results["throughput_ratio"] > 0


def test_bench_sweeps_concurrency_and_plots_it(tiny_build, env, tmp_path):
    res = _llmc("bench", tiny_build.output, "--sweep", "1,2,4", "--max-tokens", "6", "--prompt-words", "6",
                "--json", tmp_path / "sweep.json", "--plot", tmp_path / "sweep.png", env=env)
    assert res.returncode == 0, res.stderr
    results = json.loads((tmp_path / "sweep.json").read_text())
    runs = [results[name] for name in ("sequential", "2 concurrent", "4 concurrent")]
    assert [r["concurrency"] for r in runs] == [1, 2, 4] and all(r["errors"] == 0 for r in runs)
    assert [r["requests"] for r in runs] == [4, 4, 8] and all(r["ttft_s_p90"] is not None for r in runs)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = _llmc("bench", tiny_build.output, "--sweep", "0,x", env=env)
    assert bad.returncode != 0 and "--sweep" in bad.stdout + bad.stderr
