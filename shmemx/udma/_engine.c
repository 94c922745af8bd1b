/* The DMA engine of one PE, in C: a thread that executes the WQEs in this PE's SQ rings without the
 * interpreter lock.
 *
 * Who owns what. Kernel threads (Python, under the interpreter lock) own posting: they write WQEs into the SQ
 * rings, store the doorbell word of the queue's engine record (hw) last, and call Engine.kick(). This thread
 * owns execution: it reads the doorbell, executes the rung WQEs in order, writes their CQEs and the queue's
 * consumer index (hw ci) and CQ producer index (hw cq_pi), its error record (err_*, then state) and its
 * counters (executed, bytes). Nothing here touches a Python object; the Python layer (engine.py) starts and
 * stops the thread, decodes errors into messages, drains the trace and hands over the local registrations.
 *
 * Layouts: every word position, opcode and status comes from shmemx/udma/layout.py and segment.py, passed in
 * as a dict when the engine is made (Engine.__init__ lists the names); none is a number of this file.
 *
 * The scheduler. Each step of the loop asks a policy (struct policy, _engine.h) for the next piece of work
 * among the rung WQEs: a queue and how many BBs of it to execute, in order, from its consumer index. The normal
 * policy serves the queues round robin, at most BATCH_BBS BBs per turn, each SQ strictly in order (DESIGN
 * section 5: stronger than the ordering rules need). The seeded chaos policy (_chaos.c, Engine.set_policy) is
 * an out-of-order one: it runs any WQE the rules allow, whole or a byte range of it, through engine_piece(), the
 * turn core's second entry, which keeps the executed set beyond ci and writes the CQEs in SQ order; _engine.h
 * says what a policy sees, may choose and must leave atomic.
 *
 * Ordering. A WQE's effects are stored before its CQE; a CQE's words 1-15 before its word 0 (owner bit,
 * status), which is stored with release order; the consumer index after the WQEs it covers. WRITE_WITH_NOTIFY
 * copies the payload, then exchanges the 64-bit signal word (a locked instruction, a full fence), then writes
 * its CQE. FAA, CAS and the fp32 reduce are locked instructions on the target word, atomic against every
 * other engine (and against libatomic, which uses the same instructions).
 *
 * Large payloads. A READ, WRITE or WRITE_WITH_NOTIFY payload of at least coop_min bytes is copied in chunks by this
 * thread and, at the same time, by a thread of this process spinning in the native quiet (coop_copy,
 * shmemx_engine_help): two cores copy, where a memcpy by the caller would use one. The WQE's execution is still
 * one step of the engine: the signal and the CQE follow once every chunk is in.
 *
 * Wake-ups: the engine remembers which PEs' memory it wrote (and its own when it wrote CQEs) and bumps their
 * wake words (the futex protocol of shmemx/shm/waits.py, shared with shm/_native.c through shm/wake.h) when it
 * runs out of work, or every WAKE_EVERY turns while queues stay busy (WAKE_EVERY_PIECES steps under a stepping
 * policy, chaos, whose step is one piece of one WQE: waking every PE's waiters after every few pieces cost the
 * chaos run a context switch per piece).
 */
#include "_config.h"
#include "_engine.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static inline void touch(Engine *e, int pe) {
    if (!e->touched[pe]) {
        e->touched[pe] = 1;
        e->touched_list[e->n_touched++] = pe;
    }
}

static void flush_wakes(Engine *e) {
    for (int k = 0; k < e->n_touched; k++) {
        int pe = e->touched_list[k];
        e->touched[pe] = 0;
        shmemx_wake(e->wake[pe], e->sleepers[pe]);
    }
    e->n_touched = 0;
}

/* --- WQE fields (the WQE copied unwrapped into 128 bytes) ------------------------------------------------- */

typedef struct {
    const uint8_t *b;
    uint32_t dw0, dw1, flag, opcode, bbs;
} Wqe;

static inline uint32_t w32(const Wqe *w, int word) { uint32_t v; memcpy(&v, w->b + 4 * word, 4); return v; }
static inline uint64_t w64(const Wqe *w, int word) { uint64_t v; memcpy(&v, w->b + 8 * word, 8); return v; }
static inline uint64_t at64(const Wqe *w, int byte) { uint64_t v; memcpy(&v, w->b + byte, 8); return v; }
static inline uint32_t at32(const Wqe *w, int byte) { uint32_t v; memcpy(&v, w->b + byte, 4); return v; }

static inline int two_bb(const Layout *L, uint32_t op) {
    return op == (uint32_t)L->op_notify || op == (uint32_t)L->op_faa || op == (uint32_t)L->op_cas;
}

static void load_wqe(Engine *e, uint32_t q, uint32_t pos, uint8_t *buf, Wqe *w) {
    uint32_t mask = e->sq_depth - 1;
    uint8_t *ring = sq_of(e, q);
    memcpy(buf, ring + 64 * (uint64_t)(pos & mask), 64);
    w->b = buf;
    w->dw0 = w32(w, e->L.w_dw0);
    w->dw1 = w32(w, e->L.w_dw1);
    w->flag = (w->dw0 >> 16) & 0xFF;
    w->opcode = (w->dw1 >> 8) & 0xFF;
    w->bbs = two_bb(&e->L, w->opcode) ? 2 : 1;
    if (w->bbs == 2)
        memcpy(buf + 64, ring + 64 * (uint64_t)((pos + 1) & mask), 64);
}

/* --- completions ------------------------------------------------------------------------------------------ */

static void write_cqe(Engine *e, uint32_t q, uint32_t pos, uint32_t bbs, uint32_t opcode, uint32_t status,
                      uint32_t byte_cnt, uint64_t eid_lo, uint64_t eid_hi, uint64_t data) {
    const Layout *L = &e->L;
    uint32_t *hw = hw_of(e, q);
    uint32_t pi = hw[L->hw_cq_pi];
    uint32_t *row = cq_of(e, q) + 16 * (uint64_t)(pi % e->cq_depth);
    uint32_t words[16] = {0};
    words[L->c_entry_idx] = (pos + bbs) & 0xFFFF;
    words[L->c_tpn] = (e->tp_base + q) & 0xFFFFFF;
    words[L->c_byte_cnt] = byte_cnt;
    words[L->c_user_data] = pos;
    words[L->c_eid] = (uint32_t)eid_lo;
    words[L->c_eid + 1] = (uint32_t)(eid_lo >> 32);
    words[L->c_eid + 2] = (uint32_t)eid_hi;
    words[L->c_eid + 3] = (uint32_t)(eid_hi >> 32);
    words[L->c_data] = (uint32_t)data;
    words[L->c_data + 1] = (uint32_t)(data >> 32);
    for (int k = 0; k < 16; k++)
        if (k != L->c_status)
            row[k] = words[k];
    uint32_t owner = ((pi / e->cq_depth) & 1) ^ 1;
    st32(row + L->c_status, (owner & 1) << L->owner_shift | (opcode & 7) << 4 | (status & 0xFF) << 24);
    hw[L->hw_cq_pi] = pi + 1;
    touch(e, e->my_pe);
}

static inline uint64_t eid_of(const Engine *e, const Wqe *w, int hi) { return w64(w, hi ? e->L.q_eid_hi : e->L.q_eid_lo); }

