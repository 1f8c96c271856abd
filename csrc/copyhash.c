/* kvbroker._copyhash: the host copy engine's inner loops, one GIL release per range.
 *
 * The engine (kvbroker/_client/engine.py) splits a copy into one byte range per thread. In
 * Python each range is a loop over 1 MiB chunks that hands the GIL back and forth twice per
 * chunk (numpy's copy, then the hash): on an H100 host's 16 cores those hand-offs held a fused
 * copy+hash on 8 threads to 0.57x of a plain 8-thread memcpy. Here a range is one call: the
 * GIL is released once, each chunk is copied with memcpy and hashed right after, while it is
 * still in cache, and the digests come back as a list.
 *
 * The hash is python-xxhash's own xxh3_64: bind_hash() looks up the function in its
 * extension module (XXH3_64bits_dispatch, xxHash's run-time choice of AVX2 / AVX-512 that
 * its x86-64 wheels carry from 4.1 on; else XXH3_64bits). The digests are therefore those
 * of xxhash.xxh3_64_intdigest by construction, and as fast; kvbroker/_client/engine.py
 * binds it at import and checks a few digests against xxhash's before using the loops.
 *
 * Buffers: any C-contiguous buffer (numpy arrays, memoryviews, mmaps) of plain data, of any
 * item type (moved and hashed as bytes), but none that holds Python objects (format 'O':
 * numpy's object arrays), whose copy would duplicate references it does not count; the
 * destination must be writable and must not overlap the source (a chunked copy and its
 * digests would read bytes it had already overwritten): TypeError, ValueError. They are
 * borrowed for the call only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

typedef uint64_t (*hash_fn)(const void *input, size_t len);
static hash_fn chunk_hash = NULL;
/* xxHash's streaming API, for a chunk copied and hashed a piece at a time */
static void *(*state_new)(void) = NULL;
static int (*state_free)(void *state) = NULL;
static int (*state_reset)(void *state) = NULL;
static int (*state_update)(void *state, const void *input, size_t len) = NULL;
static uint64_t (*state_digest)(const void *state) = NULL;

/* Below this many bytes the call keeps the GIL: releasing and taking it back costs more. */
#define GIL_FREE_MIN (64 * 1024)

/* stream=True copies store with non-temporal (streaming) stores: the destination's lines are
 * written to memory without first being read into the cache, and without evicting what the
 * cache holds (this process's and the daemon's working sets, which the next request needs).
 * A copy then moves each byte twice over the memory bus (read, write) instead of three times
 * (read, read-for-ownership, write back). The engine asks for it on copies too big to stay
 * in cache anyway (kvbroker/_client/engine.py, STREAM_MIN); glibc's memcpy switches to such
 * stores only past a threshold of its own, per call, that a copy split into chunks and
 * threads never reaches. The hash then reads the source, which the copy just loaded. */
#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAM 1
static void
stream_copy(char *dst, const char *src, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)dst & 63); /* to the destination's next cache line */
    if (n < head + 64) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
}
/* Streaming stores are weakly ordered: fence them before anyone is told the copy is done. */
#define STREAM_FENCE() _mm_sfence()
#else
#define HAVE_STREAM 0
#define stream_copy(dst, src, n) memcpy((dst), (src), (n))
#define STREAM_FENCE() ((void)0)
#endif

/* One pass instead of two: each 64-byte stripe is loaded once, stored to the destination and
 * fed to xxh3_64's accumulators from the same registers, so the hash costs no second read
 * (from cache or memory) and its arithmetic overlaps the copy's memory stalls. On an H100
 * host's cores a chunk copied and then hashed ran at 0.74x of a memcpy on one thread and
 * 0.76x on eight (at d92d877): the hash's own pass. In one pass, 0.76-0.86x on one thread;
 * on eight, where memory bandwidth is the limit, no faster than two passes
 * (benchmarks/results/host-copy-h100-host.md and its history).
 *
 * The digest is xxh3_64 (seed 0, default secret) of a long input (more than 240 bytes), as
 * xxHash's specification (doc/xxhash_spec.md, "XXH3 algorithm", long inputs) defines it and
 * kvbroker/_client/gpu_checksum.py computes it on GPUs: 8 lanes accumulate 64-byte stripes
 * keyed by the secret at 8-byte steps, scrambled after each 1 KiB block (16 stripes); then
 * the last block's whole stripes, the input's last 64 bytes keyed at secret + 121, and the
 * merge keyed at secret + 11. bind_hash() checks it against xxHash's own function before the
 * loops use it (fused_ok), and engine.py checks the loops' digests again at import. AVX2 only
 * (chosen at run time): elsewhere the two-pass path runs. */
