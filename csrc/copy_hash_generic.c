/* The fused loop with the kernel xxHash picks for the compiler's baseline target (SSE2 on
 * x86-64, NEON on AArch64, scalar elsewhere), and 16-byte non-temporal stores where SSE2 is
 * (elsewhere "streaming" is memcpy). */
#define XXH_INLINE_ALL
#include "xxhash.h"
#if defined(__SSE2__)
#define COPY_STREAM_WIDTH 16
#endif
#include "copy_stream.h"
#define COPY_HASH_FN copy_hash_generic_impl
#include "copy_hash_kernel.h"

uint64_t kvckpt_copy_hash_generic(uint8_t *out, const uint8_t *in, size_t len, int flags) {
    return copy_hash_generic_impl(out, in, len, flags);
}
void kvckpt_stream_copy_generic(uint8_t *out, const uint8_t *in, size_t len) {
    copy_stream(out, in, len);
    copy_stream_fence();
}
