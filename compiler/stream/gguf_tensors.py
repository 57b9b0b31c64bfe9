"""A GGUF file's tensors, one at a time, named and valued as transformers' GGUF loader gives them.

`GGUFTensors(path)` parses the file once (gguf's `GGUFReader`, a memory map, shared through
`gguf_reader.one_parse`); `load(key)` dequantizes that one tensor from the map (`gguf.dequantize`, what transformers
calls) and applies the tensor processor transformers would (Llama's q/k reverse permutation,
Gemma's norm offset, GPT-2's transposes), so that it equals `load_gguf_checkpoint(path, return_tensors=True)`'s
tensor of that name; nothing else is read. The names come from transformers' `get_gguf_hf_weights_map`, run on the
model built on the meta device (no memory), as `from_pretrained` builds it.

Written by hand, since transformers has no per-tensor API: `_run` repeats the body of `load_gguf_checkpoint`'s
loop over tensors (process, then keep the result under its mapped name, or take what the processor stored itself
in `parsed_parameters`); the tensor names are learned by running the processor on a zero-strided stand-in of
each tensor's shape (no memory, nothing dequantized). A name that transformers assembles from several GGUF tensors
(the MoE processors' merged experts) cannot be read one tensor at a time and is refused. Architectures that
transformers loads through its newer packed-weights path (`integrations/gguf`) rather than
`load_gguf_checkpoint` are refused too: none is a family llmc reads from GGUF.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmc.errors import SourceError


class GGUFTensors:
    """The tensors of one GGUF file, each dequantized (float32) on demand."""

    def __init__(self, path: Path):
        import gguf
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                              get_gguf_hf_weights_map, load_gguf_checkpoint,
                                                              read_field)

        from llmc.compiler.gguf_reader import one_parse

        self.path = path = Path(path)
        try:
            with one_parse():  # one parse: the reader kept here is the one transformers reads the metadata from
                self._reader = gguf.GGUFReader(str(path))
                parsed = load_gguf_checkpoint(str(path))  # metadata only: the config the processors read
                config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        except Exception as err:  # gguf and transformers raise ValueError/KeyError/struct errors on bad files
            raise SourceError(f"{path}: transformers could not read this GGUF file ({err})") from None
        arch = read_field(self._reader, "general.architecture")[0]
        if _packed_path(arch):
            raise SourceError(f"{path}: transformers loads {arch!r} GGUF files through its packed-weights loader, "
                              "which cannot be read a tensor at a time here")
        self._processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        self._mapping = get_gguf_hf_weights_map(skeleton, self._processor)

        # HF name -> (the GGUF tensor it is made from, its shape as load returns it)
        self._where: dict[str, tuple] = {}
        for tensor in self._reader.tensors:
            for key, value in self._run(tensor, _stand_in(tensor)).items():
                if key in self._where:  # the MoE processors' gate + up experts, stored as one gate_up_proj
                    raise SourceError(
                        f"{path}: transformers' {type(self._processor).__name__} builds {key} from several GGUF "
                        f"tensors ({self._where[key][0].name}, {tensor.name}, ...); a streamed build reads one tensor "
                        "at a time and cannot make it: build from the HF checkpoint folder, or without streaming")
                self._where[key] = (tensor, tuple(value.shape))

    def keys(self) -> list[str]:
        return list(self._where)

    def load(self, key: str):
        """The tensor `key` (float32), dequantized from the file's memory map and processed as transformers does."""
        import gguf
        import torch

        tensor, _ = self._where[key]
        try:
            try:
                weights = gguf.dequantize(tensor.data, tensor.tensor_type)  # as load_gguf_checkpoint calls it
            except Exception as err:
                raise SourceError(f"{self.path}: could not dequantize tensor {tensor.name} "
                                  f"({tensor.tensor_type.name}) for {key} ({err})") from None
            value = self._run(tensor, weights).get(key)
            if value is None:  # the processor named it otherwise with real values than with the stand-in
                raise SourceError(f"{self.path}: transformers' {type(self._processor).__name__} gave tensor "
                                  f"{tensor.name} no name {key} when read")
            if not isinstance(value, torch.Tensor):
                value = torch.from_numpy(np.copy(value))  # as load_gguf_checkpoint: a copy, off the read-only map
            return value.to(torch.float32)
        finally:  # after the copy: an F32 or F16 tensor "dequantizes" to a view of the map itself
            self._release(tensor)

    def _release(self, tensor) -> None:
        """Take the tensor's pages of the file out of this process's resident set once read (madvise DONTNEED on
        its range of the map; they stay in the page cache, and a later read faults them back in). The map is the
        whole file and lives as long as the build: without this every tensor ever read stays resident, at 8B a
        Q8_0 file's 8.5 GB on top of the build (measured: 14.9 GiB resident, 9.2 of it anonymous)."""
        import mmap

        raw = getattr(self._reader.data, "_mmap", None)  # numpy's memmap keeps its mmap.mmap there
        if raw is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE  # madvise takes whole pages
        raw.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start)

    def _run(self, tensor, weights) -> dict:
        """What `load_gguf_checkpoint`'s loop keeps of one GGUF tensor, {HF name: weights}: the processor's result
        under its mapped name, and whatever the processor stored in `parsed_parameters` itself (GPT-2's
        output.weight). Written by hand: the loop's body, for one tensor (transformers offers no call for it)."""
        scratch: dict = {"tensors": {}}
        result = self._processor.process(weights=weights, name=tensor.name, tensor_key_mapping=self._mapping,
                                         parsed_parameters=scratch)
        kept = dict(scratch["tensors"])
        if result.name in self._mapping:
            kept[self._mapping[result.name]] = result.weights  # after the stored ones: the loop's later write wins
        return kept


def _stand_in(tensor):
    """A float32 array of `tensor`'s dequantized shape, every element the same zero (zero strides: no memory), for
    the processor to name without anything read or dequantized. A processor that copies it allocates that one
    tensor's size for the moment (GPT-2's output.weight; the MoE processors' experts, refused above)."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ggml lists dims innermost first
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape, (0,) * len(shape), writeable=False)


def _packed_path(arch: str) -> bool:
    """Whether transformers loads `arch` through `integrations/gguf` (GgufHfQuantizer), not load_gguf_checkpoint."""
    try:
        from transformers.integrations.gguf.utils import is_gguf_arch_supported
    except ImportError:  # an older transformers: load_gguf_checkpoint only
        return False
    return is_gguf_arch_supported(arch)
