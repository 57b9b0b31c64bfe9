/* llmc's CPU collectives for tensor parallelism (collective.c): AllReduce (elementwise sum) and AllGather
 * (concatenation along the last axis) between the ranks of one model instance, each rank its own OS process
 * on one machine, over a POSIX shared-memory segment the leader makes (runtime/kernels/collective.py,
 * `Group.create`) and every rank maps by name (shm_open + mmap). collective_op.c is the ONNX Runtime op
 * around it. Written by hand: MPI, gloo and oneCCL do this, but each is a runtime of its own (a launcher,
 * sockets or a daemon) that an ONNX Runtime custom op in a wheel-only install cannot carry; what is needed
 * here is one barrier over a shared page, a memcpy and a sum.
 *
 * The segment (all offsets in bytes; the Python side writes the header's first fields, then the magic):
 *
 *   0      uint32 magic 'LLMC' (COLL_MAGIC), uint32 version (COLL_VERSION)
 *   8      uint32 world_size, uint32 unused
 *   16     uint64 slot_bytes: one rank's data slot in one buffer (a multiple of 64)
 *   24     uint64 total_bytes: the segment's size
 *   64     atomic uint32 aborted: 1 once Group.abort(reason) has stored its reason (below) and the flag
 *   128    atomic uint32 failed: 0, then 1 while a rank that timed out writes `failure`, then 2
 *   192    char reason[256]: abort()'s reason, NUL-terminated
 *   448    char failure[256]: the first timed-out rank's message, NUL-terminated
 *   1024   per rank r < 64, one 64-byte line each: atomic uint64 arrived (the number of collective steps
 *          rank r has entered: its data for step s is in place once arrived > s), atomic int32 owner (the
 *          process id running rank r, 0 when none)
 *   5120   descriptors [2 buffers][64 ranks], 64 bytes each: what a rank's data in that buffer is (CollDesc)
 *   16384  data: [2 buffers][world_size ranks][slot_bytes]
 *
 * One step (one chunk of one collective call; a call over more elements than a slot holds takes several):
 * rank r at step s (s = its own arrived count) writes its chunk into its slot of buffer s % 2 and its
 * descriptor, stores arrived = s + 1 (release), waits until every rank's arrived > s (acquire), checks that
 * every rank's descriptor matches its own, then reads all slots of buffer s % 2 into its output. One barrier
 * per step is enough because of the two buffers: buffer s % 2 is written again at step s + 2, which no rank
 * enters before every rank has entered s + 1, which each does only after it finished reading step s.
 * Every rank sums the slots in rank order, so all ranks get the same bits.
 *
 * Waiting: a spin of 5 us, then sched_yield() until 1 ms (the machine may have fewer cores than ranks and
 * threads, and a pure spin would starve the peer it waits for), then nanosleep with a backoff from 10 us to
 * 100 us (so an abort or a late peer is seen within ~0.1 ms).
 * A wait ends with an error when the group is aborted (the reason) or failed (another rank timed out), or
 * after the timeout (default 60 s, LLMC_COLLECTIVE_TIMEOUT_S): the message names the ranks that had not
 * arrived, and the group is marked failed so the other ranks stop too. A failed or aborted group stays so:
 * the supervisor makes a new one. Never a wait without end. */
#ifndef LLMC_COLLECTIVE_H
#define LLMC_COLLECTIVE_H

#include <stddef.h>
#include <stdint.h>

enum { COLL_MAGIC = 0x434d4c4c /* "LLMC" little-endian */, COLL_VERSION = 1, COLL_MAX_RANKS = 64 };
enum {
  COLL_OFF_ABORTED = 64,
  COLL_OFF_FAILED = 128,
  COLL_OFF_REASON = 192,
  COLL_OFF_FAILURE = 448,
  COLL_TEXT = 256, /* reason and failure, each with its NUL */
  COLL_OFF_RANKS = 1024,
  COLL_OFF_DESCS = 5120,
  COLL_OFF_DATA = 16384,
  COLL_LINE = 64,
};

enum { COLL_ALL_REDUCE = 0, COLL_ALL_GATHER = 1 };     /* the op */
enum { COLL_F32 = 0, COLL_F16 = 1 };                  /* the element type */
extern const char *const coll_op_names[2], *const coll_type_names[2];
#define COLL_DEFAULT_TIMEOUT_S 60.0

typedef struct CollGroup CollGroup; /* this process's mapping of one group, shared by its kernels */

/* This process's mapping of group `name` (mapped on first use, then shared and counted), claimed as `rank`
 * of `world_size`; NULL with a message in err when the group does not exist or is not llmc's, its world
 * size is not `world_size`, the rank is outside it or run by another live process, or this process
 * already runs another rank of it. */
CollGroup *coll_attach(const char *name, int64_t rank, int64_t world_size, char *err, size_t err_size);
/* one use of coll_attach given back: the last unmaps the segment and releases the rank */
void coll_detach(CollGroup *group);

/* runs task(arg, 0 .. tasks - 1), in parallel where it can; 0 on success (the op's: ONNX Runtime's ParallelFor) */
typedef int (*CollParallelFor)(void *context, void (*task)(void *, size_t), size_t tasks, void *arg);

typedef struct {
  int op, type;          /* COLL_ALL_REDUCE / COLL_ALL_GATHER, COLL_F32 / COLL_F16 */
  const void *x;         /* this rank's input: count elements */
  void *y;               /* the output: count (AllReduce) or world_size * count (AllGather) elements */
  int64_t count, width;  /* width: AllGather's last axis (x is [count / width, width]); AllReduce: 1 */
  double timeout_s;
  CollParallelFor parallel_for; /* NULL: the sum runs on the calling thread */
  void *parallel_context;
} CollCall;

/* One collective call over all ranks: 0, or -1 with a message in err (aborted, timed out, or ranks that
 * passed different ops, types or sizes: then every rank fails at the same step and the group goes on). */
int coll_run(CollGroup *group, const CollCall *call, char *err, size_t err_size);

int64_t coll_world_size(const CollGroup *group);
int64_t coll_rank(const CollGroup *group);
const char *coll_name(const CollGroup *group);

#endif
