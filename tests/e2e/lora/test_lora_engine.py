"""LoRA adapters served end to end below Triton, against PEFT itself: the tiny Llama built with two adapters
(lora_build.py), its repository loaded as Triton's model loads it (runtime/serving/loader.py). Each adapter's greedy
tokens equal PEFT's generate, a mixed batch (base, A, B) equals each request alone, a base-only step runs the base
graph, the prefix cache never hits across adapters, an unknown adapter is refused before anything runs, and what is
not served yet is refused before a build works."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lora_build import SPEC, engine_greedy, lora_build, make_adapter, peft_greedy

PROMPTS = [[5, 17, 99, 3, 42, 200, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [11, 12, 13, 14, 60, 61]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def built(tiny_checkpoints, tmp_path_factory):
    return lora_build(tmp_path_factory, tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def engine(built):
    from llmc.runtime.serving.loader import load

    engine = load(built[0])[0]
    yield engine
    engine.close()


def generate(engine, requests: list[tuple[list[int], str | None]]) -> list[list[int]]:
    return engine_greedy(engine, requests, MAX_TOKENS)


def test_the_repository_holds_the_lora_graph_sites_and_adapters(built):
    from llmc.compiler.repository.triton_config import parse
    from llmc.runtime.manifest import RepositoryManifest

    version, _ = built
    m = RepositoryManifest.load(version)
    assert m.lora.lora_file == "model_lora.onnx" and (version / m.lora.lora_file).is_file()
    assert [(a.name, a.rank, len(a.digest)) for a in m.lora.adapters] == [("a", 4, 64), ("b", 8, 64)]
    assert len(m.lora.sites) == 2 * 5 + 1 and all((version / a.file).is_file() for a in m.lora.adapters)
    assert [s.rows for s in m.lora.sites if s.name == "lm_head"] == ["logits_indices"] and m.lora.head_digest
    assert (m.lora.max_slots, m.lora.max_rank, m.lora.max_host_adapters) == (2, 16, 2)
    config = parse((version.parent / "config.pbtxt").read_text())
    assert "lora_name" in {i.name for i in config.input}
    assert json.loads(config.parameters["lora_adapters"].string_value) == ["a", "b"]


def test_the_build_verified_each_adapter_like_the_base(built):
    """The verify-adapters stage ran: its report passed, names each adapter's identity, and the build record has its
    line; `llmc inspect` shows it."""
    from llmc.compiler import inspect_path
    from llmc.compiler.artifacts import AdapterVerifyReport
    from llmc.runtime.manifest import RepositoryManifest

    version, _ = built
    out = version.parents[2]  # <output>/model_repository/<name>/<version>
    report = AdapterVerifyReport.load(out / "verify-adapters")
    digests = {a.name: a.digest for a in RepositoryManifest.load(version).lora.adapters}
    assert report.passed and report.adapters == digests
    assert [c.name for c in report.cases] == ["a: batch-3", "b: batch-3", "mixed: batch-3"]
    stages = {s["name"]: s for s in json.loads((out / "build.json").read_text())["stages"]}
    assert list(stages).index("verify-adapters") == list(stages).index("verify") + 1
    assert "a, b: greedy tokens equal" in stages["verify-adapters"]["summary"]
    assert any(section.title == "verify-adapters" for section in inspect_path(out))


def test_each_adapter_equals_peft_and_a_mixed_batch_equals_each_alone(built, engine, tiny_checkpoints):
    _, adapters = built
    runs = [(PROMPTS[0], None), (PROMPTS[0], "a"), (PROMPTS[0], "b"), (PROMPTS[1], "b")]
    want = peft_greedy(tiny_checkpoints["llama"], adapters, runs, MAX_TOKENS)
    assert len({tuple(w) for w in want[:3]}) == 3  # the adapters change the tokens, each its own way
    assert generate(engine, runs) == want  # one batch: base, A, B (another rank, rsLoRA) and B again
    assert [generate(engine, [run])[0] for run in runs] == want


@pytest.mark.parametrize("keep_stale", [False, True])
def test_a_slot_rewritten_in_place_serves_the_new_adapter(built, engine, tiny_checkpoints, keep_stale):
    """B (rank 8) then A (rank 4) alone: A's step keeps B's stacks and rewrites its slot in place (the bound arrays
    ONNX Runtime reads), and A's tokens still equal PEFT's. Where the session reads each token's own slot only
    (llmc.LoraDelta), B's slot stays bound beside A's, unread, and A's tokens are PEFT's all the same."""
    _, adapters = built
    lora = engine.runner.lora
    want = peft_greedy(tiny_checkpoints["llama"], adapters, [(PROMPTS[1], "b"), (PROMPTS[1], "a")], MAX_TOKENS)
    kept, lora.keep_stale = lora.keep_stale, keep_stale
    try:
        if keep_stale:
            generate(engine, [(PROMPTS[1], "a"), (PROMPTS[1], "b")])  # both bound
        assert generate(engine, [(PROMPTS[1], "b")])[0] == want[0]
        refills, stackings = lora.num_refills, lora.num_stackings
        assert generate(engine, [(PROMPTS[1], "a")])[0] == want[1]
        assert (lora.num_refills, lora.num_stackings) == ((refills, stackings) if keep_stale else (refills + 1, stackings))
    finally:
        lora.keep_stale = kept


def test_a_staged_adapter_takes_the_slot_read_longest_ago(built, engine, tiny_checkpoints):
    """An adapter staged ahead of its first request (what the serving loop does while idle: paged_lora.py) overwrites
    the slot read longest ago; the adapter still bound keeps serving PEFT's tokens, the one pushed out is written back
    when asked for, and one above the slots' rank is not staged."""
    from llmc.runtime.lora.stacks import AdapterRef, AdapterWeights

    _, adapters = built
    lora, store = engine.runner.lora, engine.lora.store
    want = peft_greedy(tiny_checkpoints["llama"], adapters, [(PROMPTS[1], "a"), (PROMPTS[1], "b")], MAX_TOKENS)
    kept, lora.keep_stale = lora.keep_stale, True
    try:
        generate(engine, [(PROMPTS[1], "a"), (PROMPTS[1], "b")])  # both bound
        assert generate(engine, [(PROMPTS[1], "b")]) == [want[1]]  # a's slot is now the one read longest ago
        a = store.pin(store.resolve("a"))
        store.unpin(a.ref)
        c = AdapterWeights(AdapterRef("c", "c" * 64), a.rank, {k: (x * 2, y) for k, (x, y) in a.sites.items()})
        slot_a, stagings = [r.name for r in lora.bound].index("a"), lora.num_stagings
        assert lora.stage(c) and lora.num_stagings == stagings + 1
        assert lora.bound[slot_a] == c.ref and "b" in [r.name for r in lora.bound]
        assert not lora.stage(c) and not lora.stage(AdapterWeights(AdapterRef("d", "d" * 64), 16, {}))
        assert generate(engine, [(PROMPTS[1], "b")]) == [want[1]]
        assert generate(engine, [(PROMPTS[1], "a")]) == [want[0]]  # written back over c's slot
    finally:
        lora.keep_stale = kept


