"""The peers llmc is measured against, as plug-ins: each builds a checkpoint at a mode (made once under a
folder) and times greedy generation from that build, the same way for all. `PEERS` names them:

  llmc        its packaged engine in process (builds.sized_build; the engine alone, no server)
  genai       onnxruntime-genai: its model builder's CPU build, `generate()`; concurrent streams through og.Engine
  llama.cpp   llama-cpp-python: its sdist's converter (LLAMA_CPP_CONVERT), generation in a child process
  hf          HF transformers' `generate()` on the checkpoint itself (PyTorch eager; fp32 only)

A benchmark asks `peer.missing()` before it builds (what is not installed is named, not a crash mid-run).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.bench.builds import sized_build, timed_build

LLAMA_CPP_TYPE = {"fp32": "f32", "int8": "q8_0", "int4": "q4_0"}


@dataclass(frozen=True)
class Peer:
    name: str
    build: Callable[[Path, str, Path, int], dict]  # (checkpoint, mode, root, threads) -> the build's record
    timed: Callable[[dict, list[int], int, int], tuple[float, float, int]]  # (build, prompt, new, threads) ->
    # (seconds to the first token, seconds in all, tokens after the first)
    streams: Callable[[dict, list[list[int]], int, int], dict] | None = None  # (build, prompts, new, streams)
    missing: Callable[[], str | None] = lambda: None  # why it cannot run here, or None


def genai_build(checkpoint: Path, mode: str, root: Path, threads: int) -> dict:
    """onnxruntime-genai's builder at `mode` (made once under `root`, timed with its peak memory), its session
    options set to `threads`: the record, its folder as "dir"."""
    out = root / f"genai-{mode}"
    record = root / f"genai-{mode}.json"
    if not record.is_file():
        wall, peak, anonymous = timed_build([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
                                             str(checkpoint), "-o", str(out), "-p", mode, "-e", "cpu"],
                                            root / f"genai-{mode}.log")
        record.write_text(json.dumps({"build_s": wall, "peak_bytes": peak, "peak_anonymous_bytes": anonymous}))
    config = json.loads((out / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {}).update(intra_op_num_threads=threads,
                                                                         inter_op_num_threads=1)
    (out / "genai_config.json").write_text(json.dumps(config, indent=4))
    return {**json.loads(record.read_text()), "dir": out}


def genai_timed(model_dir: Path, prompt: list[int], batch: int, new: int) -> tuple[float, float, int]:
    """onnxruntime-genai greedy generation: (seconds to the first token, seconds in all, tokens
    per row after the first; fewer than new - 1 when it reached an end id).

    `append_tokens` runs the prompt and holds its logits; the first `generate_next_token` after it only
    picks the first token from them (no model run: 0.08 ms against a 25 ms step, SmolLM2), so it is
    timed with the prompt, and each later call (a model run, then a pick) is a token after the first.
    Counting that first pick as a decoded token credited genai one step it never ran: 64/63 of its rate
    at 64 new tokens, 32/31 at 32."""
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, do_sample=False, batch_size=batch)
    gen = og.Generator(model, params)
    start = time.perf_counter()
    gen.append_tokens(np.array([prompt] * batch, dtype=np.int32))  # the prompt's run
    gen.generate_next_token()  # the first token, from the prompt's logits
    first, produced = time.perf_counter() - start, 0
    while not gen.is_done():
        gen.generate_next_token()
        produced += 1
    return first, time.perf_counter() - start, produced


def genai_generate(model_dir: Path, prompt: list[int], batch: int, new: int) -> float:
    """Decode tokens/s after the first token."""
    first, total, produced = genai_timed(model_dir, prompt, batch, new)
    return batch * produced / (total - first)


def hf_generate(model, prompt: list[int], new: int) -> tuple[float, float, int]:
    """HF greedy generate(): (TTFT from a 1-token generate of the same prompt, total, tokens after the first)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return ttft, time.perf_counter() - start, new - 1


