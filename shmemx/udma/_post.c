/* The native posting path: one WRITE or READ from a put/get call, checked and posted without Python code.
 *
 * ``Poster.rw(remote, local, nelems, pe, qp_idx, opcode, flag, api)`` does what api/rma.py's checked path and
 * QueuePair.post_rw do for the plain case, and only for it (``Poster.notify``, the same for a put_signal and
 * QueuePair.post_bytes): exact ndarrays, C-contiguous, of one dtype, a count
 * in range, a remote view inside a live allocation of this PE's own heap copy, a local view that is this PE's
 * heap or lies in a live registration the Python path used lately, the calling thread the queue's submitter
 * (or the queue free: then it claims it, as QueuePair.claim does), room in the ring. Then it writes the same 64 bytes QueuePair.post_rw writes (a test pins them
 * equal), the sidecar word, head, cqe_cnt and the doorbell (last), kicks the engine, counts the WQE and records
 * the registration's use. Any other case returns -1 before touching anything, and the caller takes the Python
 * path, which raises the errors and handles claims, credit waits and registrations.
 *
 * Concurrency: everything here runs holding the interpreter lock (like the Python path it replaces), so no other
 * posting thread of this PE runs meanwhile; the registry's lock is only checked (if a collect holds it, the
 * Python path waits for it). The queue's posting state lives in a private int64 block (QueuePair reads and
 * writes the same words): head, tail, cqe_cnt, cq_tail, owner thread, owner block, WQEs and bytes posted.
 *
 * numpy arrays are read through the stable prefix of numpy's PyArrayObject (data, nd, dimensions, strides,
 * base, descr, flags), checked against numpy's own answers when the Poster is made (``probe``).
 */
#include "_config.h"
#include "_engine.h"

enum { ST_HEAD, ST_TAIL, ST_CQE_CNT, ST_CQ_TAIL, ST_OWNER, ST_OWNER_BLOCK, ST_N_POSTED, ST_B_POSTED, ST_DOORBELLS,
       ST_CQES, ST_WORDS };
#define NPY_C_CONTIGUOUS 0x0001
#define ASSIST_AFTER_NS 20000 /* a spinning quiet leaves a spinning engine this long to take its queue's work */

typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
} NpArray;

#define N_REGS 8
typedef struct {
    PyObject *reg, *uses;
    uint64_t addr, len, va;
    int writable;
} Reg;

/* A WRITE's source while --check fingerprints sources: its fingerprint at post, checked again by the quiet that
 * retires the WQE (a source refilled before its quiet). ``end``: the BB position after the WQE. */
typedef struct { uint32_t end, pos; uint8_t *addr; uint64_t len, hash; } Pin;
typedef struct { Pin *v; uint32_t first, n, cap; } Pins; /* one FIFO per queue */

typedef struct {
    PyObject_HEAD
    Engine *engine;
    Events *ev;                       /* the event log while observed (set_events), else NULL */
    PyObject *on_local, *on_retire;   /* --check's watch of local arrays in flight (set_watch), or NULL */
    PyObject *on_post;                /* --check's flush of derived heap views before a post (set_watch), or NULL */
    uint64_t *flights;                /* (queue, end BB, local VA, bytes) of WQEs on_local has not heard of yet */
    uint32_t n_flights, flights_cap;
    int hold_flights;                 /* a wqes_many: on_local hears of every segment's WQEs at its end */
    Pins *pins;                       /* per queue, while the log fingerprints sources */
    FpCache fp;                       /* chunk fingerprints of the current native call (fp_range) */
    PyObject *ndarray;                /* numpy.ndarray */
    PyObject *alt;                    /* an ndarray subclass the heap arrays may have (accept), or NULL */
    PyObject *state_obj;              /* keeps the state block alive */
    int64_t *st;                      /* [n_slots][ST_WORDS] */
    uint32_t *tpn, *tid, *token;      /* per queue: what QueuePair.post_rw packs */
    uint64_t *eid_lo, *eid_hi;
    PyObject **qidx;                  /* per queue: its index as an int (the key of a registration's uses) */
    uint64_t heap_va;                 /* this PE's heap VA */
    int64_t *alloc_lo, *alloc_hi;     /* this PE's live allocations, sorted */
    Py_ssize_t n_alloc;
    PyObject *reg_lock;               /* the registry's lock */
    Reg regs[N_REGS];
    int n_regs, next_reg;
    PyObject *descr[8];
    Py_ssize_t itemsize[8];
    PyObject *sig_descr[2];           /* int64, uint64: the dtypes of a put_signal's signal word */
    uint64_t wq_off, sidecar_off, cq_ctx_off;
    uint32_t credit_guard, dw0_base;
    int wq_head, wq_cqe_cnt, wq_tail_word, cq_tail_word, hw_cq_db;
} Poster;

static PyObject *s_last, *s_locked, *s_address, *s_nbytes, *s_va, *s_writable, *s_uses, *s_itemsize, *s_live;

static Py_ssize_t itemsize_of(Poster *p, PyObject *descr) {
    for (int k = 0; k < 8; k++)
        if (p->descr[k] == descr) return p->itemsize[k];
    PyObject *v = PyObject_GetAttr(descr, s_itemsize);
    if (!v) { PyErr_Clear(); return -1; }
    Py_ssize_t size = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (size <= 0) { PyErr_Clear(); return -1; }
    for (int k = 0; k < 8; k++)
        if (!p->descr[k]) {
            Py_INCREF(descr);
            p->descr[k] = descr;
            p->itemsize[k] = size;
            break;
        }
    return size;
}

static inline Py_ssize_t size_of(const NpArray *a) {
    Py_ssize_t n = 1;
    for (int k = 0; k < a->nd; k++) n *= a->dimensions[k];
    return n;
}

static inline int allocated(const Poster *p, int64_t off, int64_t nbytes) {
    Py_ssize_t lo = 0, hi = p->n_alloc;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (p->alloc_lo[mid] <= off) lo = mid + 1; else hi = mid;
    }
    return lo > 0 && off + nbytes <= p->alloc_hi[lo - 1];
}

/* Registrations the Python path used lately (LocalRegistry.seen), each valid while its ``live`` flag is set
 * (a collection clears it). */
static void forget(Poster *p) {
    for (int k = 0; k < N_REGS; k++) {
        Py_CLEAR(p->regs[k].reg);
        Py_CLEAR(p->regs[k].uses);
    }
    p->n_regs = 0;
}

static int remember(Poster *p, PyObject *reg) {
    PyObject *a = PyObject_GetAttr(reg, s_address), *n = PyObject_GetAttr(reg, s_nbytes),
             *v = PyObject_GetAttr(reg, s_va), *w = PyObject_GetAttr(reg, s_writable), *u = PyObject_GetAttr(reg, s_uses);
    int ok = a && n && v && w && u && PyDict_CheckExact(u);
    Reg r = {0};
    if (ok) {
        r.addr = PyLong_AsUnsignedLongLongMask(a);
        r.len = PyLong_AsUnsignedLongLongMask(n);
        r.va = PyLong_AsUnsignedLongLongMask(v);
        r.writable = PyObject_IsTrue(w);
        ok = !PyErr_Occurred();
    }
    Py_XDECREF(a); Py_XDECREF(n); Py_XDECREF(v); Py_XDECREF(w);
    if (!ok) { Py_XDECREF(u); if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "seen: not a Registration"); return -1; }
    int k = p->n_regs < N_REGS ? p->n_regs++ : (p->next_reg++ % N_REGS);
    Py_XDECREF(p->regs[k].reg);
    Py_XDECREF(p->regs[k].uses);
    Py_INCREF(reg);
    r.reg = reg;
    r.uses = u;
    p->regs[k] = r;
    return k;
}

