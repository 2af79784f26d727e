/* The padding kernel in one pass: gather ragged rows from where they lie, convert them to the
 * output dtype, pad them to the batch's width and write the row mask. And its packing twin
 * (pack_rows): several pieces per row, with the labels, positions and document ids.
 *
 * The numpy kernels in _kernels.py do the same in four or five whole-array passes (a gather of
 * each row's window, a mask, a multiply, a casting copy, a mask copy). This one touches every
 * output byte once and reads only the real elements, so it runs at the speed of writing the
 * output (about 3x the numpy kernels on token ids; see _kernels.py).
 *
 * Only the buffer protocol is used (no numpy headers), and the GIL is released while copying.
 * Every offset is checked against the buffers before anything is written: a bad argument
 * raises ValueError and leaves the output untouched.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Element types, numbered as _kernels.py numbers them (NATIVE_TYPES). */
enum { T_BOOL, T_I8, T_U8, T_I16, T_U16, T_I32, T_U32, T_I64, T_U64, T_F32, T_F64, T_COUNT };

static const Py_ssize_t type_size[T_COUNT] = {1, 1, 1, 2, 2, 4, 4, 8, 8, 4, 8};

/* Convert n items from src (type S) to dst (type D). */
#define CONVERT(S, D)                                                                          \
    static void convert_##S##_##D(const void *src, void *dst, Py_ssize_t n) {                  \
        const S *s = (const S *)src;                                                           \
        D *d = (D *)dst;                                                                       \
        for (Py_ssize_t k = 0; k < n; k++) d[k] = (D)s[k];                                     \
    }

#define CONVERT_FROM(S)                                                                        \
    CONVERT(S, uint8_t) CONVERT(S, int8_t) CONVERT(S, int16_t) CONVERT(S, uint16_t)            \
    CONVERT(S, int32_t) CONVERT(S, uint32_t) CONVERT(S, int64_t) CONVERT(S, uint64_t)          \
    CONVERT(S, float) CONVERT(S, double)

CONVERT_FROM(uint8_t)
CONVERT_FROM(int8_t)
CONVERT_FROM(int16_t)
CONVERT_FROM(uint16_t)
CONVERT_FROM(int32_t)
CONVERT_FROM(uint32_t)
CONVERT_FROM(int64_t)
CONVERT_FROM(uint64_t)
CONVERT_FROM(float)
CONVERT_FROM(double)

typedef void (*convert_fn)(const void *, void *, Py_ssize_t);