static const unsigned char XXH3_SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
#define XXH_P32_1 0x9E3779B1U
#define XXH_P32_2 0x85EBCA77U
#define XXH_P32_3 0xC2B2AE3DU
#define XXH_P64_1 0x9E3779B185EBCA87ULL
#define XXH_P64_2 0xC2B2AE3D27D4EB4FULL
#define XXH_P64_3 0x165667B19E3779F9ULL
#define XXH_P64_4 0x85EBCA77C2B2AE63ULL
#define XXH_P64_5 0x27D4EB2F165667C5ULL
#define XXH_MX1 0x165667919E3779F9ULL
#define XXH_STRIPE 64
#define XXH_BLOCK 1024 /* 16 stripes: (192 - 64) / 8 */
#define XXH_LONG_MIN 241

static uint64_t
read64(const void *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* x86-64: little-endian, any alignment */
    return v;
}

static uint64_t
mul128_fold64(uint64_t a, uint64_t b)
{
    __uint128_t m = (__uint128_t)a * b;
    return (uint64_t)m ^ (uint64_t)(m >> 64);
}

/* the merge of the 8 accumulators into the digest of a long input of len bytes */
static uint64_t
xxh3_merge(const uint64_t acc[8], size_t len)
{
    uint64_t r = (uint64_t)len * XXH_P64_1;
    for (int i = 0; i < 4; i++)
        r += mul128_fold64(acc[2 * i] ^ read64(XXH3_SECRET + 11 + 16 * i),
                           acc[2 * i + 1] ^ read64(XXH3_SECRET + 11 + 16 * i + 8));
    r ^= r >> 37;
    r *= XXH_MX1;
    return r ^ (r >> 32);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_FUSED 1

/* one stripe: acc[i] += (lo32(d ^ k) * hi32(d ^ k)) + d[i ^ 1], lanes 0-3 and 4-7 */
#define XXH3_STRIPE_AVX2(a0, a1, d0, d1, key)                                                     \
    do {                                                                                           \
        __m256i k0_ = _mm256_loadu_si256((const __m256i *)(key));                                 \
        __m256i k1_ = _mm256_loadu_si256((const __m256i *)((key) + 32));                          \
        __m256i x0_ = _mm256_xor_si256((d0), k0_);                                                 \
        __m256i x1_ = _mm256_xor_si256((d1), k1_);                                                 \
        __m256i p0_ = _mm256_mul_epu32(x0_, _mm256_srli_epi64(x0_, 32));                          \
        __m256i p1_ = _mm256_mul_epu32(x1_, _mm256_srli_epi64(x1_, 32));                          \
        (a0) = _mm256_add_epi64((a0), _mm256_add_epi64(p0_, _mm256_shuffle_epi32((d0), 0x4e)));   \
        (a1) = _mm256_add_epi64((a1), _mm256_add_epi64(p1_, _mm256_shuffle_epi32((d1), 0x4e)));   \
    } while (0)

__attribute__((target("avx2"))) static inline __m256i
xxh3_scramble_avx2(__m256i a, const unsigned char *key)
{
    __m256i p = _mm256_set1_epi64x(XXH_P32_1);
    a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
    a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)key));
    __m256i lo = _mm256_mul_epu32(a, p);
    __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), p);
    return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

/* Copy len (> 240) bytes from src to dst and return their xxh3_64, in one pass. dst NULL:
 * hash only. stream: non-temporal stores where dst is 32-byte aligned (the caller fences). */