/* The live registration holding local [addr, addr + nbytes), or NULL (the Python path registers). */
static Reg *registration(Poster *p, uint64_t addr, uint64_t nbytes) {
    int found = -1;
    for (int k = 0; k < p->n_regs && found < 0; k++)
        if (addr >= p->regs[k].addr && nbytes <= p->regs[k].len && addr - p->regs[k].addr <= p->regs[k].len - nbytes)
            found = k;
    if (found < 0) return NULL;
    Reg *r = &p->regs[found];
    PyObject *live = PyObject_GetAttr(r->reg, s_live); /* collected meanwhile: forget it */
    if (!live) { PyErr_Clear(); return NULL; }
    int ok = live == Py_True;
    Py_DECREF(live);
    if (!ok) {
        Py_CLEAR(r->reg);
        Py_CLEAR(r->uses);
        r->len = 0;
        return NULL;
    }
    PyObject *locked = PyObject_CallMethodNoArgs(p->reg_lock, s_locked); /* a collect in progress: Python waits */
    if (!locked) { PyErr_Clear(); return NULL; }
    int busy = locked == Py_True;
    Py_DECREF(locked);
    return busy ? NULL : r;
}

/* seen(registration): the Python path used it; remember it. */
static PyObject *Poster_seen(Poster *p, PyObject *reg) {
    for (int k = 0; k < p->n_regs; k++)
        if (p->regs[k].reg == reg) Py_RETURN_NONE;
    if (remember(p, reg) < 0) return NULL;
    Py_RETURN_NONE;
}

/* An ndarray, or the heap arrays' subclass (read through the same NpArray prefix). */
static inline int is_array(const Poster *p, PyObject *o) {
    PyObject *t = (PyObject *)Py_TYPE(o);
    return t == p->ndarray || (t == p->alt && p->alt);
}

/* A checked transfer: the queue, the remote heap offset, the bytes, the local VA and its registration. */
typedef struct {
    uint32_t q;
    int pe;
    int64_t roff;
    uint64_t nbytes, local_va;
    Reg *reg;
} Transfer;

/* The checks of the plain case (see the top); 0 when they pass, -1 when the Python path must take the call. */
static int transfer(Poster *p, PyObject *ro, PyObject *lo, PyObject *nel, PyObject *pe_o, PyObject *qp_o,
                    int writable, long slot, Transfer *t) {
    Engine *e = p->engine;
    if (!is_array(p, ro) || !is_array(p, lo) || !PyLong_CheckExact(nel)
        || !PyLong_CheckExact(pe_o) || !PyLong_CheckExact(qp_o))
        return -1;
    NpArray *r = (NpArray *)ro, *l = (NpArray *)lo;
    long long nelems = PyLong_AsLongLong(nel);
    long pe = PyLong_AsLong(pe_o), qp_idx = PyLong_AsLong(qp_o);
    if (PyErr_Occurred()) { PyErr_Clear(); return -1; }
    if (pe < 0 || pe >= e->n_pes || pe == e->my_pe || qp_idx < 0 || qp_idx >= e->qp_num) return -1;
    if (r->descr != l->descr || !(r->flags & NPY_C_CONTIGUOUS) || !(l->flags & NPY_C_CONTIGUOUS) || nelems <= 0
        || nelems > size_of(r) || nelems > size_of(l))
        return -1;
    Py_ssize_t item = itemsize_of(p, r->descr);
    if (item <= 0) return -1;
    t->nbytes = (uint64_t)nelems * (uint64_t)item;
    if (t->nbytes > e->L.max_msg) return -1;
    uint8_t *my_heap = e->heap[e->my_pe];
    t->roff = (int64_t)((uint8_t *)r->data - my_heap);
    if (t->roff < 0 || (uint64_t)t->roff >= e->heap_size || !allocated(p, t->roff, (int64_t)t->nbytes)) return -1;
    t->reg = NULL;
    int64_t loff = (int64_t)((uint8_t *)l->data - my_heap);
    if (loff >= 0 && (uint64_t)loff < e->heap_size && allocated(p, loff, (int64_t)t->nbytes)) {
        t->local_va = p->heap_va + (uint64_t)loff;
    } else {
        uint64_t addr = (uint64_t)(uintptr_t)l->data;
        t->reg = registration(p, addr, t->nbytes);
        if (!t->reg || (writable && !t->reg->writable)) return -1;
        t->local_va = t->reg->va + (addr - t->reg->addr);
    }
    t->pe = (int)pe;
    t->q = (uint32_t)(pe * e->qp_num + qp_idx);
    int64_t *st = p->st + (uint64_t)t->q * ST_WORDS;
    int64_t me = (int64_t)PyThread_get_thread_ident();
    if (st[ST_OWNER] == 0 && st[ST_N_POSTED] == 0) { /* a free queue: claim it (QueuePair.claim) */
        st[ST_OWNER] = me;
        st[ST_OWNER_BLOCK] = slot;
    }
    return st[ST_OWNER] == me ? 0 : -1;
}

/* Whether ``bbs`` more BBs leave the credit guard free. */
static inline int room(Poster *p, uint32_t q, uint32_t bbs) {
    int64_t *st = p->st + (uint64_t)q * ST_WORDS;
    return ((uint32_t)(st[ST_HEAD] + bbs - st[ST_TAIL])) + p->credit_guard < p->engine->sq_depth;
}

/* --- events (while the log is on: set_events) ----------------------------------------------------------
 *
 * What a post and a quiet tell the event log (udma/events.py has the record layouts): every doorbell one
 * DOORBELL record (queue, first BB, BBs, where its BBs went in the blob when the log keeps WQE bytes), then one
 * POST record per WQE decoded from the ring, after the WQEs were written and before the doorbell (a release:
 * stamped before it becomes visible), and a VALUE record for a small payload; every quiet one QUIET record after
 * its CQEs were consumed (an acquire), preceded by a SRC_CHANGED record for each source it retired whose bytes
 * changed since the post. The Python posting and polling paths (queues.py) call the same functions (Poster
 * emit_posted / emit_quiet), so each event has one writer. */

#define SMALL_PAYLOAD 32 /* payloads up to this many bytes are logged with their bytes (a flag, a generation) */

static void pin(Poster *p, uint32_t q, uint32_t end, uint32_t pos, uint8_t *addr, uint64_t len, uint64_t hash) {
    if (!p->pins) {
        p->pins = calloc(p->engine->n_slots, sizeof(Pins));
        if (!p->pins) return;
    }
    Pins *f = &p->pins[q];
    if (f->n == f->cap) {
        uint32_t cap = f->cap ? 2 * f->cap : 64;
        Pin *v = malloc(cap * sizeof(Pin));
        if (!v) return;
        for (uint32_t k = 0; k < f->n; k++) v[k] = f->v[(f->first + k) % f->cap];
        free(f->v);
        f->v = v; f->cap = cap; f->first = 0;
    }
    f->v[(f->first + f->n++) % f->cap] = (Pin){end, pos, addr, len, hash};
}

/* The sources of queue q retired up to ``tail``: a SRC_CHANGED record for each whose bytes changed. */
static void check_pins(Poster *p, uint32_t q, uint32_t tail, int64_t ts, long slot, uint32_t site) {
    Pins *f = p->pins ? &p->pins[q] : NULL;
    Engine *e = p->engine;
    while (f && f->n) {
        Pin *x = &f->v[f->first];
        if ((uint32_t)(tail - x->end) >= 0x80000000u) break; /* not retired yet */
        if (fp_range(&p->fp, x->addr, x->len) != x->hash)
            events_put(p->ev, ts, p->ev->k.src_changed, (int)slot, 0, site, (q / e->qp_num) | (q % e->qp_num) << 16,
                       x->pos, x->len, 0, 0, 0, 0);
        f->first = (f->first + 1) % f->cap;
        f->n--;
    }
}

/* The result ``r`` of a call of one of --check's hooks (set_watch): the interpreter lock is held (every caller
 * posts or quiets under it); an exception in the hook is reported, never raised here. */
static void watch_done(PyObject *hook, PyObject *r) {
    if (!r) PyErr_WriteUnraisable(hook);
    Py_XDECREF(r);
}

/* Tell --check's watch (Checker.retired) of a quiet that retired queue q's WQEs before BB ``tail``. */
static void watch_retired(Poster *p, uint32_t q, uint32_t tail) {
    watch_done(p->on_retire, PyObject_CallFunction(p->on_retire, "II", q, tail));
}

