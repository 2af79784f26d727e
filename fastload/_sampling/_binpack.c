/* Best-fit decreasing bin packing of documents into rows, window by window: the hot loop of
 * fastload's packing plan (fastload/_sampling/_bestfit.py holds the same algorithm in Python,
 * which gives the same rows where this module cannot be compiled).
 *
 * best_fit(lengths, window_ends, capacity) -> (order, row_sizes)
 *   lengths:     int64, each in 1..capacity, every window's documents longest first;
 *   window_ends: int64, the end of each window in `lengths` (ascending, the last == n);
 *   order:       int64[n], the documents (positions in `lengths`) grouped by row, rows in the
 *                order they were opened, each row's documents in the order they were placed;
 *   row_sizes:   int64[rows], how many documents each row holds.
 *
 * Each document goes to the open row of the window whose free space is the smallest that holds
 * it (among rows with equal free space, the one that reached it last), else a new row. Rows with
 * free space f are kept on a stack per f, and a two-level bitmap of the non-empty stacks finds
 * the smallest f >= length in a word or two.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The free spaces that some open row has, as a two-level bitmap: bit c of `bits` is set when a
 * row with free space c is open, bit w of `words` when word w of `bits` is non-zero. Finding the
 * smallest free space >= a length scans a word or two in practice, and at most
 * capacity / 4096 + 2 words. */
typedef struct {
    uint64_t *bits;
    uint64_t *words;
    int64_t nbits, nwords;
} rooms;

static void rooms_set(rooms *r, int64_t c) {
    r->bits[c >> 6] |= 1ULL << (c & 63);
    r->words[c >> 12] |= 1ULL << ((c >> 6) & 63);
}

static void rooms_clear(rooms *r, int64_t c) {
    r->bits[c >> 6] &= ~(1ULL << (c & 63));
    if (!r->bits[c >> 6]) r->words[c >> 12] &= ~(1ULL << ((c >> 6) & 63));
}

/* The smallest set c >= from, or -1. */
static int64_t rooms_find(const rooms *r, int64_t from) {
    int64_t w = from >> 6;
    if (w >= r->nbits) return -1;
    uint64_t here = r->bits[w] & (~0ULL << (from & 63));
    if (here) return (w << 6) + __builtin_ctzll(here);
    int64_t next = w + 1; /* the first word after w that has a bit set */
    int64_t top = next >> 6;
    if (top >= r->nwords) return -1;
    uint64_t mask = (next & 63) ? (~0ULL << (next & 63)) : ~0ULL;
    uint64_t summary = r->words[top] & mask;
    while (!summary) {
        if (++top >= r->nwords) return -1;
        summary = r->words[top];
    }
    w = (top << 6) + __builtin_ctzll(summary);
    return (w << 6) + __builtin_ctzll(r->bits[w]);
}

static PyObject *best_fit(PyObject *module, PyObject *args) {
    Py_buffer lengths_buf, ends_buf;
    long long capacity;
    PyObject *order_obj = NULL, *sizes_obj = NULL, *result = NULL;
    if (!PyArg_ParseTuple(args, "y*y*L", &lengths_buf, &ends_buf, &capacity)) return NULL;
    const int64_t *lengths = (const int64_t *)lengths_buf.buf;
    const int64_t *ends = (const int64_t *)ends_buf.buf;
    Py_ssize_t n = lengths_buf.len / 8, windows = ends_buf.len / 8;
    int64_t *row_of = NULL, *free_of = NULL, *next_on_stack = NULL, *head = NULL, *counts = NULL;
    int64_t *order = NULL;
    rooms free_spaces = {NULL, NULL, (capacity >> 6) + 1, (capacity >> 12) + 1};
    if (capacity < 1) {
        PyErr_SetString(PyExc_ValueError, "best_fit: capacity must be >= 1");
        goto done;
    }
    row_of = malloc(sizeof(int64_t) * (n ? n : 1));
    free_of = malloc(sizeof(int64_t) * (n ? n : 1));
    next_on_stack = malloc(sizeof(int64_t) * (n ? n : 1));
    head = malloc(sizeof(int64_t) * (capacity + 1));
    free_spaces.bits = calloc(free_spaces.nbits, sizeof(uint64_t));
    free_spaces.words = calloc(free_spaces.nwords, sizeof(uint64_t));
    if (!row_of || !free_of || !next_on_stack || !head || !free_spaces.bits || !free_spaces.words) {
        PyErr_NoMemory();
        goto done;
    }
    for (int64_t c = 0; c <= capacity; c++) head[c] = -1;
    int64_t rows = 0;
    Py_ssize_t doc = 0;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t w = 0; w < windows && !bad; w++) {
        int64_t first_row = rows, end = ends[w];
        if (end < doc || end > n) { bad = 1; break; }
        for (; doc < end; doc++) {
            int64_t length = lengths[doc], row, room;
            if (length < 1 || length > capacity) { bad = 2; break; }
            room = rooms_find(&free_spaces, length);
            if (room < 0) {  /* no open row holds it: open one */
                row = rows++;
                free_of[row] = capacity;
            } else {
                row = head[room];
                head[room] = next_on_stack[row];
                if (head[room] == -1) rooms_clear(&free_spaces, room);
            }
            row_of[doc] = row;
            room = free_of[row] -= length;
            if (room > 0) {
                if (head[room] == -1) rooms_set(&free_spaces, room);
                next_on_stack[row] = head[room];
                head[room] = row;
            }
        }
        /* The window's rows are closed: empty the stacks and the tree for the next one. */
        for (int64_t row = first_row; row < rows; row++) {
            int64_t room = free_of[row];
            if (room > 0) {
                head[room] = -1;
                rooms_clear(&free_spaces, room);
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, bad == 1 ? "best_fit: window ends must ascend up to n"
                                                   : "best_fit: lengths must be in 1..capacity");
        goto done;
    }
    /* Group the documents by row, stably: a counting sort. */
    sizes_obj = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(rows * 8));
    order_obj = PyByteArray_FromStringAndSize(NULL, n * 8);
    if (!sizes_obj || !order_obj) goto done;
    counts = (int64_t *)PyByteArray_AS_STRING(sizes_obj);
    order = (int64_t *)PyByteArray_AS_STRING(order_obj);
    memset(counts, 0, (size_t)rows * 8);
    for (Py_ssize_t d = 0; d < n; d++) counts[row_of[d]]++;
    /* next_on_stack is free now: it holds each row's next write position. */
    int64_t at = 0;
    for (int64_t r = 0; r < rows; r++) {
        next_on_stack[r] = at;
        at += counts[r];
    }
    for (Py_ssize_t d = 0; d < n; d++) order[next_on_stack[row_of[d]]++] = d;
    result = PyTuple_Pack(2, order_obj, sizes_obj);
done:
    Py_XDECREF(order_obj);
    Py_XDECREF(sizes_obj);
    free(row_of);
    free(free_of);
    free(next_on_stack);
    free(head);
    free(free_spaces.bits);
    free(free_spaces.words);
    PyBuffer_Release(&lengths_buf);
    PyBuffer_Release(&ends_buf);
    return result;
}

static PyMethodDef methods[] = {
    {"best_fit", best_fit, METH_VARARGS, "Best-fit decreasing rows per window (see the source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_binpack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__binpack(void) { return PyModule_Create(&module); }
