/* Reading the dicts the Python side hands to the native code when it makes an Engine (its layout and config) or a
 * Poster (its config): one integer, or a list of n integers, by key, with an error naming the dict and the key.
 * Shared by _engine.c and _post.c. */
#ifndef SHMEMX_UDMA_CONFIG_H
#define SHMEMX_UDMA_CONFIG_H

#include <Python.h>
#include <stdint.h>

/* d[name] as a signed integer; KeyError "<what>: <name> missing" when absent. */
static inline int config_int(PyObject *d, const char *what, const char *name, long long *out) {
    PyObject *v = PyDict_GetItemString(d, name);
    if (!v) { PyErr_Format(PyExc_KeyError, "%s: %s missing", what, name); return -1; }
    *out = PyLong_AsLongLong(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* d[name] as a 64-bit unsigned integer (its low 64 bits); KeyError when absent. */
static inline int config_u64(PyObject *d, const char *what, const char *name, uint64_t *out) {
    PyObject *v = PyDict_GetItemString(d, name);
    if (!v) { PyErr_Format(PyExc_KeyError, "%s: %s missing", what, name); return -1; }
    *out = PyLong_AsUnsignedLongLongMask(v);
    return PyErr_Occurred() ? -1 : 0;
}

/* d[name], a list of n integers, into out[0..n) (their low 64 bits); ValueError when it is not one. */
static inline int config_list(PyObject *d, const char *what, const char *name, Py_ssize_t n, uint64_t *out) {
    PyObject *v = PyDict_GetItemString(d, name);
    if (!v || !PyList_Check(v) || PyList_GET_SIZE(v) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be a list of %zd ints", what, name, n);
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        out[k] = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(v, k));
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

#endif
