"""How fast llmc's 4-bit decode tile streams weights, against a plain read of the same bytes:

    .venv/bin/python -m llmc.bench q4-stream [--k 2048] [--n 2048] [--blocks 32,128] [--layers 300] [--copies 2]
        [--rounds 6] [--reps 4] [--isa avx512vnni]

Batch-1 decode streams every weight once a step, so its ceiling is the bytes the cores can read. This
measures the tile alone, with no ONNX Runtime around it: a C harness (compiled here with the kernel's own
sources) runs q4_prepare / q4_run at one row, on one thread, over `--layers` random K x N layers made in
MatMulNBits' layout (4-bit codes; a scale and a 4-bit zero point a block of weights, each of `--blocks`: 32, 64
or 128) and repacked by q4_pack into the kernel's one stream, as a session does: once with the scales kept fp32
(0.64 bytes a weight in blocks of 32; 300 x 2048 x 2048 is 806 MB, out of any cache), once stored as fp16 (0.58
bytes a weight: what a session packs when every scale is an fp16 value, as llmc's quantizer writes them); the best
of `--reps` passes is a run's time. The same harness reads the first block size's fp32 layout's number of bytes
with a plain vector loop that asks for lines as far ahead as the tile does. `--copies` copies of each run at once,
each on its own thread (one per core, as a decode step's threads do), in `--rounds` rounds with the order
alternating; the benchmark prints the GB/s of each (summed over the copies; medians over the rounds), each tile's
share of the read's rate (the share of the memory stream the tile leaves unused), how much faster the same layers
run with fp16 scales, and, with more than one block size, how much faster each runs (fp16 scales) than the first:
what the bytes of wider blocks' fewer scales save.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
from concurrent.futures import ThreadPoolExecutor
import tempfile
from pathlib import Path

from llmc.bench.harness import UsageError, in_turn, median
from llmc.runtime.kernels import cpu_kernels

KERNEL = cpu_kernels.HERE / "matmul_nbits4"
HARNESS = r"""
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include "matmul_nbits4.h"

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static uint64_t next(uint64_t *s) { *s = *s * 6364136223846793005ull + 1442695040888963407ull; return *s >> 33; }

/* best seconds of `reps` passes of one row through `layers` random k x n layers (made in MatMulNBits' layout,
 * then repacked by q4_pack as a session does, the scales as fp16 when `half_scales`); < 0: out of memory */
double llmc_q4_stream(int64_t k, int64_t n, int64_t layers, int64_t reps, int isa, int half_scales, int share) {
  int64_t blocks = k / 32, wide = blocks / share, zeros = n * ((wide + 1) / 2);
  int64_t per_layer = (int64_t)q4_packed_bytes(k, n, 1, half_scales, share);
  uint8_t *all = malloc((size_t)(layers * per_layer)), *b = malloc(n * blocks * 16), *zp = malloc(zeros);
  float *s = malloc(n * wide * 4), *a = malloc(k * 4), *y = malloc(n * 4);
  void *memory = malloc(q4_memory(1, k));
  if (!all || !b || !zp || !s || !a || !y || !memory) return -1.0;
  uint64_t seed = 1;
  for (int64_t l = 0; l < layers; l++) {
    for (int64_t i = 0; i < n * blocks * 16; i++) b[i] = (uint8_t)next(&seed);
    for (int64_t i = 0; i < n * wide; i++) s[i] = (float)(1 + next(&seed) % 7) / 512.f; /* fp16 values */
    for (int64_t i = 0; i < zeros; i++) zp[i] = (uint8_t)next(&seed);
    q4_pack(k, n, b, s, zp, half_scales, share, all + l * per_layer);
  }
  for (int64_t i = 0; i < k; i++) a[i] = (float)(next(&seed) % 2001) * 1e-3f - 1.f;
  double best = 1e30;
  for (int64_t r = 0; r < reps; r++) {
    double start = now();
    for (int64_t l = 0; l < layers; l++) {
      size_t tasks;
      Q4Matmul *call = q4_prepare(memory, isa, a, 1, k, n, 1, all + l * per_layer, 1, half_scales, share, NULL, y,
                                  &tasks);
      for (size_t t = 0; t < tasks; t++) q4_run(call, t);
    }
    double took = now() - start;
    best = took < best ? took : best;
  }
  free(all), free(b), free(zp), free(s), free(a), free(y), free(memory);
  return best;
}

