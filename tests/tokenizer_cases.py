"""Tiny tokenizers shaped like real checkpoints' (built here with the `tokenizers` library, nothing
downloaded), for the served-tokenizer check (tests/compiler/repository/test_tokenizer.py) and the chat
templates through the OpenAI path (tests/llmc/openai/test_chat_families.py). Each writes a checkpoint's
tokenizer files into a folder: tokenizer.json as the family ships it and tokenizer_config.json naming
the class transformers' AutoTokenizer then picks.

- `qwen2_bytelevel`: a plain byte-level BPE tokenizer.json (GPT-2's split) under Qwen2Tokenizer, which
  rebuilds the pipeline with Qwen2's own split regex and NFC normalizer (the case seen in the field);
- `gemma`: SentencePiece-style BPE with byte fallback, a BOS the post-processor adds
  (`add_bos_token`), `<start_of_turn>`/`<end_of_turn>` and Gemma 3's template shape: `bos_token` in the
  template, the system message folded into the first user turn;
- `phi3`: Llama-style SentencePiece BPE (a `▁` prepended by the normalizer, stripped by the decoder)
  under LlamaTokenizer, `add_bos_token` false in its config while tokenizer.json's post-processor
  adds `<s>`, and Phi-3's `<|user|> ... <|end|><|assistant|>` template.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello there, how are you today? I'm fine.",
          "def add(a, b):\n    return a + b", "it's 2026 and 12345 numbers", "café naïve résumé  spaces",
          "you are a helpful assistant; answer in one line", "system user model assistant"] * 20

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")

PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")


def _write(folder: Path, tokenizer, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def qwen2_bytelevel(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return _write(folder, tok, {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
                                "pad_token": "<|endoftext|>", "bos_token": None,
                                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})


def _sentencepiece_bpe(specials: list[str], *, prepend: bool, bos: str):
    """A SentencePiece-converted BPE as HF ships them: `▁` for spaces, byte-fallback tokens <0x00>..<0xFF>
    after the special tokens, merges trained on CORPUS; the post-processor adds `bos`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors, trainers

    steps = [normalizers.Prepend("▁")] if prepend else []
    normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizer
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    state = json.loads(trained.model.__getstate__())
    learned = sorted(state["vocab"], key=state["vocab"].get)
    vocab = {t: i for i, t in enumerate([*specials, *(f"<0x{b:02X}>" for b in range(256)), *learned])}
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tail = [decoders.Strip(" ", 1, 0)] if prepend else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *tail])
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, vocab[bos])])
    return tok


def gemma(folder: Path) -> Path:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    tok = _sentencepiece_bpe(specials, prepend=False, bos="<bos>")
    return _write(folder, tok, {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
                                "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                                "unk_token": "<unk>", "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
                                "chat_template": GEMMA_TEMPLATE})


def phi3(folder: Path) -> Path:
    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tok = _sentencepiece_bpe(specials, prepend=True, bos="<s>")
    return _write(folder, tok, {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
                                "legacy": False, "bos_token": "<s>", "eos_token": "<|end|>", "unk_token": "<unk>",
                                "pad_token": "<|end|>", "chat_template": PHI3_TEMPLATE})


FAMILIES = {"qwen2": qwen2_bytelevel, "gemma": gemma, "phi3": phi3}