static void fail(Engine *e, uint32_t q, uint32_t pos, const Wqe *w, uint32_t status, uint32_t where, uint32_t arg) {
    const Layout *L = &e->L;
    uint32_t *hw = hw_of(e, q);
    int first = ld32(hw + L->hw_state) == 0;
    if (first) {
        hw[L->hw_err_status] = status;
        hw[L->hw_err_substatus] = 0;
        hw[L->hw_err_pos] = pos;
        hw[L->hw_err_where] = where;
        hw[L->hw_err_arg] = arg;
    }
    if (w->flag & L->cqe_flag)
        write_cqe(e, q, pos, w->bbs, w->opcode, status, 0, eid_of(e, w, 0), eid_of(e, w, 1), 0);
    if (first) /* published after the CQE: a barrier that sees the failure also finds its CQE */
        st32(hw + L->hw_state, 1);
    touch(e, e->my_pe);
}

static inline void account(Engine *e, uint32_t q, uint64_t wqes, uint64_t nbytes) {
    uint64_t *hw64 = (uint64_t *)hw_of(e, q);
    hw64[e->L.hw_executed] += wqes;
    hw64[e->L.hw_bytes] += nbytes;
}

/* --- checks --------------------------------------------------------------------------------------------- */

typedef struct { uint32_t status, where; } Fault;
#define OK ((Fault){0, W_NONE})

static inline int in_range(uint64_t va, uint64_t len, uint64_t base, uint64_t size) {
    return va >= base && len <= size && va - base <= size - len;
}

static Fault check_segment(Engine *e, int pe, uint32_t tid, uint32_t token, uint64_t va, uint64_t len, uint32_t where) {
    const Layout *L = &e->L;
    if (tid != e->tid[pe]) return (Fault){L->st_bad_token_id, where};
    if (token != e->token[pe]) return (Fault){L->st_token_mismatch, where};
    if (!in_range(va, len, e->heap_va_base + (uint64_t)pe * e->heap_va_stride, e->heap_size))
        return (Fault){L->st_out_of_bounds, where};
    return OK;
}

uint8_t *shmemx_resolve_local(Engine *e, uint64_t va, uint64_t len) {
    uint64_t my_va = e->heap_va_base + (uint64_t)e->my_pe * e->heap_va_stride;
    if (in_range(va, len, my_va, e->heap_size)) return e->heap[e->my_pe] + (va - my_va);
    if (in_range(va, len, e->amo_va, e->amo_len)) return e->seg + e->amo_off + (va - e->amo_va);
    uint8_t *found = NULL;
    pthread_mutex_lock(&e->reg_lock);
    Py_ssize_t lo = 0, hi = e->n_locals; /* the last registration that starts at or below va */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (e->locals[mid].va <= va) lo = mid + 1; else hi = mid;
    }
    if (lo > 0) {
        Local *r = &e->locals[lo - 1];
        if (len <= r->len && va - r->va <= r->len - len) found = r->addr + (va - r->va);
    }
    pthread_mutex_unlock(&e->reg_lock);
    return found;
}

typedef struct { int pe; uint8_t *remote, *local, *sig; uint64_t len; } Target;

static Fault check(Engine *e, const Wqe *w, Target *t) {
    const Layout *L = &e->L;
    uint32_t op = w->opcode;
    if (op != (uint32_t)L->op_write && op != (uint32_t)L->op_read && op != (uint32_t)L->op_notify
        && op != (uint32_t)L->op_faa && op != (uint32_t)L->op_cas && op != (uint32_t)L->op_nop)
        return (Fault){L->st_bad_opcode, W_OPCODE};
    if (op == (uint32_t)L->op_nop) return OK;
    uint32_t tpw = w32(w, L->w_tp);
    if ((tpw >> 24) != 1 || ((w->dw0 >> 29) & 3) != (uint32_t)L->jetty_type) return (Fault){L->st_bad_opcode, W_MALFORMED};
    uint64_t lo = eid_of(e, w, 0), hi = eid_of(e, w, 1);
    uint64_t pe = lo & 0xFFFFFFFFu;
    if (pe >= (uint64_t)e->n_pes || e->eid_lo[pe] != lo || e->eid_hi[pe] != hi) return (Fault){L->st_bad_eid, W_EID};
    if (e->remote_pe[pe]) return (Fault){L->st_bad_tp, W_TP}; /* another host's PE: only its queues reach it */
    int64_t tp = (int64_t)(tpw & 0xFFFFFF) - (int64_t)e->tp_base;
    if (tp < 0 || tp >= (int64_t)e->n_pes * e->qp_num || tp / e->qp_num != (int64_t)pe) return (Fault){L->st_bad_tp, W_TP};
    int notify = op == (uint32_t)L->op_notify;
    uint64_t len = notify ? at32(w, L->notify_sge) : w32(w, L->w_sge_len);
    uint64_t lva = notify ? at64(w, L->notify_sge + 8) : w64(w, L->q_sge_va);
    if (len > L->max_msg) return (Fault){L->st_length, W_LENGTH};
    uint64_t rva = w64(w, L->q_rmt_va);
    Fault f = check_segment(e, (int)pe, w32(w, L->w_seg) & 0xFFFFF, w32(w, L->w_token), rva, len, W_REMOTE);
    if (f.status) return f;
    t->local = shmemx_resolve_local(e, lva, len);
    if (!t->local) return (Fault){L->st_local_access, W_LOCAL};
    uint64_t base = e->heap_va_base + pe * e->heap_va_stride;
    t->pe = (int)pe;
    t->len = len;
    t->remote = e->heap[pe] + (rva - base);
    if (notify) {
        uint64_t q0 = at64(w, L->notify_ctx), sva = at64(w, L->notify_ctx + 8);
        f = check_segment(e, (int)pe, (uint32_t)(q0 & 0xFFFFF), (uint32_t)(q0 >> 32), sva, 8, W_SIGNAL);
        if (f.status) return f;
        if (sva % 8) return (Fault){L->st_bad_atomic, W_SIGNAL_ALIGN};
        t->sig = e->heap[pe] + (sva - base);
    } else if (op == (uint32_t)L->op_faa || op == (uint32_t)L->op_cas || (w->flag & L->reduce_flag)) {
        if ((len != 4 && len != 8) || rva % len) return (Fault){L->st_bad_atomic, W_ATOMIC_SIZE};
        uint32_t ra = w32(w, L->w_reduce);
        if ((w->flag & L->reduce_flag)
            && (((ra >> 8) & 0xF) != (uint32_t)L->fp32 || ((ra >> 12) & 0xF) != (uint32_t)L->reduce_add || len != 4))
            return (Fault){L->st_bad_atomic, W_REDUCE};
    }
    return OK;
}

/* --- execution ------------------------------------------------------------------------------------------ */

static uint32_t fp32_add(uint32_t *word, float operand) {
    uint32_t old = __atomic_load_n(word, __ATOMIC_SEQ_CST);
    for (;;) {
        float f, r;
        memcpy(&f, &old, 4);
        r = (float)((double)f + (double)operand);
        uint32_t bits;
        memcpy(&bits, &r, 4);
        if (__atomic_compare_exchange_n(word, &old, bits, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return old;
    }
}

/* --- payload copies ---------------------------------------------------------------------------------------- */

/* A payload copy as a DMA engine makes it: into memory, not into the executing core's cache. With ``stream``, from
 * STREAM_MIN_BYTES up, the destination is written with non-temporal stores: no read for ownership of its lines
 * (a peer reads them later, from another core, and they are rarely cached anywhere by then), a third less memory
 * traffic than memmove's (two processes copying 14-43 KB pieces into a large region at once: about 2x the bytes
 * per CPU second here). The sfence makes the stores globally visible before anything the caller stores next (a
 * signal, a CQE, a chunk count). Without ``stream``, overlapping ranges and small payloads: memmove. */
static void dma_copy(uint8_t *dst, const uint8_t *src, uint64_t n, int stream) {
#if defined(__SSE2__)
    if (stream && n >= STREAM_MIN_BYTES && (dst + n <= src || src + n <= dst)) {
        uint64_t head = (64 - ((uintptr_t)dst & 63)) & 63; /* to the destination's next cache line */
        memcpy(dst, src, head);
        uint64_t lines = (n - head) / 64, k;
        uint8_t *d = dst + head;
        const uint8_t *s = src + head;
        for (k = 0; k < lines; k++, d += 64, s += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)s + 1);
            __m128i c = _mm_loadu_si128((const __m128i *)s + 2), e = _mm_loadu_si128((const __m128i *)s + 3);
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)d + 1, b);
            _mm_stream_si128((__m128i *)d + 2, c);
            _mm_stream_si128((__m128i *)d + 3, e);
        }
        memcpy(d, s, n - head - 64 * lines);
        _mm_sfence();
        return;
    }
