/* A copy with non-temporal stores, defined once per instruction set before copy_hash_kernel.h
 * is included: copy_stream(d, s, n) copies n bytes and copy_stream_fence() orders the stores
 * before anything written after it (another thread that then reads the destination sees it);
 * stream_stripe(d, s) copies one 64-byte stripe to a destination aligned to STREAM_ALIGN.
 * The stores need an aligned destination: the bytes before the first aligned address and
 * after the last are copied with memcpy. COPY_STREAM_WIDTH is the store's width in bytes
 * (32 with AVX2, 16 with SSE2); where neither is (non-x86), it is plain memcpy. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(COPY_STREAM_WIDTH)
#include <immintrin.h>
/* One store's width, COPY_STREAM_WIDTH bytes, to an aligned destination. */
static inline void stream_one(uint8_t *d, const uint8_t *s) {
#if COPY_STREAM_WIDTH == 32
    _mm256_stream_si256((__m256i *)d, _mm256_loadu_si256((const __m256i *)s));
#else
    _mm_stream_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s));
#endif
}
static inline void copy_stream(uint8_t *d, const uint8_t *s, size_t n) {
    size_t head = (size_t)(-(uintptr_t)d) & (COPY_STREAM_WIDTH - 1);
    if (head >= n) {
        memcpy(d, s, n);
        return;
    }
    memcpy(d, s, head);
    size_t k = head;
    for (; k + COPY_STREAM_WIDTH <= n; k += COPY_STREAM_WIDTH)
        stream_one(d + k, s + k);
    memcpy(d + k, s + k, n - k);
}
/* One 64-byte stripe to an aligned destination. */
static inline void stream_stripe(uint8_t *d, const uint8_t *s) {
    for (size_t k = 0; k < 64; k += COPY_STREAM_WIDTH)
        stream_one(d + k, s + k);
}
static inline void copy_stream_fence(void) { _mm_sfence(); }
#define STREAM_ALIGN COPY_STREAM_WIDTH
#else
static inline void copy_stream(uint8_t *d, const uint8_t *s, size_t n) { memcpy(d, s, n); }
static inline void stream_stripe(uint8_t *d, const uint8_t *s) { memcpy(d, s, 64); }
static inline void copy_stream_fence(void) {}
#define STREAM_ALIGN 1
#endif
