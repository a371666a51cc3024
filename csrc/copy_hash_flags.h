/* The flags of the fused copy-and-hash loop (copy_hash_kernel.h), which copy_hash.c passes
 * through to the kernel it chose. */
#ifndef KVCKPT_COPY_HASH_FLAGS_H
#define KVCKPT_COPY_HASH_FLAGS_H
/* Write the destination with non-temporal stores. */
#define COPY_HASH_STREAM 1
/* Prefetch the source 8 KiB ahead (the CPU's own prefetcher alone without it). */
#define COPY_HASH_PREFETCH_AHEAD 2
#endif