/* The C type each element type is converted through (bool travels as uint8_t: 0 or 1). */
#define ROW(S)                                                                                 \
    {convert_##S##_uint8_t, convert_##S##_int8_t, convert_##S##_uint8_t, convert_##S##_int16_t, \
     convert_##S##_uint16_t, convert_##S##_int32_t, convert_##S##_uint32_t,                    \
     convert_##S##_int64_t, convert_##S##_uint64_t, convert_##S##_float, convert_##S##_double}

static const convert_fn converters[T_COUNT][T_COUNT] = {
    ROW(uint8_t), ROW(int8_t),   ROW(uint8_t), ROW(int16_t), ROW(uint16_t), ROW(int32_t),
    ROW(uint32_t), ROW(int64_t), ROW(uint64_t), ROW(float),  ROW(double),
};

/* One item of `type` holding `value` (an integer type gets `whole`, a float type `real`). */
static void encode(int type, long long whole, double real, unsigned char *item) {
    switch (type) {
    case T_BOOL: case T_U8: { uint8_t v = (uint8_t)whole; memcpy(item, &v, 1); break; }
    case T_I8: { int8_t v = (int8_t)whole; memcpy(item, &v, 1); break; }
    case T_I16: { int16_t v = (int16_t)whole; memcpy(item, &v, 2); break; }
    case T_U16: { uint16_t v = (uint16_t)whole; memcpy(item, &v, 2); break; }
    case T_I32: { int32_t v = (int32_t)whole; memcpy(item, &v, 4); break; }
    case T_U32: { uint32_t v = (uint32_t)whole; memcpy(item, &v, 4); break; }
    case T_I64: { int64_t v = (int64_t)whole; memcpy(item, &v, 8); break; }
    case T_U64: { uint64_t v = (uint64_t)whole; memcpy(item, &v, 8); break; }
    case T_F32: { float v = (float)real; memcpy(item, &v, 4); break; }
    case T_F64: { memcpy(item, &real, 8); break; }
    }
}

/* Fill n items of `size` bytes with `item`: memset when every byte of it is the same, else a
 * loop of fixed-size stores the compiler turns into wide ones (a memcpy of variable size per
 * item would be a call per item). */
#define FILL_WITH(T)                                                                           \
    do {                                                                                       \
        T v;                                                                                   \
        memcpy(&v, item, sizeof v);                                                            \
        for (Py_ssize_t k = 0; k < n; k++) memcpy(dst + k * (Py_ssize_t)sizeof v, &v, sizeof v); \
    } while (0)

static void fill(unsigned char *dst, Py_ssize_t n, const unsigned char *item, Py_ssize_t size) {
    int uniform = 1;
    for (Py_ssize_t b = 1; b < size; b++) uniform &= item[b] == item[0];
    if (uniform) {
        memset(dst, item[0], (size_t)(n * size));
        return;
    }
    switch (size) {
    case 2: FILL_WITH(uint16_t); break;
    case 4: FILL_WITH(uint32_t); break;
    case 8: FILL_WITH(uint64_t); break;
    default:
        for (Py_ssize_t k = 0; k < n; k++) memcpy(dst + k * size, item, (size_t)size);
    }
}

static int valid_type(int t) { return t >= 0 && t < T_COUNT; }

/* Rows i < rows: count[i] elements of `items` items from element first[i] of src, converted,
 * then padding (first with `left`), and the mask row. Bounds are the caller's to check. */
static void write_rows(const unsigned char *src, int src_type, const int64_t *first,
                       const int64_t *count, Py_ssize_t rows, unsigned char *out, int out_type,
                       Py_ssize_t width, Py_ssize_t items, long long pad_int, double pad_float,
                       int left, unsigned char *mask, int mask_type) {
    Py_ssize_t src_item = type_size[src_type] * items, out_size = type_size[out_type];
    Py_ssize_t out_row = width * items * out_size;
    Py_ssize_t mask_size = mask != NULL ? type_size[mask_type] : 0;
    unsigned char pad[8], one[8], zero[8] = {0};
    encode(out_type, pad_int, pad_float, pad);
    if (mask != NULL) encode(mask_type, 1, 1.0, one);
    convert_fn convert = converters[src_type][out_type];
    int same = src_type == out_type;
    for (Py_ssize_t i = 0; i < rows; i++) {
        Py_ssize_t n = (Py_ssize_t)count[i], gap = width - n;
        const unsigned char *from = src + first[i] * src_item;
        unsigned char *row = out + i * out_row;
        unsigned char *data = left ? row + gap * items * out_size : row;
        unsigned char *rest = left ? row : row + n * items * out_size;
        if (same)
            memcpy(data, from, (size_t)(n * src_item));
        else
            convert(from, data, n * items);
        fill(rest, gap * items, pad, out_size);
        if (mask != NULL) {
            unsigned char *m = mask + i * width * mask_size;
            fill(left ? m + gap * mask_size : m, n, one, mask_size);
            fill(left ? m : m + n * mask_size, gap, zero, mask_size);
        }
    }
}

PyDoc_STRVAR(pad_rows_doc,
"pad_rows(source, source_type, starts, kept, out, out_type, width, items, pad_int, pad_float,\n"
"         left, mask, mask_type)\n\n"
"Row i of `out` (`width` elements of `items` items each) gets the `kept[i]` elements of\n"
"`source` starting at element `starts[i]`, converted to `out_type`; the rest of the row is\n"
"the pad value (`pad_int` for an integer type, `pad_float` for a float type). With `left`\n"
"the padding comes first. `mask` (or None) gets 1 on the copied elements, 0 elsewhere.\n"
"`starts` and `kept` are int64 buffers; every buffer is C-contiguous.");

static PyObject *pad_rows(PyObject *module, PyObject *args) {
    Py_buffer src, starts, kept, out, mask;
    int src_type, out_type, mask_type, left;
    Py_ssize_t width, items;
    long long pad_int;
    double pad_float;
    PyObject *mask_obj;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*iy*y*w*innLdpOi", &src, &src_type, &starts, &kept, &out,
                          &out_type, &width, &items, &pad_int, &pad_float, &left, &mask_obj,
                          &mask_type))
        return NULL;
    int have_mask = mask_obj != Py_None;
    mask.buf = NULL;
    if (have_mask && PyObject_GetBuffer(mask_obj, &mask, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto fail;

    const char *error = NULL;
    Py_ssize_t rows = kept.len / 8;
    if (!valid_type(src_type) || !valid_type(out_type) || (have_mask && !valid_type(mask_type)))
        error = "unknown element type";
    else if (starts.len != kept.len || kept.len % 8)
        error = "starts and kept must be int64 buffers of the same length";
    else if (width < 0 || items < 1)
        error = "width must be >= 0 and items >= 1";
    else if (out.len < rows * width * items * type_size[out_type])
        error = "out is smaller than rows * width elements";
    else if (have_mask && mask.len < rows * width * type_size[mask_type])
        error = "mask is smaller than rows * width";
    if (error != NULL) {
        PyErr_SetString(PyExc_ValueError, error);
        goto fail;
    }
    const int64_t *first = (const int64_t *)starts.buf, *count = (const int64_t *)kept.buf;
    Py_ssize_t available = src.len / (items * type_size[src_type]);
    for (Py_ssize_t i = 0; i < rows; i++) {
        if (count[i] < 0 || count[i] > width || first[i] < 0 || first[i] > available - count[i]) {
            PyErr_Format(PyExc_ValueError,
                         "row %zd: %lld elements from element %lld do not fit (source holds %zd "
                         "elements, rows are %zd wide)",
                         i, (long long)count[i], (long long)first[i], available, width);
            goto fail;
        }
    }

    Py_BEGIN_ALLOW_THREADS
    write_rows((const unsigned char *)src.buf, src_type, first, count, rows,
               (unsigned char *)out.buf, out_type, width, items, pad_int, pad_float, left,
               have_mask ? (unsigned char *)mask.buf : NULL, mask_type);
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&src);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&kept);
    PyBuffer_Release(&out);
    if (have_mask) PyBuffer_Release(&mask);
    Py_RETURN_NONE;

