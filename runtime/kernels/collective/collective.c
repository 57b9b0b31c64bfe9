/* llmc's CPU collectives (collective.h says what and why, and lays out the shared segment): this process's
 * mappings of groups, the rank claims, the barrier and its wait, and a call's steps; the sum and the gather of a
 * step's slots are collective_data.c. */
#include "collective.h"
#include "collective_data.h"

#include <errno.h>
#include <fcntl.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>


const char *const coll_op_names[2] = {"AllReduce", "AllGather"};
const char *const coll_type_names[2] = {"float", "float16"};

struct CollGroup {
  CollGroup *next;
  char name[256];
  unsigned char *base;
  size_t size;
  int64_t rank, world;
  uint64_t slot_bytes;
  int uses;              /* kernels of this process using the mapping */
  pthread_mutex_t calls; /* one collective at a time from this process: a rank has one slot and one step count */
};

/* what a rank's data in a buffer is: every rank's must match at every step */
typedef struct {
  uint32_t op, type;
  int64_t count, width;
} CollDesc;

static CollGroup *groups; /* this process's mappings, by name */
static pthread_mutex_t groups_lock = PTHREAD_MUTEX_INITIALIZER;

/* The wait's phases, by time since it began (a pause's length varies tenfold between CPUs, so not by count):
 * spin, then yield, then sleep. The spin covers ranks in step (a peer a node behind arrives within
 * microseconds); past it the peer may be off its core, and yielding lets it run. */
static const double SPIN_S = 5e-6, YIELD_S = 1e-3;
enum { CLOCK_EVERY = 32 };                     /* polls between clock reads while spinning */
enum { SLEEP_MIN_NS = 10000, SLEEP_MAX_NS = 100000 };

static _Atomic uint32_t *word(const CollGroup *g, size_t offset) { return (_Atomic uint32_t *)(g->base + offset); }
static _Atomic uint64_t *arrived(const CollGroup *g, int64_t r) {
  return (_Atomic uint64_t *)(g->base + COLL_OFF_RANKS + r * COLL_LINE);
}
static _Atomic int32_t *owner(const CollGroup *g, int64_t r) {
  return (_Atomic int32_t *)(g->base + COLL_OFF_RANKS + r * COLL_LINE + 8);
}
static CollDesc *desc(const CollGroup *g, int buffer, int64_t r) {
  return (CollDesc *)(g->base + COLL_OFF_DESCS + (buffer * COLL_MAX_RANKS + r) * COLL_LINE);
}
static unsigned char *slot(const CollGroup *g, int buffer, int64_t r) {
  return g->base + COLL_OFF_DATA + ((uint64_t)buffer * (uint64_t)g->world + (uint64_t)r) * g->slot_bytes;
}

int64_t coll_world_size(const CollGroup *g) { return g->world; }
int64_t coll_rank(const CollGroup *g) { return g->rank; }
const char *coll_name(const CollGroup *g) { return g->name; }

/* ---- attaching ---- */

/* the segment mapped and its header checked: 0, or -1 with err set */
static int map_segment(CollGroup *g, char *err, size_t n) {
  char path[sizeof g->name + 1];
  snprintf(path, sizeof path, "%s%s", g->name[0] == '/' ? "" : "/", g->name);
  int fd = shm_open(path, O_RDWR, 0);
  if (fd < 0) return snprintf(err, n, "group '%s' does not exist (shm_open: %s)", g->name, strerror(errno)), -1;
  struct stat st;
  int bad = fstat(fd, &st) || st.st_size < COLL_OFF_DATA;
  void *base = bad ? MAP_FAILED : mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED)
    return snprintf(err, n, "group '%s' could not be mapped (%s)", g->name, bad ? "too small" : strerror(errno)), -1;
  g->base = (unsigned char *)base, g->size = (size_t)st.st_size;
  const uint32_t *head = (const uint32_t *)base;
  const uint64_t *sizes = (const uint64_t *)(g->base + 16);
  g->world = head[2], g->slot_bytes = sizes[0];
  if (head[0] != COLL_MAGIC || head[1] != COLL_VERSION || g->world < 1 || g->world > COLL_MAX_RANKS ||
      !g->slot_bytes || g->slot_bytes % COLL_LINE || sizes[1] > g->size ||
      sizes[1] != COLL_OFF_DATA + 2 * (uint64_t)g->world * g->slot_bytes) {
    munmap(base, g->size);
    return snprintf(err, n, "shared memory '%s' is not an llmc collective group of version %d", g->name,
                    COLL_VERSION), -1;
  }
  return 0;
}

/* rank r claimed for this process (taken over from a process that is gone): 0, or -1 with err set */
static int claim(CollGroup *g, int64_t r, char *err, size_t n) {
  int32_t me = (int32_t)getpid(), holder = 0;
  while (!atomic_compare_exchange_strong(owner(g, r), &holder, me)) {
    if (holder == me) return 0;
    if (kill(holder, 0) == 0 || errno != ESRCH)
      return snprintf(err, n, "rank %lld of group '%s' is already run by process %d (one process per rank)",
                      (long long)r, g->name, holder), -1;
  }
  return 0;
}