__attribute__((target("avx2"))) static uint64_t
copy_xxh3_avx2(char *dst, const char *src, size_t len, int stream)
{
    __m256i a0 = _mm256_setr_epi64x(XXH_P32_3, XXH_P64_1, XXH_P64_2, XXH_P64_3);
    __m256i a1 = _mm256_setr_epi64x(XXH_P64_4, XXH_P32_2, XXH_P64_5, XXH_P32_1);
    size_t blocks = (len - 1) / XXH_BLOCK;
    size_t stripes = ((len - 1) - blocks * XXH_BLOCK) / XXH_STRIPE; /* of the last block */
    size_t body = blocks * XXH_BLOCK + stripes * XXH_STRIPE;        /* bytes the loops see */
    int nt = stream && dst != NULL && ((uintptr_t)dst & 31) == 0;
#define XXH3_STORE(off, d0, d1)                                                                 \
    do {                                                                                         \
        if (nt) {                                                                                \
            _mm256_stream_si256((__m256i *)(dst + (off)), (d0));                                 \
            _mm256_stream_si256((__m256i *)(dst + (off) + 32), (d1));                            \
        } else if (dst != NULL) {                                                                \
            _mm256_storeu_si256((__m256i *)(dst + (off)), (d0));                                 \
            _mm256_storeu_si256((__m256i *)(dst + (off) + 32), (d1));                            \
        }                                                                                        \
    } while (0)
    for (size_t b = 0; b < blocks; b++) {
        size_t base = b * XXH_BLOCK;
        for (int s = 0; s < 16; s++) {
            size_t off = base + (size_t)s * XXH_STRIPE;
            __m256i d0 = _mm256_loadu_si256((const __m256i *)(src + off));
            __m256i d1 = _mm256_loadu_si256((const __m256i *)(src + off + 32));
            XXH3_STORE(off, d0, d1);
            XXH3_STRIPE_AVX2(a0, a1, d0, d1, XXH3_SECRET + 8 * s);
        }
        a0 = xxh3_scramble_avx2(a0, XXH3_SECRET + 128);
        a1 = xxh3_scramble_avx2(a1, XXH3_SECRET + 160);
    }
    for (size_t s = 0; s < stripes; s++) {
        size_t off = blocks * XXH_BLOCK + s * XXH_STRIPE;
        __m256i d0 = _mm256_loadu_si256((const __m256i *)(src + off));
        __m256i d1 = _mm256_loadu_si256((const __m256i *)(src + off + 32));
        XXH3_STORE(off, d0, d1);
        XXH3_STRIPE_AVX2(a0, a1, d0, d1, XXH3_SECRET + 8 * s);
    }
#undef XXH3_STORE
    if (dst != NULL)
        memcpy(dst + body, src + body, len - body); /* 1 to 64 bytes */
    const char *last = src + len - XXH_STRIPE; /* may overlap what the loops saw */
    __m256i d0 = _mm256_loadu_si256((const __m256i *)last);
    __m256i d1 = _mm256_loadu_si256((const __m256i *)(last + 32));
    XXH3_STRIPE_AVX2(a0, a1, d0, d1, XXH3_SECRET + 121);
    uint64_t acc[8];
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
    return xxh3_merge(acc, len);
}

/* whether the fused loop runs here (AVX2, and its digests are xxHash's: bind_hash checks) */
static int fused_ok = 0;
#else
#define HAVE_FUSED 0
static int fused_ok = 0;
static uint64_t
copy_xxh3_avx2(char *dst, const char *src, size_t len, int stream)
{
    (void)dst; (void)src; (void)len; (void)stream;
    return 0;
}
#endif

static int
take_chunk(PyObject *arg, Py_ssize_t *chunk)
{
    *chunk = PyLong_AsSsize_t(arg);
    if (*chunk == -1 && PyErr_Occurred())
        return -1;
    if (*chunk <= 0) {
        PyErr_SetString(PyExc_ValueError, "chunk must be a positive number of bytes");
        return -1;
    }
    return 0;
}