fail:
    PyBuffer_Release(&src);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&kept);
    PyBuffer_Release(&out);
    if (mask.buf != NULL) PyBuffer_Release(&mask);
    return NULL;
}


PyDoc_STRVAR(gather_pad_doc,
"gather_pad(values, values_type, items, offsets, indices, out, base, capacity, out_type,\n"
"           mask_type, pad_int, pad_float, left, max_length, multiple, align)\n\n"
"One batch of one ragged field stored as `values` (all samples back to back, `items` items\n"
"per element) and int64 `offsets` (sample i is values[offsets[i]:offsets[i+1]]), padded\n"
"into `out` from byte `base`, as PadCollate lays it out: the padded values [rows, width],\n"
"then the mask [rows, width] (`mask_type`), then int64 lengths [rows], each array starting\n"
"on an `align`-byte boundary. Rows keep their first `max_length` elements (0: all); the\n"
"width is the longest kept row rounded up to `multiple`.\n\n"
"Returns (status, rows, width, real, nbytes, mask_offset, lengths_offset), offsets relative\n"
"to `base`. status 0: written. 1: nbytes exceeds `capacity`, nothing written. 2: an index\n"
"is negative or not below len(offsets) - 1, or its offsets leave `values`: nothing written\n"
"(the caller's slower path says which and why).");

static Py_ssize_t round_up(Py_ssize_t n, Py_ssize_t to) { return (n + to - 1) / to * to; }