/* the node's rank and world_size against group g (fresh: not yet used by this process, whose rank is then
 * claimed): 0, or -1 with err set */
static int check_node(CollGroup *g, int fresh, int64_t rank, int64_t world_size, char *err, size_t n) {
  if (world_size != g->world)
    return snprintf(err, n, "the node's world_size is %lld but group '%s' has world_size %lld", (long long)world_size,
                    g->name, (long long)g->world), -1;
  if (rank < 0 || rank >= g->world)
    return snprintf(err, n, "the node's rank is %lld, outside group '%s' of world_size %lld (ranks 0 to %lld)",
                    (long long)rank, g->name, (long long)g->world, (long long)g->world - 1), -1;
  if (!fresh && g->rank != rank)
    return snprintf(err, n, "the node's rank is %lld but this process runs rank %lld of group '%s' (one rank per "
                    "process)", (long long)rank, (long long)g->rank, g->name), -1;
  return fresh ? claim(g, rank, err, n) : 0;
}

/* a new mapping of group `name` (not yet listed): NULL with err set */
static CollGroup *map_group(const char *name, char *err, size_t n) {
  CollGroup *g = (CollGroup *)calloc(1, sizeof(CollGroup));
  if (!g) return snprintf(err, n, "out of memory"), NULL;
  snprintf(g->name, sizeof g->name, "%s", name);
  if (map_segment(g, err, n)) {
    free(g);
    return NULL;
  }
  pthread_mutex_init(&g->calls, NULL);
  return g;
}

static void unmap_group(CollGroup *g) {
  munmap(g->base, g->size);
  pthread_mutex_destroy(&g->calls);
  free(g);
}

CollGroup *coll_attach(const char *name, int64_t rank, int64_t world_size, char *err, size_t n) {
  if (!*name || strlen(name) + 1 >= sizeof ((CollGroup *)0)->name)
    return snprintf(err, n, "group name '%s' is empty or too long", name), NULL;
  pthread_mutex_lock(&groups_lock);
  CollGroup *g = groups;
  while (g && strcmp(g->name, name)) g = g->next;
  int fresh = !g;
  if (fresh) g = map_group(name, err, n);
  if (g && check_node(g, fresh, rank, world_size, err, n)) {
    if (fresh) unmap_group(g);
    g = NULL;
  }
  if (g && fresh) g->rank = rank, g->next = groups, groups = g;
  if (g) g->uses++;
  pthread_mutex_unlock(&groups_lock);
  return g;
}

void coll_detach(CollGroup *g) {
  pthread_mutex_lock(&groups_lock);
  if (--g->uses == 0) {
    CollGroup **at = &groups;
    while (*at != g) at = &(*at)->next;
    *at = g->next;
    int32_t me = (int32_t)getpid();
    atomic_compare_exchange_strong(owner(g, g->rank), &me, 0); /* the rank is free again */
    unmap_group(g);
  }
  pthread_mutex_unlock(&groups_lock);
}

/* ---- waiting ---- */

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* whether the group was aborted or failed (err says which and why) */
static int stopped(const CollGroup *g, char *err, size_t n) {
  if (atomic_load_explicit(word(g, COLL_OFF_ABORTED), memory_order_acquire)) {
    snprintf(err, n, "the group was aborted: %.*s", COLL_TEXT - 1, (const char *)g->base + COLL_OFF_REASON);
    return 1;
  }
  if (atomic_load_explicit(word(g, COLL_OFF_FAILED), memory_order_acquire) == 2) { /* 1: its message is coming */
    snprintf(err, n, "the group failed: %.*s", COLL_TEXT - 1, (const char *)g->base + COLL_OFF_FAILURE);
    return 1;
  }
  return 0;
}

/* the ranks whose arrived count is below target, as "rank 2" or "ranks 1, 2" */
static void list_missing(const CollGroup *g, uint64_t target, char *out, size_t n) {
  int count = 0;
  size_t used = 0;
  char ranks[160] = "";
  for (int64_t r = 0; r < g->world; r++)
    if (atomic_load_explicit(arrived(g, r), memory_order_acquire) < target && used < sizeof ranks - 24)
      used += (size_t)snprintf(ranks + used, sizeof ranks - used, "%s%lld", count++ ? ", " : "", (long long)r);
  snprintf(out, n, "%s %s", count > 1 ? "ranks" : "rank", ranks);
}

/* the wait timed out: err names the ranks that had not arrived; the group is marked failed (the first
 * rank to time out writes why), so the ranks still waiting elsewhere stop as well */