/* best seconds of `reps` passes reading `bytes` bytes (a multiple of 64) with 32-byte loads, summed, each 64 bytes
 * asking for the line 4 KiB ahead as the tile does */
__attribute__((target("avx2"))) double llmc_read_stream(int64_t bytes, int64_t reps) {
  uint64_t *p = aligned_alloc(64, (size_t)bytes);
  if (!p) return -1.0;
  for (int64_t i = 0; i < bytes / 8; i++) p[i] = (uint64_t)i;
  double best = 1e30;
  volatile uint64_t sink = 0;
  for (int64_t r = 0; r < reps; r++) {
    double start = now();
    uint64_t acc[8] = {0};
    for (int64_t i = 0; i < bytes / 8; i += 8) {
      __builtin_prefetch((const char *)(p + i) + 4096, 0, 3); /* as far ahead as the tile asks (PREFETCH_BYTES) */
      for (int j = 0; j < 8; j++) acc[j] += p[i + j];
    }
    double took = now() - start;
    for (int j = 0; j < 8; j++) sink += acc[j];
    best = took < best ? took : best;
  }
  free(p);
  return best;
}
"""


def tile_name(block: int, half: bool) -> str:
    return f"tile, blocks of {block}, {'fp16' if half else 'fp32'} scales"


def harness(out_dir: Path) -> Path:
    """The harness and the kernel's sources compiled into one shared library under `out_dir`."""
    source = out_dir / "q4_stream.c"
    source.write_text(HARNESS)
    sources = [source, *(KERNEL / f for f in ("matmul_nbits4.c", "matmul_nbits4_avx512.c", "matmul_nbits4_avx2.c"))]
    return cpu_kernels.compile_library(sources, out_dir / "libq4_stream.so", cpu_kernels.FLAGS, [KERNEL], ["-lm"])