#endif
    memmove(dst, src, n);
}

/* --- the cooperative copy of a large payload (Coop, _engine.h) --------------------------------------------- */

static int pick_round_robin(Engine *e, uint32_t *queue, uint32_t *bbs);

/* Claim one chunk (from the back when ``back``) and copy it; 0 when every chunk is claimed. */
static int coop_claim(Coop *c, int back) {
    uint64_t cl = __atomic_load_n(&c->claims, __ATOMIC_ACQUIRE), next;
    uint32_t k;
    do {
        uint32_t front = (uint32_t)cl, rear = (uint32_t)(cl >> 32);
        if (front + rear >= c->n) return 0;
        k = back ? c->n - 1 - rear : front;
        next = back ? cl + (1ULL << 32) : cl + 1;
    } while (!__atomic_compare_exchange_n(&c->claims, &cl, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    uint64_t off = (uint64_t)k * c->chunk, len = c->len - off < c->chunk ? c->len - off : c->chunk;
    dma_copy(c->dst + off, c->src + off, len, c->stream);
    __atomic_fetch_add(&c->finished, 1, __ATOMIC_RELEASE);
    return 1;
}

/* Copy ``len`` bytes (the ranges do not overlap) with whichever quiet-ing thread of this process helps
 * (shmemx_engine_help); returns when every chunk is copied, so what follows (a signal, the CQE) comes after the
 * whole payload as with one memmove. Called by whoever executes the WQE, holding the turn lock. */
static void coop_copy(Engine *e, uint8_t *dst, const uint8_t *src, uint64_t len, int stream) {
    Coop *c = &e->coop;
    c->stream = stream;
    c->dst = dst;
    c->src = src;
    c->len = len;
    c->chunk = COOP_CHUNK;
    c->n = (uint32_t)((len + COOP_CHUNK - 1) / COOP_CHUNK);
    __atomic_store_n(&c->claims, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&c->finished, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&c->active, 1, __ATOMIC_SEQ_CST);
    while (coop_claim(c, 0)) {}
    /* a helper's last chunk: it never blocks, but a loaded host may take its core for a while */
    for (unsigned k = 1; __atomic_load_n(&c->finished, __ATOMIC_ACQUIRE) != c->n; k++)
        if (k % 1024) __builtin_ia32_pause(); else sched_yield();
    /* no helper may still read this job when the next one rewrites it: one that counted itself in before
     * ``active`` dropped is waited for, one that counts itself in after sees it dropped (both sequentially
     * consistent) */
    __atomic_store_n(&c->active, 0, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&c->users, __ATOMIC_SEQ_CST)) __builtin_ia32_pause();
    __atomic_fetch_add(&c->copied, c->n, __ATOMIC_RELAXED);
}

/* A thread waiting in a quiet copies chunks of the payload being copied cooperatively, if any (from the back);
 * returns 1 when it copied some. Never blocks: a claimed chunk is copied and counted at once. */
int shmemx_engine_help(Engine *e) {
    Coop *c = &e->coop;
    if (!__atomic_load_n(&c->active, __ATOMIC_ACQUIRE)) return 0;
    __atomic_fetch_add(&c->users, 1, __ATOMIC_SEQ_CST);
    uint64_t did = 0;
    if (__atomic_load_n(&c->active, __ATOMIC_SEQ_CST))
        while (coop_claim(c, 1)) did++;
    if (did) __atomic_fetch_add(&c->helped, did, __ATOMIC_RELAXED);
    __atomic_fetch_sub(&c->users, 1, __ATOMIC_SEQ_CST);
    return did > 0;
}

/* The payload copy of a READ, a WRITE or a WRITE_WITH_NOTIFY: cooperative when whole, large, the ranges apart,
 * and the normal policy runs (a seeded policy splits transfers itself); around the cache (dma_copy's ``stream``)
 * unless it rewrites where the previous payload went (one buffer put again and again, as a benchmark or a halo
 * exchange does, whose lines are likely still in the cache: memmove keeps them there). Called holding the turn
 * lock (``last_dst`` has one writer at a time). */
static inline void copy_payload(Engine *e, uint8_t *dst, const uint8_t *src, uint64_t lo, uint64_t hi, uint64_t len) {
    uint64_t n = hi - lo;
    int stream = dst != e->last_dst;
    e->last_dst = dst;
    if (e->coop_min && n >= e->coop_min && n == len && e->policy.pick == pick_round_robin
        && (dst + n <= src || src + n <= dst))
        coop_copy(e, dst, src, n, stream);
    else
        dma_copy(dst + lo, src + lo, n, stream);
}

/* Execute a checked WQE, or the byte range [lo, hi) of its payload (a READ, a WRITE, a WRITE_WITH_NOTIFY's
 * payload; the signal with the ``last`` piece); returns its byte count, *data the fetched value. Atomics and
 * reduces run whole (lo = 0, hi = len, last). */
static uint64_t run(Engine *e, const Wqe *w, const Target *t, uint64_t *data, uint64_t lo, uint64_t hi, int last) {
    const Layout *L = &e->L;
    uint32_t op = w->opcode;
    *data = 0;
    if (op == (uint32_t)L->op_nop) return 0;
    uint64_t n = t->len;
    if (op == (uint32_t)L->op_read) {
        copy_payload(e, t->local, t->remote, lo, hi, n);
        touch(e, e->my_pe);
        return n;
    }
    touch(e, t->pe);
    if (op == (uint32_t)L->op_write && (w->flag & L->reduce_flag)) {
        float operand;
        memcpy(&operand, t->local, 4);
        *data = fp32_add((uint32_t *)t->remote, operand);
        return n;
    }
    if (op == (uint32_t)L->op_write) {
        copy_payload(e, t->remote, t->local, lo, hi, n);
        return n;
    }
    if (op == (uint32_t)L->op_notify) {
        copy_payload(e, t->remote, t->local, lo, hi, n);
        if (last) __atomic_exchange_n((uint64_t *)t->sig, at64(w, L->notify_ctx + 16), __ATOMIC_SEQ_CST);
        return n;
    }
    uint64_t operand = n == 8 ? at64(w, L->amo_operand) : at32(w, L->amo_operand);
    uint64_t old;
    if (op == (uint32_t)L->op_faa) {
        old = n == 8 ? __atomic_fetch_add((uint64_t *)t->remote, operand, __ATOMIC_SEQ_CST)
                     : __atomic_fetch_add((uint32_t *)t->remote, (uint32_t)operand, __ATOMIC_SEQ_CST);
    } else if (n == 8) {
        uint64_t expected = at64(w, L->amo_operand + 8);
        __atomic_compare_exchange_n((uint64_t *)t->remote, &expected, operand, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
        old = expected;
    } else {
        uint32_t expected = at32(w, L->amo_operand + 4);
        __atomic_compare_exchange_n((uint32_t *)t->remote, &expected, (uint32_t)operand, 0, __ATOMIC_SEQ_CST,
                                    __ATOMIC_SEQ_CST);
        old = expected;
    }
    memcpy(t->local, &old, n);
    touch(e, e->my_pe);
    *data = old;
    return n;
}

static void execute(Engine *e, uint32_t q, uint32_t pos, const Wqe *w) {
    const Layout *L = &e->L;
    Target t = {0};
    Fault f = check(e, w, &t);
    if (!f.status && e->inject > 0) {
        e->inject--;
        f = (Fault){L->st_engine_fault, W_INJECTED};
    }
    if (f.status) {
        fail(e, q, pos, w, f.status, f.where, 0);
        return;
    }
    uint64_t data;
    uint64_t n = run(e, w, &t, &data, 0, t.len, 1);
    account(e, q, 1, n);
    if (w->flag & L->cqe_flag)
        write_cqe(e, q, pos, w->bbs, w->opcode, 0, (uint32_t)n, eid_of(e, w, 0), eid_of(e, w, 1), data);
}

/* One turn: up to ``bbs`` rung BBs of queue ``q``, in order from its consumer index. */
static void trace_turn(Engine *e, int64_t start, uint32_t q, uint32_t first, uint32_t bbs) {
    pthread_mutex_lock(&e->trace_lock);
    if (e->trace_len + 5 > e->trace_cap) {
        size_t cap = e->trace_cap ? 2 * e->trace_cap : 5 * 4096;
        int64_t *grown = realloc(e->trace, cap * sizeof(int64_t));
        if (grown) { e->trace = grown; e->trace_cap = cap; }
    }
    if (e->trace_len + 5 <= e->trace_cap) {
        int64_t *r = e->trace + e->trace_len;
        r[0] = start; r[1] = now_ns(); r[2] = q; r[3] = first; r[4] = bbs;
        e->trace_len += 5;
    }
    pthread_mutex_unlock(&e->trace_lock);
}

static inline Ahead *ahead_of(Engine *e, uint32_t q, uint32_t pos) {
    return e->ahead ? &e->ahead[(uint64_t)q * e->sq_depth + (pos & (e->sq_depth - 1))] : NULL;
}

static void turn(Engine *e, uint32_t q, uint32_t bbs) {
    const Layout *L = &e->L;
    uint32_t *hw = hw_of(e, q);
    uint32_t ci = hw[L->hw_ci];
    uint32_t db = ld32(hw + L->hw_sq_db);
    uint32_t n = db - ci;
    uint8_t buf[128];
    Wqe w;
    if (n == 0) return;
    if (n > e->sq_depth) { /* a corrupted doorbell: fail the queue, drop its WQEs */
        load_wqe(e, q, ci, buf, &w);
        fail(e, q, ci, &w, L->st_engine_fault, W_DOORBELL, db);
        st32(hw + L->hw_ci, db);
        return;
    }
    if (n > bbs) n = bbs;
    int64_t start = e->tracing ? now_ns() : 0;
    uint32_t k = 0;
    while (k < n) {
        uint32_t pos = ci + k;
        load_wqe(e, q, pos, buf, &w);
        if (k + w.bbs > n) break; /* the rest of this WQE is not rung yet */
        Ahead *a = ahead_of(e, q, pos);
        if (a && a->done) { /* executed ahead of an earlier WQE (an out-of-order policy): its CQE now, in order */
            if (w.flag & L->cqe_flag)
                write_cqe(e, q, pos, w.bbs, w.opcode, a->status, a->byte_cnt, eid_of(e, &w, 0), eid_of(e, &w, 1),
                          a->data);
        } else if (ld32(hw + L->hw_state)) { /* the queue is in error: complete without executing */
            if (w.flag & L->cqe_flag)
                write_cqe(e, q, pos, w.bbs, w.opcode, L->st_flushed, 0, eid_of(e, &w, 0), eid_of(e, &w, 1), 0);
        } else {
            execute(e, q, pos, &w);
        }
        if (a) a->done = a->chunks = 0;
        k += w.bbs;
    }
    st32(hw + L->hw_ci, ci + k);
    if (start) trace_turn(e, start, q, ci, k);
}

void engine_turn(Engine *e, uint32_t q, uint32_t bbs) { turn(e, q, bbs); }

/* ci over the executed prefix: the CQEs of the WQEs that ran ahead, in SQ order. */
static void advance(Engine *e, uint32_t q) {
    const Layout *L = &e->L;
    uint32_t *hw = hw_of(e, q);
    uint32_t ci = hw[L->hw_ci], db = ld32(hw + L->hw_sq_db);
    uint8_t buf[128];
    Wqe w;
    while (ci != db) {
        Ahead *a = ahead_of(e, q, ci);
        if (!a->done) break;
        load_wqe(e, q, ci, buf, &w);
        if (w.flag & L->cqe_flag)
            write_cqe(e, q, ci, w.bbs, w.opcode, a->status, a->byte_cnt, eid_of(e, &w, 0), eid_of(e, &w, 1), a->data);
        a->done = a->chunks = 0;
        ci += w.bbs;
    }
    st32(hw + L->hw_ci, ci);
}

/* The out-of-order entry of the turn core: execute the rung WQE at BB ``pos`` of queue ``q`` (ci <= pos < the
 * doorbell, both BBs rung), whole or the payload bytes [lo, hi) of it; ``last`` completes it (a notify's signal,
 * the CQE, ci). The same checks and execution code as turn(). A WQE that fails its checks runs only at ci, as
 * turn() would run it (returns 1 when it is not at ci: the policy must let the queue catch up first). A queue
 * in error is flushed in order. */
int engine_piece(Engine *e, uint32_t q, uint32_t pos, uint64_t lo, uint64_t hi, int last) {
    const Layout *L = &e->L;
    uint32_t *hw = hw_of(e, q);
    uint32_t ci = hw[L->hw_ci];
    if (ld32(hw + L->hw_state) || ld32(hw + L->hw_sq_db) - ci > e->sq_depth) {
        turn(e, q, BATCH_BBS);
        return 0;
    }
    int64_t start = e->tracing ? now_ns() : 0;
    uint8_t buf[128];
    Wqe w;
    load_wqe(e, q, pos, buf, &w);
    Ahead *a = ahead_of(e, q, pos);
    Target t = {0};
    Fault f = check(e, &w, &t);
    if (!f.status && e->inject > 0) f = (Fault){L->st_engine_fault, W_INJECTED};
    if (f.status) {
        if (pos != ci) return 1;
        if (f.where == W_INJECTED) e->inject--;
        fail(e, q, pos, &w, f.status, f.where, 0);
        a->done = a->chunks = 0;
        st32(hw + L->hw_ci, ci + w.bbs);
        advance(e, q);
        if (start) trace_turn(e, start, q, pos, w.bbs);
        return 0;
    }
    uint64_t data;
    uint64_t n = run(e, &w, &t, &data, lo, hi, last);
    if (last) {
        account(e, q, 1, n);
        if (pos == ci) {
            if (w.flag & L->cqe_flag)
                write_cqe(e, q, pos, w.bbs, w.opcode, 0, (uint32_t)n, eid_of(e, &w, 0), eid_of(e, &w, 1), data);
            a->done = a->chunks = 0;
            st32(hw + L->hw_ci, ci + w.bbs);
            advance(e, q);
        } else {
            *a = (Ahead){1, a->chunks, 0, (uint32_t)n, data};
        }
    }
    if (start) trace_turn(e, start, q, pos, last ? w.bbs : 0);
    return 0;
}

/* What an out-of-order policy needs of the rung WQE at ``pos`` of queue ``q``; 0 when its second BB is not rung. */
int engine_wqe(Engine *e, uint32_t q, uint32_t pos, WqeInfo *out) {
    const Layout *L = &e->L;
    uint32_t *hw = hw_of(e, q);
    uint8_t buf[128];
    Wqe w;
    load_wqe(e, q, pos, buf, &w);
    if (ld32(hw + L->hw_sq_db) - pos < w.bbs) return 0;
    uint32_t op = w.opcode;
    int notify = op == (uint32_t)L->op_notify;
    out->flag = w.flag;
    out->opcode = op;
    out->bbs = w.bbs;
    out->len = notify ? at32(&w, L->notify_sge) : w32(&w, L->w_sge_len);
    out->dst_va = op == (uint32_t)L->op_read ? (notify ? at64(&w, L->notify_sge + 8) : w64(&w, L->q_sge_va))
                                              : w64(&w, L->q_rmt_va);
    out->splittable = (op == (uint32_t)L->op_read || notify || op == (uint32_t)L->op_write)
                      && !(w.flag & L->reduce_flag) && out->len <= L->max_msg;
    return 1;
}

/* A policy's decision record (when tracing): time, kind, queue, position, two arguments. */
void engine_log(Engine *e, int64_t kind, int64_t q, int64_t pos, int64_t a, int64_t b) {
    if (!e->tracing) return;
    pthread_mutex_lock(&e->trace_lock);
    if (e->log_len + 6 > e->log_cap) {
        size_t cap = e->log_cap ? 2 * e->log_cap : 6 * 4096;
        int64_t *grown = realloc(e->log, cap * sizeof(int64_t));
        if (grown) { e->log = grown; e->log_cap = cap; }
    }
    if (e->log_len + 6 <= e->log_cap) {
        int64_t *r = e->log + e->log_len;
        r[0] = now_ns(); r[1] = kind; r[2] = q; r[3] = pos; r[4] = a; r[5] = b;
        e->log_len += 6;
    }
    pthread_mutex_unlock(&e->trace_lock);
}

/* --- the scheduler ---------------------------------------------------------------------------------------- */

static inline int has_work(Engine *e, uint32_t q) {
    uint32_t *hw = hw_of(e, q);
    if (e->remote[q]) return 0; /* the host's NIC executes the queues to other hosts' PEs */
    return ld32(hw + e->L.hw_sq_db) != hw[e->L.hw_ci];
}

/* The normal policy: the next queue with rung BBs after the last one served, up to BATCH_BBS of it. */
static int pick_round_robin(Engine *e, uint32_t *queue, uint32_t *bbs) {
    for (uint32_t k = 1; k <= e->n_slots; k++) {
        uint32_t q = (e->rr + k) % e->n_slots;
        if (has_work(e, q)) {
            e->rr = q;
            *queue = q;
            *bbs = BATCH_BBS;
            return 1;
        }
    }
    return 0;
}

static int any_work(Engine *e) {
    for (uint32_t q = 0; q < e->n_slots; q++)
        if (has_work(e, q)) return 1;
    return 0;
}

/* The quiet's assist (_post.c's Poster.quiet, unobserved runs only): the quieting thread executes its own queue's
 * rung WQEs itself, the engine's own turn() under the turn lock, instead of waiting for the engine thread to be
 * woken or scheduled (a futex wake-up costs 10-15 us here, and with PEs outnumbering cores the engine may wait
 * milliseconds for a core). The same execution code, so not a second engine: the turn lock makes it one turn
 * of the one engine, with the same ordering within the SQ; SQs are unordered with respect to each other, so
 * serving this one out of round robin breaks no rule. Only under the normal policy (a seeded policy decides
 * every turn itself), never while paused, stopping or stopped. ``wait``: block on a busy turn lock (else give
 * up at once). Returns 1 when it executed WQEs, 0 otherwise. */
int shmemx_engine_assist(Engine *e, uint32_t q, int wait) {
    if (wait) pthread_mutex_lock(&e->turn_lock);
    else if (pthread_mutex_trylock(&e->turn_lock)) return 0;
    int ran = 0;
    if (e->assist && e->started && !__atomic_load_n(&e->stopping, __ATOMIC_ACQUIRE) && !e->paused
        && e->policy.pick == pick_round_robin && has_work(e, q)) {
        turn(e, q, BATCH_BBS);
        flush_wakes(e);
        ran = 1;
    }
    pthread_mutex_unlock(&e->turn_lock);
    return ran;
}

/* The assist of a quiet of many queues (_post.c's quiet_many, PEs outnumbering cores): shmemx_engine_assist of
 * each queue of ``qs`` (indices below n_slots) until it has no rung work left, under one hold of the turn lock
 * (taken once: not 255 hand-offs with the engine thread, each a wait for its turn when it runs), then one flush
 * of the wake-ups. The same turns in the same order per SQ as one assist per queue. Returns the queues served. */
int shmemx_engine_assist_many(Engine *e, const int64_t *qs, Py_ssize_t n) {
    int served = 0;
    pthread_mutex_lock(&e->turn_lock);
    if (e->assist && e->started && !__atomic_load_n(&e->stopping, __ATOMIC_ACQUIRE) && !e->paused
        && e->policy.pick == pick_round_robin) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t q = (uint32_t)qs[i];
            if (qs[i] < 0 || q >= e->n_slots || !has_work(e, q)) continue;
            uint32_t *hw = hw_of(e, q), ci;
            do { /* turn after turn while one makes progress (a WQE rung only in part waits for the rest) */
                ci = hw[e->L.hw_ci];
                turn(e, q, BATCH_BBS);
            } while (has_work(e, q) && hw[e->L.hw_ci] != ci);
            served++;
        }
        flush_wakes(e);
    }
    pthread_mutex_unlock(&e->turn_lock);
    return served;
}

