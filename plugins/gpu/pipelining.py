"""What a compiled attention kernel's key loop keeps in flight: read from Triton's TritonGPU IR (`ttgir`), so it
is checked without a GPU, for any target Triton compiles for.

    key_pipelining(ttgir, block_n, block_d) -> KeyPipelining(buffers, in_flight)

Why it is needed: Triton's software pipeliner turns a loop's loads into asynchronous copies into `num_stages - 1`
shared-memory buffers, so the next key tiles load while this one is computed. A load whose address comes from
another load of the same iteration (the paged kernels' keys and values, found through the block table) counts as
a level of indirection, and the pipeliner shares the stages among the levels: with 3 or 4 stages the paged kernels'
key and value copies got one buffer (decode) and were waited for with nothing left in flight (`ttg.async_wait
{num = 0}` at the top of every iteration: each tile's load issued after the previous tile's compute and waited
for in full), where the slot kernels, at the same stage count, keep two in flight. From 5 stages on, both levels
get their buffers. The property is read here, not assumed, because it depends on Triton's version and the
layouts it picks (the paged decode kernel at 128 keys and 4 warps pipelined at 3 stages, at 8 warps not).

Written by hand: Triton reports the shared memory a kernel needs, not how its loops were pipelined. The IR's op
names (`ttg.local_alloc`, `ttg.async_copy_global_to_local`, `ttg.async_wait {num = N}`) are those of Triton 3.2
and later (checked with 3.6 and 3.9).
"""

from __future__ import annotations

import re
from typing import NamedTuple

_ALLOC = re.compile(r"= ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x(\d+)x(\d+)x")
_WAIT = re.compile(r"ttg\.async_wait\b.*\{num = (\d+) : i32\}")


class KeyPipelining(NamedTuple):
    buffers: int  # shared-memory buffers of the key (and value) tiles: 0 when they are not copied asynchronously
    in_flight: int  # copy groups the key loops' waits leave outstanding (the least of them): 0 = none overlaps

    @property
    def overlapped(self) -> bool:
        """Whether the next key tile loads while one is computed: two buffers at least, and a wait that leaves
        copies in flight."""
        return self.buffers >= 2 and self.in_flight >= 1


def key_pipelining(ttgir: str, block_n: int, block_d: int) -> KeyPipelining:
    """The key loops' pipelining in a compiled kernel's TritonGPU IR (`compiled.asm["ttgir"]`): the fewest buffers
    any [block_n, block_d] tile (or its transpose) gets, and the fewest copy groups any wait inside a loop that
    holds a dot and asynchronous copies leaves outstanding."""
    buffers = [int(m.group(1)) for m in _ALLOC.finditer(ttgir) if {int(m.group(2)), int(m.group(3))} == {block_n,
                                                                                                         block_d}]
    in_flight = []
    loops = []  # open loops: [brace depth where each opened, its waits, whether it dots, whether it copies]
    depth = 0
    for line in ttgir.splitlines():
        if "scf.for" in line and line.rstrip().endswith("{"):
            loops.append([depth, [], False, False])
        for loop in loops:
            wait = _WAIT.search(line)
            if wait:
                loop[1].append(int(wait.group(1)))
            loop[2] = loop[2] or "ttng.warp_group_dot " in line or "tt.dot " in line
            loop[3] = loop[3] or "ttg.async_copy_global_to_local" in line
        depth += line.count("{") - line.count("}")
        while loops and depth <= loops[-1][0]:
            _, waits, dots, copies = loops.pop()
            if dots and copies:
                in_flight.append(min(waits, default=0))
    return KeyPipelining(min(buffers, default=0), min(in_flight, default=0))
