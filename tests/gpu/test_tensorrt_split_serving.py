"""The tiny Llama split over 2 GPUs on TensorRT, end to end, where TensorRT (10.16+), two GPUs and NCCL exist (skipped
here with the reason): `llmc build` with `parallel.tensor: 2` builds rank0/ and rank1/ engines, whose check runs them
together against ONNX Runtime; the repository's manifest lists both; the served model's loader runs them as
TrtTensorParallelRunner (rank 0 here on GPU 0, rank 1 a worker on GPU 1), whose greedy tokens must equal the unsplit
engine's on the same prompts. The CPU tests up to TensorRT are tests/compiler/trt/test_split_engine.py and
tests/runtime/runners/test_trt_group.py."""


from multi_gpu import marks

WORLD = 2


pytestmark = marks(WORLD)


def test_a_two_gpu_split_builds_verifies_and_serves_the_unsplit_engines_greedy_tokens(tiny_llama, tmp_path):
    from llmc.compiler import build
    from llmc.compiler.graph.greedy import runner_greedy
    from llmc.compiler.spec import parse_spec
    from llmc.runtime.runners.parallel.trt_group import TrtTensorParallelRunner
    from llmc.runtime.serving import loader

    base = {"name": "tiny", "source": str(tiny_llama), "target": "tensorrt", "precision": "fp16",
            "limits": {"max_batch_size": 4, "max_seq_len": 128, "max_num_tokens": 64}}
    split = build(parse_spec({**base, "parallel": {"tensor": WORLD}}), output=tmp_path / "split")
    assert "2 rank engines together" in split.tensorrt.verified and "passed" in split.tensorrt.verified
    version = split.repository / "tiny" / "1"
    assert [p.relative_to(version).as_posix() for p in split.manifest.graphs(version)] == \
        ["rank0/model.plan", "rank1/model.plan"]
    whole = build(parse_spec(base), output=tmp_path / "whole")
    prompts = [[5, 9, 200, 17], list(range(1, 30)), [42]]
    tokens = []
    for result in (split, whole):
        engine, _, _ = loader.load(result.repository / "tiny" / "1")
        try:
            assert isinstance(engine.runner, TrtTensorParallelRunner) == (result is split)
            decoded = runner_greedy(engine.runner, prompts, 8, lambda: None)
            tokens.append([[int(x.argmax()) for x in last] for _, last in decoded])
        finally:
            engine.close()
    assert tokens[0] == tokens[1]