/* The posting thread's turn (_post.c publish, QueuePair's posts through Engine.ring): a doorbell was just stored
 * for one small WQE (``bbs`` BBs from ``head``, a payload of at most POST_TURN_BYTES) and the queue has no earlier
 * outstanding work (its consumer index is at ``head``: every WQE before it executed, so no ordering rule can put
 * it behind another). Then the posting thread executes it at once, the engine's own turn() under the turn lock,
 * instead of waking the engine thread and waiting for it to be scheduled: one hop instead of two wake-ups. The
 * same WQE stays in the ring, the same checks, effects, CQE and consumer index follow, and the events of the post
 * were written before its doorbell (so the event log holds the same stream either way); like the quiet's assist it
 * is one turn of the one engine, taken only when the policy is the normal one (a seeded policy decides every
 * turn itself), never while paused, stopping or stopped, and never waiting for a busy turn lock. Returns 1 when
 * it executed the WQE; 0 when the engine must be kicked. */
int shmemx_engine_post_turn(Engine *e, uint32_t q, uint32_t head, uint32_t bbs) {
    const Layout *L = &e->L;
    if (bbs > 2 || q >= e->n_slots || !__atomic_load_n(&e->assist, __ATOMIC_ACQUIRE)) return 0;
    if (e->remote[q]) return 0; /* a queue to another host's PE: its NIC executes it, never this host's engine */
    uint32_t *hw = hw_of(e, q);
    if (hw[L->hw_ci] != head || ld32(hw + L->hw_sq_db) != head + bbs) return 0; /* earlier work, or more rung */
    uint8_t buf[128];
    Wqe w;
    load_wqe(e, q, head, buf, &w);
    if (w.bbs != bbs) return 0;
    uint64_t len = w.opcode == (uint32_t)L->op_notify ? at32(&w, L->notify_sge) : w32(&w, L->w_sge_len);
    if (len > POST_TURN_BYTES || pthread_mutex_trylock(&e->turn_lock)) return 0;
    int ran = 0;
    if (e->started && !__atomic_load_n(&e->stopping, __ATOMIC_ACQUIRE) && !e->paused
        && e->policy.pick == pick_round_robin && hw[L->hw_ci] == head) {
        turn(e, q, bbs);
        flush_wakes(e);
        e->post_turns++;
        ran = 1;
    }
    pthread_mutex_unlock(&e->turn_lock);
    return ran;
}

