"""Structured output: a request's guide (a JSON schema, a regex, a Lark or GBNF grammar, a list of
choices) compiled by llguidance into a matcher that says, token by token, which tokens may come next.

    Guide(kind, text)            what a request asks for (kinds: GUIDE_TYPES, TensorRT-LLM's names); a regex
                                 guide and a schema's patterns are ECMA-262's (regex.py)
    GuideCompiler.submit(guide)  -> Future[GuideMatcher]: compiled on the compiler's worker threads,
                                 never the engine's, from a cache keyed on (kind, text, tokenizer)
    GuideMatcher                 one request's state: consume(token), is_stopped, is_accepting
    next_token_bitmask(...)      the next-token bitmask [rows, ceil(V / 32)] of each matcher, filled by
                                 llguidance's threads outside the GIL, end ids allowed where the grammar may end
    apply_bitmask(logits, ...)   the rows' logits with every token the bitmask forbids at -inf

The grammar decides the end: a row's end ids are allowed exactly where its grammar may end, and a
sequence whose grammar can take nothing more is finished by the engine (sequence.py).

llguidance is imported on first use, so a model serves unconstrained requests without it; a
guided request then fails naming the input.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from llmc.runtime.decoding.regex import ecma_schema, ecma_to_rust

# guided_decoding_guide_type values: TensorRT-LLM's (json, json_schema, regex, ebnf_grammar), llguidance's
# Lark, and vLLM's choice (the guide a JSON list of strings)
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "lark_grammar", "choice")
# JSON as json.dumps writes it (", " and ": ", no other blanks): no whitespace freedom, where a small model
# can spend max_tokens on blanks, and the keys of a schema's fixed property order are forced tokens, fed
# ahead (token_scheduler.py). Not without cost: a model that wants a newline after a value may write more of
# the value instead. SmolLM2 135M, 7 greedy City answers at max_tokens 300: 3 ran on in the population's
# digits (integers are unbounded, as JSON Schema says), none with blanks up to 32 allowed per place
# ({"whitespace_pattern": "[\\x20\\x0A\\x0D\\x09]{0,32}"}), which random-weight test models fill instead.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256  # compiled guides kept, least recently used dropped


class GuideError(ValueError):
    """A guide that does not compile; the message is llguidance's, after the input it names."""


@dataclass(frozen=True)
class Guide:
    kind: str  # one of GUIDE_TYPES
    text: str  # the schema, regex, grammar or choices ("" for kind json: any JSON object)


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - the serving requirements list it
        raise GuideError("guided_decoding_guide_type: structured output needs the llguidance package "
                         "(pip install llguidance)") from None
    return llguidance


def grammar_text(guide: Guide) -> str:
    """The llguidance grammar for `guide` (GuideError naming the input when it cannot be read)."""
    llg = _llguidance()
    try:
        if guide.kind == "json":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if guide.kind == "json_schema":
            # a schema's patterns are ECMA-262's, as JSON Schema says (regex.py)
            return llg.LLMatcher.grammar_from_json_schema(ecma_schema(json.loads(guide.text)), defaults=_JSON_OPTIONS)
        if guide.kind == "choice":
            choices = json.loads(guide.text)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise GuideError("guided_decoding_guide: a choice guide is a JSON list of strings, "
                                 f"got {guide.text[:80]!r}")
            return llg.grammar_from("choice", choices)
        if guide.kind == "ebnf_grammar":
            return llg.grammar_from("gbnf", guide.text)  # GBNF or Lark (llguidance converts GBNF to Lark)
        if guide.kind == "lark_grammar":
            return llg.grammar_from("lark", guide.text)
        if guide.kind == "regex":
            return llg.grammar_from("regex", ecma_to_rust(guide.text))  # ECMA-262, as a schema's patterns
    except json.JSONDecodeError as err:
        raise GuideError(f"guided_decoding_guide: not valid JSON for a {guide.kind} guide ({err})") from None
    except ValueError as err:
        if isinstance(err, GuideError):
            raise
        raise GuideError(f"guided_decoding_guide: {err}") from None
    raise GuideError(f"guided_decoding_guide_type: {guide.kind!r} is not one of {', '.join(GUIDE_TYPES)}")


