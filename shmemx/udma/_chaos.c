/* The seeded chaos policy of the DMA engine (``shmemx run --chaos SEED``): the same engine, another scheduler.
 *
 * Each step executes one piece of work chosen among everything the ordering rules allow (DESIGN section 5):
 *
 * - Eligible: a rung WQE of a queue, in its first WINDOW WQEs past ci, not executed yet, whose ordering is met:
 *   NO and RO WQEs of one QP are unordered among themselves; an SO WQE (any odr but NO and RO) waits until every
 *   earlier RO or SO WQE of its QP has executed; a fenced WQE until every earlier WQE of its QP has. Different
 *   QPs and different peers are unordered. (A WQE that would fail its checks runs only at ci, in order.)
 * - Which queue: PCT-style priorities. Every queue draws a priority; the eligible queue of the highest one runs;
 *   at change points (a draw per piece) the running queue drops below every other.
 * - Which WQE of it: the first eligible one (1/4), the last (1/2: a signal posted after its data, which the rules
 *   let overtake it, is tried early), or any (a draw), so that NO WQEs overtake each other.
 * - Splits: a READ, WRITE or WRITE_WITH_NOTIFY of at least SPLIT_MIN bytes is cut into up to MAX_CHUNKS pieces at
 *   8-byte boundaries of its destination (a naturally aligned 4- or 8-byte word stays in one piece) executed in
 *   a drawn order, interleaved with other work; the signal and the completion come with the last piece. Every
 *   piece reads its source when it runs: a WRITE's source is read as late as the schedule puts it.
 * - Starving writes: when a queue's work arrives with a plain WRITE first (no signal, no atomic), the queue
 *   starves with a probability each PE draws once (P_STARVE): it runs only while no other queue has work, and
 *   only after every queue was quiet (no piece, no arrival) for a drawn STARVE_QUIET_MIN_NS..STARVE_QUIET_MAX_NS
 *   (log-uniform), at the latest STARVE_MAX_NS after its arrival; among starving queues left alone, the
 *   highest-priority one whose quiet has passed goes first. So a signal or an atomic on another queue lands, and
 *   stays alone long enough in wall time for a receiver to wake and read, while the data before it is held.
 * - Holds (delays): a queue, or every queue to one peer, is held back for a drawn number of steps of the other
 *   queues or a drawn time (log-uniform, up to HOLD_MAX_NS) while nothing else can run, whichever ends first.
 *   Drawn when a queue's work arrives (with a probability each PE draws once, its temperament, times
 *   P_ARRIVE_READ when a READ comes first, P_ARRIVE_SIGNAL when a put_signal or an atomic does; otherwise the
 *   queue is held GATHER_MIN_NS..GATHER_MAX_NS, so that a burst of posts is rung before any of it runs), after a
 *   piece that ran ahead of an earlier WQE of its queue (likely, and long: HOLD_LONG_NS at least), after any
 *   other piece (rarely), and for a queue that a higher-priority one overtook. The time the engine sleeps
 *   because only held work is left is budgeted: at most BUDGET_BASE_NS at once, refilled at BUDGET_SHARE divided
 *   by the job's PEs of the time that passes (a held PE holds up the PEs that wait on it, so the job as a whole
 *   sleeps about BUDGET_SHARE); past it, the holds end early.
 *
 * Determinism: every draw is a hash of (seed, PE, what is decided, the queue, the WQE's BB position, ...), not
 * a generator advanced by the engine's steps, so a WQE gets the same priority context, split, piece order and
 * holds in every run of one seed, and two runs make the same choices while the kernel threads ring the same WQEs
 * in the same order. What can still differ: which WQEs are rung together when the engine looks (the OS schedules
 * the kernel threads; their jitter is seeded, their timing is not), the time a hold lasts when a kick ends the
 * engine's sleep early, and the budget. When tracing, every decision is logged (engine_log): kind 1 a piece
 * (queue, BB, byte range), 2 a hold of a queue (queue, BB, steps, ns), 3 a change point (queue, BB, priority),
 * 4 a hold of a peer (peer, BB, steps, ns), 5 holds ended by the budget (credit ns, cap ns), 6 a queue starves
 * (queue, BB, quiet ns), 7 a starving queue released (queue, BB, ns it starved, 1 after its quiet / 0 at the
 * latest or stopping). */
