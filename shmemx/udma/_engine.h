/* What the native engine (_engine.c) and the native posting path (_post.c) share: the layout they take from
 * layout.py / segment.py, the engine's state, and the few inline helpers both use. */
#ifndef SHMEMX_UDMA_ENGINE_H
#define SHMEMX_UDMA_ENGINE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "../shm/wake.h"

#define BATCH_BBS 4096
#define WAKE_EVERY 8
#define WAKE_EVERY_PIECES 64 /* a stepping policy (chaos) runs a piece per step, not a batch per turn */
#define COOP_MIN_BYTES (1 << 20) /* READ / WRITE payloads this large: copied by the engine and a quiet-ing thread */
#define COOP_CHUNK (256 << 10)
#define STREAM_MIN_BYTES 4096 /* payloads this large may be stored around the cache (dma_copy) */
#define POST_TURN_BYTES 256 /* WQEs with payloads up to this: executed by the posting thread when its queue is idle */
#define IDLE_BACKSTOP_NS 100000000LL /* a doorbell stored without kick() is seen within 0.1 s */

/* Why a WQE failed, beside its status (hw err_where): lets the Python layer rebuild the detail message from
 * the WQE and the tables. Mirrored by engine.py's Where enum. */
enum where {
    W_NONE = 0, W_OPCODE = 1, W_MALFORMED = 2, W_EID = 3, W_TP = 4, W_LENGTH = 5, W_REMOTE = 6, W_LOCAL = 7,
    W_SIGNAL = 8, W_SIGNAL_ALIGN = 9, W_ATOMIC_SIZE = 10, W_REDUCE = 11, W_DOORBELL = 12, W_INJECTED = 13,
};

typedef struct {
    /* WQE: u32 / u64 word positions of the first BB, byte offsets of second-BB fields */
    int w_dw0, w_dw1, w_tp, w_seg, w_token, w_reduce, w_sge_len, q_eid_lo, q_eid_hi, q_rmt_va, q_sge_va;
    int notify_ctx, notify_sge, amo_operand;
    /* CQE word positions */
    int c_status, c_entry_idx, c_tpn, c_byte_cnt, c_user_data, c_eid, c_data, owner_shift;
    /* engine record (hw) u32 word positions; executed and bytes are u64 words */
    int hw_sq_db, hw_ci, hw_cq_pi, hw_state, hw_err_status, hw_err_substatus, hw_err_pos, hw_err_where,
        hw_err_arg, hw_executed, hw_bytes;
    int op_write, op_notify, op_read, op_cas, op_faa, op_nop;
    int st_bad_opcode, st_bad_eid, st_bad_tp, st_bad_token_id, st_token_mismatch, st_out_of_bounds,
        st_local_access, st_length, st_bad_atomic, st_flushed, st_engine_fault;
    int reduce_flag, cqe_flag, jetty_type, fp32, reduce_add;
    uint64_t max_msg;
} Layout;

typedef struct { uint64_t va, len; uint8_t *addr; } Local;

struct engine;
/* A scheduling policy: the one place that decides what the engine executes next (DESIGN section 5, 9).
 *
 * A policy is either in order (pick) or out of order (step); both run on the engine thread, holding the turn
 * lock, never touching Python. They see the engine: for each queue q (0..n_slots-1) its engine record hw_of(e,
 * q) (the doorbell word L.hw_sq_db, stored last by the poster with release order; the consumer index L.hw_ci;
 * L.hw_state, nonzero while the queue is in error) and its SQ ring sq_of(e, q), whose BBs from ci up to the
 * doorbell are rung and may be read (never written; engine_wqe decodes one).
 *
 * pick() chooses the next turn: *queue and *bbs (>= 1), and the engine then executes that queue's WQEs in order
 * from its consumer index, at most *bbs BBs and never a WQE past the doorbell (each WQE's checks, effects and
 * CQE are one atomic step of the engine thread; the consumer index and the CQ producer index advance only over
 * executed WQEs; the CQEs go to the CQ in SQ order). Returning 0 chooses nothing now: the engine flushes its
 * wake-ups and idles until the next kick or the backstop. The normal policy is pick_round_robin: the next queue
 * with rung BBs after the last one served, up to BATCH_BBS.
 *
 * step() (the seeded chaos policy of _chaos.c) executes one piece of work itself through the turn core's
 * out-of-order entry, engine_piece(): any rung WQE of a queue (the ordering rules are the policy's to keep), whole
 * or a byte range of its payload, the signal and the completion with its last piece. The turn core keeps the
 * executed set beyond ci (e->ahead) and advances ci only over the executed prefix, writing the prefix's CQEs in
 * SQ order, so that a poller that restores the SQ tail from a CQE's entry_idx never frees an unexecuted slot and
 * a quiet that consumed its CQEs finds every earlier WQE of the queue executed. step() returns 1 after doing
 * work; 0 with *nap_ns > 0 when rung work is held back (the engine sleeps that long, or until a kick); 0 with
 * *nap_ns == 0 when there is nothing to do. While e->stopping it must hold nothing back. */
