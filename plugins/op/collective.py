"""`llmc::all_reduce` and `llmc::all_gather`: the collectives a tensor-parallel rank's graph calls, as torch
custom ops with an in-process reference, and their ONNX lowering.

    all_reduce(x, rank, world_size) -> the elementwise sum of x over the group's ranks
    all_gather(x [..., w], rank, world_size) -> [..., world_size * w], the ranks' x side by side in rank order

A rank's graph holds one `llmc.AllReduce` / `llmc.AllGather` node per call, with `rank` and `world_size` as
attributes; which group of processes it sums with is given when a session opens
(runtime/kernels/collective.py: ranks are processes on one machine, summing through shared memory).

The torch reference runs the ranks as threads of one process, in lockstep (`lockstep(world_size)`): each
thread runs its rank's module and the ops meet at a barrier, so a split model can be checked against the
unsplit one in PyTorch, with no ONNX Runtime and no processes (tests/compiler/models/test_tensor_parallel.py).
Outside `lockstep` a collective with world_size > 1 has no peers and raises.
"""

from __future__ import annotations

import contextlib
import threading

import onnx
import torch
from onnx.defs import OpSchema
from torch import Tensor

from llmc.plugins.op.onnx_schema import LLMC_DOMAIN
from llmc.plugins.op.onnx_schema import make_schema as op_schema

REDUCE_OP, GATHER_OP = "AllReduce", "AllGather"


class _Lockstep:
    """The ranks of one lockstep run: a barrier and one slot per rank for each collective call."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.slots: list[Tensor | None] = [None] * world_size

    def exchange(self, x: Tensor, rank: int) -> list[Tensor]:
        """Every rank's x, in rank order (the slots are read before the second barrier lets any rank reuse them)."""
        self.slots[rank] = x
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values


_group: _Lockstep | None = None


@contextlib.contextmanager
def lockstep(world_size: int):
    """Run the collectives of `world_size` threads (one per rank, each calling with its own `rank`) as one group."""
    global _group
    if _group is not None:
        raise RuntimeError("a lockstep group is already running in this process")
    _group = _Lockstep(world_size)
    try:
        yield
    finally:
        _group.barrier.abort()  # a rank still waiting (another failed) is released with BrokenBarrierError
        _group = None


def _exchange(x: Tensor, rank: int, world_size: int) -> list[Tensor]:
    if world_size == 1:
        return [x]
    if _group is None or _group.world_size != world_size:
        raise RuntimeError(f"llmc collective (rank {rank} of {world_size}) outside a rank group: in PyTorch, run the "
                           f"ranks as threads inside plugins.op.collective.lockstep({world_size})")
    return _group.exchange(x, rank)


@torch.library.custom_op("llmc::all_reduce", mutates_args=())
def all_reduce(x: Tensor, rank: int, world_size: int) -> Tensor:
    values = _exchange(x, rank, world_size)
    return torch.stack([v.float() for v in values]).sum(dim=0).to(x.dtype)


@all_reduce.register_fake
def _all_reduce_fake(x, rank, world_size):
    return torch.empty_like(x)


@torch.library.custom_op("llmc::all_gather", mutates_args=())
def all_gather(x: Tensor, rank: int, world_size: int) -> Tensor:
    return torch.cat(_exchange(x, rank, world_size), dim=-1)


@all_gather.register_fake
def _all_gather_fake(x, rank, world_size):
    return x.new_empty((*x.shape[:-1], x.shape[-1] * world_size))


def lowerings() -> dict:
    """`custom_translation_table` entries: one llmc.AllReduce / llmc.AllGather node per call."""
    from onnxscript.values import Opset

    llmc = Opset(LLMC_DOMAIN, 1)

    def reduce(x, rank: int, world_size: int):
        return llmc.AllReduce(x, rank=rank, world_size=world_size)

    def gather(x, rank: int, world_size: int):
        return llmc.AllGather(x, rank=rank, world_size=world_size)

    return {torch.ops.llmc.all_reduce.default: reduce, torch.ops.llmc.all_gather.default: gather}


def _infer_gather(ctx) -> None:
    out = onnx.TypeProto()
    out.CopyFrom(ctx.get_input_type(0))
    dims = out.tensor_type.shape.dim
    world = onnx.helper.get_attribute_value(ctx.get_attribute("world_size"))
    if dims and dims[-1].HasField("dim_value"):
        dims[-1].dim_value *= world
    elif dims:
        dims[-1].Clear()  # symbolic: unknown after the gather
    ctx.set_output_type(0, out)


def _copy_type(ctx) -> None:
    ctx.set_output_type(0, ctx.get_input_type(0))


def register_schemas() -> None:
    """llmc.AllReduce and llmc.AllGather for onnxscript and onnx.checker. Idempotent."""
    attributes = [OpSchema.Attribute("rank", OpSchema.AttrType.INT, "this graph's rank"),
                  OpSchema.Attribute("world_size", OpSchema.AttrType.INT, "ranks in the group")]
    for name, doc, infer in (
            (REDUCE_OP, "The elementwise sum of X over the ranks of the session's group.", _copy_type),
            (GATHER_OP, "The ranks' X concatenated along the last axis, in rank order.", _infer_gather)):
        if not onnx.defs.has(name, LLMC_DOMAIN):
            onnx.defs.register_schema(op_schema(name, LLMC_DOMAIN, [("X", "T")], [("Y", "T")], attributes, doc,
                                                infer))
