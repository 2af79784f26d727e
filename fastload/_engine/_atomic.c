/* Atomic operations on one 64-bit word of a shared, writable buffer (a batch slot's claim word:
 * see _claims.py). Python has no compare-and-swap on shared memory, and the claim must be one:
 * a worker and the main process may race for the same task.
 *
 * Only the buffer protocol is used. The word must lie wholly inside the buffer and be 8-byte
 * aligned in memory (ValueError otherwise), so that the operation is atomic.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The word at `offset` of `obj`'s buffer (acquired into `view`; the caller releases it), or NULL
 * with an exception set. */
static int64_t *word_at(PyObject *obj, Py_ssize_t offset, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0) return NULL;
    char *at = (char *)view->buf + offset;
    if (offset < 0 || offset > view->len - 8 || ((uintptr_t)at & 7) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "offset %zd is not an 8-byte aligned word inside the buffer (%zd bytes)",
                     offset, view->len);
        PyBuffer_Release(view);
        return NULL;
    }
    return (int64_t *)at;
}

PyDoc_STRVAR(compare_exchange_doc,
"compare_exchange(buffer, offset, expected, desired, /) -> bool\n\n"
"Atomically: if the int64 at `offset` equals `expected`, set it to `desired` and return True;\n"
"else leave it and return False.");

static PyObject *compare_exchange(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t offset;
    long long expected, desired;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "OnLL:compare_exchange", &obj, &offset, &expected, &desired))
        return NULL;
    int64_t *word = word_at(obj, offset, &view);
    if (word == NULL) return NULL;
    int64_t want = (int64_t)expected;
    int swapped = __atomic_compare_exchange_n(word, &want, (int64_t)desired, 0, __ATOMIC_ACQ_REL,
                                              __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyBool_FromLong(swapped);
}

PyDoc_STRVAR(store_doc,
"store(buffer, offset, value, /) -> None\n\n"
"Atomically set the int64 at `offset` to `value` (release order: writes before it are seen\n"
"first by whoever reads the new value).");

static PyObject *store(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t offset;
    long long value;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "OnL:store", &obj, &offset, &value)) return NULL;
    int64_t *word = word_at(obj, offset, &view);
    if (word == NULL) return NULL;
    __atomic_store_n(word, (int64_t)value, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(load_doc,
"load(buffer, offset, /) -> int\n\n"
"Atomically read the int64 at `offset` (acquire order).");

static PyObject *load(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t offset;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "On:load", &obj, &offset)) return NULL;
    int64_t *word = word_at(obj, offset, &view);
    if (word == NULL) return NULL;
    int64_t value = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromLongLong((long long)value);
}

static PyMethodDef methods[] = {
    {"compare_exchange", compare_exchange, METH_VARARGS, compare_exchange_doc},
    {"store", store, METH_VARARGS, store_doc},
    {"load", load, METH_VARARGS, load_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastload._engine._atomic",
    "Atomic operations on a 64-bit word of a shared buffer (see _claims.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__atomic(void) { return PyModule_Create(&module); }
