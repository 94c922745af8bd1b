/* The event log of one PE: what observation (--check, --trace, --record) reads, written by the code that runs.
 *
 * One shared-memory segment per PE (udma/events.py declares its layout: a header page, fixed 64-byte records,
 * then a blob area for strings, WQE bytes and small payloads). Every writer holds the interpreter lock: the
 * native posting path (_post.c) and the Python side (events.EventLog) append through events_put and events_blob
 * below, so the records of a thread are in its program order. A record's kind byte is stored last, with release
 * order, so that a reader in another process (the launcher, after a crash) takes a slot with a kind as whole.
 * The record kinds and mask bits the native side writes come from events.py (one home), handed over at init.
 *
 * Sites: under --check every record names the kernel's source line that made it (the first Python frame outside
 * shmemx, numpy and threading). events_site walks the calling thread's frames; which code objects are inside is
 * asked once per code object of the ``classify`` callable (and the code object kept, so its address stays its
 * own); each (code, line) gets a site id with a SITE record and its "file\0function" string in the blob.
 *
 * Fingerprints: a WRITE's source is summed at its post and again when the quiet that retires it returns
 * (_post.c); fingerprint() is a 64-bit hash of eight multiply-rotate lanes, one vector per 64 bytes (about 4x the
 * speed of the four scalar lanes it replaced, in cache; memory speed on cold rows: the checked run reads every
 * source twice, so this is most of what it costs).
 * fp_range() is the fingerprint of a range as the posts and quiets use it: a function of its bytes alone (the same
 * bytes anywhere give the same value), folded from the fingerprints of its FP_CHUNK-byte chunks, which an FpCache
 * keeps for the rest of one native call (no Python code, so no store into a source, runs within one): a row that
 * a dispatch sends to seven peers is read once for their seven WQEs, not seven times.
 */
#include "_engine.h"

enum { H_RECORDS = 3, H_BLOB = 4, H_MASK = 5, H_BLOB_CAP = 6 }; /* u64 words of the header (events.HEADER) */
#define HEADER_BYTES 4096
#define REC_BYTES 64

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* The lanes of fingerprint(): the eight 64-bit words of each 64-byte stripe feed eight lanes, each with the
 * multiply-rotate round a scalar hash gives one word (bijective in the word, and in order: moved words or stripes
 * change it); the lanes start apart, so a word in another lane changes it too. */
#define FP_LANES 8
static const uint64_t fp_key[FP_LANES] = {0x2CB0F69F4ABEA221ULL, 0x9417034723148989ULL, 0xDD555950609DFE03ULL,
                                          0xDBAFB150DEB12800ULL, 0x7E789B2E6C442CB6ULL, 0xF41E5636C7E4F8C4ULL,
                                          0x0959D150F8FBA7E4ULL, 0xA97316F13CDB9EEAULL};

/* ``stripes`` whole stripes from ``p`` into the lanes: one vector of 64-bit multiplies and rotates per stripe
 * where the CPU has AVX-512 (x86-64-v4, chosen at load time), the same rounds in AVX2 or scalar code elsewhere. */
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
static void fp_lanes(uint64_t *restrict lanes, const uint8_t *restrict p, uint64_t stripes) {
    const uint64_t k1 = 0x9E3779B185EBCA87ULL, k2 = 0xC2B2AE3D27D4EB4FULL;
    uint64_t a[FP_LANES], w[FP_LANES];
    memcpy(a, lanes, sizeof a);
    for (uint64_t s = 0; s < stripes; s++) {
        memcpy(w, p + 64 * s, 64);
        for (int i = 0; i < FP_LANES; i++) a[i] = rotl(a[i] + w[i] * k2, 31) * k1;
    }
    memcpy(lanes, a, sizeof a);
}