/* A doorbell was stored for ``bbs`` BBs of queue ``q`` from ``head``: the posting thread's turn when it may take
 * one (shmemx_engine_post_turn), else the kick that wakes the engine. */
void shmemx_engine_rung(Engine *e, uint32_t q, uint32_t head, uint32_t bbs) {
    if (!shmemx_engine_post_turn(e, q, head, bbs)) kick(e);
}

static void futex_wait_private(uint32_t *addr, uint32_t seen, int64_t ns) {
    struct timespec ts = {ns / 1000000000LL, ns % 1000000000LL};
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, seen, &ts, NULL, 0);
}

/* Out of work: spin a while (only when the machine has a core for it), then sleep until a kick. */
static void idle(Engine *e) {
    if (e->spin_ns > 0) {
        int64_t end = now_ns() + e->spin_ns;
        while (now_ns() < end) {
            if (any_work(e) || __atomic_load_n(&e->stopping, __ATOMIC_ACQUIRE) || __atomic_load_n(&e->paused, __ATOMIC_ACQUIRE)) return;
            sched_yield();
        }
    }
    uint32_t seen = __atomic_load_n(&e->seq, __ATOMIC_SEQ_CST);
    __atomic_store_n(&e->sleeping, 1, __ATOMIC_SEQ_CST);
    if (!any_work(e) && !__atomic_load_n(&e->stopping, __ATOMIC_SEQ_CST))
        futex_wait_private(&e->seq, seen, IDLE_BACKSTOP_NS);
    __atomic_store_n(&e->sleeping, 0, __ATOMIC_SEQ_CST);
}