static PyObject *
digest_list(const unsigned long long *digests, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(digests[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* The work of copy_hashed and hash_chunks: dst NULL hashes src in place. piece > 0: each
 * chunk copied and hashed (streaming) piece bytes at a time. stream: non-temporal stores,
 * and the hash reads the source (in cache: the copy just loaded it). */
static PyObject *
run(char *dst, const char *src, Py_ssize_t nbytes, Py_ssize_t chunk, Py_ssize_t piece,
    int stream)
{
    if (chunk_hash == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bind_hash() first");
        return NULL;
    }
    Py_ssize_t n = nbytes ? (nbytes - 1) / chunk + 1 : 0;
    unsigned long long *digests = PyMem_Malloc((n ? n : 1) * sizeof *digests);
    if (digests == NULL)
        return PyErr_NoMemory();
    void *state = NULL;
    int fused = fused_ok && dst != NULL; /* one pass: pieces need no streaming state */
    if (piece > 0 && dst != NULL && !fused) {
        if (state_new == NULL || (state = state_new()) == NULL) {
            PyMem_Free(digests);
            PyErr_SetString(PyExc_RuntimeError, "no streaming xxh3 bound");
            return NULL;
        }
    }
    PyThreadState *released = nbytes >= GIL_FREE_MIN ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0, at = 0; i < n; i++, at += chunk) {
        size_t len = (size_t)(nbytes - at < chunk ? nbytes - at : chunk);
        /* streaming stores want a 32-byte aligned destination: else the two-pass
         * stream_copy, which peels a head to reach alignment */
        if (fused && len >= XXH_LONG_MIN && !(stream && ((uintptr_t)(dst + at) & 31))) {
            digests[i] = (unsigned long long)copy_xxh3_avx2(dst + at, src + at, len, stream);
            continue;
        }
        if (state != NULL) {
            state_reset(state);
            for (size_t off = 0; off < len; off += (size_t)piece) {
                size_t plen = len - off < (size_t)piece ? len - off : (size_t)piece;
                char *to = dst + at + off;
                const char *from = src + at + off;
                if (stream) {
                    stream_copy(to, from, plen);
                    state_update(state, from, plen);
                } else {
                    memcpy(to, from, plen);
                    state_update(state, to, plen);
                }
            }
            digests[i] = (unsigned long long)state_digest(state);
            continue;
        }
        const char *bytes = src + at;
        if (dst != NULL) {
            if (stream) {
                stream_copy(dst + at, bytes, len);
            } else {
                memcpy(dst + at, bytes, len);
                bytes = dst + at; /* hash what landed, while it is in cache */
            }
        }
        digests[i] = (unsigned long long)chunk_hash(bytes, len);
    }
    if (stream)
        STREAM_FENCE();
    if (released != NULL)
        PyEval_RestoreThread(released);
    if (state != NULL)
        state_free(state);
    PyObject *out = digest_list(digests, n);
    PyMem_Free(digests);
    return out;
}

/* Whether a buffer's struct format holds a Python object ('O' outside a field's :name:). */
static int
holds_objects(const char *format)
{
    int in_name = 0;
    for (const char *c = format; c != NULL && *c; c++) {
        if (*c == ':')
            in_name = !in_name;
        else if (*c == 'O' && !in_name)
            return 1;
    }
    return 0;
}

/* A C-contiguous buffer of plain data (writable if asked); 0, or -1 with an exception set. */
static int
take_data(const char *fn, PyObject *o, Py_buffer *view, int writable)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, view, flags) < 0)
        return -1;
    if (holds_objects(view->format)) {
        PyErr_Format(PyExc_TypeError, "%s: a buffer of Python objects (format '%s') is not "
                     "plain data", fn, view->format);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Two buffers of plain data of equal length, dst writable, not overlapping; 0, or -1 with
 * an exception set. */
static int
take_pair(const char *fn, PyObject *d, PyObject *s, Py_buffer *dst, Py_buffer *src)
{
    if (take_data(fn, d, dst, 1) < 0)
        return -1;
    if (take_data(fn, s, src, 0) < 0) {
        PyBuffer_Release(dst);
        return -1;
    }
    const char *why = NULL;
    uintptr_t d0 = (uintptr_t)dst->buf, s0 = (uintptr_t)src->buf;
    if (dst->len != src->len)
        why = "sizes";
    else if (src->len > 0 && d0 < s0 + (uintptr_t)src->len && s0 < d0 + (uintptr_t)dst->len)
        why = "overlap";
    if (why != NULL) {
        if (why[0] == 's')
            PyErr_Format(PyExc_ValueError, "%s: dst has %zd bytes, src %zd", fn, dst->len,
                         src->len);
        else
            PyErr_Format(PyExc_ValueError, "%s: dst and src overlap (%zd bytes at %zd bytes "
                         "apart): copy through a separate buffer", fn, src->len,
                         (Py_ssize_t)(d0 > s0 ? d0 - s0 : s0 - d0));
        PyBuffer_Release(src);
        PyBuffer_Release(dst);
        return -1;
    }
    return 0;
}

static int
take_flag(PyObject *arg, int *flag)
{
    *flag = PyObject_IsTrue(arg);
    return *flag < 0 ? -1 : 0;
}

PyDoc_STRVAR(copy_hashed_doc,
"copy_hashed(dst, src, chunk, piece=0, stream=False) -> list[int]\n\n"
"Copy src into dst (C-contiguous buffers of plain data of equal size, dst writable, the two\n"
"not overlapping) chunk by chunk and return the xxh3_64 of each copied chunk of ``chunk``\n"
"bytes (the last one may be shorter), hashed in dst. ``piece`` > 0: each chunk copied and\n"
"hashed (streaming) that many bytes at a time. ``stream``: non-temporal stores (the hash\n"
"then reads src, which holds the same bytes). The GIL is released for the whole call\n"
"(64 KiB and more).");

static PyObject *
copy_hashed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer dst, src;
    Py_ssize_t chunk, piece = 0;
    int stream = 0;
    if (nargs < 3 || nargs > 5) {
        PyErr_SetString(PyExc_TypeError,
                        "copy_hashed(dst, src, chunk[, piece[, stream]]) takes 3 to 5 arguments");
        return NULL;
    }
    if (take_chunk(args[2], &chunk) < 0)
        return NULL;
    if (nargs >= 4) { /* 0: whole chunks */
        piece = PyLong_AsSsize_t(args[3]);
        if (piece == -1 && PyErr_Occurred())
            return NULL;
        if (piece < 0) {
            PyErr_SetString(PyExc_ValueError, "piece must be 0 (whole chunks) or more bytes");
            return NULL;
        }
    }
    if (nargs == 5 && take_flag(args[4], &stream) < 0)
        return NULL;
    if (take_pair("copy_hashed", args[0], args[1], &dst, &src) < 0)
        return NULL;
    PyObject *out = run(dst.buf, src.buf, src.len, chunk, piece, stream);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return out;
}