class GuideMatcher:
    """One request's position in its grammar (an llguidance LLMatcher of its own)."""

    def __init__(self, matcher, vocab_size: int):
        self._m, self.vocab_size = matcher, vocab_size

    @property
    def llmatcher(self):
        return self._m

    def consume(self, token: int) -> None:
        """Advance over a sampled token (one the bitmask allowed)."""
        if not self._m.consume_token(token):  # the mask allowed only tokens the grammar takes
            raise RuntimeError(f"the grammar refused token {token}: {self._m.get_error()}")

    def allows(self, token: int, end_ids: Sequence[int], model_end_ids: Sequence[int] = ()) -> bool:
        """Whether the grammar takes `token` next (what the bitmask would allow), without advancing:
        an end id only where the grammar may end, and only the request's own end ids."""
        if token in end_ids:
            return self._m.is_accepting()
        if token in model_end_ids or not 0 <= token < self.vocab_size:  # past the vocabulary: an error state
            return False
        return self._m.validate_tokens([token]) == 1

    def valid_prefix(self, tokens: Sequence[int], end_ids: Sequence[int]) -> int:
        """How many of `tokens` (proposals) the grammar takes in a row from here, stopping before an
        end id or a token past the vocabulary (without advancing)."""
        n = next((i for i, t in enumerate(tokens) if t in end_ids or not 0 <= t < self.vocab_size), len(tokens))
        return self._m.validate_tokens(list(tokens[:n])) if n else 0

    def forced_tokens(self, limit: int, end_ids: Sequence[int]) -> list[int]:
        """Up to `limit` tokens the grammar forces from here (llguidance's fast-forward tokens: its
        forced bytes, tokenized), stopping before an end id or a token past the vocabulary; without
        advancing. Not a promise that each is the only token the mask allows: the engine feeds them as
        proposals, verified under the mask like any other (token_scheduler.py)."""
        if limit < 1 or self._m.is_stopped():
            return []
        tokens = self._m.compute_ff_tokens()[:limit]
        return tokens[:next((i for i, t in enumerate(tokens) if t in end_ids or not 0 <= t < self.vocab_size),
                            len(tokens))]

    def bitmasks_along(self, tokens: Sequence[int], end_ids: Sequence[int], model_end_ids: Sequence[int],
                       vocab_size: int) -> np.ndarray:
        """The bitmask [len(tokens) + 1, W] of the next token after each prefix of `tokens` (tokens the
        grammar takes: valid_prefix), the matcher rolled back to where it was."""
        rows = []
        for j in range(len(tokens) + 1):
            rows.append(next_token_bitmask([self], [end_ids], model_end_ids, vocab_size))
            if j < len(tokens):
                self.consume(tokens[j])
        self.rollback(len(tokens))
        return np.concatenate(rows)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` consumed (proposals tried, not kept)."""
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"the grammar could not roll back {num_tokens} tokens: {self._m.get_error()}")

    @property
    def is_stopped(self) -> bool:
        """Nothing more can follow: the output is complete."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output may end here (the end ids are allowed)."""
        return self._m.is_accepting()


class GuideCompiler:
    """Compiles guides against one tokenizer on its own worker threads. `tokenizer` is a HF
    `tokenizers.Tokenizer`; `end_ids` the model's; `vocab_size` the logits' width."""

    _cache: "OrderedDict[tuple, object]" = OrderedDict()  # (kind, text, tokenizer) -> compiled LLMatcher
    _cache_lock = threading.Lock()

    def __init__(self, tokenizer, end_ids: Sequence[int], vocab_size: int | None = None, workers: int = 2):
        self.tokenizer, self.end_ids, self.vocab_size = tokenizer, list(end_ids), vocab_size
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="llmc-grammar")
        self._lltokenizer, self._tokenizer_key = None, None
        self._tokenizer_lock = threading.Lock()

    def submit(self, guide: Guide) -> Future:
        """A future of `guide`'s matcher (its exception a GuideError naming the input)."""
        return self._pool.submit(self.compile, guide)

    def compile(self, guide: Guide) -> GuideMatcher:
        """`guide`'s matcher, compiled here (on the caller's thread) or copied from the cache."""
        lltokenizer, tokenizer_key = self._tokenizer()
        key = (guide.kind, guide.text, tokenizer_key)
        with self._cache_lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        if template is None:
            llg = _llguidance()
            grammar = grammar_text(guide)
            template = llg.LLMatcher(lltokenizer, grammar, log_level=0)
            if template.is_error():
                raise GuideError(f"guided_decoding_guide: {template.get_error()}")
            with self._cache_lock:
                self._cache[key] = template
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return GuideMatcher(template.deep_copy(), lltokenizer.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _tokenizer(self):
        """llguidance's tokenizer, built on first use (~0.3 s for a 49k vocabulary), and its cache key."""
        with self._tokenizer_lock:
            if self._lltokenizer is None:
                llg = _llguidance()
                text = self.tokenizer.to_str()
                # a matcher holds its tokenizer: one made with another vocabulary size or EOS is another entry
                self._tokenizer_key = (hashlib.sha256(text.encode()).hexdigest(), self.vocab_size, tuple(self.end_ids))
                self._lltokenizer = llg.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.end_ids or None)
            return self._lltokenizer, self._tokenizer_key


_executor = None
_executor_lock = threading.Lock()


def token_bitmask(matchers: Sequence[GuideMatcher], vocab_size: int) -> np.ndarray:
    """Each matcher's allowed next tokens as a bitmask int32 [len(matchers), ceil(vocab_size / 32)]
    (bit t % 32 of word t // 32), filled in parallel by llguidance's executor."""
    global _executor
    llg = _llguidance()
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    with _executor_lock:
        if _executor is None:
            _executor = llg.LLExecutor()
    bitmask = allocate_token_bitmask(len(matchers), vocab_size)
    fill_next_token_bitmask_par(_executor, [(m.llmatcher, i) for i, m in enumerate(matchers)], bitmask)
    return bitmask


def next_token_bitmask(matchers: Sequence[GuideMatcher], end_ids: Sequence[Sequence[int]],
                       model_end_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """The rows' bitmask (token_bitmask) with each row's end ids set where its grammar may end (set_end_ids)."""
    bitmask = token_bitmask(matchers, vocab_size)
    set_end_ids(bitmask, matchers, end_ids, model_end_ids)
    return bitmask


def set_end_ids(bitmask: np.ndarray, matchers: Sequence[GuideMatcher], end_ids: Sequence[Sequence[int]],
                model_end_ids: Sequence[int] = ()) -> None:
    """Per row, allow the row's `end_ids` exactly where its grammar may end (llguidance allows the
    tokenizer's EOS; a request may name other end ids), and no other of `model_end_ids`."""
    words = bitmask.view(np.uint32)
    for r, (m, ends) in enumerate(zip(matchers, end_ids)):
        accepting = m.is_accepting
        for token in set(model_end_ids) | set(ends):
            word, bit = divmod(int(token), 32)
            if word < words.shape[1]:
                if accepting and token in ends:
                    words[r, word] |= np.uint32(1 << bit)
                else:
                    words[r, word] &= ~np.uint32(1 << bit)


def allowed(bitmask_row: np.ndarray, token: int) -> bool:
    """Whether one row of a bitmask [W] allows `token`."""
    word, bit = divmod(token, 32)
    return word < bitmask_row.shape[0] and bool((int(bitmask_row.view(np.uint32)[word]) >> bit) & 1)


def apply_bitmask(logits: np.ndarray, rows: Sequence[int], bitmask: np.ndarray) -> np.ndarray:
    """A copy of `logits` [R, V] with, in each of `rows` (row i of `bitmask` for rows[i]), every token
    the bitmask does not allow set to -inf; tokens past the bitmask's width are never allowed."""
    out = logits.astype(np.float32, copy=True)
    vocab = out.shape[1]
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").astype(bool)
    if allowed.shape[1] < vocab:
        allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
    rows = list(rows)
    out[rows] = np.where(allowed[:, :vocab], out[rows], np.float32(-np.inf))
    return out