static void *engine_main(void *arg) {
    Engine *e = arg;
    int turns = 0;
    if (e->spin_ns == 0) {
        /* PEs outnumber cores: a batch thread is not woken into the CPU of the thread that kicked it, so a
         * block's doorbells pile up while it posts and the engine serves them when the block waits (as the
         * interpreter lock made the Python engine do), instead of a context switch per doorbell */
        struct sched_param sp = {0};
        pthread_setschedparam(pthread_self(), SCHED_BATCH, &sp);
    }
    for (;;) {
        uint32_t q = 0, bbs = 0;
        int64_t nap_ns = 0;
        uint32_t seen = __atomic_load_n(&e->seq, __ATOMIC_SEQ_CST);
        pthread_mutex_lock(&e->turn_lock);
        while (e->paused && !e->stopping)
            pthread_cond_wait(&e->turn_cond, &e->turn_lock);
        int found;
        if (e->policy.step) {
            found = e->policy.step(e, &nap_ns);
        } else {
            found = e->policy.pick(e, &q, &bbs);
            if (found) turn(e, q, bbs);
        }
        /* the wake-ups are flushed under the turn lock: a quiet's assist (shmemx_engine_assist) touches too */
        if (!found || ++turns >= (e->policy.step ? WAKE_EVERY_PIECES : WAKE_EVERY)) { flush_wakes(e); turns = 0; }
        pthread_mutex_unlock(&e->turn_lock);
        if (found) continue;
        if (nap_ns > 0) { /* the policy holds rung work back: sleep that long, or until a kick */
            __atomic_store_n(&e->sleeping, 1, __ATOMIC_SEQ_CST);
            if (!__atomic_load_n(&e->stopping, __ATOMIC_SEQ_CST) && !__atomic_load_n(&e->paused, __ATOMIC_SEQ_CST))
                futex_wait_private(&e->seq, seen, nap_ns);
            __atomic_store_n(&e->sleeping, 0, __ATOMIC_SEQ_CST);
            continue;
        }
        if (__atomic_load_n(&e->stopping, __ATOMIC_ACQUIRE)) break;
        idle(e);
    }
    pthread_mutex_lock(&e->turn_lock);
    flush_wakes(e);
    pthread_mutex_unlock(&e->turn_lock);
    return NULL;
}

/* --- the Python type ------------------------------------------------------------------------------------- */

static int get_int(PyObject *d, const char *name, long long *out) { return config_int(d, "engine layout", name, out); }
static int get_u64(PyObject *d, const char *name, uint64_t *out) { return config_u64(d, "engine config", name, out); }
static int get_list(PyObject *d, const char *name, int n, uint64_t *out) {
    return config_list(d, "engine config", name, n, out);
}

#define LAYOUT_FIELDS(X) \
    X(w_dw0) X(w_dw1) X(w_tp) X(w_seg) X(w_token) X(w_reduce) X(w_sge_len) X(q_eid_lo) X(q_eid_hi) X(q_rmt_va) \
    X(q_sge_va) X(notify_ctx) X(notify_sge) X(amo_operand) X(c_status) X(c_entry_idx) X(c_tpn) X(c_byte_cnt) \
    X(c_user_data) X(c_eid) X(c_data) X(owner_shift) X(hw_sq_db) X(hw_ci) X(hw_cq_pi) X(hw_state) \
    X(hw_err_status) X(hw_err_substatus) X(hw_err_pos) X(hw_err_where) X(hw_err_arg) X(hw_executed) X(hw_bytes) \
    X(op_write) X(op_notify) X(op_read) X(op_cas) X(op_faa) X(op_nop) X(st_bad_opcode) X(st_bad_eid) X(st_bad_tp) \
    X(st_bad_token_id) X(st_token_mismatch) X(st_out_of_bounds) X(st_local_access) X(st_length) X(st_bad_atomic) \
    X(st_flushed) X(st_engine_fault) X(reduce_flag) X(cqe_flag) X(jetty_type) X(fp32) X(reduce_add)

static void Engine_dealloc(Engine *e);

