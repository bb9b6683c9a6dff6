/* A job's check and packing in one native call, for every `submit`.  Built and loaded by
 * offload/transfer/fast_check.py (why: its docstring).
 *
 * Called through ctypes.PyDLL, so it runs holding the GIL and may use the C API: the columns
 * arrive as Python objects and are read through the buffer protocol (numpy arrays of any integer
 * type, strided or not) or as lists and tuples of exact ints.  The function never raises: on any
 * input it does not take, or any entry that fails a rule, it returns -1 and the numpy path checks
 * the job again and words the error.  So the error messages have one source, and this file only
 * has to be right about what it accepts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* One index column: a buffer's items or a sequence's ints. */
struct column {
    Py_buffer view;
    int has_view;
    PyObject *sequence; /* a list or tuple (borrowed) when has_view is 0 */
    PyObject **items;   /* its items, taken once every buffer is open (NULL when empty) */
    Py_ssize_t n;
    Py_ssize_t stride;  /* bytes between a buffer's items */
    char kind;          /* 'i' signed or 'u' unsigned buffer items */
};

static void release(struct column *c) {
    if (c->has_view)
        PyBuffer_Release(&c->view);
    c->has_view = 0;
}

/* The item kind of a one-letter struct format (an optional byte-order prefix of native order),
 * or 0 for anything that is not an integer type. */
static char integer_kind(const char *format, Py_ssize_t itemsize) {
    if (format == NULL)
        return 'u'; /* plain bytes */
    if (format[0] == '@' || format[0] == '=' ||
#if PY_LITTLE_ENDIAN
        format[0] == '<'
#else
        format[0] == '>'
#endif
    )
        format++;
    if (format[0] == 0 || format[1] != 0)
        return 0;
    if (strchr("bhilqn", format[0]))
        return itemsize <= 8 ? 'i' : 0;
    if (strchr("BHILQN", format[0]))
        return itemsize <= 8 ? 'u' : 0;
    return 0;
}

/* Open ``obj`` as a column; 0 when it is not one this file reads.  A list's or tuple's items
 * are taken later (`take_items`): opening a buffer may run Python code (``__buffer__``), which
 * could change a list opened before it. */
static int open_column(PyObject *obj, struct column *c) {
    c->has_view = 0;
    c->sequence = NULL;
    c->items = NULL;
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
        c->sequence = obj;
        return 1;
    }
    if (PyBytes_Check(obj) || !PyObject_CheckBuffer(obj))
        return 0; /* numpy reads bytes as one string, not as indices */
    if (PyObject_GetBuffer(obj, &c->view, PyBUF_RECORDS_RO) != 0) {
        PyErr_Clear();
        return 0;
    }
    c->has_view = 1;
    c->kind = integer_kind(c->view.format, c->view.itemsize);
    if (c->view.ndim != 1 || c->kind == 0 || c->view.itemsize <= 0) {
        release(c);
        return 0;
    }
    /* exporters such as ctypes arrays leave shape or strides out: then they are contiguous */
    c->n = c->view.shape != NULL ? c->view.shape[0] : c->view.len / c->view.itemsize;
    c->stride = c->view.strides != NULL ? c->view.strides[0] : c->view.itemsize;
    return 1;
}

/* A list's or tuple's items and length, read once every column is open. */
static void take_items(struct column *c) {
    if (c->sequence != NULL) {
        c->items = PySequence_Fast_ITEMS(c->sequence);
        c->n = PySequence_Fast_GET_SIZE(c->sequence);
    }
}

/* The limits of one engine's jobs in one direction, set once (mirrored by
 * fast_check.CheckContext). */
struct offload_check {
    int64_t num_blocks, chunk_count, bpc;
    int32_t field;   /* the destination that must not repeat: 0 blocks, 1 host pages */
    int32_t *stamps; /* an int32 per destination, or NULL: repeats are not checked here */
};

/* One typed loop per (item type, output type): ``OP(i, v)`` gets entry ``i`` as int64 ``v``
 * and evaluates to 0 when the entry fails.  A list's items go through the same OP. */
#define FOR_ITEMS(T, c, OP)                                                                     \
    do {                                                                                        \
        const char *base_ = (const char *)(c)->view.buf;                                       \
        Py_ssize_t stride_ = (c)->stride;                                                      \
        for (Py_ssize_t i_ = 0; i_ < (c)->n; i_++) {                                           \
            int64_t v_ = (int64_t) * (const T *)(base_ + i_ * stride_);                         \
            if (!(OP(i_, v_)))                                                                  \
                return 0;                                                                       \
        }                                                                                       \
    } while (0)

