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
 * Buffers: any C-contiguous buffer (numpy arrays, memoryviews, mmaps); the destination must
 * be writable. They are borrowed for the call only.
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
    if (piece > 0 && dst != NULL) {
        if (state_new == NULL || (state = state_new()) == NULL) {
            PyMem_Free(digests);
            PyErr_SetString(PyExc_RuntimeError, "no streaming xxh3 bound");
            return NULL;
        }
    }
    PyThreadState *released = nbytes >= GIL_FREE_MIN ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0, at = 0; i < n; i++, at += chunk) {
        size_t len = (size_t)(nbytes - at < chunk ? nbytes - at : chunk);
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

/* Two buffers of equal length, dst writable; 0, or -1 with an exception set. */
static int
take_pair(const char *fn, PyObject *d, PyObject *s, Py_buffer *dst, Py_buffer *src)
{
    if (PyObject_GetBuffer(d, dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (PyObject_GetBuffer(s, src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(dst);
        return -1;
    }
    if (dst->len != src->len) {
        PyErr_Format(PyExc_ValueError, "%s: dst has %zd bytes, src %zd", fn, dst->len,
                     src->len);
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
"Copy src into dst (C-contiguous buffers of equal size, dst writable) chunk by chunk and\n"
"return the xxh3_64 of each copied chunk of ``chunk`` bytes (the last one may be shorter),\n"
"hashed in dst. ``piece`` > 0: each chunk copied and hashed (streaming) that many bytes at\n"
"a time. ``stream``: non-temporal stores (the hash then reads src, which holds the same\n"
"bytes). The GIL is released for the whole call (64 KiB and more).");

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
"Copy src into dst (C-contiguous buffers of equal size, dst writable); ``stream``:\n"
"non-temporal stores. The GIL is released for the whole call (64 KiB and more).");

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
"The xxh3_64 of each chunk of ``chunk`` bytes of a C-contiguous buffer (the last one may be\n"
"shorter). The GIL is released for the whole call (64 KiB and more).");

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
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    PyObject *out = run(NULL, buf.buf, buf.len, chunk, 0, 0);
    PyBuffer_Release(&buf);
    return out;
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
