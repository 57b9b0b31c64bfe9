"""Helpers shared by tests in several folders or files: a truncated checkpoint as a draft, a metrics recorder,
a built version served with and without speculation, an engine run to the end on greedy prompts, pairwise
parametrization and the plugin kernels' cases, whether a guide's grammar takes a text, and one MoE node as a graph."""

from __future__ import annotations

import shutil
import time

import pytest

from checkpoints import byte_tokenizer
from serving_rig import RecordingSink, request_inputs
from llmc.runtime.manifest import RepositoryManifest
from llmc.runtime.serving.loop import ServingLoop
from llmc.runtime.serving.metrics import ServingMetrics


def all_pairs(**levels):
    """`pytest.mark.parametrize` over cases holding every pair of values of any two parameters (allpairspy),
    not the whole product: each two-way interaction is covered in a fraction of the cases (9 for 3x3x2x2,
    not 36). For sweeps whose cases cost seconds each, such as the GPU kernels run by Triton's interpreter."""
    from allpairspy import AllPairs

    return pytest.mark.parametrize(", ".join(levels), [tuple(case) for case in AllPairs(list(levels.values()))])


# (capability, float type, rotary) of the plugin kernels whose TensorRT calling convention the GPU tests check: both
# forms (rotary in the kernel, or none with the other features) on both targets, and each float type at least once.
# A kernel's parameters follow its signature, where the pointers' element type does not change their declaration.
PLUGIN_CASES = ((80, "fp16", True), (80, "bf16", False), (90, "fp32", True), (90, "fp16", False))


def run_greedy(engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Every prompt queued at once as a greedy request of `max_tokens`, the engine stepped until done:
    each request's token ids."""
    from llmc.runtime.decoding.sampling import SamplingParams

    for name, ids in prompts.items():
        engine.add_request(name, ids, SamplingParams(max_tokens=max_tokens))
    out = {name: [] for name in prompts}
    while engine.has_work:
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return out


def truncated(checkpoint, folder, num_layers=1):
    """`checkpoint` with its first `num_layers` decoder layers only (embeddings, norm and LM head kept):
    a smaller draft with the same tokenizer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, folder / name)
    return folder


class Recorder:
    def __init__(self):
        self.values = {}

    def __call__(self, kind, name, doc, buckets, extra=None):
        rec = self
        name += "".join(f"{{{k}={v}}}" for k, v in (extra or {}).items())  # llmc_kv_cache_blocks{state=used}

        class Metric:
            def observe(self, v):
                rec.values.setdefault(name, []).append(v)

            def increment(self, v):
                rec.values[name] = rec.values.get(name, 0) + v

            def set(self, v):
                rec.values[name] = v

        return Metric()


def serve_prompts(version, prompts: list[str], metrics=None):
    """`prompts` served together (greedy, 20 tokens each) by `version`'s serving loop: their output
    ids, and the engine."""
    loop = ServingLoop.from_manifest(version, metrics).start()
    try:
        sinks = [RecordingSink() for _ in prompts]
        for prompt, sink in zip(prompts, sinks):
            loop.submit(request_inputs(prompt, max_tokens=20), sink)
        ids = [sink.joined("output_ids").tolist() for sink in sinks]
        time.sleep(0.3)  # the idle loop publishes the metrics
        return ids, loop.engine
    finally:
        loop.stop()


def served_with_and_without_speculation(version, tmp_path, prompts: list[str]):
    """`prompts` served by `version` as built and by a copy of it with speculation off: the same
    outputs, and the speculative side's proposal counters equal to its engine's (both > 0). Its
    outputs, engine and metric values."""
    recorder = Recorder()
    ids, engine = serve_prompts(version, prompts, ServingMetrics(recorder))
    plain = tmp_path / "1"
    shutil.copytree(version, plain)
    RepositoryManifest.load(version).model_copy(update={"speculative": None}).save(plain)
    plain_ids, plain_engine = serve_prompts(plain, prompts)
    assert plain_engine.speculator is None and ids == plain_ids
    values = recorder.values
    drafted, accepted = values["llmc_spec_decode_draft_tokens_total"], values["llmc_spec_decode_accepted_tokens_total"]
    assert (drafted, accepted) == (engine.speculator.num_draft_tokens, engine.speculator.num_accepted_tokens)
    assert 0 < accepted <= drafted
    return ids, engine, values


def grammar_takes(compiler, guide, text: str, end_id: int = 0) -> bool:
    """Whether `guide`'s grammar (compiled by a GuideCompiler over the byte tokenizer) takes exactly `text`, byte by
    byte, and may end there."""
    matcher = compiler.compile(guide)
    ids = byte_tokenizer().encode(text).ids
    if matcher.valid_prefix(ids, (end_id,)) != len(ids):
        return False
    for token in ids:
        matcher.consume(token)
    return matcher.is_accepting


def moe_model(fc1, fc2, k: int):
    """One com.microsoft.MoE node (Mixtral's routing: softmax, top `k` renormalized) over experts fc1 [E, 2I, H]
    (gate and up interleaved) and fc2 [E, H, I] as numpy arrays: inputs `x` [T, H] and `logits` [T, E], output `y`."""
    from onnx import TensorProto, helper, numpy_helper

    from llmc.plugins.op import moe

    experts, hidden = fc1.shape[0], fc1.shape[2]
    node = helper.make_node(moe.OP_TYPE, ["x", "logits", "fc1", "", "fc2"], ["y"], domain=moe.MICROSOFT_DOMAIN,
                            **moe.attributes(k, True, 1.0, 0.0, 0.0))
    graph = helper.make_graph(
        [node], "mixture",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", hidden]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", experts])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", hidden])],
        [numpy_helper.from_array(fc1, "fc1"), numpy_helper.from_array(fc2, "fc2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe.MICROSOFT_DOMAIN, 1)])