/* Tell --check's watch (Checker.in_flight) of the WQEs over local arrays noted since it last heard: one call with
 * their (queue, end BB, local VA, bytes) as native uint64 words, not one per WQE. */
static void watch_flush(Poster *p) {
    if (!p->n_flights || !p->on_local) {
        p->n_flights = 0;
        return;
    }
    PyObject *words = PyBytes_FromStringAndSize((const char *)p->flights, 32 * (Py_ssize_t)p->n_flights);
    p->n_flights = 0;
    watch_done(p->on_local, words ? PyObject_CallOneArg(p->on_local, words) : NULL);
    Py_XDECREF(words);
}

/* A WQE of queue q ending at BB ``end`` whose local side is [lva, lva + len) of a registered array. */
static void watch_note(Poster *p, uint32_t q, uint32_t end, uint64_t lva, uint64_t len) {
    if (p->n_flights == p->flights_cap) {
        uint32_t cap = p->flights_cap ? 2 * p->flights_cap : 256;
        uint64_t *v = realloc(p->flights, 32 * (size_t)cap);
        if (!v) watch_flush(p); /* (no room to keep it: the watch hears of what it has now) */
        else { p->flights = v; p->flights_cap = cap; }
    }
    if (p->n_flights == p->flights_cap) {
        watch_done(p->on_local, PyErr_NoMemory());
        return;
    }
    uint64_t *r = p->flights + 4 * (uint64_t)p->n_flights++;
    r[0] = q; r[1] = end; r[2] = lva; r[3] = len;
}

/* One WQE of queue q at BB ``pos`` (``w``: its bytes, two BBs unwrapped): its POST record, its pin, its value. */
static void emit_wqe(Poster *p, uint32_t q, uint32_t pos, const uint8_t *w, int64_t ts, long api, long slot,
                     uint32_t site) {
    Engine *e = p->engine;
    const Layout *L = &e->L;
    Events *ev = p->ev;
    uint32_t dw0, dw1, len = 0;
    uint64_t eid_lo, rva, lva = 0, sig = 0, value = 0, third = 0;
    memcpy(&dw0, w + 4 * L->w_dw0, 4);
    memcpy(&dw1, w + 4 * L->w_dw1, 4);
    memcpy(&eid_lo, w + 8 * L->q_eid_lo, 8);
    memcpy(&rva, w + 8 * L->q_rmt_va, 8);
    uint32_t op = (dw1 >> 8) & 0xFF, flag = (dw0 >> 16) & 0xFF;
    uint32_t peer = (uint32_t)(eid_lo & 0xFFFFFFFFu);
    if (peer >= (uint32_t)e->n_pes) peer = q / e->qp_num;
    uint64_t peer_va = e->heap_va_base + (uint64_t)peer * e->heap_va_stride;
    int notify = op == (uint32_t)L->op_notify, amo = op == (uint32_t)L->op_faa || op == (uint32_t)L->op_cas;
    int sge = notify ? L->notify_sge : 4 * L->w_sge_len;
    memcpy(&len, w + sge, 4);
    memcpy(&lva, w + (notify ? L->notify_sge + 8 : 8 * L->q_sge_va), 8);
    if (notify) {
        memcpy(&sig, w + L->notify_ctx + 8, 8);
        sig -= peer_va;
        memcpy(&value, w + L->notify_ctx + 16, 8);
    } else if (amo) {
        uint32_t size = len == 8 ? 8 : 4;
        memcpy(&value, w + L->amo_operand, size);
        if (op == (uint32_t)L->op_cas) memcpy(&third, w + L->amo_operand + size, size);
    }
    uint64_t loff = lva - p->heap_va, lref = lva;
    int flags = (int)(flag | (uint32_t)api << 8);
    if (lva >= p->heap_va && loff + len <= e->heap_size) {
        flags |= ev->k.local_heap;
        lref = loff;
    }
    int write = op == (uint32_t)L->op_write || notify;
    uint8_t *src = write && len ? shmemx_resolve_local(e, lva, len) : NULL;
    if (src && lva >= e->amo_va && lva - e->amo_va < e->amo_len) src = NULL; /* the amo scratch is no source */
    if (src && op == (uint32_t)L->op_write && len <= 8) memcpy(&value, src, len);
    uint32_t bbs = notify || amo ? 2 : 1;
    if (src && (ev->mask & ev->k.fingerprints)) {
        uint64_t hash = fp_range(&p->fp, src, len);
        third = (uint32_t)hash;
        pin(p, q, pos + bbs, pos, src, len, hash);
    }
    events_put(ev, ts, ev->k.post, (int)slot, flags, site,
               (uint64_t)pos | (uint64_t)peer << 32 | (uint64_t)(q % e->qp_num) << 48 | (uint64_t)op << 56,
               rva - peer_va, lref, sig, value, len, (uint32_t)third);
    if (src && len <= SMALL_PAYLOAD && (ev->mask & ev->k.wqe_bytes)) {
        uint64_t words[4] = {0};
        memcpy(words, src, len);
        events_put(ev, ts, ev->k.value, (int)slot, 0, site, pos, len, words[0], words[1], words[2],
                   (uint32_t)words[3], (uint32_t)(words[3] >> 32));
    }
    /* a source read, or a get's (or fetching atomic's) destination written */
    int local_side = write || amo || op == (uint32_t)L->op_read;
    if (p->on_local && local_side && len && !(flags & ev->k.local_heap)
        && !(lva >= e->amo_va && lva - e->amo_va < e->amo_len))
        watch_note(p, q, pos + bbs, lva, len);
}

/* The events of ``bbs`` BBs of queue q from ``head``, written and about to be doorbelled with ``cqes`` CQEs. */
static void emit_posted(Poster *p, uint32_t q, uint32_t head, uint32_t bbs, long api, long slot, long cqes) {
    if (p->on_post) /* while the call's arguments (heap views derived for it) are still alive */
        watch_done(p->on_post, PyObject_CallNoArgs(p->on_post));
    Engine *e = p->engine;
    const Layout *L = &e->L;
    Events *ev = p->ev;
    uint32_t mask = e->sq_depth - 1;
    const uint8_t *ring = sq_of(e, q);
    int64_t ts = now_ns();
    uint32_t site = (ev->mask & ev->k.sites) ? events_site(ev) : 0;
    int64_t blob = -1;
    if (ev->mask & ev->k.wqe_bytes) { /* the exact BBs, unwrapped, for the recording */
        uint32_t first = head & mask, part = bbs < e->sq_depth - first ? bbs : e->sq_depth - first;
        blob = events_blob(ev, ring + 64 * (uint64_t)first, 64 * (uint64_t)part);
        if (blob >= 0 && part < bbs && events_blob(ev, ring, 64 * (uint64_t)(bbs - part)) < 0) blob = -1;
    }
    events_put(ev, ts, ev->k.doorbell, (int)slot, (int)api, site, q, head, bbs, (uint64_t)blob, (uint64_t)cqes, 0, 0);
    uint8_t w[128];
    for (uint32_t k = 0; k < bbs;) {
        uint32_t pos = head + k;
        memcpy(w, ring + 64 * (uint64_t)(pos & mask), 64);
        uint32_t dw1;
        memcpy(&dw1, w + 4 * L->w_dw1, 4);
        uint32_t op = (dw1 >> 8) & 0xFF;
        uint32_t n = (op == (uint32_t)L->op_notify || op == (uint32_t)L->op_faa || op == (uint32_t)L->op_cas)
                     && k + 1 < bbs ? 2 : 1;
        if (n == 2) memcpy(w + 64, ring + 64 * (uint64_t)((pos + 1) & mask), 64);
        else memset(w + 64, 0, 64);
        emit_wqe(p, q, pos, w, ts, api, slot, site);
        k += n;
    }
    if (!p->hold_flights) watch_flush(p);
}