static int Engine_init(Engine *e, PyObject *args, PyObject *kw) {
    PyObject *layout, *cfg;
    if (!PyArg_ParseTuple(args, "O!O!", &PyDict_Type, &layout, &PyDict_Type, &cfg)) return -1;
    long long v;
#define X(name) if (get_int(layout, #name, &v)) return -1; e->L.name = (int)v;
    LAYOUT_FIELDS(X)
#undef X
    if (get_u64(layout, "max_msg", &e->L.max_msg)) return -1;
    uint64_t u;
#define U(name, field) if (get_u64(cfg, name, &u)) return -1; field = u;
    if (get_u64(cfg, "seg_addr", &u)) return -1;
    e->seg = (uint8_t *)(uintptr_t)u;
    U("sq_off", e->sq_off) U("sq_bytes", e->sq_bytes) U("cq_off", e->cq_off)
    U("cq_bytes", e->cq_bytes) U("hw_off", e->hw_off) U("amo_off", e->amo_off) U("amo_len", e->amo_len)
    U("amo_va", e->amo_va) U("sq_depth", e->sq_depth) U("cq_depth", e->cq_depth) U("n_slots", e->n_slots)
    U("tp_base", e->tp_base) U("my_pe", e->my_pe) U("n_pes", e->n_pes) U("qp_num", e->qp_num)
    U("heap_size", e->heap_size) U("heap_va_base", e->heap_va_base) U("heap_va_stride", e->heap_va_stride)
    U("spin_ns", e->spin_ns)
#undef U
    int n = e->n_pes;
    if (n <= 0 || e->n_slots == 0 || (e->sq_depth & (e->sq_depth - 1))) {
        PyErr_SetString(PyExc_ValueError, "engine config: bad sizes");
        return -1;
    }
    uint64_t *tmp = PyMem_Calloc(n, sizeof(uint64_t));
    e->heap = calloc(n, sizeof(uint8_t *));
    e->eid_lo = calloc(n, 8); e->eid_hi = calloc(n, 8);
    e->tid = calloc(n, 4); e->token = calloc(n, 4);
    e->wake = calloc(n, sizeof(uint32_t *)); e->sleepers = calloc(n, sizeof(uint32_t *));
    e->touched = calloc(n, 1); e->touched_list = calloc(n, sizeof(int));
    e->remote_pe = calloc(n, 1); e->remote = calloc(e->n_slots, 1);
    if (!e->remote_pe || !e->remote ||
        !tmp || !e->heap || !e->eid_lo || !e->eid_hi || !e->tid || !e->token || !e->wake || !e->sleepers
        || !e->touched || !e->touched_list) { PyMem_Free(tmp); PyErr_NoMemory(); return -1; }
    int rc = 0;
#define L(name, body) if (!rc && (rc = get_list(cfg, name, n, tmp)) == 0) for (int k = 0; k < n; k++) { body; }
    L("heap_addrs", e->heap[k] = (uint8_t *)(uintptr_t)tmp[k])
    L("eid_lo", e->eid_lo[k] = tmp[k])
    L("eid_hi", e->eid_hi[k] = tmp[k])
    L("tids", e->tid[k] = (uint32_t)tmp[k])
    L("tokens", e->token[k] = (uint32_t)tmp[k])
    L("wake_addrs", e->wake[k] = (uint32_t *)(uintptr_t)tmp[k])
    L("sleepers_addrs", e->sleepers[k] = (uint32_t *)(uintptr_t)tmp[k])
    if (!rc && PyDict_GetItemString(cfg, "remote_pes")) /* a job of several hosts */
        L("remote_pes", e->remote_pe[k] = tmp[k] != 0)
#undef L
    PyMem_Free(tmp);
    if (rc) return -1;
    for (uint32_t q = 0; q < e->n_slots; q++) e->remote[q] = e->remote_pe[q / e->qp_num];
    e->policy = (struct policy){"round_robin", pick_round_robin, NULL, NULL};
    e->rr = e->n_slots - 1;
    e->assist = 1;
    e->coop_min = e->spin_ns > 0 ? COOP_MIN_BYTES : 0; /* helpers spin only when PEs do not outnumber cores */
    return 0;
}

static PyObject *Engine_start(Engine *e, PyObject *unused) {
    if (e->started) Py_RETURN_NONE;
    e->stopping = 0;
    int rc = pthread_create(&e->thread, NULL, engine_main, e);
    if (rc) { errno = rc; return PyErr_SetFromErrno(PyExc_OSError); }
    e->started = 1;
    Py_RETURN_NONE;
}

static PyObject *Engine_kick(Engine *e, PyObject *unused) { kick(e); Py_RETURN_NONE; }

/* ring(q, head, bbs): a doorbell was stored for bbs BBs of queue index q from head (shmemx_engine_rung). */
static PyObject *Engine_ring(Engine *e, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "ring takes 3 arguments"); return NULL; }
    unsigned long q = PyLong_AsUnsignedLong(args[0]), head = PyLong_AsUnsignedLongMask(args[1]);
    unsigned long bbs = PyLong_AsUnsignedLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    shmemx_engine_rung(e, (uint32_t)q, (uint32_t)head, (uint32_t)bbs);
    Py_RETURN_NONE;
}

/* Execute everything rung, then end the thread (finalize: a failure among it is raised afterwards). */
static PyObject *Engine_stop(Engine *e, PyObject *unused) {
    if (!e->started) Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&e->turn_lock);
    __atomic_store_n(&e->stopping, 1, __ATOMIC_RELEASE);
    e->paused = 0;
    pthread_cond_broadcast(&e->turn_cond);
    pthread_mutex_unlock(&e->turn_lock);
    kick(e);
    pthread_join(e->thread, NULL);
    Py_END_ALLOW_THREADS
    e->started = 0;
    Py_RETURN_NONE;
}

/* Stall every queue until resume(): returns once no turn is running and none will start. */
static PyObject *Engine_pause(Engine *e, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&e->turn_lock);
    __atomic_store_n(&e->paused, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&e->turn_lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Engine_resume(Engine *e, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&e->turn_lock);
    __atomic_store_n(&e->paused, 0, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&e->turn_cond);
    pthread_mutex_unlock(&e->turn_lock);
    Py_END_ALLOW_THREADS
    kick(e);
    Py_RETURN_NONE;
}

static PyObject *Engine_inject_fault(Engine *e, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&e->turn_lock);
    e->inject = (int)n;
    pthread_mutex_unlock(&e->turn_lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Replace the local registrations: three equal-length bytes objects of native uint64 (VA, length, address),
 * sorted by VA. */
static PyObject *Engine_set_locals(Engine *e, PyObject *args) {
    Py_buffer vas, lens, addrs;
    if (!PyArg_ParseTuple(args, "y*y*y*", &vas, &lens, &addrs)) return NULL;
    Py_ssize_t n = vas.len / 8;
    Local *table = NULL;
    if (lens.len != vas.len || addrs.len != vas.len) {
        PyErr_SetString(PyExc_ValueError, "set_locals: lengths differ");
        goto done;
    }
    table = n ? malloc(n * sizeof(Local)) : NULL;
    if (n && !table) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t k = 0; k < n; k++) {
        memcpy(&table[k].va, (char *)vas.buf + 8 * k, 8);
        memcpy(&table[k].len, (char *)lens.buf + 8 * k, 8);
        uint64_t a;
        memcpy(&a, (char *)addrs.buf + 8 * k, 8);
        table[k].addr = (uint8_t *)(uintptr_t)a;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&e->reg_lock);
    Local *old = e->locals;
    e->locals = table;
    e->n_locals = n;
    pthread_mutex_unlock(&e->reg_lock);
    free(old);
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&vas); PyBuffer_Release(&lens); PyBuffer_Release(&addrs);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* set_policy(name, seed=0): install a scheduling policy (under the turn lock). "round_robin" is the normal one;
 * "chaos" the seeded out-of-order one of _chaos.c (its generator seeded by seed and this PE). */
