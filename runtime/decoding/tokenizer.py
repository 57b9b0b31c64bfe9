"""The served tokenizer: the repository's tokenizer.json (HF `tokenizers` format) and how a prompt
becomes ids. The serving loop (serving/loop.py, through serving/loader.py) and the build's check of
the packaged tokenizer against transformers' (compiler/repository/tokenizer_check.py) both go through
here, so the check tests what is served.

A plain prompt is encoded with the tokenizer's special tokens (its post-processor's BOS/EOS), as
transformers' `tokenizer(text)` encodes it. A prompt rendered from a chat template is encoded
without them (the request's `add_special_tokens` false), as `apply_chat_template(tokenize=True)`
encodes it: a template writes its own BOS, and a second one would change the model's input.
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