struct policy {
    const char *name;
    int (*pick)(struct engine *e, uint32_t *queue, uint32_t *bbs);
    int (*step)(struct engine *e, int64_t *nap_ns);
    void *state;
};

/* The executed set beyond a queue's ci, per SQ slot (q * sq_depth + (pos & (sq_depth - 1))): set when a WQE ran
 * ahead of an earlier one, cleared when ci passes it; ``chunks`` is a policy's record of the pieces done. */
typedef struct { uint8_t done, chunks; uint16_t status; uint32_t byte_cnt; uint64_t data; } Ahead;

/* What a policy needs to know of a rung WQE (engine_wqe). */
typedef struct { uint32_t flag, opcode, bbs; uint64_t len, dst_va; int splittable; } WqeInfo;

/* A large READ's or WRITE's payload copied by two threads at once (_engine.c coop_copy): the thread that
 * executes the WQE (the engine's, or a quiet's assist) and a thread of this process that waits in a quiet
 * meanwhile (shmemx_engine_help). The payload is cut into ``chunk``-byte chunks; the executor claims them from the
 * front, a helper from the back (so that each side keeps copying the same part of a buffer put again and again:
 * its cache lines stay on that core), both through one 64-bit claim word. The executor waits for every chunk,
 * then signals and writes the CQE as before. */
typedef struct {
    uint8_t *dst;
    const uint8_t *src;
    uint64_t len, chunk;
    uint64_t claims;   /* low 32 bits: chunks claimed from the front; high 32 bits: from the back */
    uint32_t n;        /* chunks */
    uint32_t finished; /* chunks copied */
    int stream;        /* chunks stored around the cache (dma_copy) */
    int active;        /* a helper may claim chunks */
    int users;         /* helpers between their check of ``active`` and their last claim */
    uint64_t copied, helped; /* counters: chunks copied cooperatively, of them by a helper */
} Coop;

typedef struct engine {
    PyObject_HEAD
    Layout L;
    uint8_t *seg;
    uint64_t sq_off, sq_bytes, cq_off, cq_bytes, hw_off, amo_off, amo_len, amo_va;
    uint32_t sq_depth, cq_depth, n_slots, tp_base;
    int my_pe, n_pes, qp_num;
    uint64_t heap_size, heap_va_base, heap_va_stride;
    uint8_t **heap;
    uint64_t *eid_lo, *eid_hi;
    uint32_t *tid, *token;
    uint32_t **wake, **sleepers;
    uint8_t *remote;   /* per queue: 1 when its peer is on another host (the host's NIC serves it, udma/nic.py) */
    uint8_t *remote_pe; /* per PE: 1 when it is on another host (its heap is not mapped here) */
    pthread_mutex_t reg_lock;
    Local *locals;
    Py_ssize_t n_locals;
    pthread_t thread;
    int started;
    uint32_t seq;      /* futex word: bumped by every kick */
    int sleeping;      /* the engine announced it sleeps on seq */
    int stopping;
    pthread_mutex_t turn_lock;
    pthread_cond_t turn_cond;
    int paused;
    int inject;        /* WQEs still to fail with an injected ENGINE_FAULT (a test hook) */
    uint8_t *touched;
    int *touched_list;
    int n_touched;
    int tracing;
    pthread_mutex_t trace_lock;
    int64_t *trace;
    size_t trace_len, trace_cap;
    uint32_t rr;
    int64_t spin_ns;
    struct policy policy;
    int assist;        /* a quiet may execute its own queue's WQEs (shmemx_engine_assist); set_assist */
    Ahead *ahead;      /* the executed set beyond ci (out-of-order policies), NULL until one is installed */
    int64_t *log;      /* a policy's decision records when tracing: 6 int64 each (engine_log) */
    size_t log_len, log_cap;
    Coop coop;         /* the payload being copied cooperatively, if any */
    uint64_t coop_min; /* READs / WRITEs of at least this many bytes are copied cooperatively (0: never); set_coop */
    const uint8_t *last_dst; /* where the previous payload copy went (dma_copy: a rewrite goes through the cache) */
    uint64_t post_turns; /* WQEs executed by their posting thread (shmemx_engine_post_turn), a counter */
} Engine;

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline uint32_t *hw_of(Engine *e, uint32_t q) { return (uint32_t *)(e->seg + e->hw_off + 64 * (uint64_t)q); }
static inline uint8_t *sq_of(Engine *e, uint32_t q) { return e->seg + e->sq_off + q * e->sq_bytes; }
static inline uint32_t *cq_of(Engine *e, uint32_t q) { return (uint32_t *)(e->seg + e->cq_off + q * e->cq_bytes); }
static inline uint32_t ld32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void st32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* The first kick after the engine announced its sleep takes the announcement and wakes it; the kicks after that
 * (the engine not yet back on a core) skip the system call. None is lost: each bumps seq before, so an engine
 * that has not reached its futex wait yet finds seq moved and does not sleep. */