@pytest.mark.parametrize("shared", [True, False])
def test_base_only_steps_on_one_session_or_two(built, shared):
    """Where the sites run fused (the default), the LoRA graph's session runs base-only steps too and no session
    is opened over the base graph (each would hold its own packed copy of the weights); a base-only step there reads
    no adapter (zero-width stacks until an adapter comes, then every mask row 0) and gives the base graph's logits
    bit for bit. With two sessions, a base-only step never touches the LoRA graph. Either way a mixed step's base
    row equals the base graph's."""
    from llmc.runtime.kernels import cpu_kernels
    from llmc.runtime.lora.files import parse_adapter
    from llmc.runtime.manifest import RepositoryManifest
    from llmc.runtime.runners.paged import PagedRunner, RowStep

    if shared and not cpu_kernels.fuses_lora():
        pytest.skip("the LoRA graph's sites run unfused here (no llmc CPU kernels, or LLMC_LORA_FUSION=0)")
    version = built[0]
    m = RepositoryManifest.load(version)
    adapter = parse_adapter((version / m.lora.adapters[0].file).read_bytes(), "a")

    def runner(lora):
        return PagedRunner(version / m.model_file, m.kv_layout, num_blocks=16, max_num_tokens=64, num_threads=2,
                           lora=(version / m.lora.lora_file, m.lora.sites) if lora else None, share_lora_session=shared)

    plain, with_lora = runner(False), runner(True)
    try:
        assert (with_lora.session is with_lora.lora.session) == shared
        calls = []
        bind = with_lora.lora.bind
        with_lora.lora.bind = lambda *args: (calls.append(args), bind(*args))[1]
        rows = [RowStep(PROMPTS[0], 0, [0, 1]), RowStep(PROMPTS[1], 0, [2, 3])]
        base = plain.step(rows)
        assert np.array_equal(with_lora.step(rows), base)
        assert bool(calls) == shared and with_lora.lora.num_stackings == 0
        decode = [RowStep([7], len(PROMPTS[0]), [0, 1]), RowStep([9], len(PROMPTS[1]), [2, 3], adapter=adapter)]
        mixed = with_lora.step(decode)
        want = plain.step(decode[:1] + [RowStep([9], len(PROMPTS[1]), [2, 3])])
        assert np.array_equal(mixed[0], want[0]) and np.abs(mixed[1] - want[1]).max() > 1e-3
        assert with_lora.lora.num_stackings == 1
        again = [RowStep([8], len(PROMPTS[0]) + 1, [0, 1]), RowStep([10], 0, [4])]  # base-only again
        assert np.array_equal(with_lora.step(again), plain.step(again))  # the adapter's slot stays bound, unread
    finally:
        plain.close()
        with_lora.close()