def llmc_in_process(version_dir: Path, prompt: list[int], new: int) -> tuple[float, float, int, float]:
    """The packaged engine alone (no thread, no server), fresh: (TTFT, total, tokens after the first),
    then the TTFT of the same prompt sent again to that engine (its prefix cache's hit, when it has one)."""
    from llmc.runtime.decoding.sampling import SamplingParams
    from llmc.runtime.serving.loop import ServingLoop

    engine = ServingLoop.from_manifest(version_dir).engine

    def one(request_id: str) -> tuple[float, float]:
        start = time.perf_counter()
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=new, min_tokens=new))
        ttft, done = None, False
        while not done:
            for out in engine.step():
                ttft = ttft if ttft is not None or not out.token_ids else time.perf_counter() - start
                done = done or out.finished
        return ttft, time.perf_counter() - start

    (ttft, total), (again, _) = one("cold"), one("again")
    engine.close()
    return ttft, total, new - 1, again


def llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot be measured here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp from its sdist; "
                "its converter, convert_hf_to_gguf.py, is in the sdist's vendor/llama.cpp)")
    if importlib.util.find_spec("diskcache") is None:  # llama_cpp imports it, and its sdist does not install it
        return "llama-cpp-python needs diskcache, which its sdist does not install (pip install diskcache)"
    if not os.environ.get("LLAMA_CPP_CONVERT"):
        return "LLAMA_CPP_CONVERT is not set to the sdist's vendor/llama.cpp/convert_hf_to_gguf.py"
    return None


# llama.cpp's converter, its tokenizer's pre-tokenizer pinned to SmolLM2's. The converter knows a tokenizer by a
# hash of its output on a probe text; checkpoints.py grows SmolLM2's tokenizer with filler tokens and
# transformers then loads it as the model type's class (Qwen2Tokenizer for qwen2), which changes that output,
# so the converter refuses it. The benchmark feeds token ids, so the pre-tokenizer llama.cpp records is moot.
PINNED_CONVERTER = (
    "import runpy, sys\n"
    "converter = sys.argv[1]\n"
    "sys.path.insert(0, converter.rsplit('/', 1)[0])\n"
    "from conversion import base\n"
    "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'smollm'\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(converter, run_name='__main__')\n")


def llama_cpp_build(checkpoint: Path, mode: str, root: Path) -> dict:
    """llama.cpp's converter at `mode` (F32 / Q8_0 as it writes them; Q4_0 requantized by llama_cpp's
    `llama_model_quantize` from a GGUF in the checkpoint's own precision, which is deleted after: at 8B an F32
    one is 32 GB), made once."""
    out = root / f"llama-cpp-{mode}.gguf"
    record = root / f"llama-cpp-{mode}.json"
    if not record.is_file():
        direct = mode != "int4"
        target = out if direct else root / "llama-cpp-int4-source.gguf"
        outtype = LLAMA_CPP_TYPE[mode] if direct else _lossless_type(checkpoint)
        wall, peak, anonymous = timed_build([sys.executable, "-c", PINNED_CONVERTER, os.environ["LLAMA_CPP_CONVERT"],
                                             str(checkpoint), "--outfile", str(target), "--outtype", outtype],
                                            root / f"llama-cpp-{mode}.log")
        if not direct:
            import llama_cpp

            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
            start = time.perf_counter()
            if llama_cpp.llama_model_quantize(str(target).encode(), str(out).encode(), params):
                raise RuntimeError(f"llama.cpp could not quantize {target} to Q4_0")
            wall += time.perf_counter() - start
            target.unlink()
        record.write_text(json.dumps({"build_s": wall, "peak_bytes": peak, "peak_anonymous_bytes": anonymous}))
    return {**json.loads(record.read_text()), "gguf": out}


# llama.cpp's greedy generation, run by llama_cpp_timed in a process of its own, printing its timings as JSON
TIMED_CHILD = (
    "import json, sys, time\n"
    "import llama_cpp\n"
    "gguf, prompt, new, threads = json.loads(sys.argv[1])\n"
    "llm = llama_cpp.Llama(gguf, n_ctx=len(prompt) + new + 8, n_threads=threads, n_batch=512, verbose=False)\n"
    "start, ttft, produced = time.perf_counter(), None, 0\n"
    "for _ in llm.generate(prompt, top_k=1, reset=True):\n"
    "    if ttft is None:\n"
    "        ttft = time.perf_counter() - start\n"
    "    else:\n"
    "        produced += 1\n"
    "    if produced == new - 1:\n"
    "        break\n"
    "print(json.dumps([ttft, time.perf_counter() - start, produced]))\n")


