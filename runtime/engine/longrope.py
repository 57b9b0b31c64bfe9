"""LongRoPE in the engines (Phi-3/3.5, Phi-4-mini: compiler/models/rope.py), kept to what
transformers computes.

transformers rotates every position of a forward with the long factors when the forward reaches past
`original_max_position_embeddings` (the switch, `kv_layout.longrope_switch`), and Phi-3's generate()
drops its KV cache and recomputes the whole sequence the first time the sequence grows past the
switch (`Phi3ForCausalLM.prepare_inputs_for_generation`). So every token's logits are those of the
whole sequence so far in one forward: a sequence's KV are all short-factor while it is at most
`switch` tokens long, all long-factor after. The engines keep to that by three rules:

- every row of a step carries its sequence's whole length (the graph's `sequence_lengths`,
  RowStep.seq_len), so a prompt prefilled in chunks rotates its first chunks as its whole length picks;
- a sequence whose KV were computed short and that has grown past the switch recomputes them
  (`must_recompute`): the paged engine gives its blocks back and prefills prompt and output again, as
  after a preemption; the slot engine prefills them again in its slot;
- a short sequence verifies proposals (speculation/speculator.py) only up to the switch (`proposal_room`), so
  no step needs both tables for one sequence: the step that crosses decodes one token, and the
  sequence recomputes before its next.

Beam search never crosses: a request whose beams would is refused (`check_beams`), as each of its W
beams would recompute. Prefix caching keys a block with the table its KV were computed with
(block_manager.py), so a prompt past the switch never reuses a shorter prompt's blocks.
"""

from __future__ import annotations


def is_long(switch: int | None, length: int) -> bool:
    """Whether a sequence of `length` tokens takes the long factors."""
    return switch is not None and length > switch


def must_recompute(switch: int | None, kv_long: bool, length: int) -> bool:
    """Whether a sequence whose KV were computed with the long factors (`kv_long`) or not must compute
    them again now that it is `length` tokens long."""
    return kv_long != is_long(switch, length)


def crossed(switch: int | None, length: int) -> bool:
    """Whether a sequence whose KV were computed as it stood one token ago (`length` - 1 tokens) must
    recompute them now that it has `length`: the token that took it past the switch."""
    return must_recompute(switch, is_long(switch, length - 1), length)


def proposal_room(switch: int | None, num_tokens: int) -> int | None:
    """How many proposals a sequence of `num_tokens` may verify after its last token in one step
    (None: as many as it likes): a short one's last verified position is the switch's last short one."""
    if switch is None or num_tokens > switch:
        return None
    return switch - num_tokens


def check_beams(switch: int | None, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse a beam search whose sequences would grow past the switch (the last token needs no forward)."""
    if switch is not None and prompt_len <= switch < prompt_len + max_new_tokens - 1:
        raise ValueError(f"beam_width: beam search on this LongRoPE model cannot cross its switch at "
                         f"{switch} tokens (original_max_position_embeddings): the prompt has {prompt_len} tokens "
                         f"and max_tokens allows {max_new_tokens} more; ask for at most "
                         f"{switch + 1 - prompt_len} tokens, or send a prompt longer than {switch}")
