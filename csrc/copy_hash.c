/* kvckpt.engines._copy_hash: copy a buffer into another and return the XXH3-64 of its bytes,
 * in one pass over memory (copy_hash_kernel.h), with ordinary or non-temporal stores; and a
 * plain copy with non-temporal stores. The GIL is released while they run, so a load's two
 * copy threads run them at once. Optional: kvckpt works without it, and uses each way only
 * where timing says it is the faster (kvckpt/engines/_copy_ways.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#include "copy_hash_flags.h"

uint64_t kvckpt_copy_hash_avx2(uint8_t *out, const uint8_t *in, size_t len, int flags);
uint64_t kvckpt_copy_hash_generic(uint8_t *out, const uint8_t *in, size_t len, int flags);
void kvckpt_stream_copy_avx2(uint8_t *out, const uint8_t *in, size_t len);
void kvckpt_stream_copy_generic(uint8_t *out, const uint8_t *in, size_t len);
extern int kvckpt_copy_hash_avx2_built;

typedef uint64_t (*copy_hash_fn)(uint8_t *, const uint8_t *, size_t, int);
typedef void (*stream_copy_fn)(uint8_t *, const uint8_t *, size_t);
static copy_hash_fn copy_hash_impl = kvckpt_copy_hash_generic;
static stream_copy_fn stream_copy_impl = kvckpt_stream_copy_generic;
static const char *kernel_name = "generic";

/* dst and src of the same size, contiguous, not overlapping; on failure an exception is set,
 * both are released and 0 is returned. */
static int usable_buffers(const char *name, Py_buffer *dst, Py_buffer *src) {
    const char *problem = NULL;
    if (dst->len != src->len) {
        PyErr_Format(PyExc_ValueError, "%s: destination holds %zd bytes, source %zd", name,
                     dst->len, src->len);
    } else if (!PyBuffer_IsContiguous(dst, 'C') || !PyBuffer_IsContiguous(src, 'C')) {
        problem = "both buffers must be contiguous";
    } else {
        const char *d = dst->buf, *s = src->buf;
        if (dst->len > 0 && d < s + src->len && s < d + dst->len)
            problem = "the buffers overlap";
        else
            return 1;
    }
    if (problem != NULL)
        PyErr_Format(PyExc_ValueError, "%s: %s", name, problem);
    PyBuffer_Release(dst);
    PyBuffer_Release(src);
    return 0;
}

static PyObject *copy_hash(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    int stream = 0, prefetch = 1;
    if (!PyArg_ParseTuple(args, "w*y*|pp:copy_hash", &dst, &src, &stream, &prefetch))
        return NULL;
    int const flags =
        (stream ? COPY_HASH_STREAM : 0) | (prefetch ? COPY_HASH_PREFETCH_AHEAD : 0);
    if (!usable_buffers("copy_hash", &dst, &src))
        return NULL;
    uint64_t digest;
    Py_BEGIN_ALLOW_THREADS
    digest = copy_hash_impl((uint8_t *)dst.buf, (const uint8_t *)src.buf, (size_t)src.len,
                            flags);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLongLong(digest);
}

static PyObject *stream_copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*:stream_copy", &dst, &src))
        return NULL;
    if (!usable_buffers("stream_copy", &dst, &src))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    stream_copy_impl((uint8_t *)dst.buf, (const uint8_t *)src.buf, (size_t)src.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

/* The kernel must give XXH3_64bits of every length class (short, mid, one block, blocks with
 * a partial tail, exact blocks) and copy every byte, with either kind of store, with and
 * without prefetching, and a destination at any alignment. A kernel that does not is not
 * used. */
static int kernel_agrees(copy_hash_fn fn, stream_copy_fn copy) {
    static const size_t lengths[] = {0, 1, 17, 129, 240, 241, 1023, 1024, 1025, 2048,
                                     4096 + 63, 9000, 16384, 65536 + 7};
    size_t const most = 65536 + 7;
    uint8_t *src = PyMem_Malloc(most), *dst = PyMem_Malloc(most + 64);
    int ok = src != NULL && dst != NULL;
    for (size_t i = 0; ok && i < most; i++)
        src[i] = (uint8_t)(i * 2654435761u >> 13);
    for (size_t k = 0; ok && k < sizeof lengths / sizeof lengths[0]; k++) {
        size_t n = lengths[k];
        for (int flags = 0; ok && flags < 4; flags++)
            for (size_t shift = 0; ok && shift < 64; shift += 13) {
                memset(dst, 0, most + 64);
                ok = fn(dst + shift, src, n, flags) == XXH3_64bits(src, n) &&
                     memcmp(dst + shift, src, n) == 0;
            }
        for (size_t shift = 0; ok && shift < 64; shift += 13) {
            memset(dst, 0, most + 64);
            copy(dst + shift, src, n);
            ok = memcmp(dst + shift, src, n) == 0;
        }
    }
    PyMem_Free(src);
    PyMem_Free(dst);
    return ok;
}

static PyObject *kernel(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(kernel_name);
}

static PyMethodDef methods[] = {
    {"copy_hash", copy_hash, METH_VARARGS,
     "copy_hash(dst, src, stream=False, prefetch=True) -> int: copy src into dst (same size, "
     "not overlapping) and return XXH3-64 (seed 0) of the bytes, reading memory once; with "
     "stream, write dst with non-temporal stores; with prefetch, prefetch src ahead. Releases "
     "the GIL."},
    {"stream_copy", stream_copy, METH_VARARGS,
     "stream_copy(dst, src) -> None: copy src into dst (same size, not overlapping) with "
     "non-temporal stores. Releases the GIL."},
    {"kernel", kernel, METH_NOARGS, "kernel() -> str: the instruction set copy_hash uses."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copy_hash",
    "Copy a buffer and hash it with XXH3-64 in one pass over memory.", -1, methods,
};

PyMODINIT_FUNC PyInit__copy_hash(void) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    if (kvckpt_copy_hash_avx2_built && __builtin_cpu_supports("avx2") &&
        kernel_agrees(kvckpt_copy_hash_avx2, kvckpt_stream_copy_avx2)) {
        copy_hash_impl = kvckpt_copy_hash_avx2;
        stream_copy_impl = kvckpt_stream_copy_avx2;
        kernel_name = "avx2";
    }
#endif
    if (copy_hash_impl == kvckpt_copy_hash_generic &&
        !kernel_agrees(kvckpt_copy_hash_generic, kvckpt_stream_copy_generic)) {
        PyErr_SetString(PyExc_ImportError,
                        "kvckpt.engines._copy_hash: the compiled kernel disagrees with XXH3");
        return NULL;
    }
    return PyModule_Create(&module);
}
