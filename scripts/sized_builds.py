"""The builds scripts/bench_sizes.py measures, each made once under its folder and timed with its peak memory:
llmc's (`llmc build`, with the dry run's estimate of that memory), onnxruntime-genai's model builder, and
llama.cpp's converter (where llama-cpp-python and the converter of its sdist are installed); and llama.cpp's
greedy generation, timed as the other two are."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

MODES = ("fp32", "int8", "int4")
LLMC_MODE = {"fp32": None, "int8": "int8-weight-only", "int4": "int4-weight-only"}
LLAMA_CPP_TYPE = {"fp32": "f32", "int8": "q8_0", "int4": "q4_0"}
STREAM_ROWS = 16  # llmc's rows a step (limits.max_batch_size, as the example's): bench_sizes.py's --streams at most


class PeakMemory:
    """The largest resident set of a process and its children, sampled every `interval` seconds: in all
    (`peak`), and its anonymous part (`peak_anonymous`: the resident set less the file-backed and shared
    pages, such as a session's mapped weights file, which the kernel can drop and read again)."""

    def __init__(self, pid: int, interval: float = 0.05):
        import psutil

        self.peak = self.peak_anonymous = 0
        self._stop = threading.Event()
        self._root = psutil.Process(pid)
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
        self._thread.start()

    def _sample(self, interval: float) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                infos = [p.memory_info() for p in (self._root, *self._root.children(recursive=True))]
                self.peak = max(self.peak, sum(i.rss for i in infos))
                self.peak_anonymous = max(self.peak_anonymous, sum(i.rss - i.shared for i in infos))
            except psutil.Error:
                pass
            self._stop.wait(interval)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak, self.peak_anonymous


def timed_build(cmd: list[str], log: Path) -> tuple[float, int, int]:
    """Run a build command: (wall seconds, peak resident bytes of its process tree, peak anonymous bytes);
    its output to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        memory = PeakMemory(proc.pid)
        code = proc.wait()
        wall, (peak, anonymous) = time.perf_counter() - start, memory.stop()
    if code:
        raise RuntimeError(f"{cmd[0]} ... failed (exit {code}); see {log}")
    return wall, peak, anonymous


def llmc_build(checkpoint: Path, mode: str, root: Path) -> dict:
    """An llmc build of `checkpoint` in `mode` (made once): its version folder, build time, peak memory
    and the dry run's estimate of that memory."""
    out = root / f"llmc-{mode}"
    spec = root / f"llmc-{mode}.yaml"
    root.mkdir(parents=True, exist_ok=True)
    lines = [f"name: {checkpoint.name}-{mode}", f"source: {checkpoint}", "target: onnxruntime", "precision: fp32",
             "limits:", f"  max_batch_size: {STREAM_ROWS}"]
    if LLMC_MODE[mode]:
        lines += ["quantization:", f"  mode: {LLMC_MODE[mode]}"]
    spec.write_text("\n".join(lines) + "\n")
    record = root / f"llmc-{mode}.json"
    if not record.is_file():
        from llmc.compiler import load_spec, plan_build

        llmc = [sys.executable, "-m", "llmc.cli"]
        estimate = plan_build(load_spec(spec)).build_peak_bytes  # what `llmc build --dry-run` says
        wall, peak, anonymous = timed_build([*llmc, "build", str(spec), "-o", str(out)], root / f"llmc-{mode}.log")
        record.write_text(json.dumps({"build_s": wall, "peak_bytes": peak, "peak_anonymous_bytes": anonymous,
                                      "estimate_bytes": estimate}))
    return {**json.loads(record.read_text()), "version": next((out / "model_repository").glob("*/[0-9]*"))}


def genai_build(checkpoint: Path, mode: str, root: Path, threads: int) -> dict:
    """onnxruntime-genai's builder at `mode` (made once), its session options set to `threads`."""
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


def llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot be measured here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp from its sdist; "
                "its converter, convert_hf_to_gguf.py, is in the sdist's vendor/llama.cpp)")
    if not os.environ.get("LLAMA_CPP_CONVERT"):
        return "LLAMA_CPP_CONVERT is not set to the sdist's vendor/llama.cpp/convert_hf_to_gguf.py"
    return None


# llama.cpp's converter, its tokenizer's pre-tokenizer pinned to SmolLM2's. The converter knows a tokenizer by a
# hash of its output on a probe text; sized_checkpoints.py grows SmolLM2's tokenizer with filler tokens and
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
    """llama.cpp's converter at `mode` (F32 / Q8_0 as it writes them; Q4_0 requantized from F32 by
    llama_cpp's `llama_model_quantize`), made once."""
    out = root / f"llama-cpp-{mode}.gguf"
    record = root / f"llama-cpp-{mode}.json"
    if not record.is_file():
        direct = mode != "int4"
        target = out if direct else root / "llama-cpp-fp32.gguf"
        wall, peak, anonymous = 0.0, 0, 0
        if not target.is_file():
            wall, peak, anonymous = timed_build([sys.executable, "-c", PINNED_CONVERTER, os.environ["LLAMA_CPP_CONVERT"],
                                                 str(checkpoint), "--outfile", str(target),
                                                 "--outtype", LLAMA_CPP_TYPE[mode if direct else "fp32"]],
                                                root / f"llama-cpp-{mode}.log")
        if not direct:
            import llama_cpp

            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
            start = time.perf_counter()
            if llama_cpp.llama_model_quantize(str(target).encode(), str(out).encode(), params):
                raise RuntimeError(f"llama.cpp could not quantize {target} to Q4_0")
            wall += time.perf_counter() - start
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