def runs(path: Path, isa: str, args) -> tuple[dict, int]:
    """The runs (the tiles of each block size, fp32 then fp16 scales, then the read), each a callable returning
    (seconds, bytes) from the harness at `path`, and the bytes of the first block size's fp32 layers (the read's, to
    64 bytes). A layer's bytes are the kernel's own q4_packed_bytes. ctypes lets go of the GIL for a call, so copies
    on threads of this process run at once, one a core."""
    lib = ctypes.CDLL(str(path))
    lib.q4_isa_name.restype = ctypes.c_char_p
    index = next(i for i in itertools.count() if lib.q4_isa_name(i) in (isa.encode(), None))  # Q4_ISA_* of `isa`
    lib.llmc_q4_stream.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_int] * 3
    lib.llmc_read_stream.argtypes = [ctypes.c_int64] * 2
    lib.llmc_q4_stream.restype = lib.llmc_read_stream.restype = ctypes.c_double
    lib.q4_packed_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64] + [ctypes.c_int] * 3
    lib.q4_packed_bytes.restype = ctypes.c_size_t

    def layers_bytes(block: int, half: bool) -> int:  # with zero points, as the harness makes them
        return args.layers * lib.q4_packed_bytes(args.k, args.n, 1, half, block // 32)

    nbytes = layers_bytes(args.blocks[0], False)
    read_bytes = nbytes // 64 * 64

    def checked(what: str, seconds: float, nbytes: int) -> tuple[float, int]:
        if seconds < 0:
            raise MemoryError(f"{what}: out of memory")
        return seconds, nbytes

    def tile(block: int, half: bool):
        return lambda: checked(tile_name(block, half), lib.llmc_q4_stream(args.k, args.n, args.layers, args.reps,
                                                                         index, half, block // 32),
                               layers_bytes(block, half))

    return {**{tile_name(b, h): tile(b, h) for b in args.blocks for h in (False, True)},
            "read": lambda: checked("read", lib.llmc_read_stream(read_bytes, args.reps), read_bytes)}, nbytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--k", type=int, default=2048, help="input width (a multiple of 64)")
    p.add_argument("--n", type=int, default=2048, help="output width")
    p.add_argument("--blocks", type=lambda v: [int(b) for b in v.split(",")], default=[32],
                   help="weights a scale and zero point, comma-separated (32, 64, 128): each timed in the same rounds")
    p.add_argument("--layers", type=int, default=300, help="layers a pass streams (300 x 2048 x 2048: 806 MB)")
    p.add_argument("--copies", type=int, default=2, help="copies running at once, each on a thread (one per core)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=4, help="passes a run, the best kept")
    p.add_argument("--isa", default="", help="avx512vnni or avx2 (default: the best this CPU runs)")


def run(args: argparse.Namespace) -> None:
    if any(b not in (32, 64, 128) for b in args.blocks):
        raise UsageError(f"--blocks {','.join(map(str, args.blocks))}: the kernel takes blocks of 32, 64 or 128")
    if args.k % max(64, *args.blocks):
        raise UsageError(f"--k {args.k}: the kernel takes multiples of 64 and of the block ({max(args.blocks)})")
    kernels = cpu_kernels.load()
    if kernels is None:
        raise UsageError("llmc's 4-bit kernel does not run here (it needs AVX2 + FMA or AVX512-VNNI and a C compiler; "
                f"{cpu_kernels.SWITCH}=0 switches it off)")
    isa = args.isa or kernels.isa
    if isa not in kernels.isas:
        raise UsageError(f"--isa {isa}: this CPU runs llmc's 4-bit kernel on {', '.join(kernels.isas)}")
    with tempfile.TemporaryDirectory() as tmp:
        run, nbytes = runs(harness(Path(tmp)), isa, args)
        rates: dict[str, list[float]] = {what: [] for what in run}
        seconds: dict[str, list[float]] = {what: [] for what in run}
        with ThreadPoolExecutor(args.copies) as pool:
            for r in range(args.rounds):
                for what in in_turn(tuple(run), r):
                    done = [f.result() for f in [pool.submit(run[what]) for _ in range(args.copies)]]
                    rates[what].append(sum(moved / took for took, moved in done) / 1e9)
                    seconds[what].append(max(took for took, _ in done))
    read = median(rates["read"])
    print(f"llmc 4-bit decode tile ({isa}), one row, {args.layers} layers of {args.k} x {args.n} "
          f"({nbytes / 1e6:.0f} MB in blocks of {args.blocks[0]} with fp32 scales), {args.copies} at once, "
          f"{args.rounds} rounds:")
    print(f"  plain read {read:.1f} GB/s")
    for block in args.blocks:
        for half in (False, True):
            what = tile_name(block, half)
            shares = [t / r for t, r in zip(rates[what], rates["read"])]
            print(f"  {what}: {median(rates[what]):.1f} GB/s, {median(shares):.0%} of the read "
                  f"(per round {', '.join(f'{s:.2f}' for s in shares)})")
        speedups = [a / b for a, b in zip(seconds[tile_name(block, False)], seconds[tile_name(block, True)])]
        print(f"  blocks of {block}, fp16 scales against fp32: {median(speedups):.2f}x faster "
              f"(per round {', '.join(f'{s:.2f}' for s in speedups)})")
    for block in args.blocks[1:]:
        speedups = [a / b for a, b in zip(seconds[tile_name(args.blocks[0], True)], seconds[tile_name(block, True)])]
        print(f"  blocks of {block} against {args.blocks[0]} (fp16 scales): {median(speedups):.2f}x faster "
              f"(per round {', '.join(f'{s:.2f}' for s in speedups)})")