static PyObject *gather_pad(PyObject *module, PyObject *args) {
    Py_buffer values, offsets, indices, out;
    int values_type, out_type, mask_type, left;
    Py_ssize_t items, base, capacity, max_length, multiple, align;
    long long pad_int;
    double pad_float;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*iny*y*w*nniiLdpnnn", &values, &values_type, &items, &offsets,
                          &indices, &out, &base, &capacity, &out_type, &mask_type, &pad_int,
                          &pad_float, &left, &max_length, &multiple, &align))
        return NULL;
    PyObject *result = NULL;
    int64_t *kept = NULL;
    if (!valid_type(values_type) || !valid_type(out_type) || !valid_type(mask_type) ||
        items < 1 || multiple < 1 || align < 1 || max_length < 0 || base < 0 || capacity < 0 ||
        offsets.len % 8 || indices.len % 8 || offsets.len < 8) {
        PyErr_SetString(PyExc_ValueError, "gather_pad: invalid arguments");
        goto done;
    }
    const int64_t *off = (const int64_t *)offsets.buf, *idx = (const int64_t *)indices.buf;
    Py_ssize_t samples = offsets.len / 8 - 1, rows = indices.len / 8;
    Py_ssize_t available = values.len / (items * type_size[values_type]);
    kept = PyMem_Malloc((size_t)(rows > 0 ? rows : 1) * 2 * sizeof(int64_t));
    if (kept == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *first = kept + rows;
    Py_ssize_t longest = 0;
    long long real = 0;
    int status = 0;
    for (Py_ssize_t i = 0; i < rows && status == 0; i++) {
        int64_t k = idx[i];
        if (k < 0 || k >= samples) {
            status = 2;
            break;
        }
        int64_t start = off[k], end = off[k + 1];
        if (start < 0 || end < start || end > available) {
            status = 2;
            break;
        }
        int64_t n = end - start;
        if (max_length > 0 && n > max_length) n = max_length;
        first[i] = start;
        kept[i] = n;
        real += n;
        if (n > longest) longest = (Py_ssize_t)n;
    }
    Py_ssize_t width = round_up(longest, multiple);
    Py_ssize_t cells = rows * width;
    Py_ssize_t mask_at = round_up(cells * items * type_size[out_type], align);
    Py_ssize_t lengths_at = round_up(mask_at + cells * type_size[mask_type], align);
    Py_ssize_t nbytes = round_up(lengths_at + rows * 8, align);
    if (status == 0 && nbytes > capacity) status = 1;
    if (status == 0 && base + nbytes > out.len) {
        PyErr_SetString(PyExc_ValueError, "gather_pad: the slot lies outside out");
        goto done;
    }
    if (status == 0) {
        unsigned char *slot = (unsigned char *)out.buf + base;
        Py_BEGIN_ALLOW_THREADS
        write_rows((const unsigned char *)values.buf, values_type, first, kept, rows, slot,
                   out_type, width, items, pad_int, pad_float, left, slot + mask_at, mask_type);
        memcpy(slot + lengths_at, kept, (size_t)(rows * 8));
        Py_END_ALLOW_THREADS
    }
    result = Py_BuildValue("innLnnn", status, rows, width, real, nbytes, mask_at, lengths_at);

done:
    PyMem_Free(kept);
    PyBuffer_Release(&values);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&indices);
    PyBuffer_Release(&out);
    return result;
}


/* One piece of int64 token ids in one pass over its source: ids, labels (the first one
 * label_pad; none where labels is NULL), positions (of type P) and document ids together, for
 * the source types token ids come in. Returns 0 (nothing written) for another source type. */
#define FUSED(S, P)                                                                            \
    do {                                                                                       \
        const S *s = (const S *)from;                                                          \
        P *pos = (P *)positions;                                                               \
        if (labels != NULL)                                                                    \
            for (Py_ssize_t k = 0; k < n; k++) {                                               \
                int64_t v = (int64_t)s[k];                                                     \
                ids[k] = v;                                                                    \
                labels[k] = v;                                                                 \
                pos[k] = (P)k;                                                                 \
                documents[k] = doc;                                                            \
            }                                                                                  \
        else                                                                                   \
            for (Py_ssize_t k = 0; k < n; k++) {                                               \
                ids[k] = (int64_t)s[k];                                                        \
                pos[k] = (P)k;                                                                 \
                documents[k] = doc;                                                            \
            }                                                                                  \
    } while (0)

