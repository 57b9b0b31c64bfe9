"""Speculative decoding in the paged engine: which rows carry proposals and how a step's logits accept them
(speculator.py), and where proposals come from: the prompt and output so far (ngram.py) or a draft model over
the target's block tables (draft.py)."""
