"""Incremental detokenizer (no broken characters, stream == whole) and stop words across boundaries."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llmc.runtime.decoding.tokenizer import IncrementalDetokenizer, StopMatcher

TEXT = ["hello world, the quick brown fox", "naïve café — 東京 and 😀 emoji 🚀 rockets", "def f(x):\n    return x"]


def _train(pre_tokenizer, decoder, alphabet=()):
    tok = Tokenizer(models.BPE(unk_token="<unk>" if not alphabet else None))
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    trainer = trainers.BpeTrainer(vocab_size=120, initial_alphabet=list(alphabet), special_tokens=["<unk>", "<eos>"])
    tok.train_from_iterator(TEXT * 3, trainer)
    return tok


@pytest.fixture(params=["byte-level", "metaspace"])
def tokenizer(request):
    if request.param == "byte-level":  # multi-byte characters are split over several tokens
        return _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                      pre_tokenizers.ByteLevel.alphabet())
    return _train(pre_tokenizers.Metaspace(), decoders.Metaspace())  # drops a leading space at decode start


@pytest.mark.parametrize("prompt, completion", [("hello", " world, naïve café 😀🚀 東京"), ("def f(x):", "\n    return x")])
def test_stream_never_breaks_a_character_and_equals_the_whole(tokenizer, prompt, completion):
    prompt_ids = tokenizer.encode(prompt).ids
    ids = tokenizer.encode(prompt + completion).ids[len(prompt_ids):]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    chunks = [detok.push(i) for i in ids] + [detok.finish()]
    assert not any("\ufffd" in c for c in chunks)
    whole = tokenizer.decode(prompt_ids + ids)[len(tokenizer.decode(prompt_ids)):]
    assert "".join(chunks) == whole
    assert sum(1 for c in chunks if c) > 3  # it really streams


def test_multibyte_tokens_are_held_until_complete():
    tok = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                 pre_tokenizers.ByteLevel.alphabet())
    ids = tok.encode("😀").ids
    assert len(ids) > 1  # the emoji spans several byte tokens in this tiny vocabulary
    detok = IncrementalDetokenizer(tok, [])
    out = [detok.push(i) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "😀"


def test_unfinished_character_at_the_end_is_flushed_as_decoded():
    tok = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                 pre_tokenizers.ByteLevel.alphabet())
    ids = tok.encode("ok 😀").ids[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok, [])
    text = "".join(detok.push(i) for i in ids) + detok.finish()
    assert text == tok.decode(ids)


def _feed(matcher, pieces):
    return "".join(matcher.feed(p) for p in pieces) + matcher.finish()


def test_stop_word_split_over_pieces_is_cut_with_everything_after():
    m = StopMatcher(["STOP", "\n\n"])
    assert _feed(m, ["Hello S", "TO", "P and more"]) == "Hello "
    assert m.stopped
    m = StopMatcher(["\n\n"])
    assert _feed(m, ["a\n", "\nb"]) == "a" and m.stopped


def test_partial_match_is_released_when_it_does_not_complete():
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ""  # could still become STOP
    assert m.feed("AR") == "STAR"
    assert m.feed("S") == "" and m.finish() == "S" and not m.stopped


def test_overlapping_stop_words_cut_at_the_earliest():
    m = StopMatcher(["world", "lo w"])
    assert _feed(m, ["hel", "lo world"]) == "hel"
