/* The fused copy-and-hash loop, compiled once per instruction set (copy_hash_avx2.c,
 * copy_hash_generic.c) with COPY_HASH_FN naming it, after copy_stream.h has defined that file's
 * copy with non-temporal stores. Included after xxhash.h with XXH_INLINE_ALL, whose
 * XXH3 internals it drives block by block.
 *
 * XXH3-64 (seed 0) of a long input accumulates 1 KiB blocks (16 stripes of 64 bytes), then
 * the stripes of the last partial block, then the input's last 64 bytes, and merges. This loop
 * runs the same steps, and after each stripe's step copies that stripe while it is in L1: the
 * hash reads the source from memory into the cache and the copy reads it from there, so memory
 * is read once. With COPY_HASH_PREFETCH_AHEAD in the flags the source is prefetched 8 KiB
 * ahead, which keeps the memory busy while the core hashes on some CPUs and slows the loop on
 * others, whose hardware prefetcher does better alone: kvckpt times both (_copy_ways.py).
 *
 * The copy goes out one of two ways. With ordinary stores each destination line is read into
 * the cache before it is written, so where the source is prefetched it is too. With
 * non-temporal stores (COPY_HASH_STREAM in the flags) the lines are written around the cache
 * without that read: a third less memory traffic, which on a CPU whose copy waits on memory
 * takes the hash's cost off, but the destination is not left in the cache (kvckpt streams only
 * values far larger than a core's cache, where nothing would be left anyway). The result equals
 * XXH3_64bits(src, len) either way; the module checks that against its own reference when it
 * loads (copy_hash.c) and kvckpt against python-xxhash before it uses it. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "copy_hash_flags.h"

#define COPY_HASH_PREFETCH 8192


/* How a block's copy goes out. */
enum { STORE_ORDINARY, STORE_STREAM_STRIPES, STORE_STREAM_BLOCK };

/* Hash blocks [0, blocks) into acc and copy them. Inlined once per store kind and prefetch,
 * each with its own loop: a test of the kind per stripe slowed the streaming loop measurably. */
static inline __attribute__((always_inline)) void copy_hash_blocks(
    xxh_u64 *acc, uint8_t *out, const uint8_t *in, size_t len, size_t blocks, int store,
    int prefetch) {
    const xxh_u8 *secret = XXH3_kSecret;
    size_t const secret_size = sizeof(XXH3_kSecret);
    size_t const stripes = (secret_size - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE;
    size_t const block = XXH_STRIPE_LEN * stripes;
    for (size_t n = 0; n < blocks; n++) {
        const xxh_u8 *s = in + n * block;
        xxh_u8 *d = out + n * block;
        if (prefetch && (n + 1) * block + COPY_HASH_PREFETCH <= len)
            for (size_t k = 0; k < block; k += 64) {
                __builtin_prefetch(s + COPY_HASH_PREFETCH + k, 0, 3);
                if (store == STORE_ORDINARY)
                    __builtin_prefetch(d + COPY_HASH_PREFETCH + k, 1, 3);
            }
        /* Stripe by stripe: the copy's stores leave between the hash's steps, so memory
         * takes the writes while the core hashes, not in a burst after each block. */
        for (size_t k = 0; k < stripes; k++) {
            size_t const at = k * XXH_STRIPE_LEN;
            XXH3_accumulate_512(acc, s + at, secret + k * XXH_SECRET_CONSUME_RATE);
            if (store == STORE_STREAM_STRIPES)
                stream_stripe(d + at, s + at);
            else if (store == STORE_ORDINARY)
                memcpy(d + at, s + at, XXH_STRIPE_LEN);
        }
        if (store == STORE_STREAM_BLOCK)
            copy_stream(d, s, block);
        XXH3_scrambleAcc(acc, secret + secret_size - XXH_STRIPE_LEN);
    }
    if (store != STORE_ORDINARY)
        copy_stream_fence();
}

/* Dispatch on the store kind and prefetch, each a constant in its own inlined loop. */
static inline __attribute__((always_inline)) void copy_hash_blocks_as(
    xxh_u64 *acc, uint8_t *out, const uint8_t *in, size_t len, size_t blocks, int store,
    int flags) {
    if (flags & COPY_HASH_PREFETCH_AHEAD)
        copy_hash_blocks(acc, out, in, len, blocks, store, 1);
    else
        copy_hash_blocks(acc, out, in, len, blocks, store, 0);
}

static uint64_t COPY_HASH_FN(uint8_t *out, const uint8_t *in, size_t len, int flags) {
    if (len <= XXH3_MIDSIZE_MAX) {
        memcpy(out, in, len);
        return XXH3_64bits(out, len);
    }
    const xxh_u8 *secret = XXH3_kSecret;
    size_t const secret_size = sizeof(XXH3_kSecret);
    XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    size_t const block = XXH_STRIPE_LEN * ((secret_size - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE);
    size_t const blocks = (len - 1) / block;
    /* Streaming stores need an aligned destination: where it is (a tensor's memory), each
     * stripe goes out as it is hashed; where it is not, each block, around its ends. */
    if (!(flags & COPY_HASH_STREAM))
        copy_hash_blocks_as(acc, out, in, len, blocks, STORE_ORDINARY, flags);
    else if (((uintptr_t)out & (STREAM_ALIGN - 1)) == 0)
        copy_hash_blocks_as(acc, out, in, len, blocks, STORE_STREAM_STRIPES, flags);
    else
        copy_hash_blocks_as(acc, out, in, len, blocks, STORE_STREAM_BLOCK, flags);
    size_t const done = blocks * block;
    memcpy(out + done, in + done, len - done);
    XXH3_accumulate(acc, out + done, secret, ((len - 1) - done) / XXH_STRIPE_LEN);
    XXH3_accumulate_512(acc, out + len - XXH_STRIPE_LEN,
                        secret + secret_size - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);
    return XXH3_mergeAccs(acc, secret + XXH_SECRET_MERGEACCS_START,
                          (xxh_u64)len * XXH_PRIME64_1);
}