#define FUSED_SOURCES(P)                                                                       \
    switch (source_type) {                                                                     \
    case T_U16: FUSED(uint16_t, P); break;                                                     \
    case T_I32: FUSED(int32_t, P); break;                                                      \
    case T_U32: FUSED(uint32_t, P); break;                                                     \
    case T_I64: FUSED(int64_t, P); break;                                                      \
    default: return 0;                                                                         \
    }

static int fused_int64(int source_type, const unsigned char *from, Py_ssize_t n, int64_t *ids,
                       int64_t *labels, void *positions, Py_ssize_t pos_size, int32_t *documents,
                       int32_t doc, long long label_pad) {
    if (pos_size == 8) {
        FUSED_SOURCES(int64_t)
    } else {
        FUSED_SOURCES(int32_t)
    }
    if (n > 0 && labels != NULL) labels[0] = label_pad;
    return 1;
}

/* Position k of the packed cells, of pos_size bytes (int64 or int32). */
static void put_position(void *positions, Py_ssize_t pos_size, Py_ssize_t at, Py_ssize_t k) {
    if (pos_size == 8)
        ((int64_t *)positions)[at] = (int64_t)k;
    else
        ((int32_t *)positions)[at] = (int32_t)k;
}

/* Packed rows (see pack_rows' doc): row r holds pieces row_at[r]..row_at[r + 1] - 1, piece p
 * being count[p] elements of src from element first[p]. labels, positions (pos_size bytes an
 * element), documents, cu (the segment boundaries: every piece, and each row's padding run)
 * and row_tokens (each row's real tokens) may be NULL. Returns the longest segment. Bounds are
 * the caller's to check. */
static int64_t write_packed(const unsigned char *src, int source_type, Py_ssize_t items,
                            const int64_t *first, const int64_t *count, const int64_t *row_at,
                            Py_ssize_t rows, unsigned char *ids, int out_type, Py_ssize_t seq_len,
                            const unsigned char *pad, int64_t *labels, long long label_pad,
                            void *positions, Py_ssize_t pos_size, int32_t *documents, int32_t *cu,
                            int32_t *row_tokens) {
    Py_ssize_t src_item = type_size[source_type] * items, out_item = type_size[out_type] * items;
    convert_fn convert = converters[source_type][out_type];
    convert_fn to_int64 = converters[source_type][T_I64];
    int same = source_type == out_type;
    int64_t longest = 0;
    Py_ssize_t segment = 0;
    if (cu != NULL) cu[0] = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        Py_ssize_t at = 0, base = r * seq_len;
        int32_t doc = 0;
        for (int64_t p = row_at[r]; p < row_at[r + 1]; p++, doc++) {
            Py_ssize_t n = (Py_ssize_t)count[p];
            const unsigned char *from = src + first[p] * src_item;
            if (items == 1 && out_type == T_I64 && positions != NULL && documents != NULL &&
                fused_int64(source_type, from, n, (int64_t *)ids + base + at,
                            labels != NULL ? labels + base + at : NULL,
                            (unsigned char *)positions + (base + at) * pos_size, pos_size,
                            documents + base + at, doc, label_pad)) {
                at += n;
                if (n > longest) longest = n;
                if (cu != NULL) {
                    cu[segment + 1] = (int32_t)(base + at);
                    segment++;
                }
                continue;
            }
            if (same)
                memcpy(ids + (base + at) * out_item, from, (size_t)(n * src_item));
            else
                convert(from, ids + (base + at) * out_item, n * items);
            if (labels != NULL) {
                to_int64(from, labels + base + at, n);
                labels[base + at] = label_pad;
            }
            if (positions != NULL)
                for (Py_ssize_t k = 0; k < n; k++) put_position(positions, pos_size, base + at + k, k);
            if (documents != NULL)
                for (Py_ssize_t k = 0; k < n; k++) documents[base + at + k] = doc;
            at += n;
            if (n > longest) longest = n;
            if (cu != NULL) {
                cu[segment + 1] = (int32_t)(base + at);
                segment++;
            }
        }
        if (row_tokens != NULL) row_tokens[r] = (int32_t)at;
        Py_ssize_t gap = seq_len - at;
        fill(ids + (base + at) * out_item, gap * items, pad, type_size[out_type]);
        for (Py_ssize_t k = 0; k < gap; k++) {
            if (labels != NULL) labels[base + at + k] = label_pad;
            if (positions != NULL) put_position(positions, pos_size, base + at + k, k);
            if (documents != NULL) documents[base + at + k] = doc;
        }
        if (gap > 0) {
            if (gap > longest) longest = gap;
            if (cu != NULL) {
                cu[segment + 1] = (int32_t)(base + seq_len);
                segment++;
            }
        }
    }
    return longest;
}