#include <math.h>

#include "_engine.h"

#define WINDOW 64                /* WQEs of a queue looked at past its ci */
#define MAX_CHUNKS 8
#define SPLIT_MIN 64             /* bytes: smaller transfers run whole */
#define HOLD_MIN_NS 500000LL     /* 0.5 ms */
#define HOLD_MAX_NS 15000000LL   /* 15 ms */
#define HOLD_LONG_NS 2000000LL   /* 2 ms: the least hold of work that was overtaken (ahead, or by another queue) */
#define BUDGET_BASE_NS 40000000LL
#define BUDGET_SHARE 0.35
static const double P_ARRIVE[4] = {0.5, 0.8, 0.95, 0.95}; /* a queue's work arrives: hold it (a PE draws one) */
#define GATHER_MIN_NS 40000LL    /* else gather its burst of posts for 40 .. 250 us, so that they can reorder */
#define GATHER_MAX_NS 250000LL
#define P_ARRIVE_READ 0.0        /* a READ's arrival is only gathered, never held: reads run early, writes lag */
#define P_ARRIVE_SIGNAL 0.3      /* a put_signal's or an atomic's arrival: held less often (signals race ahead) */
#define P_AHEAD 0.75             /* a piece ran ahead of an earlier WQE of its queue: hold the queue */
#define P_AFTER 0.04             /* any other piece */
#define P_OVERTAKEN 0.6          /* a queue with eligible work that a higher-priority one overtook */
#define P_PEER 0.25              /* a hold covers every queue to the peer */
#define P_CHANGE (1.0 / 16)      /* change point per piece */
static const double P_STARVE[4] = {0.75, 0.85, 0.9, 0.95}; /* a queue's plain WRITE arrives: starve it (per PE) */
#define STARVE_QUIET_MIN_NS 1000000LL  /* released after the other queues were quiet for 1 .. 20 ms */
#define STARVE_QUIET_MAX_NS 20000000LL
#define STARVE_MAX_NS 40000000LL       /* and at the latest 40 ms after its arrival */

enum { S_PRIO = 1, S_PICK, S_SPLIT, S_CUT, S_ORDER, S_HOLD, S_ARRIVE, S_OVERTAKEN, S_CHANGE, S_PEER, S_STEPS,
       S_NS, S_PE, S_STARVE, S_QUIET };
enum { LOG_PIECE = 1, LOG_HOLD = 2, LOG_CHANGE = 3, LOG_PEER = 4, LOG_BUDGET = 5, LOG_STARVE = 6, LOG_RELEASE = 7 };

typedef struct {
    uint64_t seed;
    uint32_t n;
    uint32_t *prio;          /* PCT priority per queue: the highest eligible runs */
    uint32_t low;            /* the next priority below every other (change points) */
    uint32_t *serial;        /* within-queue choices taken on the queue (keys them) */
    uint32_t *hold_steps;    /* a hold: steps of other queues left ... */
    int64_t *hold_ns;        /* ... and sleeping time left; it ends when either runs out */
    uint8_t *empty;          /* the queue was seen empty: its next work is an arrival */
    uint32_t *overtaken;     /* ci + 1 at which the queue's overtaken draw was taken (0: none) */
    uint32_t *stuck;         /* ci + 1 until which the queue runs in order (a WQE ahead failed its checks) */
    uint8_t *starve;         /* the queue starves: it runs only after the others were quiet for starve_quiet */
    int64_t *starve_since;   /* its arrival */
    int64_t *starve_quiet;
    double p_arrive;         /* this PE's temperament: P_ARRIVE[a draw] */
    double p_starve;         /* and P_STARVE[a draw] */
    int64_t credit_ns;       /* the time the engine may still sleep on held work (the budget) ... */
    int64_t credit_at;       /* ... as of this time: it refills at share of the time passed, up to BUDGET_BASE_NS */
    double share;            /* BUDGET_SHARE / the job's PEs */
    int64_t nap_since;
    int64_t activity;        /* the last piece executed or work arrived, on any queue */
} Chaos;