def test_the_prefix_cache_never_hits_across_adapters(engine):
    prompt = list(range(40, 80))  # several full blocks
    blocks = engine.blocks

    def hits(name):
        before = blocks.prefix_hits
        generate(engine, [(prompt, name)])
        return blocks.prefix_hits - before

    assert hits("a") == 0 and hits("b") == 0 and hits(None) == 0
    assert hits("a") > 0 and hits("b") > 0 and hits(None) > 0  # each its own blocks, found again


def test_an_unknown_adapter_is_refused_and_nothing_runs(engine, built):
    from serving_rig import RecordingSink

    from llmc.runtime.decoding.tokenizer import load as load_tokenizer
    from llmc.runtime.lora.store import UnknownAdapter
    from llmc.runtime.serving.loop import ServingLoop
    from llmc.runtime.serving.request import Limits

    with pytest.raises(UnknownAdapter, match=r"lora_name: this model serves no adapter 'c' \(its adapters: a, b\)"):
        generate(engine, [(PROMPTS[1], "c")])
    assert not engine.has_work and engine.scheduler.num_waiting == 0
    loop = ServingLoop(engine, load_tokenizer(built[0] / "tokenizer.json"), Limits(128, 16, 4))
    sink = RecordingSink()
    loop.submit({"text_input": np.array([b"hi"], dtype=object), "lora_name": np.array([b"c"], dtype=object)}, sink)
    assert sink.wait().errors == ["lora_name: this model serves no adapter 'c' (its adapters: a, b)"]
    assert not loop.num_in_flight and not engine.has_work


@pytest.mark.parametrize("fields, message", [
    ({"quantization": {"mode": "int8"}}, "quantization.mode: int8: adapters are not served on Q/DQ graphs"),
    ({"parallel": {"tensor": 2}}, "parallel.tensor: tensor parallelism is not served with adapters"),
    ({"speculative": {"method": "ngram", "num_tokens": 2}}, "speculative: speculative decoding is not served"),
])
def test_what_is_not_served_yet_is_refused_before_the_build_works(fields, message, built, tiny_checkpoints, tmp_path):
    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec
    from llmc.errors import UnsupportedError

    spec = parse_spec({"name": "t", "source": str(tiny_checkpoints["llama"]), **fields,
                       "adapters": {k: str(v) for k, v in built[1].items()}})
    with pytest.raises(UnsupportedError, match=message):
        build(spec, output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_adapter_for_another_base_is_refused_before_the_build_works(tiny_checkpoints, tmp_path):
    from llmc.compiler import build
    from llmc.compiler.lora import AdapterError
    from llmc.compiler.spec import parse_spec

    other = make_adapter(tiny_checkpoints["qwen3"], tmp_path / "q", 3, r=2, lora_alpha=4, target_modules=["q_proj"])
    spec = parse_spec({"name": "t", "source": str(tiny_checkpoints["llama"]), **SPEC, "adapters": {"q": str(other)}})
    with pytest.raises(AdapterError, match="adapter 'q': .*q_proj maps .* the adapter was made for another base"):
        build(spec, output=tmp_path / "out")
    assert not (tmp_path / "out").exists()