/* A quiet of queue q that returned: its SRC_CHANGED records, then its QUIET record (after the CQEs). */
static void emit_quiet(Poster *p, uint32_t q, long call, uint32_t target, int64_t t0, long slot, uint32_t consumed) {
    Engine *e = p->engine;
    Events *ev = p->ev;
    int64_t ts = now_ns();
    uint32_t site = (ev->mask & ev->k.sites) ? events_site(ev) : 0;
    uint32_t tail = (uint32_t)p->st[(uint64_t)q * ST_WORDS + ST_TAIL];
    check_pins(p, q, tail, ts, slot, site);
    events_put(ev, ts, ev->k.quiet, (int)slot, 0, site,
               (q / e->qp_num) | (uint64_t)(q % e->qp_num) << 16 | (uint64_t)(call & 0xFF) << 24, tail, target,
               (uint64_t)t0, consumed, 0, 0);
    if (p->on_retire) watch_retired(p, q, tail);
}

/* Words 0-11 of a WQE of this queue (the SQE base: what every opcode shares). */
static void sqe_base(Poster *p, const Transfer *t, uint32_t *w, long opcode, long flag) {
    Engine *e = p->engine;
    const Layout *L = &e->L;
    uint32_t q = t->q;
    w[L->w_dw0] = p->dw0_base | ((uint32_t)flag & 0xFF) << 16;
    w[L->w_dw1] = ((uint32_t)opcode & 0xFF) << 8;
    w[L->w_tp] = (p->tpn[q] & 0xFFFFFF) | 1u << 24;
    w[L->w_seg] = p->tid[q];
    memcpy(w + 2 * L->q_eid_lo, &p->eid_lo[q], 8);
    memcpy(w + 2 * L->q_eid_hi, &p->eid_hi[q], 8);
    w[L->w_token] = p->token[q];
    uint64_t rva = e->heap_va_base + (uint64_t)t->pe * e->heap_va_stride + (uint64_t)t->roff;
    memcpy(w + 2 * L->q_rmt_va, &rva, 8);
}

/* Store ``bbs`` BBs at the head (a two-BB WQE at the last slot wraps), the sidecar word, head, cqe_cnt, the
 * doorbell (last); kick the engine; count; record the registration's use. Returns the BB position. */
static PyObject *publish(Poster *p, const Transfer *t, const uint32_t *w, uint32_t bbs, long flag, long api,
                         long slot) {
    Engine *e = p->engine;
    uint32_t q = t->q;
    int64_t *st = p->st + (uint64_t)q * ST_WORDS;
    uint32_t head = (uint32_t)st[ST_HEAD], mask = e->sq_depth - 1;
    PyObject *pos = PyLong_FromUnsignedLong(head);
    if (!pos) return NULL;
    if (t->reg) {
        PyObject *use = PyLong_FromUnsignedLong(head + bbs);
        if (!use || PyDict_SetItem(t->reg->uses, p->qidx[q], use) < 0) { Py_XDECREF(use); Py_DECREF(pos); return NULL; }
        Py_DECREF(use);
    }
    uint8_t *ring = sq_of(e, q);
    for (uint32_t k = 0; k < bbs; k++)
        memcpy(ring + 64 * (uint64_t)((head + k) & mask), w + 16 * k, 64);
    uint32_t *sidecar = (uint32_t *)(e->seg + p->sidecar_off) + (uint64_t)q * e->sq_depth;
    sidecar[head & mask] = (uint32_t)api | (uint32_t)st[ST_OWNER_BLOCK] << 8;
    uint32_t *wq = (uint32_t *)(e->seg + p->wq_off + 64 * (uint64_t)q);
    uint32_t next = head + bbs;
    st[ST_HEAD] = next;
    wq[p->wq_head] = next;
    int cqe = (flag & e->L.cqe_flag) != 0;
    if (cqe) {
        st[ST_CQE_CNT] = (uint32_t)(st[ST_CQE_CNT] + 1);
        wq[p->wq_cqe_cnt] = (uint32_t)st[ST_CQE_CNT];
    }
    if (p->ev) emit_posted(p, q, head, bbs, api, slot, cqe);
    st[ST_DOORBELLS] += 1;
    st32(hw_of(e, q) + e->L.hw_sq_db, next); /* the doorbell, last */
    st[ST_N_POSTED] += 1;
    st[ST_B_POSTED] += (int64_t)t->nbytes;
    shmemx_engine_rung(e, q, head, bbs); /* a small WQE on an idle queue: executed now, by this thread */
    return pos;
}

/* The start of a native call: fingerprints of sources kept from an earlier call may be stale now. */
static inline void begin_call(Poster *p) {
    if (p->ev && (p->ev->mask & p->ev->k.fingerprints)) fp_begin(&p->fp);
}

/* rw(remote, local, nelems, pe, qp_idx, opcode, flag, api, slot) -> BB position, or -1: take the Python path.
 * ``slot``: the calling thread's AIV block (waits.thread_slot), which becomes the submitter of a free queue. */
static PyObject *Poster_rw(Poster *p, PyObject *const *args, Py_ssize_t nargs) {
    begin_call(p);
    if (nargs != 9) { PyErr_SetString(PyExc_TypeError, "rw takes 9 arguments"); return NULL; }
    long opcode = PyLong_AsLong(args[5]), flag = PyLong_AsLong(args[6]), api = PyLong_AsLong(args[7]);
    long slot = PyLong_AsLong(args[8]);
    if (PyErr_Occurred()) return NULL;
    Transfer t;
    if (transfer(p, args[0], args[1], args[2], args[3], args[4], opcode == p->engine->L.op_read, slot, &t) < 0
        || !room(p, t.q, 1))
        return PyLong_FromLong(-1);
    const Layout *L = &p->engine->L;
    uint32_t w[16] = {0};
    sqe_base(p, &t, w, opcode, flag);
    w[L->w_sge_len] = (uint32_t)t.nbytes;
    memcpy(w + 2 * L->q_sge_va, &t.local_va, 8);
    return publish(p, &t, w, 1, flag, api, slot);
}

/* notify(dst, src, nelems, sig_addr, signal, pe, qp_idx, flag, api, slot) -> BB position, or -1: one
 * WRITE_WITH_NOTIFY whose signal word (a 64-bit integer word in a live allocation of this heap, 8-aligned) is SET
 * to ``signal``. */