def _lossless_type(checkpoint: Path) -> str:
    """The converter's --outtype that keeps the checkpoint's weights exactly: its own dtype (bf16 or f16), else f32."""
    config = json.loads((checkpoint / "config.json").read_text())
    dtype = config.get("torch_dtype") or config.get("dtype")  # transformers 5 writes `dtype`
    return {"bfloat16": "bf16", "float16": "f16"}.get(dtype, "f32")


def llama_cpp_timed(gguf: Path, prompt: list[int], new: int, threads: int) -> tuple[float, float, int]:
    """llama.cpp greedy generation of `new` tokens: (TTFT, total seconds, tokens after the first), timed
    inside a child process, so that a llama.cpp that dies takes only the child: one built with
    GGML_NATIVE for a CPU that reports AMX but runs in a VM that does not enable it dies by SIGILL at its
    first AMX tile load (seen on a Xeon VM); the run then raises naming that, not vanishing mid-pass."""
    import signal

    done = subprocess.run([sys.executable, "-c", TIMED_CHILD, json.dumps([str(gguf), list(prompt), new, threads])],
                          capture_output=True, text=True)
    if done.returncode < 0:
        died = signal.Signals(-done.returncode).name
        hint = (" (an instruction this CPU cannot run: rebuild llama-cpp-python with CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" "
                "and the GGML_AVX2/GGML_AVX512... flags the CPU has, AMX left off)") if died == "SIGILL" else ""
        raise RuntimeError(f"llama.cpp died by {died} generating from {gguf.name}{hint}")
    if done.returncode:
        raise RuntimeError(f"llama.cpp failed generating from {gguf.name}: {done.stderr.strip()[-800:]}")
    ttft, total, produced = json.loads(done.stdout.strip().splitlines()[-1])
    return ttft, total, produced


def hf_build(checkpoint: Path, mode: str, root: Path, threads: int) -> dict:
    """The checkpoint loaded into transformers (nothing written): HF runs the weights as they are."""
    if mode != "fp32":
        raise ValueError(f"the HF peer runs the checkpoint's own fp32 weights, not {mode}")
    import torch

    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec

    torch.set_num_threads(threads)
    return {"model": load_model(inspect_source(SourceSpec(path=checkpoint)))[0].eval()}


def genai_missing() -> str | None:
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return "onnxruntime-genai is not installed (the `bench` extra: pip install -e .[bench])"
    return None


def _llmc_streams(build: dict, prompts: list[list[int]], new: int, streams: int) -> dict:
    from llmc.bench.streams import llmc_streams

    return llmc_streams(build["version"], prompts, new, streams)


def _genai_streams(build: dict, prompts: list[list[int]], new: int, streams: int) -> dict:
    from llmc.bench.streams import genai_streams

    return genai_streams(build["dir"], prompts, new, streams)


PEERS = {
    "llmc": Peer("llmc", lambda c, mode, root, threads: sized_build(c, mode, root),
                 lambda b, prompt, new, threads: llmc_in_process(b["version"], prompt, new)[:3], _llmc_streams),
    "genai": Peer("genai", genai_build, lambda b, prompt, new, threads: genai_timed(b["dir"], prompt, 1, new),
                  _genai_streams, genai_missing),
    "llama.cpp": Peer("llama.cpp", lambda c, mode, root, threads: llama_cpp_build(c, mode, root),
                      lambda b, prompt, new, threads: llama_cpp_timed(b["gguf"], prompt, new, threads),
                      missing=llama_cpp_missing),
    "hf": Peer("hf", hf_build, lambda b, prompt, new, threads: hf_generate(b["model"], prompt, new)),
}
