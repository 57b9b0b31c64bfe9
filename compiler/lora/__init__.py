"""LoRA adapters served on one base model (issue 54, docs/lora.md): the compiler's side (the runtime's: runtime/lora/).

    adapter.py    a PEFT adapter read and checked (PEFT's scaling, rank_pattern/alpha_pattern, expert parameters,
                  refusals naming the field), its identity (name + content digest)
    base.py       an adapter checked against the base model (modules, shapes, sites, a tied or copied LM head)
    sites.py      where a branch goes: each layer projection of an exported graph and the PEFT modules in it
    experts.py    LoRA on a mixture's experts: their sites, and the branch recomputing the MoE for adapter tokens
    graph.py      the flat-slot branch beside each projection (four nodes), a pass over an exported (or quantized) graph
    stacks.py     a PEFT adapter laid out per site as the runtime stacks it (runtime/lora/stacks.py), a step's inputs
    package.py    the spec's adapters checked before the build works, and packaged into the model repository
    convert.py    a PEFT adapter made into the file a served model loads at run time, checked against its sites
    fold.py       a base's AWQ scaling folded into an adapter's arrays
    reference.py  the branch's PyTorch reference (shrink, then expand, over the active slots)
"""

from llmc.compiler.lora.adapter import Adapter, AdapterError, ModuleLora, read_adapter
from llmc.compiler.lora.base import BaseLinears, check_against
from llmc.compiler.lora.graph import a_name, add_lora_branches, b_name
from llmc.compiler.lora.sites import Member, Site, find_sites
from llmc.compiler.lora.stacks import slot_masks, stack_slots, step_inputs, token_slots

__all__ = ["Adapter", "AdapterError", "BaseLinears", "Member", "ModuleLora", "Site", "a_name", "add_lora_branches",
           "b_name", "check_against", "find_sites", "read_adapter", "slot_masks", "stack_slots", "step_inputs",
           "token_slots"]
