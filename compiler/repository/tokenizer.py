"""The served tokenizer: the pipeline transformers actually encodes with, serialized for the runtime.

transformers' AutoTokenizer does not always run the checkpoint's tokenizer.json as shipped: a family
class (Qwen2Tokenizer, GemmaTokenizer, LlamaTokenizer, ...) may rebuild the pipeline from the file's
vocabulary and merges with its own normalizer and pre-tokenizer, and `add_bos_token` / `add_eos_token`
in tokenizer_config.json rewrite the post-processor. The runtime encodes with the `tokenizers`
library alone, so the repository gets AutoTokenizer's own backend (`backend_tokenizer`), serialized
with truncation and padding off (transformers turns both off for a plain call; the served model
checks lengths itself). What cannot be carried in tokenizer.json (a Python-side decode cleanup,
`split_special_tokens`) is caught by the check that follows (compiler/repository/tokenizer_check.py).
"""

from __future__ import annotations

from pathlib import Path

from llmc.compiler.repository.tokenizer_check import check_tokenizer
from llmc.errors import SourceError


def served_tokenizer_json(tokenizer) -> str:
    """`tokenizer`'s (a transformers fast tokenizer) backend pipeline as tokenizer.json text."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())  # a copy: the loaded one stays as it is
    backend.no_truncation()
    backend.no_padding()
    return backend.to_str()


def write_tokenizer(tokenizer, dest: Path, *, origin: str, chat_template: dict | None = None,
                    check: bool = True) -> int:
    """Write `tokenizer`'s served form to `dest` and, with `check`, compare it with `tokenizer` on
    the sample texts (and conversations, with `chat_template`). `dest` appears only once it has
    passed: a failed check leaves no file. Returns how many samples were compared."""
    if tokenizer is None or not getattr(tokenizer, "is_fast", False):
        raise SourceError(f"{origin}: the served model needs a fast tokenizer (tokenizer.json) and none could be "
                          f"made from this checkpoint ({type(tokenizer).__name__ if tokenizer is not None else 'none'})")
    partial = dest.with_name(dest.name + ".partial")
    try:
        partial.write_text(served_tokenizer_json(tokenizer), encoding="utf-8")
        compared = check_tokenizer(tokenizer, partial, chat_template, origin=origin) if check else 0
        partial.replace(dest)
    finally:
        partial.unlink(missing_ok=True)
    return compared