static PyObject *Engine_set_policy(Engine *e, PyObject *args) {
    const char *name;
    unsigned long long seed = 0;
    if (!PyArg_ParseTuple(args, "s|K", &name, &seed)) return NULL;
    struct policy chosen;
    if (strcmp(name, "round_robin") == 0) {
        chosen = (struct policy){"round_robin", pick_round_robin, NULL, NULL};
    } else if (strcmp(name, "chaos") == 0) {
        if (!e->ahead && !(e->ahead = calloc((size_t)e->n_slots * e->sq_depth, sizeof(Ahead)))) return PyErr_NoMemory();
        void *state = chaos_new(e, seed);
        if (!state) return PyErr_NoMemory();
        chosen = (struct policy){"chaos", NULL, chaos_step, state};
    } else {
        return PyErr_Format(PyExc_ValueError, "engine policy %R: known policies: 'round_robin', 'chaos'",
                            PyTuple_GET_ITEM(args, 0));
    }
    void *old;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&e->turn_lock);
    old = e->policy.state;
    e->policy = chosen;
    pthread_mutex_unlock(&e->turn_lock);
    Py_END_ALLOW_THREADS
    if (old) chaos_free(old);
    kick(e);
    Py_RETURN_NONE;
}

static PyObject *Engine_get_policy(Engine *e, void *closure) { return PyUnicode_FromString(e->policy.name); }

static PyObject *Engine_set_coop(Engine *e, PyObject *arg) {
    unsigned long long min = PyLong_AsUnsignedLongLong(arg);
    if (min == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&e->turn_lock); /* between turns: no cooperative copy runs */
    e->coop_min = min;
    pthread_mutex_unlock(&e->turn_lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Engine_get_coop(Engine *e, void *closure) { return PyLong_FromUnsignedLongLong(e->coop_min); }

/* (chunks copied cooperatively, of them by a quiet-ing thread) since the engine was made. */
static PyObject *Engine_get_coop_counts(Engine *e, void *closure) {
    return Py_BuildValue("KK", (unsigned long long)__atomic_load_n(&e->coop.copied, __ATOMIC_RELAXED),
                         (unsigned long long)__atomic_load_n(&e->coop.helped, __ATOMIC_RELAXED));
}

static PyObject *Engine_get_post_turns(Engine *e, void *closure) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&e->post_turns, __ATOMIC_RELAXED));
}

static PyGetSetDef Engine_getset[] = {
    {"post_turns", (getter)Engine_get_post_turns, NULL,
     "WQEs executed by their posting thread at post time (small, on an idle queue) since the engine was made.", NULL},
    {"policy", (getter)Engine_get_policy, NULL, "The scheduling policy's name.", NULL},
    {"coop_min", (getter)Engine_get_coop, NULL,
     "WRITEs of at least this many bytes are copied by the engine and a quiet-ing thread together (0: never).", NULL},
    {"coop_counts", (getter)Engine_get_coop_counts, NULL,
     "(chunks copied cooperatively, of them by a quiet-ing thread) since the engine was made.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *Engine_set_tracing(Engine *e, PyObject *arg) {
    e->tracing = PyObject_IsTrue(arg);
    Py_RETURN_NONE;
}

static PyObject *Engine_set_assist(Engine *e, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    __atomic_store_n(&e->assist, on, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* The policy's decision records since the last call, as bytes of int64 (ns, kind, queue, position, a, b). */
static PyObject *Engine_take_log(Engine *e, PyObject *unused) {
    PyObject *out;
    pthread_mutex_lock(&e->trace_lock);
    out = PyBytes_FromStringAndSize((const char *)e->log, (Py_ssize_t)(e->log_len * sizeof(int64_t)));
    e->log_len = 0;
    pthread_mutex_unlock(&e->trace_lock);
    return out;
}

/* The turn records since the last call, as bytes of int64 (start ns, end ns, queue, first BB, BBs). */
static PyObject *Engine_take_trace(Engine *e, PyObject *unused) {
    PyObject *out;
    pthread_mutex_lock(&e->trace_lock);
    out = PyBytes_FromStringAndSize((const char *)e->trace, (Py_ssize_t)(e->trace_len * sizeof(int64_t)));
    e->trace_len = 0;
    pthread_mutex_unlock(&e->trace_lock);
    return out;
}

static PyMethodDef Engine_methods[] = {
    {"start", (PyCFunction)Engine_start, METH_NOARGS, "Start the engine thread."},
    {"stop", (PyCFunction)Engine_stop, METH_NOARGS, "Execute everything rung, then end the engine thread."},
    {"kick", (PyCFunction)Engine_kick, METH_NOARGS, "A doorbell was stored: wake the engine if it sleeps."},
    {"ring", (PyCFunction)(void (*)(void))Engine_ring, METH_FASTCALL,
     "ring(q, head, bbs): a doorbell was stored for one WQE: execute it now when small and the queue idle, else kick."},
    {"pause", (PyCFunction)Engine_pause, METH_NOARGS, "Execute nothing until resume()."},
    {"resume", (PyCFunction)Engine_resume, METH_NOARGS, "Undo pause()."},
    {"inject_fault", (PyCFunction)Engine_inject_fault, METH_O, "The next n WQEs fail with ENGINE_FAULT (tests)."},
    {"set_locals", (PyCFunction)Engine_set_locals, METH_VARARGS, "Replace the local registrations."},
    {"set_tracing", (PyCFunction)Engine_set_tracing, METH_O, "Record a turn record per turn."},
    {"set_policy", (PyCFunction)Engine_set_policy, METH_VARARGS, "Install a scheduling policy: (name, seed=0)."},
    {"take_trace", (PyCFunction)Engine_take_trace, METH_NOARGS, "Drain the turn records."},
    {"set_assist", (PyCFunction)Engine_set_assist, METH_O,
     "Whether a quiet may execute its own queue's WQEs when the engine is not at them (default True)."},
    {"set_coop", (PyCFunction)Engine_set_coop, METH_O,
     "set_coop(min_bytes): copy WRITEs of at least min_bytes with a quiet-ing thread's help (0: never)."},
    {"take_log", (PyCFunction)Engine_take_log, METH_NOARGS, "Drain the policy's decision records."},
    {NULL, NULL, 0, NULL},
};

static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Engine *e = (Engine *)type->tp_alloc(type, 0);
    if (!e) return NULL;
    pthread_mutex_init(&e->reg_lock, NULL);
    pthread_mutex_init(&e->turn_lock, NULL);
    pthread_mutex_init(&e->trace_lock, NULL);
    pthread_cond_init(&e->turn_cond, NULL);
    return (PyObject *)e;
}

static void Engine_dealloc(Engine *e) {
    if (e->started) {
        PyObject *r = Engine_stop(e, NULL);
        Py_XDECREF(r);
    }
    free(e->heap); free(e->eid_lo); free(e->eid_hi); free(e->tid); free(e->token);
    free(e->wake); free(e->sleepers); free(e->touched); free(e->touched_list); free(e->remote); free(e->remote_pe);
    free(e->locals); free(e->trace); free(e->log); free(e->ahead);
    if (e->policy.step && e->policy.state) chaos_free(e->policy.state);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmemx.udma._engine.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The native DMA engine of one PE: Engine(layout: dict, config: dict).",
    .tp_new = Engine_new,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_getset = Engine_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_engine", "The native DMA engine.", -1, NULL};

PyMODINIT_FUNC PyInit__engine(void) {
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) { Py_DECREF(&EngineType); Py_DECREF(m); return NULL; }
    if (shmemx_post_init(m) < 0 || shmemx_events_init(m) < 0) { Py_DECREF(m); return NULL; }
    PyModule_AddIntConstant(m, "BATCH_BBS", BATCH_BBS);
    PyModule_AddIntConstant(m, "WAKE_EVERY", WAKE_EVERY);
    PyModule_AddIntConstant(m, "COOP_MIN_BYTES", COOP_MIN_BYTES);
    PyModule_AddIntConstant(m, "COOP_CHUNK", COOP_CHUNK);
    PyModule_AddIntConstant(m, "POST_TURN_BYTES", POST_TURN_BYTES);
    return m;
}
