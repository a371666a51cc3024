/* The fused loop with xxHash's AVX2 kernel and 32-byte non-temporal stores; called only where
 * the CPU has AVX2 (copy_hash.c). GCC only: clang ignores `#pragma GCC target`, so there this
 * file builds the stub and the generic kernel (SSE2) is used, as kernel() then says. */
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#pragma GCC target("avx2,prfchw")
#define XXH_INLINE_ALL
#include "xxhash.h"
#define COPY_STREAM_WIDTH 32
#include "copy_stream.h"
#define COPY_HASH_FN copy_hash_avx2_impl
#include "copy_hash_kernel.h"

uint64_t kvckpt_copy_hash_avx2(uint8_t *out, const uint8_t *in, size_t len, int flags) {
    return copy_hash_avx2_impl(out, in, len, flags);
}
void kvckpt_stream_copy_avx2(uint8_t *out, const uint8_t *in, size_t len) {
    copy_stream(out, in, len);
    copy_stream_fence();
}
int kvckpt_copy_hash_avx2_built = 1;
#else
#include <stddef.h>
#include <stdint.h>
uint64_t kvckpt_copy_hash_avx2(uint8_t *out, const uint8_t *in, size_t len, int flags) {
    (void)out, (void)in, (void)len, (void)flags;
    return 0;
}
void kvckpt_stream_copy_avx2(uint8_t *out, const uint8_t *in, size_t len) {
    (void)out, (void)in, (void)len;
}
int kvckpt_copy_hash_avx2_built = 0;
#endif