static PyObject *Poster_notify(Poster *p, PyObject *const *args, Py_ssize_t nargs) {
    begin_call(p);
    if (nargs != 10) { PyErr_SetString(PyExc_TypeError, "notify takes 10 arguments"); return NULL; }
    Engine *e = p->engine;
    const Layout *L = &e->L;
    long flag = PyLong_AsLong(args[7]), api = PyLong_AsLong(args[8]), slot = PyLong_AsLong(args[9]);
    if (PyErr_Occurred()) return NULL;
    PyObject *so = args[3], *sv = args[4];
    if (!is_array(p, so) || !PyLong_CheckExact(sv)) return PyLong_FromLong(-1);
    PyObject *sd = ((NpArray *)so)->descr;
    if (sd != p->sig_descr[0] && sd != p->sig_descr[1]) return PyLong_FromLong(-1);
    int overflow = 0;
    uint64_t value;
    long long as_signed = PyLong_AsLongLongAndOverflow(sv, &overflow);
    if (overflow > 0) {
        value = PyLong_AsUnsignedLongLong(sv);
        if (PyErr_Occurred()) { PyErr_Clear(); return PyLong_FromLong(-1); }
    } else if (overflow < 0 || (as_signed == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return PyLong_FromLong(-1);
    } else {
        value = (uint64_t)as_signed;
    }
    int64_t soff = (int64_t)((uint8_t *)((NpArray *)so)->data - e->heap[e->my_pe]);
    if (soff < 0 || (uint64_t)soff >= e->heap_size || soff % 8 || !allocated(p, soff, 8)) return PyLong_FromLong(-1);
    Transfer t;
    if (transfer(p, args[0], args[1], args[2], args[5], args[6], 0, slot, &t) < 0 || !room(p, t.q, 2))
        return PyLong_FromLong(-1);
    uint32_t w[32] = {0};
    sqe_base(p, &t, w, L->op_notify, flag);
    uint8_t *b = (uint8_t *)w;
    uint64_t ctx0 = (uint64_t)p->tid[t.q] | (uint64_t)p->token[t.q] << 32;
    uint64_t sva = e->heap_va_base + (uint64_t)t.pe * e->heap_va_stride + (uint64_t)soff;
    memcpy(b + L->notify_ctx, &ctx0, 8);
    memcpy(b + L->notify_ctx + 8, &sva, 8);
    memcpy(b + L->notify_ctx + 16, &value, 8);
    uint32_t len = (uint32_t)t.nbytes;
    memcpy(b + L->notify_sge, &len, 4);
    memcpy(b + L->notify_sge + 8, &t.local_va, 8);
    return publish(p, &t, w, 2, flag, api, slot);
}

/* Store ``bbs`` BBs of built WQEs (``src``) for queue index ``q``: each a one-BB WRITE / READ or a two-BB
 * WRITE_WITH_NOTIFY (any other opcode, a WQE cut at the end, no room or another submitter: -1 before touching
 * anything). Stores them at the head (wrapping BB by BB, as RawQueue.write does), every BB's sidecar word, head,
 * cqe_cnt += cqes and the doorbell (last), and counts the WQEs and their SGE bytes as ring_doorbell's scan does;
 * the caller kicks the engine. Returns the BB position after them. */
static int64_t store_wqes(Poster *p, long q, const uint8_t *src, uint32_t bbs, long cqes, long api, long slot) {
    Engine *e = p->engine;
    const Layout *L = &e->L;
    if (q < 0 || q >= (long)e->n_pes * e->qp_num || q / e->qp_num == e->my_pe || cqes < 0) return -1;
    if (!bbs || bbs >= e->sq_depth || !room(p, (uint32_t)q, bbs)) return -1;
    int64_t n_wqes = 0, nbytes = 0;
    for (uint32_t k = 0; k < bbs;) {
        uint32_t dw1;
        memcpy(&dw1, src + 64 * (uint64_t)k + 4 * L->w_dw1, 4);
        long op = (dw1 >> 8) & 0xFF;
        uint32_t len;
        if (op == L->op_write || op == L->op_read) {
            memcpy(&len, src + 64 * (uint64_t)k + 4 * L->w_sge_len, 4);
            k += 1;
        } else if (op == L->op_notify && k + 1 < bbs) {
            memcpy(&len, src + 64 * (uint64_t)k + L->notify_sge, 4);
            k += 2;
        } else {
            return -1;
        }
        n_wqes++;
        nbytes += len;
    }
    int64_t *st = p->st + (uint64_t)q * ST_WORDS;
    int64_t me = (int64_t)PyThread_get_thread_ident();
    if (st[ST_OWNER] == 0 && st[ST_N_POSTED] == 0) { /* a free queue: claim it (QueuePair.claim) */
        st[ST_OWNER] = me;
        st[ST_OWNER_BLOCK] = slot;
    }
    if (st[ST_OWNER] != me) return -1;
    uint32_t head = (uint32_t)st[ST_HEAD], mask = e->sq_depth - 1;
    uint8_t *ring = sq_of(e, (uint32_t)q);
    uint32_t *sidecar = (uint32_t *)(e->seg + p->sidecar_off) + (uint64_t)q * e->sq_depth;
    uint32_t side = (uint32_t)api | (uint32_t)st[ST_OWNER_BLOCK] << 8;
    for (uint32_t k = 0; k < bbs; k++) {
        memcpy(ring + 64 * (uint64_t)((head + k) & mask), src + 64 * (uint64_t)k, 64);
        sidecar[(head + k) & mask] = side;
    }
    uint32_t *wq = (uint32_t *)(e->seg + p->wq_off + 64 * (uint64_t)q);
    uint32_t next = head + bbs;
    st[ST_HEAD] = next;
    wq[p->wq_head] = next;
    if (cqes) {
        st[ST_CQE_CNT] = (uint32_t)(st[ST_CQE_CNT] + (uint32_t)cqes);
        wq[p->wq_cqe_cnt] = (uint32_t)st[ST_CQE_CNT];
    }
    if (p->ev) emit_posted(p, (uint32_t)q, head, bbs, api, slot, cqes);
    st[ST_DOORBELLS] += 1;
    st32(hw_of(e, (uint32_t)q) + L->hw_sq_db, next); /* the doorbell, last */
    st[ST_N_POSTED] += n_wqes;
    st[ST_B_POSTED] += nbytes;
    return next;
}

/* wqes(q, data, cqes, api, slot) -> the BB position after them, or -1: take the Python path (RawQueue.post =
 * reserve + write + ring_doorbell). ``data``: whole BBs of already built WQEs for queue index ``q`` (a
 * C-contiguous buffer), stored as store_wqes does; one kick. */
static PyObject *Poster_wqes(Poster *p, PyObject *const *args, Py_ssize_t nargs) {
    begin_call(p);
    if (nargs != 5) { PyErr_SetString(PyExc_TypeError, "wqes takes 5 arguments"); return NULL; }
    long q = PyLong_AsLong(args[0]), cqes = PyLong_AsLong(args[2]), api = PyLong_AsLong(args[3]);
    long slot = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_C_CONTIGUOUS) < 0) { PyErr_Clear(); return PyLong_FromLong(-1); }
    int64_t next = -1;
    if (view.len % 64 == 0 && view.len / 64 < p->engine->sq_depth)
        next = store_wqes(p, q, view.buf, (uint32_t)(view.len / 64), cqes, api, slot);
    PyBuffer_Release(&view);
    if (next < 0) return PyLong_FromLong(-1);
    kick(p->engine);
    return PyLong_FromLongLong(next);
}

/* wqes_many(queues, bbs, cqes, data, heads, api, slot) -> how many segments were posted (a prefix). ``data``:
 * whole BBs of built WQEs, segment after segment; segment i (``bbs[i]`` BBs, ``cqes[i]`` of them with a CQE)
 * goes to queue index ``queues[i]`` with one doorbell, as ``wqes`` posts it; ``heads[i]`` receives the BB
 * position after it. ``queues``, ``bbs``, ``cqes``, ``heads``: C-contiguous int64 buffers of one length. Stops
 * at the first segment ``wqes`` would refuse (the caller posts the rest through RawQueue.post, which takes the
 * Python path where needed); one kick for everything posted. */
static PyObject *Poster_wqes_many(Poster *p, PyObject *const *args, Py_ssize_t nargs) {
    begin_call(p);
    if (nargs != 7) { PyErr_SetString(PyExc_TypeError, "wqes_many takes 7 arguments"); return NULL; }
    long api = PyLong_AsLong(args[5]), slot = PyLong_AsLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer v[5];
    int got = 0;
    for (; got < 5; got++) {
        int flags = got == 4 ? PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE : PyBUF_C_CONTIGUOUS;
        if (PyObject_GetBuffer(args[got], &v[got], flags) < 0) break;
    }
    Py_ssize_t done = 0;
    if (got < 5) {
        for (int k = 0; k < got; k++) PyBuffer_Release(&v[k]);
        return NULL;
    }
    Py_ssize_t m = v[0].len / 8;
    if (v[0].len % 8 || v[1].len != v[0].len || v[2].len != v[0].len || v[4].len != v[0].len || v[3].len % 64) {
        PyErr_SetString(PyExc_ValueError, "wqes_many: queues, bbs, cqes and heads must be int64 of one length, "
                                          "data whole BBs");
        for (int k = 0; k < 5; k++) PyBuffer_Release(&v[k]);
        return NULL;
    }
    const int64_t *qs = v[0].buf, *bbs = v[1].buf, *cqes = v[2].buf;
    int64_t *heads = v[4].buf;
    const uint8_t *src = v[3].buf;
    uint64_t at = 0, total = (uint64_t)v[3].len / 64;
    p->hold_flights = 1;
    for (; done < m; done++) {
        if (bbs[done] <= 0 || (uint64_t)bbs[done] > total - at) break;
        int64_t next = store_wqes(p, (long)qs[done], src + 64 * at, (uint32_t)bbs[done], (long)cqes[done], api, slot);
        if (next < 0) break;
        heads[done] = next;
        at += (uint64_t)bbs[done];
    }
    p->hold_flights = 0;
    watch_flush(p);
    if (done) kick(p->engine);
    for (int k = 0; k < 5; k++) PyBuffer_Release(&v[k]);
    return PyLong_FromSsize_t(done);
}