uint64_t fingerprint(const uint8_t *p, uint64_t n) {
    const uint64_t k1 = 0x9E3779B185EBCA87ULL, k2 = 0xC2B2AE3D27D4EB4FULL;
    uint64_t lanes[FP_LANES], w, i = n / 64 * 64;
    memcpy(lanes, fp_key, sizeof lanes);
    if (i) fp_lanes(lanes, p, n / 64);
    uint64_t acc = k2 ^ n;
    for (int k = 0; k < FP_LANES; k++) /* independent lanes: their multiplies overlap */
        acc ^= rotl(lanes[k] * (fp_key[k] | 1), 8 * k);
    for (; i + 8 <= n; i += 8) {
        memcpy(&w, p + i, 8);
        acc = rotl(acc ^ (w * k2), 27) * k1 + k2;
    }
    for (; i < n; i++) acc = rotl(acc ^ (p[i] * k1), 11) * k2;
    acc ^= acc >> 33;
    acc *= k2;
    return acc ^ (acc >> 29);
}

/* The fingerprint of chunk ``p`` (FP_CHUNK bytes) in this call's cache (computed at its first use). */
static uint64_t chunk_fp(FpCache *c, const uint8_t *p) {
    uintptr_t key = (uintptr_t)p;
    uint32_t i = (uint32_t)(key / FP_CHUNK) & (FP_SLOTS - 1); /* a range's chunks in neighbouring slots */
    for (uint32_t probe = 0; probe < 8; probe++, i = (i + 1) & (FP_SLOTS - 1)) {
        FpSlot *s = &c->slot[i];
        if (s->gen == c->gen && s->key == key) return s->hash;
        if (s->gen != c->gen) {
            *s = (FpSlot){key, fingerprint(p, FP_CHUNK), c->gen};
            return s->hash;
        }
    }
    return fingerprint(p, FP_CHUNK); /* a crowded neighbourhood: not kept */
}

/* A new native call: what the cache holds may be stale from here on. */
void fp_begin(FpCache *c) {
    if (!c->slot) c->slot = calloc(FP_SLOTS, sizeof(FpSlot));
    if (++c->gen == 0) c->gen = 1;
}

uint64_t fp_range(FpCache *c, const uint8_t *p, uint64_t n) {
    if (!c->slot || n < 2 * FP_CHUNK) return fingerprint(p, n);
    uint64_t h = 0x27D4EB2F165667C5ULL ^ n, k = 0;
    for (; k + FP_CHUNK <= n; k += FP_CHUNK) h = rotl(h ^ chunk_fp(c, p + k), 23) * 0x9E3779B185EBCA87ULL;
    return h ^ fingerprint(p + k, n - k);
}

/* Append one record; returns 0, or -1 when the log is full (counted: the reader reports the overflow). */
int events_put(Events *ev, int64_t ts, int kind, int block, int flags, uint32_t site, uint64_t a, uint64_t b,
               uint64_t c, uint64_t d, uint64_t e, uint32_t f, uint32_t g) {
    uint64_t i = __atomic_fetch_add(&ev->hdr[H_RECORDS], 1, __ATOMIC_RELAXED);
    if (i >= ev->capacity) return -1;
    uint8_t *r = ev->base + HEADER_BYTES + i * REC_BYTES;
    uint64_t t = ts ? (uint64_t)ts : (uint64_t)now_ns();
    uint8_t blk = (uint8_t)block;
    uint16_t fl = (uint16_t)flags;
    memcpy(r, &t, 8);
    r[9] = blk;
    memcpy(r + 10, &fl, 2);
    memcpy(r + 12, &site, 4);
    memcpy(r + 16, &a, 8);
    memcpy(r + 24, &b, 8);
    memcpy(r + 32, &c, 8);
    memcpy(r + 40, &d, 8);
    memcpy(r + 48, &e, 8);
    memcpy(r + 56, &f, 4);
    memcpy(r + 60, &g, 4);
    __atomic_store_n(r + 8, (uint8_t)kind, __ATOMIC_RELEASE); /* the kind last: a slot with a kind is whole */
    return 0;
}

