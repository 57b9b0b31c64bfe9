"""The per-layer attention features in llmc.PagedAttention's CPU kernel (runtime/kernels/paged_attention/), against
plugins/op/attention.py's reference_paged_attention on every instruction set this CPU runs: attention sinks
(`head_sink`, input 11), logit softcap, a window shorter than the rows, partial rotary, and all of them together,
over float32, float16 and int8 caches; head_sink's refusals; and an exported graph whose node carries a sink
running on ONNX Runtime with the kernel."""

import numpy as np
import pytest
import torch

from llmc.plugins.op import paged_schema
from llmc.runtime.kernels import cpu_kernels

from paged_cases import case, paged_model, reference
from test_paged_kernel import FLOAT, ISAS, check, run

# a long chunked-prefill row (past 100: tiles of 64 and chunks of 16 both cut by the window), a short one from
# the start, decode rows; head size 32 (a tail-free multiple of 8 for the vector loops), GQA 4:1
ROWS, HEADS, KV_HEADS, HEAD_SIZE = [(100, 40), (0, 3), (31, 1), (8, 1)], 8, 2, 32
CACHES = {"float32": {}, "float16": {"fp16": True}, "int8": {"int8": "PER_CHANNEL"}}
FEATURES = {
    "sinks": ({"sinks": True}, {}),
    "sinks + softcap": ({"sinks": True}, {"softcap": 1.5}),
    "sinks + window": ({"sinks": True}, {"local_window_size": 7}),
    "partial rotary": ({"rotary": True, "rotary_dim": 16}, {}),
    "all": ({"sinks": True, "rotary": True, "rotary_dim": 16}, {"softcap": 2.0, "local_window_size": 7, "scale": 0.2}),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("feature, cache", [*((f, "float32") for f in FEATURES), ("sinks", "int8"), ("all", "float16"),
                                            ("all", "int8")])
def test_features_match_the_reference(isa, feature, cache):
    """Each feature over a float32 cache; sinks (their denominator beside the int8 value scales applied after
    it) and all of them over the float16 and int8 caches."""
    made, attributes = FEATURES[feature]
    feeds = case(ROWS, HEADS, KV_HEADS, HEAD_SIZE, 16, seed=len(feature), **made, **CACHES[cache])
    check(feeds, HEADS, KV_HEADS, isa, **attributes)


@pytest.mark.parametrize("isa", ISAS)
def test_sinks_take_their_share_of_each_softmax(isa):
    """A sink far above every logit leaves (almost) nothing; one far below changes nothing; per head."""
    feeds = case([(20, 4), (3, 1)], 4, 2, 16, 8, seed=1, sinks=True)
    plain = run({k: v for k, v in feeds.items() if k != "head_sink"}, 4, 2, isa)[0]
    sinks = np.array([-1e4, 60.0, 0.0, -1e4], np.float32)
    got = run({**feeds, "head_sink": sinks}, 4, 2, isa)[0].reshape(-1, 4, 16)
    np.testing.assert_allclose(got[:, [0, 3]], plain.reshape(-1, 4, 16)[:, [0, 3]], rtol=2e-5, atol=2e-5)
    assert np.abs(got[:, 1]).max() < 1e-12 and not np.allclose(got[:, 2], plain.reshape(-1, 4, 16)[:, 2], atol=1e-3)


@pytest.mark.parametrize("isa", ISAS)
def test_a_query_that_sees_nothing_gets_zeros_with_or_without_a_sink(isa):
    """Positions 4..7 unmapped and a window of 2: the row's two queries (positions 6, 7) see no key at all."""
    for sinks in (False, True):
        feeds = case([(6, 2)], 4, 2, 8, 4, seed=3, sinks=sinks)
        feeds["block_table"][0, 1] = -1
        got = run(feeds, 4, 2, isa, local_window_size=2)
        np.testing.assert_array_equal(got[0], np.zeros_like(got[0]))
        np.testing.assert_array_equal(got[0], reference(feeds, 4, 2, local_window_size=2)[0])


def test_head_sink_of_the_wrong_shape_or_type_is_refused_by_name():
    import onnxruntime as ort

    feeds = case([(2, 2)], 4, 2, 8, 4, sinks=True)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(cpu_kernels.paged_library()))
    for elem, sink in ((FLOAT, feeds["head_sink"][:3]), (FLOAT, feeds["head_sink"].reshape(2, 2)),
                       (10, feeds["head_sink"].astype(np.float16))):
        model = paged_model(paged_schema.LLMC_DOMAIN, FLOAT, heads=4, kv_heads=2, head_size=8,
                            blocks=feeds["key_cache"].shape[0], extra_inputs=[("head_sink", elem, list(sink.shape))],
                            isa=ISAS[-1])
        sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        with pytest.raises(Exception, match=r"head_sink is not float32 \[num_heads 4\]"):
            sess.run(None, {**feeds, "head_sink": sink})


class _SinkLayer(torch.nn.Module):
    """One llmc::paged_attention call with learned sinks, softcap and a window: what a gpt-oss-like layer exports."""

    def __init__(self, sinks):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.from_numpy(sinks), requires_grad=False)

    def forward(self, query, key, value, key_cache, value_cache, cumulative, past, table):
        return torch.ops.llmc.paged_attention(query, key, value, key_cache, value_cache, cumulative, past, table,
                                              HEADS, KV_HEADS, 0.0, None, None, self.sinks, 3.0, 9)


def test_an_exported_node_with_head_sink_runs_on_onnxruntime(tmp_path):
    """llmc::paged_attention with sinks, exported through the paged lowering (head_sink as input 11, an
    initializer), opened by make_session (the kernel library registered) and run: the reference's answer."""
    import onnx.reference  # noqa: F401  (before the schemas: it refuses one op name in two domains once they are)

    from llmc.plugins.op import paged_op  # noqa: F401  (registers torch.ops.llmc.paged_attention)
    from llmc.plugins.op.lowering import Heads, Lowering, translation_table
    from llmc.runtime.runners.ort import make_session

    feeds = case([(20, 5), (0, 3)], HEADS, KV_HEADS, HEAD_SIZE, 8, seed=9, sinks=True)
    names = ["query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length", "past_seqlens",
             "block_table"]
    table = translation_table(Lowering.paged, Heads(HEADS, KV_HEADS, HEAD_SIZE))
    program = torch.onnx.export(_SinkLayer(feeds["head_sink"]), tuple(torch.from_numpy(feeds[n]) for n in names),
                                input_names=names, output_names=["output", "key_cache_out", "value_cache_out"],
                                dynamo=True, custom_translation_table=table, verbose=False, report=False)
    node = next(n for n in program.model_proto.graph.node if n.op_type == "PagedAttention")
    assert len(node.input) == 12 and node.input[11] and not node.input[10]
    program.save(str(tmp_path / "sink.onnx"))
    sess = make_session(tmp_path / "sink.onnx", num_threads=2)
    got = sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})
    want = reference(feeds, HEADS, KV_HEADS, softcap=3.0, local_window_size=9)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=2e-5)