static inline int cqe_written(Engine *e, uint32_t q, uint32_t pos) {
    uint32_t word = ld32(cq_of(e, q) + 16 * (uint64_t)(pos % e->cq_depth) + e->L.c_status);
    return ((word >> e->L.owner_shift) & 1) == (((pos / e->cq_depth) & 1) ^ 1);
}

/* quiet(pe, qp_idx, spin_ns, call, slot) -> -1 (take the Python path: QueuePair.poll) or bits: 1 the CQ tail
 * advanced (run the retire hook), 2 the caller's queue is retired to its head (release it). Consumes the CQEs
 * up to cqe_cnt when the engine has written them all, none is an error and the queue is not in error, executing
 * the queue's rung WQEs itself when the engine is not at them (shmemx_engine_assist) and spinning for them up to
 * spin_ns, without the interpreter lock; anything else is the Python path's (which sleeps, records the wait,
 * raises). ``call`` (a WaitCall) and ``slot`` (the caller's block) are what the quiet's event says. */
/* The quiet of queue index ``q`` (not this PE's own): the bits of ``quiet``, or -1. */
static int quiet_one(Poster *p, uint32_t q, long long spin_ns, long call, long slot) {
    int64_t t0 = p->ev ? now_ns() : 0;
    Engine *e = p->engine;
    const Layout *L = &e->L;
    int64_t *st = p->st + (uint64_t)q * ST_WORDS;
    uint32_t *hw = hw_of(e, q);
    uint32_t t = (uint32_t)st[ST_CQ_TAIL], target = (uint32_t)st[ST_CQE_CNT];
    uint32_t n = target - t;
    if (n > e->cq_depth || ld32(hw + L->hw_state)) return -1;
    int bits = 0;
    if (n) {
        uint32_t last = target - 1;
        if (!cqe_written(e, q, last)) {
            /* with no spin (PEs outnumber cores: the engine sleeps or waits for a core) execute the queue's WQEs on
             * this thread (shmemx_engine_assist), after the engine's current turn if one runs: the rows were just
             * written by this thread, so they are in this core's caches. With a spin the engine is awake and
             * spinning too: let it work (taking the copy off its core would move the buffers' cache lines between
             * cores on every put) and assist only when it has not taken the work after ASSIST_AFTER_NS (it
             * yielded its core to another job of a loaded host). Meanwhile, when the engine copies a large payload
             * (a WRITE of at least coop_min bytes), copy chunks of it too (shmemx_engine_help), so that both cores
             * copy, as a caller's own memcpy would take one */
            Py_BEGIN_ALLOW_THREADS
            int64_t now = now_ns(), end = now + spin_ns, assist_at = spin_ns > 0 ? now + ASSIST_AFTER_NS : 0;
            for (unsigned k = 0; !cqe_written(e, q, last); k++) {
                if (spin_ns > 0 && shmemx_engine_help(e)) { /* copied chunks of a large payload: spin on */
                    now = now_ns();
                    end = now + spin_ns;
                    continue;
                }
                if ((k & 63) == 0) {
                    now = k ? now_ns() : now;
                    if (now >= assist_at && shmemx_engine_assist(e, q, spin_ns <= 0)) continue;
                    if (cqe_written(e, q, last) || spin_ns <= 0 || now >= end) break;
                    if (k) sched_yield();
                } else {
                    __builtin_ia32_pause();
                }
            }
            Py_END_ALLOW_THREADS
            if ((uint32_t)st[ST_CQ_TAIL] != t || (uint32_t)st[ST_CQE_CNT] != target) return -1;
        }
        if (!cqe_written(e, q, last) || ld32(hw + L->hw_state)) return -1;
        uint32_t *cq = cq_of(e, q);
        for (uint32_t pos = t; pos != target; pos++)
            if (cq[16 * (uint64_t)(pos % e->cq_depth) + L->c_status] >> 16) return -1;
        uint32_t entry_idx = cq[16 * (uint64_t)(last % e->cq_depth) + L->c_entry_idx] & 0xFFFF;
        uint32_t tail = (uint32_t)st[ST_TAIL];
        tail = tail + ((entry_idx - tail) & 0xFFFF);
        st[ST_TAIL] = tail;
        st[ST_CQ_TAIL] = target;
        st[ST_CQES] += n;
        ((uint32_t *)(e->seg + p->cq_ctx_off + 64 * (uint64_t)q))[p->cq_tail_word] = target;
        hw[p->hw_cq_db] = target & 0xFFFFFF;
        ((uint32_t *)(e->seg + p->wq_off + 64 * (uint64_t)q))[p->wq_tail_word] = tail;
        bits |= 1;
    }
    if (st[ST_OWNER] == (int64_t)PyThread_get_thread_ident() && (uint32_t)st[ST_TAIL] == (uint32_t)st[ST_HEAD])
        bits |= 2;
    if (p->ev) emit_quiet(p, q, call, target, t0, slot, n);
    return bits;
}

static PyObject *Poster_quiet(Poster *p, PyObject *const *args, Py_ssize_t nargs) {
    begin_call(p);
    if (nargs != 5) { PyErr_SetString(PyExc_TypeError, "quiet takes 5 arguments"); return NULL; }
    Engine *e = p->engine;
    if (!PyLong_CheckExact(args[0]) || !PyLong_CheckExact(args[1])) return PyLong_FromLong(-1);
    long pe = PyLong_AsLong(args[0]), qp_idx = PyLong_AsLong(args[1]);
    long long spin_ns = PyLong_AsLongLong(args[2]);
    long call = PyLong_AsLong(args[3]), slot = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) { PyErr_Clear(); return PyLong_FromLong(-1); }
    if (pe < 0 || pe >= e->n_pes || pe == e->my_pe || qp_idx < 0 || qp_idx >= e->qp_num) return PyLong_FromLong(-1);
    return PyLong_FromLong(quiet_one(p, (uint32_t)(pe * e->qp_num + qp_idx), spin_ns, call, slot));
}

/* quiet_many(queues, bits, spin_ns, call, slot) -> how many queues were quieted (a prefix): ``quiet`` of queue
 * index ``queues[i]`` in turn, its bits into ``bits[i]``, stopping at the first that needs the Python path (-1).
 * Without a spin (PEs outnumber cores) every queue's rung WQEs are first executed in one assist
 * (shmemx_engine_assist_many), so that the quiets find their CQEs written.
 * ``queues``, ``bits``: C-contiguous int64 buffers of one length. */
static PyObject *Poster_quiet_many(Poster *p, PyObject *const *args, Py_ssize_t nargs) {
    begin_call(p);
    if (nargs != 5) { PyErr_SetString(PyExc_TypeError, "quiet_many takes 5 arguments"); return NULL; }
    Engine *e = p->engine;
    long long spin_ns = PyLong_AsLongLong(args[2]);
    long call = PyLong_AsLong(args[3]), slot = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer qv, bv;
    if (PyObject_GetBuffer(args[0], &qv, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &bv, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&qv);
        return NULL;
    }
    if (qv.len % 8 || bv.len != qv.len) {
        PyBuffer_Release(&qv); PyBuffer_Release(&bv);
        PyErr_SetString(PyExc_ValueError, "quiet_many: queues and bits must be int64 of one length");
        return NULL;
    }
    const int64_t *qs = qv.buf;
    int64_t *bits = bv.buf;
    Py_ssize_t m = qv.len / 8, done = 0;
    if (spin_ns <= 0 && m > 1) { /* PEs outnumber cores: assist every queue at once, under one turn lock */
        Py_BEGIN_ALLOW_THREADS
        shmemx_engine_assist_many(e, qs, m);
        Py_END_ALLOW_THREADS
    }
    for (; done < m; done++) {
        int64_t q = qs[done];
        if (q < 0 || q >= (int64_t)e->n_pes * e->qp_num || q / e->qp_num == e->my_pe) break;
        int b = quiet_one(p, (uint32_t)q, spin_ns, call, slot);
        if (b < 0) break;
        bits[done] = b;
    }
    PyBuffer_Release(&qv); PyBuffer_Release(&bv);
    return PyLong_FromSsize_t(done);
}