static inline uint64_t mix(uint64_t x) { /* splitmix64's finalizer */
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static inline uint64_t draw(const Chaos *c, uint64_t what, uint64_t q, uint64_t pos, uint64_t extra) {
    return mix(c->seed ^ mix(what * 0xD6E8FEB86659FD93ULL ^ mix(q * 0xA0761D6478BD642FULL ^ mix(pos ^ extra << 32))));
}

static inline double unit(uint64_t h) { return (double)(h >> 11) * (1.0 / 9007199254740992.0); }

/* A log-uniform draw in [lo, hi) ns, keyed like every draw. */
static int64_t log_uniform(const Chaos *c, int64_t lo, int64_t hi, uint64_t what, uint32_t q, uint32_t pos,
                           uint64_t extra) {
    double l = log((double)lo), h = log((double)hi);
    return (int64_t)exp(l + (h - l) * unit(draw(c, what, q, pos, extra)));
}

void *chaos_new(Engine *e, uint64_t seed) {
    Chaos *c = calloc(1, sizeof(Chaos));
    if (!c) return NULL;
    uint32_t n = c->n = e->n_slots;
    c->seed = mix(seed ^ mix(S_PE * 0x9E3779B97F4A7C15ULL + (uint64_t)e->my_pe));
    c->prio = calloc(n, 4); c->serial = calloc(n, 4); c->hold_steps = calloc(n, 4); c->hold_ns = calloc(n, 8);
    c->empty = calloc(n, 1); c->overtaken = calloc(n, 4); c->stuck = calloc(n, 4);
    c->starve = calloc(n, 1); c->starve_since = calloc(n, 8); c->starve_quiet = calloc(n, 8);
    if (!c->prio || !c->serial || !c->hold_steps || !c->hold_ns || !c->empty || !c->overtaken || !c->stuck
        || !c->starve || !c->starve_since || !c->starve_quiet) {
        chaos_free(c);
        return NULL;
    }
    c->low = 1u << 20;
    c->p_arrive = P_ARRIVE[draw(c, S_ARRIVE, 0, 0, 1) % 4];
    c->p_starve = P_STARVE[draw(c, S_STARVE, 0, 0, 1) % 4];
    for (uint32_t q = 0; q < n; q++) {
        c->prio[q] = (1u << 20) + (uint32_t)(draw(c, S_PRIO, q, 0, 0) % (1u << 30));
        c->empty[q] = 1;
    }
    c->credit_ns = BUDGET_BASE_NS;
    c->share = BUDGET_SHARE / (e->n_pes > 0 ? e->n_pes : 1);
    c->credit_at = now_ns();
    return c;
}

void chaos_free(void *state) {
    Chaos *c = state;
    if (!c) return;
    free(c->prio); free(c->serial); free(c->hold_steps); free(c->hold_ns); free(c->empty); free(c->overtaken);
    free(c->stuck); free(c->starve); free(c->starve_since); free(c->starve_quiet);
    free(c);
}

static inline int held(const Chaos *c, uint32_t q) { return c->hold_steps[q] > 0 && c->hold_ns[q] > 0; }

/* Hold queue q (or, by a draw, every queue to its peer), keyed by what decided it and the WQE at pos. */
static void hold(Chaos *c, Engine *e, uint32_t q, uint32_t pos, uint64_t why, int64_t min_ns) {
    uint32_t steps = 4 + (uint32_t)(draw(c, S_STEPS, q, pos, why) % 61);
    int64_t ns = log_uniform(c, min_ns, HOLD_MAX_NS, S_NS, q, pos, why);
    uint32_t first = q, last = q;
    int peer = unit(draw(c, S_PEER, q, pos, why)) < P_PEER;
    if (peer) {
        first = q - q % (uint32_t)e->qp_num;
        last = first + (uint32_t)e->qp_num - 1;
    }
    for (uint32_t k = first; k <= last && k < c->n; k++) {
        if (c->hold_steps[k] < steps) c->hold_steps[k] = steps;
        if (c->hold_ns[k] < ns) c->hold_ns[k] = ns;
    }
    if (peer) engine_log(e, LOG_PEER, q / (uint32_t)e->qp_num, pos, steps, ns);
    else engine_log(e, LOG_HOLD, q, pos, steps, ns);
}

/* The pieces of a WQE: cut points at 8-byte boundaries of its destination; returns how many (1..MAX_CHUNKS). */
static int pieces(const Chaos *c, uint32_t q, uint32_t pos, const WqeInfo *w, uint64_t *cut) {
    cut[0] = 0;
    int m = 1;
    if (w->splittable && w->len >= SPLIT_MIN) {
        uint64_t h = draw(c, S_SPLIT, q, pos, 0);
        int want = h % 4 == 0 ? 1 : 2 + (int)((h >> 8) % (MAX_CHUNKS - 1));
        for (int i = 1; i < want; i++) {
            uint64_t off = draw(c, S_CUT, q, pos, (uint64_t)i) % w->len;
            off = ((w->dst_va + off) & ~7ULL) - w->dst_va; /* wraps to a huge value below the first boundary */
            if (off == 0 || off >= w->len) continue;
            int k = m; /* insert sorted, no duplicates */
            while (k > 1 && cut[k - 1] > off) k--;
            if (cut[k - 1] == off) continue;
            memmove(cut + k + 1, cut + k, (m - k) * sizeof(uint64_t));
            cut[k] = off;
            m++;
        }
    }
    cut[m] = w->len;
    return m;
}

/* The queue's eligible WQEs in its window: positions and infos; returns how many. */
static int eligible(Chaos *c, Engine *e, uint32_t q, uint32_t ci, uint32_t db, uint32_t *pos, WqeInfo *info) {
    int n = 0, all_done = 1, ordered_done = 1;
    uint32_t p = ci;
    int in_order = c->stuck[q] && (int32_t)(c->stuck[q] - 1 - ci) >= 0;
    if (!in_order) c->stuck[q] = 0;
    for (int k = 0; k < WINDOW && p != db; k++) {
        WqeInfo w;
        if (!engine_wqe(e, q, p, &w)) break;
        int done = e->ahead[(uint64_t)q * e->sq_depth + (p & (e->sq_depth - 1))].done;
        uint32_t odr = w.flag & 7, fence = w.flag >> 3 & 1;
        int strong = odr != 0 && odr != 1; /* SO, and any odr value but NO and RO */
        if (!done && (fence ? all_done : strong ? ordered_done : 1) && (!in_order || p == ci)) {
            pos[n] = p;
            info[n++] = w;
        }
        if (!done) {
            all_done = 0;
            if (odr != 0) ordered_done = 0;
        }
        p += w.bbs;
    }
    return n;
}

/* The time slept because only held work was left (the nap that ends now) counts against every hold. */
static void charge_nap(Chaos *c, int64_t now) {
    if (!c->nap_since) return;
    int64_t dt = now - c->nap_since;
    c->credit_ns -= dt;
    c->nap_since = 0;
    for (uint32_t q = 0; q < c->n; q++)
        if (c->hold_ns[q] > 0) c->hold_ns[q] = c->hold_ns[q] > dt ? c->hold_ns[q] - dt : 0;
}

/* Work arrived on queue q (seen empty before), its first WQE at ci: a plain WRITE may starve; otherwise the queue
 * is held (less often when a READ, a signal or an atomic comes first) or its burst of posts is gathered. */
static void on_arrival(Chaos *c, Engine *e, uint32_t q, uint32_t ci, int64_t now) {
    const Layout *L = &e->L;
    c->empty[q] = 0;
    c->activity = now;
    WqeInfo w0;
    int known = engine_wqe(e, q, ci, &w0);
    uint32_t op = known ? w0.opcode : UINT32_MAX;
    int plain = op == (uint32_t)L->op_write, read = op == (uint32_t)L->op_read;
    int signal = op == (uint32_t)L->op_notify || op == (uint32_t)L->op_faa || op == (uint32_t)L->op_cas;
    if (plain && unit(draw(c, S_STARVE, q, ci, 0)) < c->p_starve) {
        c->starve[q] = 1;
        c->starve_since[q] = now;
        c->starve_quiet[q] = log_uniform(c, STARVE_QUIET_MIN_NS, STARVE_QUIET_MAX_NS, S_QUIET, q, ci, 0);
        engine_log(e, LOG_STARVE, q, ci, c->starve_quiet[q], 0);
    } else if (unit(draw(c, S_ARRIVE, q, ci, 0))
               < (read ? P_ARRIVE_READ : signal ? P_ARRIVE_SIGNAL : 1.0) * c->p_arrive) {
        hold(c, e, q, ci, S_ARRIVE, HOLD_MIN_NS);
    } else if (!held(c, q)) {
        c->hold_steps[q] = 64;
        c->hold_ns[q] = log_uniform(c, GATHER_MIN_NS, GATHER_MAX_NS, S_NS, q, ci, S_ARRIVE);
        engine_log(e, LOG_HOLD, q, ci, 64, c->hold_ns[q]);
    }
}

/* A starving queue runs at the latest STARVE_MAX_NS after its arrival, and at once when the engine stops. */
static void starve_ends(Chaos *c, Engine *e, uint32_t q, uint32_t ci, int64_t now, int stopping) {
    if (c->starve[q] && (stopping || now - c->starve_since[q] >= STARVE_MAX_NS)) {
        c->starve[q] = 0;
        engine_log(e, LOG_RELEASE, q, ci, now - c->starve_since[q], 0);
    }
}

/* What a scan of every queue found: the highest-priority queue that may run (best, -1: none), the queues that
 * could (cands), the starving ones, and whether held work is left and when its first hold ends. */
typedef struct {
    int best, held_work, n_cands, n_starved;
    int64_t soonest;
    uint32_t *cands, *starved;
} Scan;

/* Classify every queue: empty, in error, arrived, starving, held, or a candidate. Returns 1 when a queue in error
 * was flushed (in order, by the turn core): that was this step. */
static int scan_queues(Chaos *c, Engine *e, int64_t now, int stopping, Scan *s) {
    const Layout *L = &e->L;
    for (uint32_t q = 0; q < c->n; q++) {
        uint32_t *hw = hw_of(e, q);
        uint32_t ci = hw[L->hw_ci], db = ld32(hw + L->hw_sq_db);
        if (e->remote[q]) continue; /* the host's NIC serves it */
        if (db == ci) {
            c->empty[q] = 1;
            continue;
        }
        if (ld32(hw + L->hw_state) || db - ci > e->sq_depth) {
            engine_turn(e, q, BATCH_BBS);
            return 1;
        }
        if (c->empty[q]) on_arrival(c, e, q, ci, now);
        starve_ends(c, e, q, ci, now, stopping);
        if (c->starve[q]) {
            s->starved[s->n_starved++] = q;
            continue;
        }
        if (held(c, q) && !stopping) {
            s->held_work = 1;
            if (c->hold_ns[q] < s->soonest) s->soonest = c->hold_ns[q];
            continue;
        }
        WqeInfo w;
        if (!engine_wqe(e, q, ci, &w)) continue; /* its second BB is not rung yet */
        s->cands[s->n_cands++] = q;
        if (s->best < 0 || c->prio[q] > c->prio[s->best]) s->best = (int)q;
    }
    return 0;
}

/* Only starving queues have work: the highest-priority one whose quiet (since its arrival or the last activity,
 * whichever is later) has passed runs; returns 1 when one was released, else lowers soonest to the next quiet. */
static int release_starved(Chaos *c, Engine *e, int64_t now, Scan *s) {
    int pick = -1;
    for (int i = 0; i < s->n_starved; i++) {
        uint32_t q = s->starved[i];
        int64_t since = c->activity > c->starve_since[q] ? c->activity : c->starve_since[q];
        int64_t left = since + c->starve_quiet[q] - now;
        if (left <= 0) {
            if (pick < 0 || c->prio[q] > c->prio[pick]) pick = (int)q;
        } else if (left < s->soonest) {
            s->soonest = left;
        }
    }
    if (pick < 0) return 0;
    c->starve[pick] = 0;
    engine_log(e, LOG_RELEASE, pick, hw_of(e, (uint32_t)pick)[e->L.hw_ci], now - c->starve_since[pick], 1);
    return 1;
}

/* The budget refills at share of the time since it was last looked at, never above BUDGET_BASE_NS: the engine
 * sleeps on held work at most BUDGET_BASE_NS plus that share of any stretch of the run (not of the run so far:
 * what a quiet start saved is not spent at once later). */
static void refill(Chaos *c, int64_t now) {
    c->credit_ns += (int64_t)(c->share * (double)(now - c->credit_at));
    if (c->credit_ns > BUDGET_BASE_NS) c->credit_ns = BUDGET_BASE_NS;
    c->credit_at = now;
}

/* No queue may run: past the budget every hold and starvation ends; else a starving queue whose quiet has passed
 * is released, or the engine naps until the first hold or quiet ends (within the budget). */
static int idle_step(Chaos *c, Engine *e, int64_t now, Scan *s, int64_t *nap_ns) {
    if (!s->held_work && !s->n_starved) return 0;
    refill(c, now);
    if (c->credit_ns <= 0) {
        engine_log(e, LOG_BUDGET, 0, 0, c->credit_ns, BUDGET_BASE_NS);
        memset(c->hold_steps, 0, c->n * sizeof(uint32_t));
        memset(c->hold_ns, 0, c->n * sizeof(int64_t));
        memset(c->starve, 0, c->n);
        return 1;
    }
    if (!s->held_work && release_starved(c, e, now, s)) return 1;
    *nap_ns = s->soonest < c->credit_ns ? s->soonest : c->credit_ns;
    if (*nap_ns < 1000) *nap_ns = 1000;
    c->nap_since = now;
    return 0;
}

/* Which of queue q's n eligible WQEs runs: the first (1/4), the last (1/2), or any. */
static int pick_wqe(Chaos *c, uint32_t q, int n) {
    uint64_t h = draw(c, S_PICK, q, c->serial[q]++, 0);
    return h % 4 == 0 ? 0 : h % 4 != 3 ? n - 1 : (int)((h >> 8) % (uint64_t)n);
}

/* Which of the WQE's m pieces runs: the undone one of the lowest drawn rank. */
static int pick_piece(const Chaos *c, uint32_t q, uint32_t pos, const Ahead *a, int m) {
    int piece = -1;
    uint64_t rank = 0;
    for (int i = 0; i < m; i++) {
        if (a->chunks >> i & 1) continue;
        uint64_t r = draw(c, S_ORDER, q, pos, (uint64_t)i);
        if (piece < 0 || r < rank) { piece = i; rank = r; }
    }
    return piece < 0 ? 0 : piece; /* (a WQE with every piece done is done) */
}

/* After a piece of queue q's WQE at pos (ci: the queue's consumer index): a hold (likely when it ran ahead of an
 * earlier WQE), a change point, a draw for each queue it overtook, and a step off every other queue's hold. */
static void after_piece(Chaos *c, Engine *e, uint32_t q, uint32_t pos, uint32_t ci, int piece, const Scan *s) {
    double u = unit(draw(c, S_HOLD, q, pos, (uint64_t)piece));
    if (u < (pos != ci ? P_AHEAD : P_AFTER))
        hold(c, e, q, pos, S_HOLD + ((uint64_t)piece << 8), pos != ci ? HOLD_LONG_NS : HOLD_MIN_NS);
    if (unit(draw(c, S_CHANGE, q, pos, (uint64_t)piece)) < P_CHANGE) {
        c->prio[q] = c->low > 0 ? c->low-- : 0;
        engine_log(e, LOG_CHANGE, q, pos, c->prio[q], 0);
    }
    for (int i = 0; i < s->n_cands; i++) { /* one draw per queue and position of its ci */
        uint32_t o = s->cands[i];
        if (o == q) continue;
        uint32_t oci = hw_of(e, o)[e->L.hw_ci];
        if (c->overtaken[o] == oci + 1) continue;
        c->overtaken[o] = oci + 1;
        if (unit(draw(c, S_OVERTAKEN, o, oci, 0)) < P_OVERTAKEN) hold(c, e, o, oci, S_OVERTAKEN, HOLD_LONG_NS);
    }
    for (uint32_t o = 0; o < c->n; o++)
        if (o != q && c->hold_steps[o] > 0) c->hold_steps[o]--;
}

/* Run one piece of queue q's work: a WQE among its eligible ones, then a piece of it. */
static int run_piece(Chaos *c, Engine *e, uint32_t q, const Scan *s) {
    uint32_t *hw = hw_of(e, q);
    uint32_t ci = hw[e->L.hw_ci], db = ld32(hw + e->L.hw_sq_db);
    uint32_t pos[WINDOW];
    WqeInfo info[WINDOW];
    int n = eligible(c, e, q, ci, db, pos, info);
    if (n == 0) return 0; /* cannot happen: the WQE at ci is always eligible */
    int k = pick_wqe(c, q, n);
    uint32_t p = pos[k];
    uint64_t cut[MAX_CHUNKS + 1];
    int m = pieces(c, q, p, &info[k], cut);
    Ahead *a = &e->ahead[(uint64_t)q * e->sq_depth + (p & (e->sq_depth - 1))];
    int piece = pick_piece(c, q, p, a, m);
    int last = __builtin_popcount(a->chunks) + 1 >= m;
    if (engine_piece(e, q, p, cut[piece], cut[piece + 1], last)) {
        c->stuck[q] = p + 1; /* it fails its checks: the queue runs in order until ci passes it */
        return 1;
    }
    engine_log(e, LOG_PIECE, q, p, (int64_t)cut[piece], (int64_t)cut[piece + 1]);
    c->activity = now_ns();
    if (!last) a->chunks |= (uint8_t)(1u << piece);
    after_piece(c, e, q, p, ci, piece, s);
    return 1;
}

/* One step of the chaos policy: returns 1 when it did something (a piece, a flush, a release), 0 when there is
 * nothing to do (with *nap_ns set when held or starving work is left). */
int chaos_step(Engine *e, int64_t *nap_ns) {
    Chaos *c = e->policy.state;
    int64_t now = now_ns();
    int stopping = __atomic_load_n(&e->stopping, __ATOMIC_ACQUIRE);
    charge_nap(c, now);
    uint32_t cands[c->n], starved[c->n];
    Scan s = {.best = -1, .soonest = INT64_MAX, .cands = cands, .starved = starved};
    if (scan_queues(c, e, now, stopping, &s)) return 1;
    if (s.best < 0) return idle_step(c, e, now, &s, nap_ns);
    return run_piece(c, e, (uint32_t)s.best, &s);
}