PyDoc_STRVAR(copy_doc,
"copy(dst, src, stream=False) -> None\n\n"
"Copy src into dst (C-contiguous buffers of plain data of equal size, dst writable, the two\n"
"not overlapping); ``stream``: non-temporal stores. The GIL is released for the whole call (64 KiB and more).");

static PyObject *
copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer dst, src;
    int stream = 0;
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy(dst, src[, stream]) takes 2 or 3 arguments");
        return NULL;
    }
    if (nargs == 3 && take_flag(args[2], &stream) < 0)
        return NULL;
    if (take_pair("copy", args[0], args[1], &dst, &src) < 0)
        return NULL;
    size_t n = (size_t)src.len;
    PyThreadState *released = src.len >= GIL_FREE_MIN ? PyEval_SaveThread() : NULL;
    if (stream) {
        stream_copy(dst.buf, src.buf, n);
        STREAM_FENCE();
    } else {
        memcpy(dst.buf, src.buf, n);
    }
    if (released != NULL)
        PyEval_RestoreThread(released);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(hash_chunks_doc,
"hash_chunks(buf, chunk) -> list[int]\n\n"
"The xxh3_64 of each chunk of ``chunk`` bytes of a C-contiguous buffer of plain data (the\n"
"last one may be shorter). The GIL is released for the whole call (64 KiB and more).");