static inline void kick(Engine *e) {
    __atomic_fetch_add(&e->seq, 1, __ATOMIC_SEQ_CST); /* a locked add: the doorbell store is visible first */
    if (__atomic_load_n(&e->sleeping, __ATOMIC_SEQ_CST) && __atomic_exchange_n(&e->sleeping, 0, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &e->seq, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

/* The event log of a PE (_events.c; udma/events.py declares it): the record kinds and mask bits its native
 * writers use, taken from events.py at init. */
typedef struct {
    int site, post, quiet, doorbell, value, src_changed; /* record kinds */
    int local_heap;                                     /* POST flags bit: the local side is a heap offset */
    int sites, fingerprints, wqe_bytes;                 /* mask bits */
} EventCodes;

typedef struct {
    PyObject_HEAD
    uint8_t *base;      /* the mapped segment: header page, records, blob */
    uint64_t *hdr;      /* its header as u64 words */
    uint64_t capacity;  /* records */
    uint64_t blob_cap;  /* bytes */
    uint32_t mask;      /* what is recorded (events.Mask) */
    EventCodes k;
    PyObject *classify; /* classify(code) -> -1 internal / 1 the kernel's (the site of a record) */
    PyObject *kinds;    /* code -> classify's answer */
    PyObject *sites;    /* (code, line) -> site id */
} Events;

extern PyTypeObject EventsType;
int events_put(Events *ev, int64_t ts, int kind, int block, int flags, uint32_t site, uint64_t a, uint64_t b,
               uint64_t c, uint64_t d, uint64_t e, uint32_t f, uint32_t g);
int64_t events_blob(Events *ev, const void *data, uint64_t n);
uint32_t events_site(Events *ev);
uint64_t fingerprint(const uint8_t *p, uint64_t n);
#define FP_CHUNK 1024    /* fp_range's chunk: row starts of bfloat16 hidden rows of a multiple of 512 elements align to
                            it (512 cost a quarter more: each chunk is looked up, summed and kept) */
#define FP_SLOTS 32768   /* chunks kept per call (32 MiB of sources) */
typedef struct { uintptr_t key; uint64_t hash; uint32_t gen; } FpSlot;
typedef struct { FpSlot *slot; uint32_t gen; } FpCache;
void fp_begin(FpCache *c);
uint64_t fp_range(FpCache *c, const uint8_t *p, uint64_t n);
int shmemx_events_init(PyObject *module);
uint8_t *shmemx_resolve_local(Engine *e, uint64_t va, uint64_t len);

/* The turn core's entries for out-of-order policies (_engine.c). */
void engine_turn(Engine *e, uint32_t q, uint32_t bbs);
int engine_piece(Engine *e, uint32_t q, uint32_t pos, uint64_t lo, uint64_t hi, int last);
int engine_wqe(Engine *e, uint32_t q, uint32_t pos, WqeInfo *out);
void engine_log(Engine *e, int64_t kind, int64_t q, int64_t pos, int64_t a, int64_t b);

/* The seeded chaos policy (_chaos.c). */
void *chaos_new(Engine *e, uint64_t seed);
void chaos_free(void *state);
int chaos_step(Engine *e, int64_t *nap_ns);

extern PyTypeObject EngineType;
int shmemx_engine_assist(Engine *e, uint32_t q, int wait);
int shmemx_engine_assist_many(Engine *e, const int64_t *qs, Py_ssize_t n);
int shmemx_engine_help(Engine *e);
int shmemx_engine_post_turn(Engine *e, uint32_t q, uint32_t head, uint32_t bbs);
void shmemx_engine_rung(Engine *e, uint32_t q, uint32_t head, uint32_t bbs);
int shmemx_post_init(PyObject *module);

#endif
