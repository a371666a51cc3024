/* The fused loop with the kernel xxHash picks for the compiler's baseline target (SSE2 on
 * x86-64, NEON on AArch64, scalar elsewhere). */
#define XXH_INLINE_ALL
#include "xxhash.h"
#define COPY_HASH_FN copy_hash_generic_impl
#include "copy_hash_kernel.h"

uint64_t kvckpt_copy_hash_generic(uint8_t *out, const uint8_t *in, size_t len) {
    return copy_hash_generic_impl(out, in, len);
}