/* Append ``n`` bytes to the blob area; returns their offset in it, or -1 when it is full. */
int64_t events_blob(Events *ev, const void *data, uint64_t n) {
    uint64_t at = __atomic_fetch_add(&ev->hdr[H_BLOB], n, __ATOMIC_RELAXED);
    if (at + n > ev->blob_cap) return -1;
    memcpy(ev->base + HEADER_BYTES + ev->capacity * REC_BYTES + at, data, n);
    return (int64_t)at;
}

/* The site id of (code, line): a SITE record and its strings the first time. 0 on failure (no site). */
static uint32_t site_of(Events *ev, PyObject *code, int line) {
    PyObject *key = Py_BuildValue("(Oi)", code, line);
    if (!key) { PyErr_Clear(); return 0; }
    PyObject *known = PyDict_GetItemWithError(ev->sites, key);
    if (known) {
        Py_DECREF(key);
        return (uint32_t)PyLong_AsUnsignedLong(known);
    }
    uint32_t sid = (uint32_t)PyDict_Size(ev->sites) + 1;
    PyObject *file = PyObject_GetAttrString(code, "co_filename"), *name = PyObject_GetAttrString(code, "co_name");
    PyObject *text = file && name ? PyUnicode_FromFormat("%U%c%U", file, 0, name) : NULL;
    Py_ssize_t n = 0;
    const char *utf8 = text ? PyUnicode_AsUTF8AndSize(text, &n) : NULL;
    PyObject *id = PyLong_FromUnsignedLong(sid);
    int ok = utf8 && id && PyDict_SetItem(ev->sites, key, id) == 0;
    if (ok) {
        int64_t at = events_blob(ev, utf8, (uint64_t)(n > 4096 ? 4096 : n));
        events_put(ev, 0, ev->k.site, 0, 0, sid, sid, at < 0 ? 0 : (uint64_t)at, at < 0 ? 0 : (uint64_t)n, 0, 0,
                   (uint32_t)line, 0);
    }
    Py_XDECREF(file); Py_XDECREF(name); Py_XDECREF(text); Py_XDECREF(id); Py_DECREF(key);
    if (!ok) { PyErr_Clear(); return 0; }
    return sid;
}

/* -1 internal (shmemx, numpy, threading), 1 the kernel's: ``classify(code)``, asked once per code object. */
static int kind_of(Events *ev, PyObject *code) {
    PyObject *known = PyDict_GetItemWithError(ev->kinds, code);
    if (known) return (int)PyLong_AsLong(known);
    PyObject *v = PyObject_CallOneArg(ev->classify, code);
    int kind = v ? (int)PyLong_AsLong(v) : -1;
    if (!v || PyErr_Occurred() || PyDict_SetItem(ev->kinds, code, v) < 0) PyErr_Clear();
    Py_XDECREF(v);
    return kind;
}

/* The site of the calling thread's first kernel frame (0 when the whole stack is internal). */
uint32_t events_site(Events *ev) {
    PyFrameObject *f = PyEval_GetFrame(); /* borrowed */
    Py_XINCREF(f);
    uint32_t sid = 0;
    while (f) {
        PyCodeObject *code = PyFrame_GetCode(f);
        int kind = kind_of(ev, (PyObject *)code);
        if (kind > 0) sid = site_of(ev, (PyObject *)code, PyFrame_GetLineNumber(f));
        Py_DECREF(code);
        PyFrameObject *back = kind > 0 ? NULL : PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    return sid;
}

/* --- the Python type ---------------------------------------------------------------------------------- */

static inline uint64_t arg_u64(PyObject *o) {
    return PyLong_Check(o) ? PyLong_AsUnsignedLongLongMask(o) : 0;
}

/* put(ts, kind, block, flags, site, a, b, c, d, e, f, g): one record; ts 0 = now; site -1 = the caller's site
 * (when the log has sites on: events.Mask.SITES), else taken as given. Returns True, False when full. */
static PyObject *Events_put(Events *ev, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12) { PyErr_SetString(PyExc_TypeError, "put takes 12 arguments"); return NULL; }
    long long site = PyLong_AsLongLong(args[4]);
    if (site == -1 && PyErr_Occurred()) return NULL;
    uint32_t sid = site >= 0 ? (uint32_t)site : (ev->mask & ev->k.sites) ? events_site(ev) : 0;
    int64_t ts = PyLong_AsLongLong(args[0]);
    int rc = events_put(ev, ts, (int)PyLong_AsLong(args[1]), (int)PyLong_AsLong(args[2]),
                        (int)PyLong_AsLong(args[3]), sid, arg_u64(args[5]), arg_u64(args[6]), arg_u64(args[7]),
                        arg_u64(args[8]), arg_u64(args[9]), (uint32_t)arg_u64(args[10]),
                        (uint32_t)arg_u64(args[11]));
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(rc == 0);
}

