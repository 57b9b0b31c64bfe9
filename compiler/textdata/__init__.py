"""Text for calibration and for measuring perplexity: the built-in corpus or a user's file.

`builtin` is compiler/textdata/corpus.txt (written for llmc, public domain), split by document into a
calibration half and a held-out half, so perplexity is never measured on calibration text. A user's
file is a `.txt` (documents separated by blank lines) or a `.jsonl` (one object per line with a
`text` field). Every problem names the spec field and the file.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import numpy as np

from llmc.errors import SpecError

BUILTIN = "builtin"
_SEPARATOR = "====="


def builtin_documents(split: str) -> list[str]:
    """The built-in corpus's `calibration` or `heldout` documents."""
    assert split in ("calibration", "heldout"), split
    text = (resources.files(__name__) / "corpus.txt").read_text(encoding="utf-8")
    docs = [d.strip() for d in text.split(_SEPARATOR)[1:] if d.strip()]
    half = len(docs) // 2
    return docs[:half] if split == "calibration" else docs[half:]


def load_documents(data: str, field: str, base_dir: Path | None = None) -> list[str]:
    """Documents from `data` ("builtin" or a path; relative paths are resolved against `base_dir`)."""
    if data == BUILTIN:
        return builtin_documents("calibration")
    path = Path(data).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise SpecError(f"{field}: {path} not found (a .txt or .jsonl file, or `builtin`)")
    if path.suffix not in (".txt", ".jsonl"):
        raise SpecError(f"{field}: {path} must be a .txt or .jsonl file (got {path.suffix or 'no suffix'})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{field}: {path} is not UTF-8 text") from None
    docs = _jsonl(text, path, field) if path.suffix == ".jsonl" else [d.strip() for d in text.split("\n\n")]
    docs = [d for d in docs if d]
    if not docs:
        raise SpecError(f"{field}: {path} has no text")
    return docs


def _jsonl(text: str, path: Path, field: str) -> list[str]:
    docs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise SpecError(f"{field}: {path} line {number} is not JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise SpecError(f"{field}: {path} line {number} has no string field `text`")
        docs.append(record["text"])
    return docs


def token_windows(tokenizer, documents: list[str], seq_len: int, num_samples: int, field: str,
                  origin: str) -> list[np.ndarray]:
    """Up to `num_samples` windows of exactly `seq_len` tokens from the documents laid end to end."""
    ids: list[int] = []
    for doc in documents:
        ids += tokenizer(doc)["input_ids"]
        if len(ids) >= seq_len * num_samples:
            break
    if len(ids) < seq_len:
        raise SpecError(f"{field}: {origin} is too short: {len(ids)} tokens, and one sample needs seq_len = "
                        f"{seq_len}; add text or lower the seq_len")
    n = min(num_samples, len(ids) // seq_len)
    return [np.array(ids[i * seq_len:(i + 1) * seq_len], dtype=np.int64) for i in range(n)]