static PyObject *
hash_chunks(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer buf;
    Py_ssize_t chunk;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "hash_chunks(buf, chunk) takes 2 arguments");
        return NULL;
    }
    if (take_chunk(args[1], &chunk) < 0)
        return NULL;
    if (take_data("hash_chunks", args[0], &buf, 0) < 0)
        return NULL;
    PyObject *out = run(NULL, buf.buf, buf.len, chunk, 0, 0);
    PyBuffer_Release(&buf);
    return out;
}

/* What bind_hash found of the one-pass loop (fused_state() names it). */
enum fused_verdict {
    FUSED_UNBOUND,    /* bind_hash not called yet */
    FUSED_CHECKED,    /* this CPU runs it and its digests are xxHash's */
    FUSED_NOT_BUILT,  /* not compiled for this architecture or compiler */
    FUSED_NO_AVX2,    /* this CPU lacks AVX2 */
    FUSED_DIFFERS,    /* its digests differ from the bound xxh3_64's: a bug, never used */
    FUSED_NO_MEMORY,  /* the check could not allocate its buffers */
};
static int fused_verdict = FUSED_UNBOUND;
static int fused_wanted = 1; /* use_fused(): off for an A/B, on by default */

/* Whether the fused loop runs on this CPU and gives xxHash's digests: every long-input case
 * (one stripe past 240 bytes, whole blocks, a block plus stripes, a partial last stripe, 1 MiB
 * and an odd length past it) against the bound chunk_hash, copied and hash-only. Returns an
 * enum fused_verdict. */
static int
fused_matches(void)
{
#if HAVE_FUSED
    if (!__builtin_cpu_supports("avx2"))
        return FUSED_NO_AVX2;
    static const size_t lens[] = {241, 255, 256, 1023, 1024, 1025, 1088, 2047, 4103,
                                  (1 << 20), (1 << 20) + 4097};
    size_t most = (1 << 20) + 4097, pad = 64; /* cases start up to 10 bytes in: room */
    unsigned char *src = PyMem_RawMalloc(most + pad), *raw = PyMem_RawMalloc(most + 2 * pad);
    int ok = src != NULL && raw != NULL;
    /* a 64-byte aligned destination, so the streaming stores' branch is checked too */
    unsigned char *dst = raw ? raw + (-(uintptr_t)raw & 63) : NULL;
    uint64_t x = 0x9E3779B97F4A7C15ULL;
    for (size_t i = 0; ok && i < most + pad; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17; /* xorshift: every byte value */
        src[i] = (unsigned char)x;
    }
    for (size_t k = 0; ok && k < sizeof lens / sizeof *lens; k++) {
        uint64_t want = chunk_hash(src + k, lens[k]); /* odd source offsets too */
        ok = copy_xxh3_avx2(NULL, (char *)src + k, lens[k], 0) == want
             && copy_xxh3_avx2((char *)dst, (char *)src + k, lens[k], 1) == want
             && memcmp(dst, src + k, lens[k]) == 0
             && copy_xxh3_avx2((char *)dst + 1, (char *)src + k, lens[k], 0) == want
             && memcmp(dst + 1, src + k, lens[k]) == 0;
    }
    STREAM_FENCE();
    int allocated = src != NULL && raw != NULL;
    PyMem_RawFree(src);
    PyMem_RawFree(raw);
    return !allocated ? FUSED_NO_MEMORY : ok ? FUSED_CHECKED : FUSED_DIFFERS;
#else
    return FUSED_NOT_BUILT;
#endif
}

PyDoc_STRVAR(use_fused_doc,
"use_fused([flag]) -> bool\n\n"
"Whether copies that hash run in one pass (each stripe copied and hashed from the same\n"
"registers: AVX2, checked against the bound xxh3_64 by bind_hash) or in two (copy, then\n"
"xxHash's own hash). ``flag`` False: two from now on; True: one where this CPU and\n"
"bind_hash allow; none: unchanged. Returns what is in force. For A/B measurements: the\n"
"default is one pass wherever it runs.");

static PyObject *
use_fused(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "use_fused([flag]) takes at most 1 argument");
        return NULL;
    }
    if (nargs == 1) {
        int flag = PyObject_IsTrue(args[0]);
        if (flag < 0)
            return NULL;
        fused_wanted = flag;
        fused_ok = fused_wanted && fused_verdict == FUSED_CHECKED;
    }
    return PyBool_FromLong(fused_ok);
}