PyDoc_STRVAR(pack_rows_doc,
"pack_rows(source, source_type, items, starts, lengths, row_offsets, out, out_type, seq_len,\n"
"          pad_int, pad_float, labels, label_pad, positions, documents, pos_size)\n\n"
"Packed rows: row r of `out` (`seq_len` elements of `items` items each) gets pieces\n"
"row_offsets[r]..row_offsets[r + 1] - 1 back to back, piece p being the `lengths[p]` elements\n"
"of `source` from element `starts[p]`, converted to `out_type`; then the pad value. With\n"
"`labels` (int64 [rows, seq_len], or None) the same values as int64 with `label_pad` on every\n"
"piece's first element and on the padding; `positions` (int64 or int32 as `pos_size` says, or\n"
"None) 0, 1, ... restarting\n"
"at every piece and at the padding; `documents` (int32, or None) each row's pieces numbered\n"
"from 0, the padding the next number. Everything is checked before anything is written.");

static PyObject *pack_rows(PyObject *module, PyObject *args) {
    Py_buffer source, starts, lengths, offsets, out;
    PyObject *labels_obj, *positions_obj, *documents_obj;
    int source_type, out_type;
    Py_ssize_t items, seq_len, pos_size;
    long long pad_int, label_pad;
    double pad_float;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*iny*y*y*w*inLdOLOOn", &source, &source_type, &items, &starts,
                          &lengths, &offsets, &out, &out_type, &seq_len, &pad_int, &pad_float,
                          &labels_obj, &label_pad, &positions_obj, &documents_obj, &pos_size))
        return NULL;
    Py_buffer extra[3];
    PyObject *extra_obj[3] = {labels_obj, positions_obj, documents_obj};
    const Py_ssize_t extra_size[3] = {8, pos_size, 4};
    int held[3] = {0, 0, 0};
    PyObject *result = NULL;
    const char *why = NULL;
    if (!valid_type(source_type) || !valid_type(out_type) || items < 1 || seq_len < 1 ||
        starts.len % 8 || lengths.len != starts.len || offsets.len % 8 || offsets.len < 8 ||
        (pos_size != 4 && pos_size != 8)) {
        why = "pack_rows: invalid arguments";
        goto done;
    }
    Py_ssize_t pieces = starts.len / 8, rows = offsets.len / 8 - 1;
    Py_ssize_t cells = rows * seq_len;
    if (out.len < cells * items * type_size[out_type]) {
        why = "pack_rows: out is smaller than rows * seq_len";
        goto done;
    }
    for (int k = 0; k < 3; k++) {
        if (extra_obj[k] == Py_None) continue;
        if (PyObject_GetBuffer(extra_obj[k], &extra[k], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        held[k] = 1;
        if (extra[k].len < cells * extra_size[k]) {
            why = "pack_rows: labels, positions or documents are smaller than rows * seq_len";
            goto done;
        }
    }
    const int64_t *first = (const int64_t *)starts.buf, *count = (const int64_t *)lengths.buf;
    const int64_t *row_at = (const int64_t *)offsets.buf;
    Py_ssize_t available = source.len / (items * type_size[source_type]);
    if (row_at[0] != 0 || row_at[rows] != pieces) {
        why = "pack_rows: row offsets must run from 0 to the number of pieces";
        goto done;
    }
    for (Py_ssize_t r = 0; r < rows && why == NULL; r++) {
        int64_t used = 0;
        if (row_at[r + 1] < row_at[r]) why = "pack_rows: row offsets must not decrease";
        for (int64_t p = row_at[r]; p < row_at[r + 1] && why == NULL; p++) {
            if (count[p] < 1 || first[p] < 0 || first[p] + count[p] > available)
                why = "pack_rows: a piece lies outside the source";
            used += count[p];
        }
        if (why == NULL && used > seq_len) why = "pack_rows: a row holds more than seq_len";
    }
    if (why != NULL) goto done;

    unsigned char pad[8];
    encode(out_type, pad_int, pad_float, pad);
    int64_t *labels = held[0] ? (int64_t *)extra[0].buf : NULL;
    void *positions = held[1] ? extra[1].buf : NULL;
    int32_t *documents = held[2] ? (int32_t *)extra[2].buf : NULL;
    Py_BEGIN_ALLOW_THREADS
    (void)write_packed((const unsigned char *)source.buf, source_type, items, first, count, row_at, rows,
                 (unsigned char *)out.buf, out_type, seq_len, pad, labels, label_pad, positions,
                 pos_size, documents, NULL, NULL);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);

done:
    if (why != NULL) PyErr_SetString(PyExc_ValueError, why);
    for (int k = 0; k < 3; k++)
        if (held[k]) PyBuffer_Release(&extra[k]);
    PyBuffer_Release(&source);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&out);
    return result;
}

