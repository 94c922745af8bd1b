/* The combine's receive-side reduction: per token, the bfloat16 rows of the ranks it went to, added in float32
 * in the given order (after an optional float32 bias), rounded once to bfloat16 (round to nearest even; NaN ->
 * the quiet NaN of its sign, as ml_dtypes rounds).
 *
 * One pass over the rows: a numpy version gathers each contributor's rows, converts them and adds them, several
 * passes over [tokens, H] per contributor. The loop runs without the interpreter lock, so the PE's other threads
 * (its engine's Python side, other blocks) run meanwhile. The float32 adds are the same adds in the same order as
 * numpy's (acc + row, one column at a time; vectorising across columns does not reorder them), so the result is
 * bit-identical to the float32 sum of the reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) & 0x8000u) | 0x7fc0u;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The rows a reduction reads: row i < n_src of ``src``, then row i - n_src of ``local`` (the rows a PE returns
 * to itself, read where they are instead of copied beside the others first). */
typedef struct {
    const uint16_t *src, *local;
    int64_t n_src;
    Py_ssize_t hidden;
} Rows;

static inline __attribute__((always_inline)) const uint16_t *row_at(const Rows *r, int64_t i) {
    return i < r->n_src ? r->src + i * r->hidden : r->local + (i - r->n_src) * r->hidden;
}

/* acc[h] += row[h] for each row in order, four (then two, one) rows per pass over acc: the adds of one column
 * stay in row order, the accumulator is loaded and stored once per pass. */
static inline __attribute__((always_inline)) void add_rows(float *restrict acc, const Rows *src,
                                                           const int64_t *restrict rows, int64_t count) {
    Py_ssize_t hidden = src->hidden;
    int64_t j = 0;
    for (; j + 4 <= count; j += 4) {
        const uint16_t *restrict r0 = row_at(src, rows[j]), *restrict r1 = row_at(src, rows[j + 1]);
        const uint16_t *restrict r2 = row_at(src, rows[j + 2]), *restrict r3 = row_at(src, rows[j + 3]);
        for (Py_ssize_t h = 0; h < hidden; h++) {
            float a = acc[h];
            a += bf16_to_f32(r0[h]);
            a += bf16_to_f32(r1[h]);
            a += bf16_to_f32(r2[h]);
            a += bf16_to_f32(r3[h]);
            acc[h] = a;
        }
    }
    for (; j + 2 <= count; j += 2) {
        const uint16_t *restrict r0 = row_at(src, rows[j]), *restrict r1 = row_at(src, rows[j + 1]);
        for (Py_ssize_t h = 0; h < hidden; h++) {
            float a = acc[h];
            a += bf16_to_f32(r0[h]);
            a += bf16_to_f32(r1[h]);
            acc[h] = a;
        }
    }
    for (; j < count; j++) {
        const uint16_t *restrict r0 = row_at(src, rows[j]);
        for (Py_ssize_t h = 0; h < hidden; h++)
            acc[h] += bf16_to_f32(r0[h]);
    }
}

/* AVX-512 or AVX2 where the CPU has it (chosen at load time), SSE2 otherwise: the same adds in the same order either
 * way (the vectors run across columns). */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void sum_rows(const Rows *src, const int64_t *restrict idx, const int64_t *restrict counts,
                     const float *restrict bias, uint16_t *restrict out, float *restrict acc, Py_ssize_t n,
                     Py_ssize_t width) {
    Py_ssize_t hidden = src->hidden;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (bias)
            memcpy(acc, bias + i * hidden, (size_t)hidden * 4);
        else
            memset(acc, 0, (size_t)hidden * 4);
        add_rows(acc, src, idx + i * width, counts[i]);
        uint16_t *restrict o = out + i * hidden;
        for (Py_ssize_t h = 0; h < hidden; h++)
            o[h] = f32_to_bf16(acc[h]);
    }
}