/* accept(type): arrays of this ndarray subclass (the heap arrays of check mode) post as ndarrays do. */
static PyObject *Poster_accept(Poster *p, PyObject *arg) {
    if (!PyType_Check(arg) || !PyType_IsSubtype((PyTypeObject *)arg, (PyTypeObject *)p->ndarray)) {
        PyErr_SetString(PyExc_TypeError, "accept: an ndarray subclass");
        return NULL;
    }
    Py_INCREF(arg);
    Py_XSETREF(p->alt, arg);
    Py_RETURN_NONE;
}

/* set_events(log or None): the event log the posts and quiets write into (udma/events.py), or none. */
static PyObject *Poster_set_events(Poster *p, PyObject *arg) {
    if (arg != Py_None && !PyObject_TypeCheck(arg, &EventsType)) {
        PyErr_SetString(PyExc_TypeError, "set_events: an _engine.Events or None");
        return NULL;
    }
    Py_XINCREF(arg == Py_None ? NULL : arg);
    Py_XSETREF(p->ev, arg == Py_None ? NULL : (Events *)arg);
    Py_RETURN_NONE;
}

/* set_watch(on_local, on_retire[, on_post]) or set_watch(None, None): --check's hooks (check/recorder.py
 * Checker): the WQEs whose local side is a registered array (a WRITE's or NOTIFY's source, a READ's or fetching
 * atomic's destination; not the heap, not the atomics' scratch) call on_local(words) after their POST records,
 * once per doorbell (per wqes_many call), ``words`` holding (queue, end BB, local VA, bytes) of each as native
 * uint64; every quiet calls on_retire(queue, tail) after its QUIET record; every post calls
 * on_post() before its records, while the heap views the kernel derived for the call are alive (a view that dies
 * unused before the next event counts as read by C code: one handed to the API was not). */
static PyObject *Poster_set_watch(Poster *p, PyObject *args) {
    PyObject *on_local, *on_retire, *on_post = Py_None;
    if (!PyArg_ParseTuple(args, "OO|O", &on_local, &on_retire, &on_post)) return NULL;
    if ((on_local != Py_None && !PyCallable_Check(on_local)) || (on_retire != Py_None && !PyCallable_Check(on_retire))
        || (on_post != Py_None && !PyCallable_Check(on_post))) {
        PyErr_SetString(PyExc_TypeError, "set_watch: callables or None");
        return NULL;
    }
    Py_XSETREF(p->on_local, on_local == Py_None ? NULL : Py_NewRef(on_local));
    Py_XSETREF(p->on_retire, on_retire == Py_None ? NULL : Py_NewRef(on_retire));
    Py_XSETREF(p->on_post, on_post == Py_None ? NULL : Py_NewRef(on_post));
    Py_RETURN_NONE;
}

static int event_args(Poster *p, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *out) {
    if (nargs != want) { PyErr_Format(PyExc_TypeError, "takes %zd arguments", want); return -1; }
    for (Py_ssize_t k = 0; k < nargs; k++) {
        out[k] = PyLong_AsLongLong(args[k]);
        if (out[k] == -1 && PyErr_Occurred()) return -1;
    }
    if (out[0] < 0 || out[0] >= p->engine->n_slots) { PyErr_SetString(PyExc_ValueError, "queue index out of range"); return -1; }
    return 0;
}

/* emit_posted(q, head, bbs, api, slot, cqes): the events of WQEs the Python path wrote at [head, head + bbs) of
 * queue index q, before it rings their doorbell (what the native posts emit themselves). */
static PyObject *Poster_emit_posted(Poster *p, PyObject *const *args, Py_ssize_t nargs) {
    begin_call(p);
    long long a[6];
    if (event_args(p, args, nargs, 6, a) < 0) return NULL;
    if (p->ev && a[2] > 0) emit_posted(p, (uint32_t)a[0], (uint32_t)a[1], (uint32_t)a[2], (long)a[3], (long)a[4], (long)a[5]);
    Py_RETURN_NONE;
}

/* emit_quiet(q, call, target, t0, slot, consumed): the events of a quiet of queue index q that the Python path
 * made (QueuePair.poll), after its CQEs and before the retire hook may drop a registration. */
static PyObject *Poster_emit_quiet(Poster *p, PyObject *const *args, Py_ssize_t nargs) {
    begin_call(p);
    long long a[6];
    if (event_args(p, args, nargs, 6, a) < 0) return NULL;
    if (p->ev) emit_quiet(p, (uint32_t)a[0], (long)a[1], (uint32_t)a[2], a[3], (long)a[4], (uint32_t)a[5]);
    Py_RETURN_NONE;
}