#define PACK_MAGIC (-0x5041434BLL)

PyDoc_STRVAR(gather_pack_doc,
"gather_pack(values, values_type, items, offsets, plan, out, base, capacity, out_type,\n"
"            pad_int, pad_float, label_pad, seq_len, align, pos_size, labels)\n\n"
"A packed batch in one call, for one ragged field held whole in memory (sample i is\n"
"values[offsets[i]:offsets[i + 1]]): `plan` is a PackedBatch's int64 encoding. Checks the\n"
"plan against the samples and `seq_len`, lays out in `out` from byte `base` the ids\n"
"([rows, seq_len], out_type), position_ids (int64, or int32 where `pos_size` is 4), labels\n"
"(int64; where `labels` is 0, each row's real tokens as int32 [rows] instead), document_ids\n"
"(int32), cu_seqlens (int32) and max_seqlen (int64), each at a multiple of `align`, and writes\n"
"them.\n"
"Returns (status, rows, segments, real, nbytes, positions_at, labels_at, documents_at,\n"
"cu_at, max_at): status 0 written, 1 more than `capacity` bytes needed (nothing written),\n"
"2 a plan this call does not take (nothing written: the general path says what is wrong).");

static PyObject *gather_pack(PyObject *module, PyObject *args) {
    Py_buffer values, offsets, plan, out;
    int values_type, out_type;
    Py_ssize_t items, base, capacity, seq_len, align, pos_size;
    long long pad_int, label_pad;
    double pad_float;
    int with_labels;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*iny*y*w*nniLdLnnnp", &values, &values_type, &items, &offsets,
                          &plan, &out, &base, &capacity, &out_type, &pad_int, &pad_float,
                          &label_pad, &seq_len, &align, &pos_size, &with_labels))
        return NULL;
    PyObject *result = NULL;
    int64_t *first = NULL;
    int status = 0;
    Py_ssize_t rows = 0, pieces = 0, segments = 0, nbytes = 0;
    Py_ssize_t pos_at = 0, lab_at = 0, doc_at = 0, cu_at = 0, max_at = 0;
    long long real = 0;
    if (!valid_type(values_type) || !valid_type(out_type) || items < 1 || seq_len < 1 ||
        align < 1 || base < 0 || capacity < 0 || offsets.len % 8 || offsets.len < 8 ||
        plan.len % 8 || (pos_size != 4 && pos_size != 8)) {
        PyErr_SetString(PyExc_ValueError, "gather_pack: invalid arguments");
        goto done;
    }
    const int64_t *head = (const int64_t *)plan.buf, *off = (const int64_t *)offsets.buf;
    Py_ssize_t words = plan.len / 8, samples = offsets.len / 8 - 1;
    Py_ssize_t available = values.len / (items * type_size[values_type]);
    if (words < 4 || head[0] != PACK_MAGIC || head[1] != seq_len || head[2] < 0 || head[3] < 0 ||
        words != 4 + head[2] + 1 + 3 * head[3]) {
        status = 2;
        goto answer;
    }
    rows = (Py_ssize_t)head[2];
    pieces = (Py_ssize_t)head[3];
    const int64_t *row_at = head + 4, *sample = row_at + rows + 1;
    const int64_t *start = sample + pieces, *stop = start + pieces;
    first = PyMem_Malloc((size_t)(pieces > 0 ? pieces : 1) * 2 * sizeof(int64_t));
    if (first == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *count = first + pieces;
    if (row_at[0] != 0 || row_at[rows] != pieces) status = 2;
    for (Py_ssize_t r = 0; r < rows && status == 0; r++) {
        int64_t used = 0;
        if (row_at[r + 1] < row_at[r]) {
            status = 2;
            break;
        }
        for (int64_t p = row_at[r]; p < row_at[r + 1]; p++) {
            int64_t k = sample[p], n = stop[p] - start[p];
            if (k < 0 || k >= samples || start[p] < 0 || n < 1 || n > seq_len ||
                off[k] < 0 || off[k + 1] < off[k] || off[k] + stop[p] > off[k + 1] ||
                off[k + 1] > available) {
                status = 2;
                break;
            }
            first[p] = off[k] + start[p];
            count[p] = n;
            used += n;
        }
        if (status == 0 && used > seq_len) status = 2;
        if (status == 0) {
            real += used;
            segments += (row_at[r + 1] - row_at[r]) + (used < seq_len ? 1 : 0);
        }
    }
    if (status != 0) goto answer;
    Py_ssize_t cells = rows * seq_len;
    pos_at = round_up(cells * items * type_size[out_type], align);
    lab_at = round_up(pos_at + cells * pos_size, align);
    doc_at = round_up(lab_at + (with_labels ? cells * 8 : rows * 4), align);
    cu_at = round_up(doc_at + cells * 4, align);
    max_at = round_up(cu_at + (segments + 1) * 4, align);
    nbytes = round_up(max_at + 8, align);
    if (nbytes > capacity) {
        status = 1;
        goto answer;
    }
    if (base + nbytes > out.len) {
        PyErr_SetString(PyExc_ValueError, "gather_pack: the slot lies outside out");
        goto done;
    }
    unsigned char *slot = (unsigned char *)out.buf + base, pad[8];
    encode(out_type, pad_int, pad_float, pad);
    Py_BEGIN_ALLOW_THREADS
    int64_t longest = write_packed(
        (const unsigned char *)values.buf, values_type, items, first, count, row_at, rows, slot,
        out_type, seq_len, pad, with_labels ? (int64_t *)(slot + lab_at) : NULL, label_pad,
        slot + pos_at, pos_size, (int32_t *)(slot + doc_at), (int32_t *)(slot + cu_at),
        with_labels ? NULL : (int32_t *)(slot + lab_at));
    memcpy(slot + max_at, &longest, 8);
    Py_END_ALLOW_THREADS
answer:
    result = Py_BuildValue("innLnnnnnn", status, rows, segments, real, nbytes, pos_at, lab_at,
                           doc_at, cu_at, max_at);
done:
    PyMem_Free(first);
    PyBuffer_Release(&values);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&plan);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"pad_rows", pad_rows, METH_VARARGS, pad_rows_doc},
    {"gather_pad", gather_pad, METH_VARARGS, gather_pad_doc},
    {"pack_rows", pack_rows, METH_VARARGS, pack_rows_doc},
    {"gather_pack", gather_pack, METH_VARARGS, gather_pack_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastload._collate._native",
    "The one-pass padding kernel (see _kernels.py, which falls back to numpy without it).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