static int get(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->len % itemsize) {
        PyErr_Format(PyExc_ValueError, "bf16_reduce: %s has %zd bytes, not a multiple of %zd", name, view->len,
                     itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* bf16_reduce(src, idx, counts, out, bias, hidden[, local]): for token i < n = len(counts),
 * out[i] = bf16(bias[i] + sum_{j < counts[i]} f32(row idx[i, j])) with rows of `hidden` uint16 words, row k being
 * src[k] for k < len(src) and local[k - len(src)] after it; idx is [n, width] int64 (width = len(idx) / n), bias
 * None or [n, hidden] float32, local None or rows like src, every buffer C-contiguous. */
static PyObject *bf16_reduce(PyObject *self, PyObject *args) {
    PyObject *o_src, *o_idx, *o_cnt, *o_out, *o_bias, *o_local = Py_None;
    Py_ssize_t hidden;
    if (!PyArg_ParseTuple(args, "OOOOOn|O", &o_src, &o_idx, &o_cnt, &o_out, &o_bias, &hidden, &o_local))
        return NULL;
    if (hidden <= 0) {
        PyErr_SetString(PyExc_ValueError, "bf16_reduce: hidden must be > 0");
        return NULL;
    }
    Py_buffer src, idx, cnt, out, bias = {0}, local = {0};
    PyObject *result = NULL;
    int have_bias = o_bias != Py_None, have_local = o_local != Py_None;
    if (get(o_src, &src, 0, 2 * hidden, "src") < 0)
        return NULL;
    if (have_local && get(o_local, &local, 0, 2 * hidden, "local") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (get(o_idx, &idx, 0, 8, "idx") < 0)
        goto e1;
    if (get(o_cnt, &cnt, 0, 8, "counts") < 0)
        goto e2;
    if (get(o_out, &out, 1, 2 * hidden, "out") < 0)
        goto e3;
    if (have_bias && get(o_bias, &bias, 0, 4 * hidden, "bias") < 0)
        goto e4;
    Py_ssize_t n = cnt.len / 8, rows = (src.len + local.len) / (2 * hidden);
    Py_ssize_t width = n ? idx.len / 8 / n : 0;
    const int64_t *ip = idx.buf, *cp = cnt.buf;
    if (n && idx.len != n * width * 8) {
        PyErr_Format(PyExc_ValueError, "bf16_reduce: idx has %zd entries, not a multiple of %zd tokens",
                     idx.len / 8, n);
        goto done;
    }
    if (out.len < n * 2 * hidden || (have_bias && bias.len < n * 4 * hidden)) {
        PyErr_Format(PyExc_ValueError, "bf16_reduce: out (or bias) holds fewer than %zd rows", n);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (cp[i] < 0 || cp[i] > width) {
            PyErr_Format(PyExc_ValueError, "bf16_reduce: token %zd has %lld contributors (width %zd)", i,
                         (long long)cp[i], width);
            goto done;
        }
        for (int64_t j = 0; j < cp[i]; j++)
            if (ip[i * width + j] < 0 || ip[i * width + j] >= rows) {
                PyErr_Format(PyExc_IndexError, "bf16_reduce: token %zd row %lld out of range [0, %zd)", i,
                             (long long)ip[i * width + j], rows);
                goto done;
            }
    }
    float *acc = malloc((size_t)hidden * 4);
    if (!acc) {
        PyErr_NoMemory();
        goto done;
    }
    Rows from = {src.buf, local.buf, src.len / (2 * hidden), hidden};
    Py_BEGIN_ALLOW_THREADS
    sum_rows(&from, ip, cp, have_bias ? bias.buf : NULL, out.buf, acc, n, width);
    Py_END_ALLOW_THREADS
    free(acc);
    result = Py_NewRef(Py_None);
done:
    if (have_bias)
        PyBuffer_Release(&bias);
e4:
    PyBuffer_Release(&out);
e3:
    PyBuffer_Release(&cnt);
e2:
    PyBuffer_Release(&idx);
e1:
    if (have_local)
        PyBuffer_Release(&local);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"bf16_reduce", bf16_reduce, METH_VARARGS,
     "bf16_reduce(src, idx, counts, out, bias, hidden[, local]): out[i] = bf16(bias[i] + sum_j f32(row idx[i, j])), "
     "j < counts[i], in order, rounded to nearest even (row k: src[k], then local[k - len(src)]); without the "
     "interpreter lock."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_reduce", "The combine's bfloat16 reduction.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__reduce(void) { return PyModule_Create(&module); }
