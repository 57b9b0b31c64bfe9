"""The benchmarks' library (llmc/bench/): the harness's passes, turns and ratios; the sized checkpoints; the peers'
plug-ins (llama.cpp in a child process, onnxruntime-genai's og.Engine)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmc.bench import checkpoints, harness, peers, streams


def test_a_ratio_is_the_median_of_per_pass_ratios_not_a_ratio_of_medians():
    """Pass 2 ran on a loaded host (both sides slow): its ratio is still 2, and the median of ratios says 2,
    where the medians' ratio (3 / 2) would not."""
    ours, theirs = [2.0, 6.0, 3.0], [1.0, 3.0, 1.5]
    assert harness.median_ratio(ours, theirs) == 2.0
    assert harness.medians({"ours": ours, "theirs": theirs}) == {"ours": 3.0, "theirs": 1.5}
    with pytest.raises(AssertionError):
        harness.median_ratio(ours, theirs[:2])


def test_contenders_take_every_place_in_turn():
    assert [harness.in_turn("ab", p) for p in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    orders = [harness.in_turn([1, 2, 3], p) for p in range(3)]
    assert orders == [[1, 2, 3], [2, 3, 1], [3, 1, 2]]
    assert all(sorted(o[i] for o in orders) == [1, 2, 3] for i in range(3))  # each first, middle and last once
    assert harness.in_turn({"x": 1, "y": 2}, 1) == ["y", "x"] and harness.in_turn([], 5) == []


def test_json_out_makes_its_folder_and_writes_paths_as_text(tmp_path):
    path = harness.write_json(tmp_path / "a" / "b.json", {"dir": tmp_path, "runs": [1.5]})
    assert json.loads(path.read_text()) == {"dir": str(tmp_path), "runs": [1.5]}
    assert "CPUs" in harness.environment() and "\n" not in harness.environment()


def test_every_peer_is_a_plug_in_with_a_build_and_a_timing():
    assert set(peers.PEERS) == {"llmc", "genai", "llama.cpp", "hf"}
    for name, peer in peers.PEERS.items():
        assert peer.name == name and callable(peer.build) and callable(peer.timed)
        assert peer.missing() is None or isinstance(peer.missing(), str)
    assert peers.PEERS["llmc"].streams and peers.PEERS["genai"].streams  # og.Engine for genai
    with pytest.raises(ValueError, match="fp32"):
        peers.PEERS["hf"].build(None, "int4", None, 1)


def test_sized_checkpoints_have_the_published_parameter_counts():
    """The shapes are the models' own configs: counted on the meta device, each matches its published size;
    the tokenizer grows to the vocabulary, so every id a random model emits decodes."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    for shape, count in checkpoints.PARAMETERS.items():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(checkpoints.config(shape))
        assert sum(p.numel() for p in model.parameters()) == count, shape
    tokenizer = Tokenizer.from_str(json.dumps(checkpoints.grown_tokenizer(151936)))
    assert tokenizer.get_vocab_size() == 151936
    assert tokenizer.decode([151935], skip_special_tokens=False) == "<|filler_151935|>"


def test_a_llama_cpp_that_dies_is_named_not_a_vanished_run(monkeypatch, tmp_path):
    """llama.cpp generates in a child process: one dying by a signal (SIGILL: built for AMX in a VM that does not
    enable it) or failing raises naming the file and the cause, and the bench's own process lives on."""
    gguf = tmp_path / "model.gguf"
    monkeypatch.setattr(peers, "TIMED_CHILD", "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    with pytest.raises(RuntimeError, match=r"llama.cpp died by SIGILL generating from model.gguf .*GGML_NATIVE=OFF"):
        peers.llama_cpp_timed(gguf, [1, 2, 3], 4, 1)
    monkeypatch.setattr(peers, "TIMED_CHILD", "raise SystemExit('no such model: ' + __import__('sys').argv[1])\n")
    with pytest.raises(RuntimeError, match=r"llama.cpp failed generating from model.gguf: no such model: .*model.gguf"):
        peers.llama_cpp_timed(gguf, [1, 2, 3], 4, 1)
    monkeypatch.setattr(peers, "TIMED_CHILD", "import json, sys\nprint('log line')\nprint(json.dumps([0.5, 2.0, 3]))\n")
    assert peers.PEERS["llama.cpp"].timed({"gguf": gguf}, [1, 2, 3], 4, 1) == (0.5, 2.0, 3)


def test_og_engine_streams_on_a_tiny_genai_build(tiny_checkpoints, tmp_path):
    """The sizes benchmark's --streams against onnxruntime-genai: its builder's CPU graph of the tiny Llama, served
    by og.Engine with the batch set to the streams; every request gets exactly its tokens."""
    build = peers.genai_build(tiny_checkpoints["llama"], "fp32", tmp_path, threads=1)
    prompts = [[1, 40 + i, 50, 60, 70 + i] for i in range(5)]
    got = streams.genai_streams(build["dir"], prompts, new=6, streams=3)
    assert got["tokens"] == 5 * 6 and got["tok_s"] > 0
    assert 0 < got["itl_p50_s"] <= got["itl_p99_s"] and 0 < got["ttft_p50_s"] <= got["ttft_p99_s"]
    config = json.loads((build["dir"] / "genai_config.json").read_text())
    assert config["engine"] == {"static_batching": {"max_batch_size": 3}}
    # batch-1 decode's count: the first token comes from the prompt's run, so 6 new tokens are 5 runs after it
    first, total, after = peers.genai_timed(build["dir"], prompts[0], 1, 6)
    assert after == 5 and 0 < first < total


def test_the_gpu_kernels_figures_are_bandwidth_shares_and_ratios_from_one_run():
    """gpu-kernels' table and JSON on timings given (no GPU here): TB/s from the KV bytes a step reads, the share
    of the data sheet's peak (none for a GPU it does not know), the ratio to SDPA's time in the same run."""
    from llmc.bench.kernels.gpu import peak_bandwidth, summarize

    assert peak_bandwidth("NVIDIA H200") == 4.8 and peak_bandwidth("NVIDIA H100 NVL") == 3.9
    assert peak_bandwidth("NVIDIA GeForce RTX 4090") is None
    kv = 2 * 32 * 8 * 4096 * 128 * 2  # batch 32 x 4k, 8 KV heads of 128, fp16: 537 MB a step
    rows = summarize({"torch SDPA": 0.128, "llmc paged one launch": 0.256}, kv, "NVIDIA H200")
    assert rows["torch SDPA"]["tb_s"] == pytest.approx(kv / 0.128e-3 / 1e12)
    assert rows["torch SDPA"]["peak_share"] == pytest.approx(rows["torch SDPA"]["tb_s"] / 4.8)
    assert rows["llmc paged one launch"]["vs_sdpa"] == pytest.approx(0.5)
    assert summarize({"torch SDPA": 1.0}, kv, "a GPU nobody listed")["torch SDPA"]["peak_share"] is None


def test_a_sized_build_names_its_block_size_in_the_spec(tmp_path):
    """sizes --int4-block: llmc's int4 build is made with that quantization.block_size; unset, the mode's default."""
    import yaml

    from llmc.bench.builds import sized_spec
    from llmc.compiler.spec import parse_spec

    def quantization(mode, block=None):
        return parse_spec(yaml.safe_load(sized_spec(tmp_path / "ckpt", mode, block))).quantization

    assert quantization("int4", 128).block == 128 and quantization("int4").block == 32
    assert quantization("int8", 64).block == 64 and not quantization("fp32").weight_only


def test_a_streamed_build_from_a_gguf_names_what_is_missing(monkeypatch, tmp_path):
    """streamed --gguf converts with llama.cpp: where it cannot, the run stops naming why, before any build."""
    from llmc.bench.sizes import streamed

    monkeypatch.setattr(peers, "llama_cpp_missing", lambda: "llama-cpp-python is not installed")
    with pytest.raises(SystemExit, match="--gguf q8_0: llama-cpp-python is not installed"):
        streamed.gguf_source(tmp_path / "ckpt", "q8_0")
    assert not any(tmp_path.iterdir())


def test_a_streamed_build_reads_a_gguf_llama_cpp_wrote(monkeypatch, capsys, tmp_path):
    """streamed --gguf q8_0 on a tiny width: the checkpoint converted by llama.cpp's own converter, then built
    reading its layers from the GGUF (dequantized a tensor at a time) and verified against the GGUF's model."""
    from llmc.bench.__main__ import main as bench_main

    if missing := peers.llama_cpp_missing():
        pytest.skip(f"llama.cpp: {missing}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    bench_main(["streamed", "--hidden", "64", "--intermediate", "128", "--layers", "2", "--loads", "layers",
                "--gguf", "q8_0", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "streamed.json").read_text())
    build = result["builds"]["2"]["layers"]
    assert result["gguf"] == "q8_0" and build["verify"]["passed"] and build["peak_gib"] > 0
    assert (tmp_path / "checkpoints" / "llama-h64-i128-v49152-l2-gguf" / "llama-cpp-int8.gguf").is_file()
    assert "2 layers, load layers" in capsys.readouterr().out


def test_llama_cpp_perplexity_is_the_checkpoints_own_on_the_held_out_windows(tmp_path):
    """quantization --llama-cpp: a GGUF's perplexity on the quality report's held-out windows. An F32 GGUF of a
    tiny random Llama (SmolLM2's tokenizer) reads as the checkpoint's own PyTorch model does, to 1e-3. Its
    embeddings are scaled up so that its predictions are far from uniform: a window read one token off would not
    agree."""
    import math
    import shutil

    import torch
    import transformers

    from llmc.bench.compare.quantization import heldout_windows, llama_cpp_perplexity, perplexity
    from llmc.bench.sizes import streamed

    if missing := peers.llama_cpp_missing():
        pytest.skip(f"llama.cpp: {missing}")
    fields = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "vocab_size": 49152,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
              "tie_word_embeddings": True, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}
    random = streamed.checkpoint(tmp_path, fields, "random")
    model = transformers.AutoModelForCausalLM.from_pretrained(random, dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(10.0)
    checkpoint = tmp_path / "sharp"
    model.save_pretrained(checkpoint)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(random / file, checkpoint / file)
    gguf = peers.llama_cpp_build(checkpoint, "fp32", tmp_path / "gguf")["gguf"]
    with torch.no_grad():
        expected = perplexity(heldout_windows(checkpoint), lambda ids: model(torch.tensor(ids)[None]).logits[0])
    got = llama_cpp_perplexity(gguf, checkpoint, threads=1)
    assert got == pytest.approx(expected, rel=1e-3)
    assert abs(math.log(expected / 49152)) > 1, expected  # far from uniform (a uniform guess's is the vocabulary)


def test_a_steps_bytes_count_the_scales_llmcs_kernel_packs_as_fp16(tmp_path):
    """The roofline's bytes: a 4-bit node whose scales are all fp16 values streams them at two bytes each through
    llmc's kernel (read from a data file with two hard links, as a packaged version's), one with any other scale at
    four; an embedding table only Gather reads is left out."""
    import os

    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from llmc.bench.sizes.sizes import step_bytes
    from llmc.runtime.kernels import cpu_kernels

    rng = np.random.default_rng(0)
    half = (rng.random(64 * 4, dtype=np.float32) * 0.02).astype(np.float16).astype(np.float32)
    inits, nodes = [numpy_helper.from_array(rng.random((10, 128), dtype=np.float32), "embed")], []
    for name, scales in (("a", half), ("b", half + np.float32(1e-7))):
        inits += [numpy_helper.from_array(rng.integers(0, 256, (64, 4, 16), dtype=np.uint8), f"{name}.B"),
                  numpy_helper.from_array(scales, f"{name}.scales")]
        nodes.append(helper.make_node("MatMulNBits", ["x", f"{name}.B", f"{name}.scales"], [name], domain="com.microsoft",
                                      K=128, N=64, bits=4, block_size=32, accuracy_level=4))
    nodes.append(helper.make_node("Gather", ["embed", "ids"], ["x"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("a", "b")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(tmp_path / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
              size_threshold=0)
    os.link(tmp_path / "model.onnx.data", tmp_path / "linked.data")
    stored = 2 * (64 * 4 * 16 + 64 * 4 * 4)
    assert step_bytes(tmp_path) == stored
    assert step_bytes(tmp_path, llmc_kernel=True) == stored - (64 * 4 * 2 if cpu_kernels.load() else 0)


@pytest.mark.parametrize("tied", [False, True])
def test_a_gguf_step_reads_every_tensor_but_a_gathered_embedding(tmp_path, tied):
    """llama.cpp's roofline bytes: the token embedding is left out where an `output.weight` reads the LM head, and
    counted where the file ties them (the embedding is then read whole every step)."""
    import gguf

    from llmc.bench.sizes.sizes import gguf_step_bytes

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    sizes = {"token_embd.weight": (32, 16), "blk.0.attn_q.weight": (16, 16)}
    sizes |= {} if tied else {"output.weight": (32, 16)}
    for name, shape in sizes.items():
        writer.add_tensor(name, np.ones(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_step_bytes(tmp_path / "m.gguf") == 4 * (32 * 16 + 16 * 16)
