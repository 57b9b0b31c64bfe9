"""An adapter over a base whose activations AWQ scaled: the scaling folded into the adapter's arrays, so the branch
(graph.py) adds PEFT's delta though it reads and writes the scaled graph's tensors.

AWQ (compiler/quantize/awq.py) divides a projection's input x by a per-channel s and multiplies the projection's
weight rows by s, and for a gated MLP divides the up projection's output columns by the s the down projection's
rows took (quantize/channel_scales.py records both). The base's function is unchanged; a branch beside it is not:

    a site reading x / s        (x / s) (diag(s) A) B  = x A B         A's rows times s
    a site whose y holds y / s  x A (B diag(1/s))     = (x A B) / s    B's columns over s, in the divided columns

Both are folded into the arrays an adapter is stacked from (stacks.site_arrays), so the branch, its op and the runtime
are the base's, and a step costs what it cost. The fold is per site (`a_rows`, `b_columns`; a site absent from
either is unscaled there) and is written into the model repository beside the site table (`lora_scales.safetensors`,
the manifest's `lora.scales_file`), where an adapter loaded at run time is folded by the same rule
(compiler/lora/convert.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from llmc.compiler.quantize.channel_scales import ChannelScales
from llmc.runtime.lora.sites import Site

FILENAME = "lora_scales.safetensors"  # in the version folder


@dataclass
class Fold:
    a_rows: dict[str, np.ndarray] = field(default_factory=dict)  # site -> what A's rows are multiplied by [in]
    b_columns: dict[str, np.ndarray] = field(default_factory=dict)  # site -> what B's columns are multiplied by [out]

    def __bool__(self) -> bool:
        return bool(self.a_rows or self.b_columns)

    @classmethod
    def of(cls, sites: Sequence[Site], scales: ChannelScales) -> "Fold":
        """The fold of every site that `scales` touched: its input divided (by its own tensor's name), or its output
        columns divided (the up projection's; its y is the MatMul's output, since the division needs the Mul or
        Split to read that output directly). Scales on tensors no site reads or writes (the final norm before a tied
        LM head, which has no site) are not a branch's business."""
        fold = cls()
        for site in sites:
            if site.x in scales.inputs:
                s = np.asarray(scales.inputs[site.x], np.float32)
                if s.shape != (site.in_features,):
                    raise ValueError(f"site {site.name}: {site.x} has {site.in_features} channels, its scale {s.shape}")
                fold.a_rows[site.name] = s
            if site.y in scales.outputs:
                start, s = scales.outputs[site.y]
                if start + len(s) > site.out_features:
                    raise ValueError(f"site {site.name}: columns {start}..{start + len(s)} of {site.out_features}")
                columns = np.ones(site.out_features, np.float32)
                columns[start:start + len(s)] = 1.0 / np.asarray(s, np.float32)
                fold.b_columns[site.name] = columns
        return fold

    def apply(self, site: str, a: np.ndarray, b: np.ndarray) -> None:
        """Fold into one site's arrays (a [in, K], b [K, out]), in place."""
        if site in self.a_rows:
            a *= self.a_rows[site][:, None]
        if site in self.b_columns:
            b *= self.b_columns[site][None, :]

    def to_bytes(self) -> bytes:
        from safetensors.numpy import save

        return save({**{f"a_rows:{k}": v for k, v in self.a_rows.items()},
                     **{f"b_columns:{k}": v for k, v in self.b_columns.items()}})

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Fold":
        from safetensors.numpy import load

        fold = cls()
        try:
            tensors = load(data)
        except Exception as err:  # noqa: BLE001 (safetensors' own error types vary by version: name the file)
            raise ValueError(f"{where}: not a LoRA scales file ({err})") from None
        for key, value in tensors.items():
            kind, site = key.split(":", 1) if ":" in key else ("", key)
            if kind not in ("a_rows", "b_columns"):
                raise ValueError(f"{where}: unknown entry {key!r}")
            getattr(fold, kind)[site] = value
        return fold