/* An int (or an object with __index__, a numpy integer) as its low 64 bits; -1 with an exception when not one. */
static int u64_of(PyObject *o, uint64_t *out) {
    PyObject *i = PyNumber_Index(o);
    if (!i) return -1;
    *out = PyLong_AsUnsignedLongLongMask(i);
    Py_DECREF(i);
    return PyErr_Occurred() ? -1 : 0;
}

/* One (offset, length) pair of put_ranges' sequence into ``off``, ``n``; -1 with an exception when not one. */
static int range_of(PyObject *r, uint64_t *off, uint64_t *n) {
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
        PyErr_SetString(PyExc_TypeError, "put_ranges: ranges must be (offset, length) tuples");
        return -1;
    }
    return u64_of(PyTuple_GET_ITEM(r, 0), off) < 0 || u64_of(PyTuple_GET_ITEM(r, 1), n) < 0 ? -1 : 0;
}

/* put_ranges(ts, kind, block, flags, site, a, ranges, d): put(ts, kind, block, flags, site, a, offset, length, d,
 * 0, 0, 0) for each (offset, length) of the sequence ``ranges``, in order: an access of many runs in one call.
 * Returns True, False when the log filled. */
static PyObject *Events_put_ranges(Events *ev, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) { PyErr_SetString(PyExc_TypeError, "put_ranges takes 8 arguments"); return NULL; }
    long long site = PyLong_AsLongLong(args[4]);
    int64_t ts = PyLong_AsLongLong(args[0]);
    int kind = (int)PyLong_AsLong(args[1]), block = (int)PyLong_AsLong(args[2]), flags = (int)PyLong_AsLong(args[3]);
    uint64_t a = arg_u64(args[5]), d = arg_u64(args[7]);
    if (PyErr_Occurred()) return NULL;
    uint32_t sid = site >= 0 ? (uint32_t)site : (ev->mask & ev->k.sites) ? events_site(ev) : 0;
    PyObject *seq = PySequence_Fast(args[6], "put_ranges: ranges must be a sequence");
    if (!seq) return NULL;
    int rc = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        uint64_t off, n;
        if (range_of(PySequence_Fast_GET_ITEM(seq, i), &off, &n) < 0) { Py_DECREF(seq); return NULL; }
        rc |= events_put(ev, ts, kind, block, flags, sid, a, off, n, d, 0, 0, 0);
    }
    Py_DECREF(seq);
    return PyBool_FromLong(rc == 0);
}

static PyObject *Events_site(Events *ev, PyObject *unused) { return PyLong_FromUnsignedLong(events_site(ev)); }

static PyObject *Events_site_of(Events *ev, PyObject *args) {
    PyObject *code;
    int line;
    if (!PyArg_ParseTuple(args, "Oi", &code, &line)) return NULL;
    return PyLong_FromUnsignedLong(site_of(ev, code, line));
}