/* fingerprint(buffer) -> the 64-bit fingerprint a source gets at its post (tests). */
static PyObject *Poster_fingerprint(Poster *p, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    fp_begin(&p->fp);
    uint64_t h = fp_range(&p->fp, view.buf, (uint64_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

/* set_allocations(starts, ends): this PE's live heap allocations as two bytes objects of native int64. */
static PyObject *Poster_set_allocations(Poster *p, PyObject *args) {
    Py_buffer lo, hi;
    if (!PyArg_ParseTuple(args, "y*y*", &lo, &hi)) return NULL;
    Py_ssize_t n = lo.len / 8;
    int64_t *a = n ? PyMem_Malloc(n * 8) : NULL, *b = n ? PyMem_Malloc(n * 8) : NULL;
    if (hi.len != lo.len || (n && (!a || !b))) {
        PyMem_Free(a); PyMem_Free(b);
        PyBuffer_Release(&lo); PyBuffer_Release(&hi);
        return hi.len != lo.len ? (PyErr_SetString(PyExc_ValueError, "set_allocations: lengths differ"), NULL)
                                : PyErr_NoMemory();
    }
    if (n) { memcpy(a, lo.buf, n * 8); memcpy(b, hi.buf, n * 8); }
    PyMem_Free(p->alloc_lo); PyMem_Free(p->alloc_hi);
    p->alloc_lo = a; p->alloc_hi = b; p->n_alloc = n;
    PyBuffer_Release(&lo); PyBuffer_Release(&hi);
    Py_RETURN_NONE;
}

/* probe(arr) -> (data address, nd, shape, C-contiguous, id(descr)): what this file reads of an ndarray. */
static PyObject *Poster_probe(Poster *p, PyObject *arr) {
    if ((PyObject *)Py_TYPE(arr) != p->ndarray) { PyErr_SetString(PyExc_TypeError, "probe: not an ndarray"); return NULL; }
    NpArray *a = (NpArray *)arr;
    if (a->nd < 0 || a->nd > 32) { PyErr_SetString(PyExc_ValueError, "probe: implausible nd"); return NULL; }
    PyObject *shape = PyTuple_New(a->nd);
    if (!shape) return NULL;
    for (int k = 0; k < a->nd; k++) PyTuple_SET_ITEM(shape, k, PyLong_FromSsize_t(a->dimensions[k]));
    return Py_BuildValue("(KiNiK)", (unsigned long long)(uintptr_t)a->data, a->nd, shape,
                         (a->flags & NPY_C_CONTIGUOUS) != 0, (unsigned long long)(uintptr_t)a->descr);
}

static int get(PyObject *d, const char *name, uint64_t *out) { return config_u64(d, "poster config", name, out); }
static int get_array(PyObject *d, const char *name, Py_ssize_t n, uint64_t *out) {
    return config_list(d, "poster config", name, n, out);
}

/* Poster(engine, ndarray, registry, state, signal_dtypes, config): config holds the layout words this file needs (wq_head,
 * wq_cqe_cnt, dw0_base, credit_guard), where the tables are (wq_off, sidecar_off, state_addr,
 * heap_va) and per queue (lists of n_slots) tpn, tid, token, eid_lo, eid_hi. */
static int Poster_init(Poster *p, PyObject *args, PyObject *kw) {
    PyObject *engine, *ndarray, *registry, *state, *cfg, *sig0, *sig1;
    if (!PyArg_ParseTuple(args, "O!OOO(OO)O!", &EngineType, &engine, &ndarray, &registry, &state, &sig0, &sig1,
                          &PyDict_Type, &cfg))
        return -1;
    Engine *e = (Engine *)engine;
    uint64_t v, state_addr;
    if (get(cfg, "wq_off", &p->wq_off) || get(cfg, "sidecar_off", &p->sidecar_off) || get(cfg, "heap_va", &p->heap_va)
        || get(cfg, "cq_ctx_off", &p->cq_ctx_off)
        || get(cfg, "state_addr", &state_addr))
        return -1;
#define G(name) if (get(cfg, #name, &v)) return -1; p->name = v;
    G(credit_guard) G(dw0_base) G(wq_head) G(wq_cqe_cnt) G(wq_tail_word) G(cq_tail_word) G(hw_cq_db)
#undef G
    Py_ssize_t n = e->n_slots;
    uint64_t *tmp = PyMem_Calloc(n, 8);
    p->tpn = calloc(n, 4); p->tid = calloc(n, 4); p->token = calloc(n, 4);
    p->eid_lo = calloc(n, 8); p->eid_hi = calloc(n, 8); p->qidx = calloc(n, sizeof(PyObject *));
    if (!tmp || !p->tpn || !p->tid || !p->token || !p->eid_lo || !p->eid_hi || !p->qidx) {
        PyMem_Free(tmp);
        PyErr_NoMemory();
        return -1;
    }
    int rc = 0;
#define A(name, body) if (!rc && !(rc = get_array(cfg, name, n, tmp))) for (Py_ssize_t k = 0; k < n; k++) { body; }
    A("tpn", p->tpn[k] = (uint32_t)tmp[k]) A("tid", p->tid[k] = (uint32_t)tmp[k]) A("token", p->token[k] = (uint32_t)tmp[k])
    A("eid_lo", p->eid_lo[k] = tmp[k]) A("eid_hi", p->eid_hi[k] = tmp[k])
#undef A
    PyMem_Free(tmp);
    if (rc) return -1;
    for (Py_ssize_t k = 0; k < n; k++)
        if (!(p->qidx[k] = PyLong_FromSsize_t(k))) return -1;
    p->reg_lock = PyObject_GetAttrString(registry, "_lock");
    if (!p->reg_lock) return -1;
    Py_INCREF(engine); p->engine = e;
    Py_INCREF(ndarray); p->ndarray = ndarray;
    Py_INCREF(state); p->state_obj = state;
    Py_INCREF(sig0); p->sig_descr[0] = sig0;
    Py_INCREF(sig1); p->sig_descr[1] = sig1;
    p->st = (int64_t *)(uintptr_t)state_addr;
    return 0;
}

static void Poster_dealloc(Poster *p) {
    if (p->qidx && p->engine)
        for (uint32_t k = 0; k < p->engine->n_slots; k++) Py_XDECREF(p->qidx[k]);
    for (int k = 0; k < 8; k++) Py_XDECREF(p->descr[k]);
    if (p->pins && p->engine)
        for (uint32_t k = 0; k < p->engine->n_slots; k++) free(p->pins[k].v);
    free(p->pins);
    free(p->fp.slot);
    free(p->flights);
    Py_XDECREF(p->ev);
    Py_XDECREF(p->on_local); Py_XDECREF(p->on_retire); Py_XDECREF(p->on_post);
    Py_XDECREF(p->alt);
    Py_XDECREF(p->engine); Py_XDECREF(p->ndarray); Py_XDECREF(p->reg_lock);
    forget(p);
    Py_XDECREF(p->state_obj); Py_XDECREF(p->sig_descr[0]); Py_XDECREF(p->sig_descr[1]);
    free(p->tpn); free(p->tid); free(p->token); free(p->eid_lo); free(p->eid_hi); free(p->qidx);
    PyMem_Free(p->alloc_lo); PyMem_Free(p->alloc_hi);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyMethodDef Poster_methods[] = {
    {"rw", (PyCFunction)(void (*)(void))Poster_rw, METH_FASTCALL, "Post one WRITE/READ of a plain put/get, or -1."},
    {"notify", (PyCFunction)(void (*)(void))Poster_notify, METH_FASTCALL, "Post one plain put_signal, or -1."},
    {"wqes", (PyCFunction)(void (*)(void))Poster_wqes, METH_FASTCALL, "Post built WQEs with one doorbell, or -1."},
    {"wqes_many", (PyCFunction)(void (*)(void))Poster_wqes_many, METH_FASTCALL,
     "Post built WQEs to many queues, a doorbell each, one kick; returns how many segments."},
    {"quiet", (PyCFunction)(void (*)(void))Poster_quiet, METH_FASTCALL, "Quiet a queue whose CQEs are all in."},
    {"quiet_many", (PyCFunction)(void (*)(void))Poster_quiet_many, METH_FASTCALL,
     "Quiet queues in turn while their CQEs are all in; returns how many."},
    {"seen", (PyCFunction)Poster_seen, METH_O, "The Python path used this registration: remember it."},
    {"accept", (PyCFunction)Poster_accept, METH_O, "Post arrays of this ndarray subclass as ndarrays."},
    {"set_events", (PyCFunction)Poster_set_events, METH_O, "The event log posts and quiets write into, or None."},
    {"set_watch", (PyCFunction)Poster_set_watch, METH_VARARGS, "--check's hooks for local arrays in flight."},
    {"emit_posted", (PyCFunction)(void (*)(void))Poster_emit_posted, METH_FASTCALL,
     "The events of WQEs the Python path wrote, before their doorbell."},
    {"emit_quiet", (PyCFunction)(void (*)(void))Poster_emit_quiet, METH_FASTCALL,
     "The events of a quiet the Python path made."},
    {"fingerprint", (PyCFunction)Poster_fingerprint, METH_O, "A source's fingerprint (tests)."},
    {"set_allocations", (PyCFunction)Poster_set_allocations, METH_VARARGS, "This PE's live heap allocations."},
    {"probe", (PyCFunction)Poster_probe, METH_O, "What the poster reads of an ndarray (a layout check)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PosterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmemx.udma._engine.Poster",
    .tp_basicsize = sizeof(Poster),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The native posting path of one PE's plain put/get calls.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Poster_init,
    .tp_dealloc = (destructor)Poster_dealloc,
    .tp_methods = Poster_methods,
};

int shmemx_post_init(PyObject *m) {
    if (!(s_last = PyUnicode_InternFromString("_last")) || !(s_locked = PyUnicode_InternFromString("locked"))
        || !(s_address = PyUnicode_InternFromString("address")) || !(s_nbytes = PyUnicode_InternFromString("nbytes"))
        || !(s_va = PyUnicode_InternFromString("va")) || !(s_writable = PyUnicode_InternFromString("writable"))
        || !(s_uses = PyUnicode_InternFromString("uses")) || !(s_itemsize = PyUnicode_InternFromString("itemsize"))
        || !(s_live = PyUnicode_InternFromString("live")))
        return -1;
    if (PyType_Ready(&PosterType) < 0) return -1;
    Py_INCREF(&PosterType);
    if (PyModule_AddObject(m, "Poster", (PyObject *)&PosterType) < 0) { Py_DECREF(&PosterType); return -1; }
    const char *names[] = {"ST_HEAD", "ST_TAIL", "ST_CQE_CNT", "ST_CQ_TAIL", "ST_OWNER", "ST_OWNER_BLOCK",
                           "ST_N_POSTED", "ST_B_POSTED", "ST_DOORBELLS", "ST_CQES", "ST_WORDS"};
    for (int k = 0; k <= ST_WORDS; k++) PyModule_AddIntConstant(m, names[k], k);
    return 0;
}