PyDoc_STRVAR(fused_state_doc,
"fused_state() -> str\n\n"
"Why copies that hash run in one pass or not: 'one pass', 'off' (use_fused(False)),\n"
"'no AVX2', 'digests differ' (the one-pass loop disagreed with xxHash when bound: a bug,\n"
"so it is not used), 'not built' (another architecture or compiler), 'unchecked' (its\n"
"check could not allocate memory) or 'not bound' (bind_hash not called yet).");

static PyObject *
fused_state(PyObject *self, PyObject *unused)
{
    static const char *names[] = {"not bound", "one pass", "not built", "no AVX2",
                                  "digests differ", "unchecked"};
    if (fused_verdict == FUSED_CHECKED && !fused_wanted)
        return PyUnicode_FromString("off");
    return PyUnicode_FromString(names[fused_verdict]);
}

PyDoc_STRVAR(bind_hash_doc,
"bind_hash(path) -> str\n\n"
"Hash with the xxh3_64 of the shared library at ``path`` (python-xxhash's extension\n"
"module, already loaded): XXH3_64bits_dispatch where it has one, else XXH3_64bits.\n"
"Returns the symbol's name; OSError when neither is found.");

static PyObject *
bind_hash(PyObject *self, PyObject *arg)
{
    PyObject *encoded;
    if (!PyUnicode_FSConverter(arg, &encoded))
        return NULL;
    /* RTLD_NOLOAD: only a library this process has loaded (import xxhash did) */
    void *lib = dlopen(PyBytes_AS_STRING(encoded), RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(encoded);
    if (lib == NULL)
        return PyErr_Format(PyExc_OSError, "bind_hash: %s", dlerror());
    static const char *const names[] = {"XXH3_64bits_dispatch", "XXH3_64bits"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        void *fn = dlsym(lib, names[i]);
        if (fn != NULL) {
            chunk_hash = (hash_fn)fn; /* the library stays loaded: dlclose drops our count */
            state_new = (void *(*)(void))dlsym(lib, "XXH3_createState");
            state_free = (int (*)(void *))dlsym(lib, "XXH3_freeState");
            state_reset = (int (*)(void *))dlsym(lib, "XXH3_64bits_reset");
            state_update = (int (*)(void *, const void *, size_t))dlsym(lib, "XXH3_64bits_update_dispatch");
            if (state_update == NULL)
                state_update = (int (*)(void *, const void *, size_t))dlsym(lib, "XXH3_64bits_update");
            state_digest = (uint64_t (*)(const void *))dlsym(lib, "XXH3_64bits_digest");
            if (!state_free || !state_reset || !state_update || !state_digest)
                state_new = NULL;
            dlclose(lib);
            fused_verdict = fused_matches();
            fused_ok = fused_wanted && fused_verdict == FUSED_CHECKED; /* use_fused() kept */
            return PyUnicode_FromString(names[i]);
        }
    }
    dlclose(lib);
    PyErr_SetString(PyExc_OSError, "bind_hash: no XXH3_64bits_dispatch or XXH3_64bits there");
    return NULL;
}

static PyMethodDef methods[] = {
    {"bind_hash", bind_hash, METH_O, bind_hash_doc},
    {"copy_hashed", (PyCFunction)(void (*)(void))copy_hashed, METH_FASTCALL, copy_hashed_doc},
    {"hash_chunks", (PyCFunction)(void (*)(void))hash_chunks, METH_FASTCALL, hash_chunks_doc},
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL, copy_doc},
    {"use_fused", (PyCFunction)(void (*)(void))use_fused, METH_FASTCALL, use_fused_doc},
    {"fused_state", fused_state, METH_NOARGS, fused_state_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copyhash",
    "The host copy engine's inner loops in C: one GIL release per range (copyhash.c).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__copyhash(void)
{
    PyObject *m = PyModule_Create(&module);
    /* whether stream=True stores non-temporally here (else it is a plain memcpy) */
    if (m != NULL && PyModule_AddIntConstant(m, "STREAM_STORES", HAVE_STREAM) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
