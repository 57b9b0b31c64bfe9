"""`llmc bench`'s prompts (llmc/bench/load.py): every request has its own, sharing no KV block with
another (a prefix cache must not turn repeats into speed), and with a shared system prompt every
request starts with the same one and then differs."""

import pytest

from llmc.bench.load import make_prompt, prompts, system_prompt

BLOCK_WORDS = 4  # prompts must differ within this many words: less than one KV block of tokens


def test_no_two_requests_share_a_prompt_or_its_first_block():
    texts = [make_prompt(40, seed) for seed in range(500)]
    assert len(set(texts)) == len(texts)
    heads = [" ".join(t.split()[:BLOCK_WORDS]) for t in texts]
    assert len(set(heads)) == len(heads)
    assert all(len(t.split()) == 40 for t in texts)


def test_prompts_are_reproducible_and_runs_with_other_seeds_differ():
    assert prompts(5, 20) == prompts(5, 20)
    assert not set(prompts(500, 20)) & set(prompts(500, 20, first_seed=500))


def test_too_short_a_prompt_to_be_distinct_is_refused():
    with pytest.raises(ValueError, match="prompt_words is 3"):
        make_prompt(3, 0)


def test_a_shared_prefix_is_shared_and_the_questions_are_distinct():
    texts = prompts(64, 12, shared_prefix=1000)
    head = system_prompt(1000) + "\n"
    assert all(t.startswith(head) for t in texts)
    assert len(head.split()) == 1000
    questions = [t[len(head):] for t in texts]
    assert len({" ".join(q.split()[:BLOCK_WORDS]) for q in questions}) == 64
    assert system_prompt(1000, seed=1) != system_prompt(1000)  # another run's system prompt


def test_the_shared_prefix_is_about_as_many_tokens_as_asked(smollm2):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    assert 990 <= len(tokenizer.encode(system_prompt(1000)).ids) <= 1010
    assert {len(tokenizer.encode(make_prompt(300, seed)).ids) for seed in range(50)} <= {300, 301}  # a token a word
