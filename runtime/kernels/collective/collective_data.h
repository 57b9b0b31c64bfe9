/* The data movement of one collective step (collective_data.c): `src` holds each rank's slot, in rank order, with
 * the step's elements [at, at + len) of the call; large sums and gathers go over the call's ParallelFor. */
#ifndef LLMC_COLLECTIVE_DATA_H
#define LLMC_COLLECTIVE_DATA_H

#include "collective.h"

/* y[at .. at + len) = the ranks' elementwise sum (fp16 summed in fp32, rounded once), in rank order */
void coll_sum(const CollCall *call, const unsigned char *const *src, int world, int64_t at, int64_t len);
/* the ranks' elements [at, at + len) of their [rows, width] inputs to their places in y [rows, world * width] */
void coll_gather(const CollCall *call, const unsigned char *const *src, int world, int64_t at, int64_t len);

#endif