static int timed_out(CollGroup *g, uint64_t target, double timeout_s, char *err, size_t n) {
  char missing[192];
  list_missing(g, target, missing, sizeof missing);
  snprintf(err, n, "timed out after %g s at step %llu waiting for %s, which had not arrived (LLMC_COLLECTIVE_TIMEOUT_S "
           "sets the limit)", timeout_s, (unsigned long long)target - 1, missing);
  uint32_t idle = 0;
  if (atomic_compare_exchange_strong(word(g, COLL_OFF_FAILED), &idle, 1)) {
    snprintf((char *)g->base + COLL_OFF_FAILURE, COLL_TEXT, "rank %lld timed out after %g s waiting for %s",
             (long long)g->rank, timeout_s, missing);
    atomic_store_explicit(word(g, COLL_OFF_FAILED), 2, memory_order_release);
  }
  return -1;
}

/* until every rank's arrived count reaches target: 0, or -1 with err set (aborted, failed, timed out) */
static int wait_all(CollGroup *g, uint64_t target, double timeout_s, char *err, size_t n) {
  int64_t next = 0; /* the ranks below it have arrived */
  double start = 0;
  long sleep_ns = SLEEP_MIN_NS;
  for (unsigned polls = 0;; polls++) {
    while (next < g->world && atomic_load_explicit(arrived(g, next), memory_order_acquire) >= target) next++;
    if (next == g->world) return 0;
    if (stopped(g, err, n)) return -1;
    if (polls % CLOCK_EVERY) {
      _mm_pause();
      continue;
    }
    double t = now_s();
    if (!start) start = t;
    if (t - start > timeout_s) return timed_out(g, target, timeout_s, err, n);
    if (t - start < SPIN_S) {
      _mm_pause();
    } else if (t - start < YIELD_S) {
      sched_yield();
    } else {
      struct timespec pause = {0, sleep_ns};
      nanosleep(&pause, NULL);
      sleep_ns = sleep_ns * 2 > SLEEP_MAX_NS ? SLEEP_MAX_NS : sleep_ns * 2;
    }
  }
}

/* ---- one step, one call ---- */

/* every rank's descriptor in buffer b is this call's, else err says whose differs */
static int mismatch(const CollGroup *g, int b, const CollDesc *mine, char *err, size_t n) {
  for (int64_t q = 0; q < g->world; q++) {
    const CollDesc *d = desc(g, b, q);
    if (d->op == mine->op && d->type == mine->type && d->count == mine->count && d->width == mine->width) continue;
    snprintf(err, n, "rank %lld called %s on %lld %s elements (last axis %lld) where rank %lld called %s on %lld "
             "%s elements (last axis %lld): every rank must run the same collectives on the same shapes",
             (long long)q, coll_op_names[d->op & 1], (long long)d->count, coll_type_names[d->type & 1],
             (long long)d->width, (long long)g->rank, coll_op_names[mine->op], (long long)mine->count,
             coll_type_names[mine->type], (long long)mine->width);
    return 1;
  }
  return 0;
}

/* elements [at, at + len) of the call: written, the barrier, checked, summed or gathered */
static int step(CollGroup *g, const CollCall *c, int64_t at, int64_t len, char *err, size_t n) {
  size_t element = c->type == COLL_F16 ? 2 : 4;
  uint64_t s = atomic_load_explicit(arrived(g, g->rank), memory_order_relaxed); /* only this rank writes it */
  int b = (int)(s & 1);
  CollDesc mine = {(uint32_t)c->op, (uint32_t)c->type, c->count, c->width};
  memcpy(slot(g, b, g->rank), (const unsigned char *)c->x + at * (int64_t)element, (size_t)len * element);
  *desc(g, b, g->rank) = mine;
  atomic_store_explicit(arrived(g, g->rank), s + 1, memory_order_release);
  if (wait_all(g, s + 1, c->timeout_s, err, n) || mismatch(g, b, &mine, err, n)) return -1;
  const unsigned char *src[COLL_MAX_RANKS];
  for (int64_t q = 0; q < g->world; q++) src[q] = slot(g, b, q);
  if (c->op == COLL_ALL_REDUCE) coll_sum(c, src, (int)g->world, at, len);
  else coll_gather(c, src, (int)g->world, at, len);
  return 0;
}

int coll_run(CollGroup *g, const CollCall *c, char *err, size_t n) {
  int64_t per_chunk = (int64_t)(g->slot_bytes / (c->type == COLL_F16 ? 2 : 4));
  int64_t chunks = c->count ? (c->count + per_chunk - 1) / per_chunk : 1; /* empty: still one step, so the
                                                                             descriptors are compared */
  pthread_mutex_lock(&g->calls);
  int status = stopped(g, err, n) ? -1 : 0;
  for (int64_t k = 0; !status && k < chunks; k++) {
    int64_t at = k * per_chunk;
    status = step(g, c, at, c->count - at < per_chunk ? c->count - at : per_chunk, err, n);
  }
  pthread_mutex_unlock(&g->calls);
  return status;
}