#define COLUMN_PASS(name, OP)                                                                   \
    static int name(const struct column *c, const struct offload_check *x, OUT_T *out) {       \
        if (!c->has_view) {                                                                     \
            for (Py_ssize_t i_ = 0; i_ < c->n; i_++) {                                         \
                PyObject *item_ = c->items[i_];                                                \
                int overflow_;                                                                  \
                long long v_;                                                                   \
                if (!PyLong_CheckExact(item_))                                                  \
                    return 0;                                                                   \
                v_ = PyLong_AsLongLongAndOverflow(item_, &overflow_);                           \
                if (overflow_ || v_ < 0) {                                                      \
                    PyErr_Clear();                                                              \
                    return 0;                                                                   \
                }                                                                               \
                if (!(OP(i_, (int64_t)v_)))                                                     \
                    return 0;                                                                   \
            }                                                                                   \
            return 1;                                                                           \
        }                                                                                       \
        switch (c->view.itemsize * (c->kind == 'i' ? 1 : -1)) {                                 \
        case 1: FOR_ITEMS(int8_t, c, OP); break;                                                \
        case 2: FOR_ITEMS(int16_t, c, OP); break;                                               \
        case 4: FOR_ITEMS(int32_t, c, OP); break;                                               \
        case 8: FOR_ITEMS(int64_t, c, OP); break;                                               \
        case -1: FOR_ITEMS(uint8_t, c, OP); break;                                              \
        case -2: FOR_ITEMS(uint16_t, c, OP); break;                                             \
        case -4: FOR_ITEMS(uint32_t, c, OP); break;                                             \
        case -8: FOR_ITEMS(int64_t, c, OP); break; /* past INT64_MAX reads negative */          \
        default: return 0;                                                                      \
        }                                                                                       \
        return 1;                                                                               \
    }

/* Three passes, one per column, into the packed output: blocks to out[0..n), chunk x bpc to
 * out[n..2n), then each position added to it. */
#define BLOCK(i, v) ((uint64_t)(v) < (uint64_t)x->num_blocks && (out[i] = (OUT_T)(v), 1))
#define CHUNK(i, v) ((uint64_t)(v) < (uint64_t)x->chunk_count && (out[i] = (OUT_T)((v) * x->bpc), 1))
#define POSITION(i, v) ((uint64_t)(v) < (uint64_t)x->bpc && (out[i] += (OUT_T)(v), 1))

#define OUT_T int32_t
COLUMN_PASS(blocks32, BLOCK)
COLUMN_PASS(chunks32, CHUNK)
COLUMN_PASS(positions32, POSITION)
#undef OUT_T
#define OUT_T int64_t
COLUMN_PASS(blocks64, BLOCK)
COLUMN_PASS(chunks64, CHUNK)
COLUMN_PASS(positions64, POSITION)
#undef OUT_T

/* Whether no destination of ``dest[0..n)`` repeats: each is marked with ``stamp``, a value no
 * earlier job used, so nothing is cleared between jobs. */
#define UNIQUE(name, T)                                                                         \
    static int name(const T *dest, Py_ssize_t n, int32_t *stamps, int32_t stamp) {              \
        for (Py_ssize_t i = 0; i < n; i++) {                                                    \
            if (stamps[dest[i]] == stamp)                                                       \
                return 0;                                                                       \
            stamps[dest[i]] = stamp;                                                            \
        }                                                                                       \
        return 1;                                                                               \
    }
UNIQUE(unique32, int32_t)
UNIQUE(unique64, int64_t)

/* Checks a job and writes it packed into ``packed`` (a writable contiguous buffer of 4- or
 * 8-byte signed ints, at least 2n long): ``packed[0..n)`` the GPU blocks, ``packed[n..2n)`` the host
 * pages (chunk x bpc + position).  Every index must be in range and, with ``x->stamps``, no
 * destination may repeat.  Returns n, or -1 for anything else (the caller checks the job the
 * slow way). */
Py_ssize_t offload_check_job(const struct offload_check *x, PyObject *packed, PyObject *blocks,
                             PyObject *chunks, PyObject *positions, int32_t stamp) {
    struct column b, c, p;
    Py_buffer out;
    Py_ssize_t n = -1;
    int ok;
    if (PyObject_GetBuffer(packed, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
        != 0) {
        PyErr_Clear();
        return -1;
    }
    if (integer_kind(out.format, out.itemsize) != 'i' || (out.itemsize != 4 && out.itemsize != 8))
        goto close_out; /* the packed job is signed ints */
    if (!open_column(blocks, &b))
        goto close_out;
    if (!open_column(chunks, &c))
        goto close_b;
    if (!open_column(positions, &p))
        goto close_c;
    take_items(&b);
    take_items(&c);
    take_items(&p);
    if (b.n != c.n || b.n != p.n || b.n > out.len / (2 * out.itemsize))
        goto close_p;
    if (out.itemsize == 4) {
        int32_t *o = (int32_t *)out.buf;
        ok = blocks32(&b, x, o) && chunks32(&c, x, o + b.n) && positions32(&p, x, o + b.n) &&
             (x->stamps == NULL || unique32(o + x->field * b.n, b.n, x->stamps, stamp));
    } else {
        int64_t *o = (int64_t *)out.buf;
        ok = blocks64(&b, x, o) && chunks64(&c, x, o + b.n) && positions64(&p, x, o + b.n) &&
             (x->stamps == NULL || unique64(o + x->field * b.n, b.n, x->stamps, stamp));
    }
    if (ok)
        n = b.n;
close_p:
    release(&p);
close_c:
    release(&c);
close_b:
    release(&b);
close_out:
    PyBuffer_Release(&out);
    return n;
}
