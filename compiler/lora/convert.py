"""A PEFT adapter made into the file a served model loads at run time (`llmc adapters load`, the OpenAI frontend's
/v1/load_lora_adapter: llmc/fleet/adapters.py): read with PEFT's semantics (adapter.py, the rank limit the model was
built with), checked against the served model's site table (the manifest's `lora` section: no base model needed, so
the operator needs neither the checkpoint nor its config), and laid out per site (stacks.py, runtime/lora/files.py).

The running model checks the file again against its own sites (runtime/lora/check.py): a file made for another
build is refused there too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from llmc.compiler.lora.adapter import Adapter, AdapterError, read_adapter
from llmc.compiler.lora.base import check_copies
from llmc.compiler.lora.experts import params_of_sites
from llmc.compiler.lora.fold import Fold
from llmc.compiler.lora.stacks import site_arrays
from llmc.runtime.lora.check import NAME
from llmc.runtime.lora.files import adapter_bytes
from llmc.runtime.lora.sites import Site
from llmc.runtime.lora.stacks import AdapterWeights
from llmc.runtime.manifest import LoraConfig


def check_against_sites(adapter: Adapter, sites: Sequence[Site], head_digest: str | None = None) -> None:
    """Refuse, naming the module, an adapter whose target modules are not the sites' members or whose shapes differ
    from theirs (an adapter made for another base, or on a module llmc serves no adapter on), or whose copy of the
    LM head's weight is not the served base's (`head_digest`: the manifest's)."""
    members = {m.module: (site, m) for site in sites for m in site.members}
    for module, lora in sorted(adapter.modules.items()):
        if module not in members:
            raise AdapterError(f"adapter {adapter.name!r}: target module {module} has no LoRA site in this model "
                               f"(the adapter was made for another base, or targets a module llmc serves no "
                               f"adapter on: a tied LM head)")
        site, member = members[module]
        got, want = (lora.a.shape[-1], lora.b.shape[-2]), (site.in_features, member.width)
        if got != want or lora.a.shape[:-2] != ((site.experts,) if site.experts else ()):
            raise AdapterError(f"adapter {adapter.name!r}: {module} maps {got[0]} -> {got[1]} features, this model's "
                               f"{want[0]} -> {want[1]}: the adapter was made for another base")
    check_copies(adapter, head_digest)


def convert(name: str, folder: Path, lora: LoraConfig, fold: Fold | None = None) -> tuple[bytes, AdapterWeights]:
    """The adapter file's bytes for the PEFT adapter in `folder` served as `name`, and its weights, for the served
    model whose manifest's LoRA section is `lora` (its sites, rank limit and LM head's digest); `fold`: its base's AWQ
    scaling (fold.py, read from `lora.scales_file`), folded in."""
    if not NAME.fullmatch(name):
        raise AdapterError(f"lora_name: {name!r} is not an adapter name (letters, digits, _ . -, at most 64)")
    if lora.scales_file and not fold:
        raise ValueError(f"the served base was AWQ scaled ({lora.scales_file}): pass its fold")
    adapter = read_adapter(name, Path(folder), max_rank=lora.max_rank, experts=params_of_sites(lora.sites))
    check_against_sites(adapter, lora.sites, lora.head_digest)
    weights = site_arrays(lora.sites, adapter, fold)
    return adapter_bytes(weights), weights
