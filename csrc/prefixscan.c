/* kvbroker._prefixscan: a prefix match's per-block passes in one C loop each.
 *
 * A match_prefix of N blocks (kvbroker/_server/prefix_leases.py) looks up N keys, then reads
 * every matched block several times: its parent (are the blocks chains?), its recency (set),
 * its shape (do all blocks have the same buffer names and size?) and its packed extent row
 * (joined into the reply). In Python each is a pass of C-driven iterators costing ~30 ns a
 * block (512 blocks: ~15 us a pass, ~90 us a match on the 2-core VM); here each block is
 * read once.
 *
 * Both functions have a Python twin in prefix_leases.py with the same contract, used where
 * this module is not built; tests/test_prefix_scan.py checks that the two agree.
 *
 * run(space, keys) -> list
 *     The values of space (a dict) for the leading keys, up to the first key that is not a
 *     str or not in space.
 *
 * Callers: the daemon only, on its own blocks (StoredObject: shape a tuple of str and int,
 * row exact bytes of the length the shape fixes). Each function copies the list it is given
 * into a tuple first and loops over that: a getter, setter or __eq__ it calls that changes
 * the list (shortens it, drops the last reference to an item) changes nothing here.
 *
 * lend_scan(found, now) -> (stride, rows)
 *     Sets every block's last_access to now. stride: s when found is s chains interleaved
 *     block by block (each block's parent is the block s before it), else 0 (fewer than two
 *     blocks: 0). rows: every block's row joined when every block has a row and a shape equal
 *     to the first block's, else None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *s_parent, *s_shape, *s_row, *s_last_access;

static PyObject *
run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyDict_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "run(space: dict, keys: list)");
        return NULL;
    }
    PyObject *space = args[0];
    PyObject *keys = PyList_AsTuple(args[1]); /* a lookup's __eq__ may change the list */
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    PyObject *found = PyList_New(n);
    if (found == NULL) {
        Py_DECREF(keys);
        return NULL;
    }
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        if (!PyUnicode_CheckExact(key))
            break;
        PyObject *obj = PyDict_GetItemWithError(space, key); /* borrowed */
        if (obj == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(keys);
                Py_DECREF(found);
                return NULL;
            }
            break;
        }
        Py_INCREF(obj);
        PyList_SET_ITEM(found, i, obj);
    }
    Py_DECREF(keys);
    if (i < n && PyList_SetSlice(found, i, n, NULL) < 0) {
        Py_DECREF(found);
        return NULL;
    }
    return found;
}

static PyObject *
lend_scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0]) || !PyFloat_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "lend_scan(found: list, now: float)");
        return NULL;
    }
    PyObject *now = args[1];
    /* the attribute getters and setters below run Python code that may change the list */
    PyObject *found = PyList_AsTuple(args[0]);
    if (found == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(found);
    Py_ssize_t stride = 0;
    int chains = n >= 2;   /* still possibly chains */
    int uniform = n >= 1;  /* every shape equal to the first, every row bytes of one size */
    PyObject *first = n ? PyTuple_GET_ITEM(found, 0) : NULL;
    PyObject *shape0 = NULL, *rows = NULL;
    Py_ssize_t row_size = 0;
    char *out = NULL;

    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PyTuple_GET_ITEM(found, i);
        if (PyObject_SetAttr(obj, s_last_access, now) < 0)
            goto fail;
        if (chains && i >= 1) {
            PyObject *parent = PyObject_GetAttr(obj, s_parent);
            if (parent == NULL)
                goto fail;
            if (stride == 0) {
                if (parent == first)
                    stride = i;  /* the second row's first block */
            } else if (parent != PyTuple_GET_ITEM(found, i - stride)) {
                chains = 0;
            }
            Py_DECREF(parent);
        }
        if (uniform) {
            PyObject *shape = PyObject_GetAttr(obj, s_shape);
            if (shape == NULL)
                goto fail;
            int same;
            if (i == 0) {
                shape0 = shape;  /* kept until the end */
                same = shape != Py_None;
            } else {
                same = PyObject_RichCompareBool(shape, shape0, Py_EQ);
                Py_DECREF(shape);
                if (same < 0)
                    goto fail;
            }
            PyObject *row = same ? PyObject_GetAttr(obj, s_row) : NULL;
            if (same && row == NULL)
                goto fail;
            if (row != NULL && PyBytes_CheckExact(row)) {
                if (i == 0) {
                    row_size = PyBytes_GET_SIZE(row);
                    rows = PyBytes_FromStringAndSize(NULL, row_size * n);
                    if (rows == NULL) {
                        Py_DECREF(row);
                        goto fail;
                    }
                    out = PyBytes_AS_STRING(rows);
                }
                if (PyBytes_GET_SIZE(row) == row_size) {
                    memcpy(out + i * row_size, PyBytes_AS_STRING(row), (size_t)row_size);
                } else {
                    uniform = 0;
                }
            } else {
                uniform = 0;
            }
            Py_XDECREF(row);
        }
    }
    Py_XDECREF(shape0);
    Py_DECREF(found);
    if (!chains)
        stride = 0;
    if (!uniform) {
        Py_XDECREF(rows);
        rows = Py_NewRef(Py_None);
    }
    return Py_BuildValue("(nN)", stride, rows);

fail:
    Py_XDECREF(shape0);
    Py_XDECREF(rows);
    Py_DECREF(found);
    return NULL;
}

PyDoc_STRVAR(run_doc,
"run(space, keys) -> list\n\n"
"The values of the dict space for the leading keys, up to the first key that is not a\n"
"str or not in space.");

PyDoc_STRVAR(lend_scan_doc,
"lend_scan(found, now) -> (stride, rows)\n\n"
"Set every block's last_access to now; stride: s when the blocks are s chains interleaved\n"
"block by block, else 0; rows: every block's row joined when all have the first block's\n"
"shape (and a row), else None.");

static PyMethodDef methods[] = {
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL, run_doc},
    {"lend_scan", (PyCFunction)(void (*)(void))lend_scan, METH_FASTCALL, lend_scan_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_prefixscan",
    "A prefix match's per-block passes in C, one read of each block (prefixscan.c).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__prefixscan(void)
{
    s_parent = PyUnicode_InternFromString("parent");
    s_shape = PyUnicode_InternFromString("shape");
    s_row = PyUnicode_InternFromString("row");
    s_last_access = PyUnicode_InternFromString("last_access");
    if (!s_parent || !s_shape || !s_row || !s_last_access)
        return NULL;
    return PyModule_Create(&module);
}
