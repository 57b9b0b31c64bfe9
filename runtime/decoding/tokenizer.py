"""The served tokenizer, both ways: the repository's tokenizer.json (HF `tokenizers` format), how a prompt
becomes ids, and how generated ids become streamed text. The serving loop (serving/loop.py, through serving/loader.py) and the build's check of
the packaged tokenizer against transformers' (compiler/repository/tokenizer_check.py) both go through
here, so the check tests what is served.

A plain prompt is encoded with the tokenizer's special tokens (its post-processor's BOS/EOS), as
transformers' `tokenizer(text)` encodes it. A prompt rendered from a chat template is encoded
without them (the request's `add_special_tokens` false), as `apply_chat_template(tokenize=True)`
encodes it: a template writes its own BOS, and a second one would change the model's input.

Ids back to text, as they arrive: token ids -> text as they arrive, and stop words matched across token boundaries.

`IncrementalDetokenizer` decodes a sliding window of ids (a few tokens of context before the new
ones, so tokenizers that drop a word's leading space at the start of a decode still see it) and
emits only text that is final: while the window's text ends in U+FFFD (a multi-byte character whose
bytes are split over tokens) nothing is emitted. `finish()` returns what is still held, so the
concatenated stream equals decoding all the ids at once.

`StopMatcher` holds back the tail of the emitted text that could still grow into a stop word and
cuts the text at the first stop word found; neither the stop word nor anything after it is emitted.
"""

from __future__ import annotations

from pathlib import Path


def load(path: Path):
    """The tokenizer in `path` (a `tokenizers.Tokenizer`)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """The ids the served model takes for `text`."""
    return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


_CONTEXT = 5  # ids of context decoded before the new ones


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix = 0  # window start
        self.read = len(self.ids)  # ids before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it makes final (often '', never half a character)."""
        self.ids.append(token_id)
        done = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]

    def finish(self) -> str:
        """Whatever is still held back (an incomplete character at the very end decodes as U+FFFD)."""
        done = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(done):]


class StopMatcher:
    def __init__(self, stop_words: tuple[str, ...] | list[str]):
        self.stop_words = tuple(stop_words)
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to emit now. After a stop word is found, `stopped` is set and nothing more is emitted."""
        if self.stopped or not self.stop_words:
            return "" if self.stopped else text
        buffer = self.held + text
        hits = [i for i in (buffer.find(w) for w in self.stop_words) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return buffer[:min(hits)]
        keep = self._partial_suffix(buffer)
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop word."""
        longest = 0
        for word in self.stop_words:
            for n in range(min(len(word) - 1, len(text)), longest, -1):
                if text.endswith(word[:n]):
                    longest = n
                    break
        return longest

    def finish(self) -> str:
        """At the end of generation a held partial match is ordinary text."""
        held, self.held = ("" if self.stopped else self.held), ""
        return held
