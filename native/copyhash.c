/* kvbroker._copyhash: copy a range and hash it per checksum chunk in one call, without the GIL.
 *
 * The host copy engine (kvbroker/_client/engine.py) splits a big copy over threads. In
 * Python each thread handed the GIL back and forth twice per 1 MiB chunk (numpy's copy, then
 * xxhash's hash), which capped its scaling. Here a thread copies and hashes its whole range
 * in one call: the GIL is released once.
 *
 * Each chunk is copied SLICE bytes at a time and each slice hashed right after it lands,
 * while it is in L1/L2: the bytes cross memory once. XXH3's streaming form gives the same
 * value as its one-shot form (the chunk digests of kvbroker._wire.checksum, kind 1).
 *
 * Digests come back as little-endian uint64 bytes, one per chunk (the last one may be short).
 * The caller owns both buffers and must not resize or free them during the call: the Python
 * buffer protocol holds them (Py_buffer) until it returns.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
/* xxHash's own run-time dispatch (SSE2, AVX2 or AVX-512, whatever the CPU has), as
 * python-xxhash builds it: compiled for the baseline ISA, the wheel runs everywhere. */
#  include "xxh_x86dispatch.c"
#  define HASH XXH3_64bits_dispatch
#  define HASH_UPDATE XXH3_64bits_update_dispatch
#else
#  define XXH_INLINE_ALL
#  include "xxhash.h"
#  define HASH XXH3_64bits
#  define HASH_UPDATE XXH3_64bits_update
#endif

/* 64 KiB: small enough to stay in L2 between the copy and the hash on every CPU we run on,
 * large enough that XXH3's per-update overhead is noise. */
#define SLICE ((size_t)64 * 1024)

static void put_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static PyObject *digests_object(Py_ssize_t nbytes, Py_ssize_t chunk, unsigned char **out) {
    Py_ssize_t count = nbytes ? (nbytes + chunk - 1) / chunk : 0;
    PyObject *res = PyBytes_FromStringAndSize(NULL, 8 * count);
    if (res) *out = (unsigned char *)PyBytes_AS_STRING(res);
    return res;
}

static int check_chunk(Py_ssize_t chunk) {
    if (chunk <= 0) {
        PyErr_SetString(PyExc_ValueError, "chunk must be positive");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(copy_hash_doc,
"copy_hash(dst, src, chunk) -> bytes\n\n"
"Copy src into dst (C-contiguous buffers of one size, dst writable) and return the XXH3-64\n"
"of each chunk of chunk bytes of the copied bytes, as little-endian uint64 bytes.");

static PyObject *copy_hash(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    Py_ssize_t chunk;
    PyObject *res = NULL;
    unsigned char *out = NULL;
    if (!PyArg_ParseTuple(args, "w*y*n:copy_hash", &dst, &src, &chunk)) return NULL;
    if (check_chunk(chunk) < 0) goto done;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy of %zd bytes into a buffer of %zd", src.len, dst.len);
        goto done;
    }
    res = digests_object(src.len, chunk, &out);
    if (!res) goto done;
    Py_BEGIN_ALLOW_THREADS
    unsigned char *d = dst.buf;
    const unsigned char *s = src.buf;
    XXH3_state_t state;
    for (Py_ssize_t at = 0; at < src.len; at += chunk, out += 8) {
        size_t left = (size_t)((src.len - at < chunk) ? src.len - at : chunk);
        XXH3_64bits_reset(&state);
        for (size_t off = 0; off < left; off += SLICE) {
            size_t n = left - off < SLICE ? left - off : SLICE;
            memcpy(d + at + off, s + at + off, n);
            HASH_UPDATE(&state, d + at + off, n);
        }
        put_le64(out, XXH3_64bits_digest(&state));
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return res;
}

PyDoc_STRVAR(hash_chunks_doc,
"hash_chunks(view, chunk) -> bytes\n\n"
"The XXH3-64 of each chunk of chunk bytes of view (C-contiguous), as little-endian uint64\n"
"bytes.");

static PyObject *hash_chunks(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t chunk;
    PyObject *res = NULL;
    unsigned char *out = NULL;
    if (!PyArg_ParseTuple(args, "y*n:hash_chunks", &view, &chunk)) return NULL;
    if (check_chunk(chunk) < 0) goto done;
    res = digests_object(view.len, chunk, &out);
    if (!res) goto done;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *v = view.buf;
    for (Py_ssize_t at = 0; at < view.len; at += chunk, out += 8) {
        size_t n = (size_t)((view.len - at < chunk) ? view.len - at : chunk);
        put_le64(out, HASH(v + at, n));
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&view);
    return res;
}

static PyMethodDef methods[] = {
    {"copy_hash", copy_hash, METH_VARARGS, copy_hash_doc},
    {"hash_chunks", hash_chunks, METH_VARARGS, hash_chunks_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvbroker._copyhash",
    "Copy and per-chunk XXH3-64 in one call without the GIL (the host copy engine's core).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__copyhash(void) { return PyModule_Create(&module); }
