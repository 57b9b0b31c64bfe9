"""The served tokenizer against transformers': part of verification (skipped with the rest of it by
`verify.enabled: false`), run by the package stage on the tokenizer file it writes
(compiler/repository/tokenizer.py) before the file is in place. It lives here, not in compiler/graph/,
because the graph package is part of the export, quantize and tensorrt stages' cache keys, and a
tokenizer check has no bearing on a graph.

The served side is exactly what the runtime does (runtime/decoding/tokenizer.py loads and encodes,
runtime/decoding/tokenizer.py streams the text back, special tokens skipped); the reference is the
tokenizer transformers' AutoTokenizer gives for the checkpoint, whatever class it picks:

- encode: every sample text (multi-byte scripts, decomposed accents, code, emoji, whitespace runs,
  digits, and the tokenizer's own special tokens written into text) gives the ids
  `tokenizer(text)["input_ids"]` gives, the BOS/EOS its post-processor adds included;
- decode: those ids streamed through the runtime's detokenizer give `tokenizer.decode(ids,
  skip_special_tokens=True)`;
- chat: each sample conversation rendered with the build's chat template (llmc/chat_template.py, as
  the OpenAI frontend renders it) and encoded as a chat prompt is served (no added special tokens)
  gives `apply_chat_template(..., tokenize=True, add_generation_prompt=True)`'s ids; a conversation
  the template refuses must be refused by both.

The first difference raises VerifyError naming the tokenizer class and the text.
"""

from __future__ import annotations

from pathlib import Path

from llmc.chat_template import ChatTemplateError, render
from llmc.errors import VerifyError

SAMPLE_TEXTS = (
    "The capital of France is",
    " a leading space, and trailing ones   ",
    "whitespace runs:  two,   three,\ttab,\t\ttabs,\n\nblank line,\r\nCRLF,    \n  \n end",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { s += a[i] * 0x1F; }  // C, with {"json": [1, 2.5e-3, null]}',
    "accents: café, naïve, résumé, Ærøskøbing, Łódź, São Paulo; decomposed: cafe\u0301 nai\u0308ve",
    "multi-byte: 日本語のテキスト、中文文本，한국어 텍스트, Ελληνικά, русский, עברית, العربية, हिन्दी",
    "emoji: 🎉🚀 👩‍💻 ❤️ 🇫🇷 👍🏽 and a lone one🙂",
    "digits 1234567890, 3.14159, 1,000,000 and contractions: it's, they're, we'll, I'd, don't",
    "compatibility forms: ﬁ ½ ℃ Ⅻ ｆｕｌｌｗｉｄｔｈ, and ß, ǅ",
)
CONVERSATIONS = (
    [{"role": "user", "content": "Hello! Who are you? 🎉"}],
    [{"role": "system", "content": "You answer in one line."},
     {"role": "user", "content": "Write def add(a, b): in Python,  with   spaces."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello — how can I help?"},
     {"role": "user", "content": "Café au lait, s'il vous plaît.\n\nMerci!"}],
)


def sample_texts(tokenizer) -> list[str]:
    """The fixed samples, then texts that carry each of the tokenizer's special tokens (its added
    tokens marked special: chat markers too), inside words and beside whitespace."""
    specials = sorted({str(t) for t in tokenizer.all_special_tokens}
                      | {t.content for t in tokenizer.added_tokens_decoder.values() if t.special})
    return [*SAMPLE_TEXTS, *(f"{s}hello{s} world {s}\n{s}" for s in specials if s)]


def check_tokenizer(tokenizer, served: Path, chat_template: dict | None, *, origin: str) -> int:
    """Compare the tokenizer file `served` with `tokenizer` (transformers'); `chat_template` is the
    build's recorded template ({template, special_tokens}) or None. Returns how many texts and
    conversations were compared; raises VerifyError at the first difference."""
    from llmc.runtime.decoding.tokenizer import IncrementalDetokenizer
    from llmc.runtime.decoding.tokenizer import encode, load

    runtime = load(served)
    where = (f"{origin}: the served tokenizer.json differs from transformers' "
             f"{type(tokenizer).__name__} (what AutoTokenizer loads for this checkpoint)")
    texts = sample_texts(tokenizer)
    for text in texts:
        expected = list(tokenizer(text)["input_ids"])
        got = encode(runtime, text)
        if got != expected:
            raise VerifyError(f"{where} on the first differing text {text!r}: it encodes to {_ids(got)}, "
                              f"transformers to {_ids(expected)}{_first(got, expected)}")
        detok = IncrementalDetokenizer(runtime, [])
        streamed = "".join(detok.push(i) for i in expected) + detok.finish()
        decoded = tokenizer.decode(expected, skip_special_tokens=True)
        if streamed != decoded:
            raise VerifyError(f"{where} on the first differing text {text!r}: its ids decode to {streamed!r}, "
                              f"transformers' to {decoded!r}")
    if chat_template is None:
        return len(texts)
    for messages in CONVERSATIONS:
        expected, refused = _reference_chat(tokenizer, chat_template, messages)
        try:
            prompt = render(chat_template, messages)
        except ChatTemplateError as err:
            if refused:
                continue
            raise VerifyError(f"{where}: the chat template refuses the conversation {messages!r} as served "
                              f"({err}) but renders it in transformers") from None
        if refused:
            raise VerifyError(f"{where}: the chat template renders the conversation {messages!r} as served "
                              f"({prompt!r}) but transformers refuses it ({refused})")
        got = encode(runtime, prompt, add_special_tokens=False)
        if got != expected:
            raise VerifyError(f"{where} on the first differing chat prompt {prompt!r}: it encodes to {_ids(got)}, "
                              f"transformers' apply_chat_template to {_ids(expected)}{_first(got, expected)}")
    return len(texts) + len(CONVERSATIONS)


def _reference_chat(tokenizer, chat_template: dict, messages: list[dict]) -> tuple[list[int], str | None]:
    """apply_chat_template's ids for `messages` with the build's template, or the reason it refuses them."""
    try:
        ids = tokenizer.apply_chat_template(messages, chat_template=chat_template["template"], tokenize=True,
                                            add_generation_prompt=True, return_dict=False)
    except Exception as err:  # the template's raise_exception, or a jinja2 error
        return [], f"{type(err).__name__}: {err}"
    return list(ids), None


def _ids(ids: list[int], limit: int = 24) -> str:
    return f"{ids[:limit]}{' ...' if len(ids) > limit else ''} ({len(ids)} ids)"


def _first(got: list[int], expected: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    return f"; first difference at id {at}"