/* blob(data) -> its offset in the blob area, or -1 when full. */
static PyObject *Events_blob(Events *ev, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    int64_t at = events_blob(ev, view.buf, (uint64_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromLongLong(at);
}

static int get_code(PyObject *d, const char *name, int *out) {
    PyObject *v = PyDict_GetItemString(d, name);
    if (!v) { PyErr_Format(PyExc_KeyError, "events layout: %s missing", name); return -1; }
    *out = (int)PyLong_AsLong(v);
    return PyErr_Occurred() ? -1 : 0;
}

/* Events(addr, capacity, blob_cap, mask, classify, codes): the log mapped at ``addr`` (its header already
 * written); ``codes`` names the record kinds and mask bits the native side uses (events.native_codes()). */
static int Events_init(Events *ev, PyObject *args, PyObject *kw) {
    unsigned long long addr, capacity, blob_cap;
    unsigned int mask;
    PyObject *classify, *codes;
    if (!PyArg_ParseTuple(args, "KKKIOO!", &addr, &capacity, &blob_cap, &mask, &classify, &PyDict_Type, &codes))
        return -1;
    EventCodes *k = &ev->k;
    if (get_code(codes, "site", &k->site) || get_code(codes, "post", &k->post) || get_code(codes, "quiet", &k->quiet)
        || get_code(codes, "doorbell", &k->doorbell) || get_code(codes, "value", &k->value)
        || get_code(codes, "src_changed", &k->src_changed) || get_code(codes, "local_heap", &k->local_heap)
        || get_code(codes, "sites", &k->sites) || get_code(codes, "fingerprints", &k->fingerprints)
        || get_code(codes, "wqe_bytes", &k->wqe_bytes))
        return -1;
    ev->base = (uint8_t *)(uintptr_t)addr;
    ev->hdr = (uint64_t *)ev->base;
    ev->capacity = capacity;
    ev->blob_cap = blob_cap;
    ev->mask = mask;
    Py_INCREF(classify);
    Py_XSETREF(ev->classify, classify);
    Py_XSETREF(ev->kinds, PyDict_New());
    Py_XSETREF(ev->sites, PyDict_New());
    return ev->kinds && ev->sites ? 0 : -1;
}

static void Events_dealloc(Events *ev) {
    Py_XDECREF(ev->classify);
    Py_XDECREF(ev->kinds);
    Py_XDECREF(ev->sites);
    Py_TYPE(ev)->tp_free((PyObject *)ev);
}

static PyObject *Events_get_mask(Events *ev, void *closure) { return PyLong_FromUnsignedLong(ev->mask); }

static PyObject *Events_get_written(Events *ev, void *closure) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&ev->hdr[H_RECORDS], __ATOMIC_ACQUIRE));
}

static PyGetSetDef Events_getset[] = {
    {"mask", (getter)Events_get_mask, NULL, "What the log records (events.Mask bits).", NULL},
    {"written", (getter)Events_get_written, NULL, "Records appended so far (past the capacity: dropped).", NULL},
    {NULL},
};

static PyMethodDef Events_methods[] = {
    {"put", (PyCFunction)(void (*)(void))Events_put, METH_FASTCALL, "Append one record."},
    {"put_ranges", (PyCFunction)(void (*)(void))Events_put_ranges, METH_FASTCALL,
     "Append one record per (offset, length) of a sequence."},
    {"site", (PyCFunction)Events_site, METH_NOARGS, "The site id of the calling kernel line."},
    {"site_of", (PyCFunction)Events_site_of, METH_VARARGS, "The site id of (code, line)."},
    {"blob", (PyCFunction)Events_blob, METH_O, "Append bytes to the blob area; their offset or -1."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject EventsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmemx.udma._engine.Events",
    .tp_basicsize = sizeof(Events),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The event log of one PE (udma/events.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Events_init,
    .tp_dealloc = (destructor)Events_dealloc,
    .tp_methods = Events_methods,
    .tp_getset = Events_getset,
};

int shmemx_events_init(PyObject *m) {
    if (PyType_Ready(&EventsType) < 0) return -1;
    Py_INCREF(&EventsType);
    if (PyModule_AddObject(m, "Events", (PyObject *)&EventsType) < 0) { Py_DECREF(&EventsType); return -1; }
    return 0;
}
