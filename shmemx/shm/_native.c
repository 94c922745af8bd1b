/* Waiting on words of shared memory without the interpreter lock, and waking their sleepers.
 *
 * shmemx/shm/waits.py decides what a wait records and raises; this module does the part that must not hold
 * the interpreter lock: spinning on a word, sleeping on a futex until the word meets a comparison (with the
 * deadline, the job-abort check and the backstop of waits.py), the wake protocol of wake.h, and the atomic adds
 * of the sleeper counts. While a thread waits here the PE's other threads (kernel blocks, whose posts its
 * engine executes without the lock anyway) run.
 *
 * Words: kind 0 int32, 1 uint32, 2 int64, 3 uint64, 4 int8, 5 uint8, 6 int16, 7 uint16, 8 float32 (its target
 * passed as its IEEE bits; compared as floats); comparisons 0..5 are ACLSHMEM_CMP_EQ..LE and 6 is
 * "(word & mask) == value" (a CQE's owner bit). Addresses are plain integers; callers bound-check them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "wake.h"

#define DOZE_MAX_NS 1000000 /* sleep_all's longest doze while words land */
#define DOZE_IDLE_MAX_NS 8000000 /* its longest after dozes in which none landed (each doubles the last) */
#define DOZE_MIN_WORDS 16 /* sleep_all dozes only while more words than this are still to come */
#define PURE_SPIN_NS 2000 /* a spin polls without yielding this long first */

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

typedef struct {
    void *addr;
    int kind, cmp;
    uint64_t target, mask;
} Cond;

#define KIND_F32 8

static inline uint64_t load_word(const Cond *c) {
    switch (c->kind) {
    case 2: case 3: return __atomic_load_n((uint64_t *)c->addr, __ATOMIC_ACQUIRE);
    case 4: case 5: return __atomic_load_n((uint8_t *)c->addr, __ATOMIC_ACQUIRE);
    case 6: case 7: return __atomic_load_n((uint16_t *)c->addr, __ATOMIC_ACQUIRE);
    default: return __atomic_load_n((uint32_t *)c->addr, __ATOMIC_ACQUIRE);
    }
}

/* A raw word of a signed kind as a signed value (sign-extended from its size). */
static inline int64_t signed_of(int kind, uint64_t raw) {
    switch (kind) {
    case 0: return (int32_t)raw;
    case 4: return (int8_t)raw;
    case 6: return (int16_t)raw;
    default: return (int64_t)raw;
    }
}

static inline float float_of(uint64_t raw) {
    uint32_t bits = (uint32_t)raw;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

static inline int met(const Cond *c, uint64_t raw) {
    if (c->cmp == 6) return (raw & c->mask) == c->target;
    int r;
    if (c->kind == KIND_F32) {
        float v = float_of(raw), t = float_of(c->target);
        r = c->cmp == 0 ? v == t : c->cmp == 1 ? v != t : c->cmp == 2 ? v > t : c->cmp == 3 ? v >= t
            : c->cmp == 4 ? v < t : v <= t;
    } else if (c->kind % 2 == 0) {
        int64_t v = signed_of(c->kind, raw), t = (int64_t)c->target;
        r = c->cmp == 0 ? v == t : c->cmp == 1 ? v != t : c->cmp == 2 ? v > t : c->cmp == 3 ? v >= t
            : c->cmp == 4 ? v < t : v <= t;
    } else {
        uint64_t v = raw, t = c->target;
        r = c->cmp == 0 ? v == t : c->cmp == 1 ? v != t : c->cmp == 2 ? v > t : c->cmp == 3 ? v >= t
            : c->cmp == 4 ? v < t : v <= t;
    }
    return r;
}

static PyObject *value_of(const Cond *c, uint64_t raw) {
    switch (c->kind) {
    case 0: case 4: case 6: return PyLong_FromLong((long)signed_of(c->kind, raw));
    case 1: return PyLong_FromUnsignedLong((uint32_t)raw);
    case 2: return PyLong_FromLongLong((int64_t)raw);
    case 5: return PyLong_FromUnsignedLong((uint8_t)raw);
    case 7: return PyLong_FromUnsignedLong((uint16_t)raw);
    case KIND_F32: return PyFloat_FromDouble((double)float_of(raw));
    default: return PyLong_FromUnsignedLongLong(raw);
    }
}

static int parse_cond(PyObject *addr, int kind, int cmp, PyObject *target, PyObject *mask, Cond *c) {
    c->addr = PyLong_AsVoidPtr(addr);
    if (PyErr_Occurred()) return -1;
    if (kind < 0 || kind > KIND_F32 || cmp < 0 || cmp > 6) {
        PyErr_SetString(PyExc_ValueError, "wait: bad word kind or comparison");
        return -1;
    }
    c->kind = kind;
    c->cmp = cmp;
    c->target = PyLong_AsUnsignedLongLongMask(target);
    if (PyErr_Occurred()) return -1;
    c->mask = PyLong_AsUnsignedLongLongMask(mask);
    if (PyErr_Occurred()) return -1;
    switch (kind) { /* compare words narrower than 64 bits in their own domain */
    case 0: case 4: case 6: c->target = (uint64_t)signed_of(kind, c->target); break;
    case 1: case KIND_F32: c->target &= 0xFFFFFFFFu; break;
    case 5: c->target &= 0xFFu; break;
    case 7: c->target &= 0xFFFFu; break;
    default: break;
    }
    return 0;
}

/* spin(addr, kind, cmp, target, mask, spin_ns) -> value or None: poll the word for up to spin_ns: the first
 * PURE_SPIN_NS without a pause in between, then yielding the core every 64 polls (the thread that will write
 * the word, this PE's engine for instance, may be waiting for a core). */
static PyObject *spin(PyObject *self, PyObject *args) {
    PyObject *addr, *target, *mask;
    int kind, cmp;
    long long spin_ns;
    Cond c;
    if (!PyArg_ParseTuple(args, "OiiOOL", &addr, &kind, &cmp, &target, &mask, &spin_ns)) return NULL;
    if (parse_cond(addr, kind, cmp, target, mask, &c)) return NULL;
    uint64_t raw = load_word(&c);
    int ok = met(&c, raw);
    if (!ok && spin_ns > 0) {
        Py_BEGIN_ALLOW_THREADS
        int64_t start = now_ns(), end = start + spin_ns, pure = start + PURE_SPIN_NS;
        for (unsigned k = 1;; k++) {
            raw = load_word(&c);
            if ((ok = met(&c, raw))) break;
            if ((k & 63) == 0) {
                int64_t now = now_ns();
                if (now >= end) break;
                if (now >= pure) sched_yield();
            } else {
                __builtin_ia32_pause();
            }
        }
        Py_END_ALLOW_THREADS
    }
    if (ok) return value_of(&c, raw);
    Py_RETURN_NONE;
}

/* One sleep of sleep_on / sleep_all's loop, not met yet: 1 past the deadline, 2 when the job is aborting, else a
 * futex wait on the wake word (while it still reads ``seen``, at most ``backstop`` ns) and 0. */
static int nap(uint32_t *wake, uint32_t seen, int64_t deadline, int64_t backstop, uint32_t *state,
               unsigned int aborting) {
    int64_t now = now_ns();
    if (now >= deadline) return 1;
    if (__atomic_load_n(state, __ATOMIC_ACQUIRE) == aborting) return 2;
    int64_t ns = deadline - now < backstop ? deadline - now : backstop;
    struct timespec ts = {ns / 1000000000LL, ns % 1000000000LL};
    syscall(SYS_futex, wake, FUTEX_WAIT, seen, &ts, NULL, 0);
    return 0;
}

/* A doze instead of a futex sleep (sleep_all with words of many writers): ``ns`` on the clock, not woken by the
 * writers' wake-ups, 1 past the deadline, 2 when the job is aborting, else 0. */
static int doze(int64_t ns, int64_t deadline, uint32_t *state, unsigned int aborting) {
    int64_t now = now_ns();
    if (now >= deadline) return 1;
    if (__atomic_load_n(state, __ATOMIC_ACQUIRE) == aborting) return 2;
    if (ns > deadline - now) ns = deadline - now;
    struct timespec ts = {ns / 1000000000LL, ns % 1000000000LL};
    nanosleep(&ts, NULL);
    return 0;
}

/* Where and how long a native sleep sleeps: the arguments sleep_on and sleep_all share. */
typedef struct {
    uint32_t *wake, *count, *state; /* the wake word, its sleeper count, the job's state word */
    int atomic;                     /* count with atomic adds (another PE's count), else plain stores */
    unsigned int aborting;          /* the state word's value while the job aborts */
    int64_t timeout_ns, backstop_ns;
} Sleeper;

static int parse_sleeper(PyObject *wake_o, PyObject *count_o, int atomic, double timeout_s, PyObject *state_o,
                         unsigned int aborting, double backstop_s, Sleeper *s) {
    s->wake = PyLong_AsVoidPtr(wake_o);
    s->count = PyLong_AsVoidPtr(count_o);
    s->state = PyLong_AsVoidPtr(state_o);
    s->atomic = atomic;
    s->aborting = aborting;
    s->timeout_ns = (int64_t)(timeout_s * 1e9);
    s->backstop_ns = (int64_t)(backstop_s * 1e9);
    return PyErr_Occurred() ? -1 : 0;
}

/* What one look at the words found: met, not met (sleep on the wake word), or look again at once (a doze was
 * taken); a doze may also end the sleep with 1 (the deadline) or 2 (the job aborts). */
enum { LOOK_MET = 0, LOOK_NAP = -1, LOOK_AGAIN = -2 };
typedef int (*Look)(void *ctx, int64_t deadline, const Sleeper *s);

/* The sleep of sleep_on and sleep_all: announce the thread in the sleeper count, then {read the wake word, look
 * at the words, nap on the wake word} until they are met (0), the deadline passes (1) or the job aborts (2); then
 * withdraw the count. Called with the interpreter lock held, which it lets go meanwhile: a plain count changes
 * only under that lock (this PE's own count; see waits.py), an atomic one without it. */
static int sleep_loop(const Sleeper *s, Look look, void *ctx) {
    int code;
    if (!s->atomic) *(volatile uint32_t *)s->count += 1;
    Py_BEGIN_ALLOW_THREADS
    int64_t deadline = now_ns() + s->timeout_ns;
    if (s->atomic) __atomic_fetch_add(s->count, 1, __ATOMIC_SEQ_CST);
    for (;;) {
        uint32_t seen = __atomic_load_n(s->wake, __ATOMIC_SEQ_CST);
        code = look(ctx, deadline, s);
        if (code == LOOK_AGAIN) continue;
        if (code != LOOK_NAP) break;
        if ((code = nap(s->wake, seen, deadline, s->backstop_ns, s->state, s->aborting))) break;
    }
    if (s->atomic) __atomic_fetch_sub(s->count, 1, __ATOMIC_SEQ_CST);
    Py_END_ALLOW_THREADS
    if (!s->atomic) *(volatile uint32_t *)s->count -= 1;
    return code;
}

typedef struct {
    Cond c;
    uint64_t raw; /* the word at the last look */
} WordLook;

static int look_word(void *ctx, int64_t deadline, const Sleeper *s) {
    WordLook *w = ctx;
    w->raw = load_word(&w->c);
    return met(&w->c, w->raw) ? LOOK_MET : LOOK_NAP;
}

/* sleep(addr, kind, cmp, target, mask, wake_addr, count_addr, atomic, timeout_s, state_addr, aborting,
 *       backstop_s) -> (code, value): code 0 met (value: the word), 1 deadline passed, 2 the job is aborting.
 * Announces itself in the sleeper count at count_addr, then loops {read the wake word, read the word, compare,
 * check deadline and job state, futex-sleep on the wake word}, then withdraws the count (sleep_loop). ``atomic``:
 * count with atomic adds (another PE's count), else with plain stores made while holding the interpreter lock
 * (this PE's own count, which its threads change only under that lock; see waits.py). */
static PyObject *sleep_on(PyObject *self, PyObject *args) {
    PyObject *addr, *target, *mask, *wake_o, *count_o, *state_o;
    int kind, cmp, atomic;
    unsigned int aborting;
    double timeout_s, backstop_s;
    WordLook w = {0};
    Sleeper s;
    if (!PyArg_ParseTuple(args, "OiiOOOOpdOId", &addr, &kind, &cmp, &target, &mask, &wake_o, &count_o, &atomic,
                          &timeout_s, &state_o, &aborting, &backstop_s))
        return NULL;
    if (parse_cond(addr, kind, cmp, target, mask, &w.c)) return NULL;
    if (parse_sleeper(wake_o, count_o, atomic, timeout_s, state_o, aborting, backstop_s, &s)) return NULL;
    int code = sleep_loop(&s, look_word, &w);
    PyObject *value = code == 0 ? value_of(&w.c, w.raw) : (Py_INCREF(Py_None), Py_None);
    if (!value) return NULL;
    return Py_BuildValue("(iN)", code, value);
}

typedef struct {
    Cond c;
    const uint8_t *on; /* one byte per word: non-zero for the words that must meet the comparison */
    uint8_t *base;
    Py_ssize_t stride, n, first; /* ``first``: the first word not met at the last look */
    int64_t doze_ns;
    int64_t dozed;        /* the last doze (ns; 0: none yet) */
    Py_ssize_t unmet;     /* words not met after it */
} WordsLook;

static inline int word_met(WordsLook *w, Py_ssize_t i) {
    w->c.addr = w->base + i * w->stride;
    return met(&w->c, load_word(&w->c));
}

/* One look at sleep_all's words, from the first one not met at the last look; a doze instead of a nap while many
 * are still to come (doze_ns > 0). */
static int look_words(void *ctx, int64_t deadline, const Sleeper *s) {
    WordsLook *w = ctx;
    while (w->first < w->n && (!w->on[w->first] || word_met(w, w->first)))
        w->first++;
    if (w->first == w->n) { /* every word met: one more pass over them all (cheap) before saying so */
        for (w->first = 0; w->first < w->n; w->first++)
            if (w->on[w->first] && !word_met(w, w->first)) break;
        if (w->first == w->n) return LOOK_MET;
    }
    if (w->doze_ns > 0) { /* more than one word to come: doze by how many, then look again */
        Py_ssize_t unmet = 0;
        for (Py_ssize_t k = w->first; k < w->n; k++)
            unmet += w->on[k] && !word_met(w, k);
        if (unmet > DOZE_MIN_WORDS) {
            int64_t ns = w->doze_ns * (int64_t)(unmet - 1);
            ns = ns < DOZE_MAX_NS ? ns : DOZE_MAX_NS;
            if (w->dozed && unmet == w->unmet) /* nothing landed during the last doze: twice as long */
                ns = 2 * w->dozed < DOZE_IDLE_MAX_NS ? 2 * w->dozed : DOZE_IDLE_MAX_NS;
            w->dozed = ns;
            w->unmet = unmet;
            /* no futex sleep meanwhile: out of the (atomic) sleeper count, so that writers skip the wake-up call;
             * back in before the loop reads the wake word again */
            if (s->atomic) __atomic_fetch_sub(s->count, 1, __ATOMIC_SEQ_CST);
            int code = doze(ns, deadline, s->state, s->aborting);
            if (s->atomic) __atomic_fetch_add(s->count, 1, __ATOMIC_SEQ_CST);
            return code ? code : LOOK_AGAIN;
        }
    }
    return LOOK_NAP;
}

/* sleep_all(addr, stride, active, kind, cmp, target, wake_addr, count_addr, atomic, timeout_s, state_addr,
 *           aborting, backstop_s, doze_ns) -> (code, unmet): sleep_on for a set of words: the words at addr + i *
 * stride whose byte active[i] is non-zero (``active``: a bytes object, one byte per word) must all meet the
 * comparison. Every wake-up re-checks them here, without the interpreter lock, starting from the first one not
 * met at the last look (the words met stay met for the callers' monotonic signals; a word that went back is still
 * seen: the final pass re-reads every word before it reports them met). code 0: all met (unmet -1); 1: deadline;
 * 2: the job is aborting (unmet: the index of a word not met).
 *
 * ``doze_ns`` > 0 (waits.doze_per_word: PEs outnumber cores): while more than DOZE_MIN_WORDS are unmet, it dozes
 * doze_ns per unmet word (at most DOZE_MAX_NS) instead of sleeping on the wake word, so that the writes of many
 * writers landing one after the other (a wait for 255 peers' signals) cost a few wake-ups, not one each; a doze
 * after one in which no word landed is twice that one (up to DOZE_IDLE_MAX_NS: a PE that waits for peers which
 * have not started yet, 255 PEs on 2 cores, looks a few times, not every millisecond); the last words are waited
 * for on the futex as before. */
static PyObject *sleep_all(PyObject *self, PyObject *args) {
    PyObject *addr_o, *target, *wake_o, *count_o, *state_o;
    Py_buffer active;
    int kind, cmp, atomic;
    unsigned int aborting;
    double timeout_s, backstop_s;
    long long doze_ns = 0;
    WordsLook w = {0};
    Sleeper s;
    if (!PyArg_ParseTuple(args, "Ony*iiOOOpdOId|L", &addr_o, &w.stride, &active, &kind, &cmp, &target, &wake_o,
                          &count_o, &atomic, &timeout_s, &state_o, &aborting, &backstop_s, &doze_ns))
        return NULL;
    w.doze_ns = doze_ns;
    PyObject *zero = PyLong_FromLong(0);
    int bad = !zero || parse_cond(addr_o, kind, cmp, target, zero, &w.c) || cmp == 6
              || parse_sleeper(wake_o, count_o, atomic, timeout_s, state_o, aborting, backstop_s, &s);
    Py_XDECREF(zero);
    if (bad || PyErr_Occurred()) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "sleep_all: bad comparison");
        PyBuffer_Release(&active);
        return NULL;
    }
    w.on = active.buf;
    w.n = active.len;
    w.base = w.c.addr;
    int code = sleep_loop(&s, look_words, &w);
    PyBuffer_Release(&active);
    return Py_BuildValue("(in)", code, code == 0 ? (Py_ssize_t)-1 : w.first);
}

/* futex_wait(addr, expected, timeout_s) -> bool: sleep while the u32 at addr equals expected (shared futex);
 * False on timeout. */
static PyObject *futex_wait(PyObject *self, PyObject *args) {
    PyObject *addr_o;
    unsigned int expected;
    double timeout;
    if (!PyArg_ParseTuple(args, "OId", &addr_o, &expected, &timeout)) return NULL;
    uint32_t *addr = PyLong_AsVoidPtr(addr_o);
    if (PyErr_Occurred()) return NULL;
    if (timeout < 0) timeout = 0;
    long rc;
    int err;
    Py_BEGIN_ALLOW_THREADS
    struct timespec ts = {(time_t)timeout, (long)((timeout - (double)(time_t)timeout) * 1e9)};
    rc = syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, NULL, 0);
    err = errno;
    Py_END_ALLOW_THREADS
    if (rc == 0 || err == EAGAIN || err == EINTR) Py_RETURN_TRUE;
    if (err == ETIMEDOUT) Py_RETURN_FALSE;
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* wake(wake_addr, sleepers_addr): the writer's side of the protocol (wake.h). */
static PyObject *wake(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "wake(wake_addr, sleepers_addr)"); return NULL; }
    uint32_t *w = PyLong_AsVoidPtr(args[0]), *s = PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return NULL;
    shmemx_wake(w, s);
    Py_RETURN_NONE;
}

/* signal_many(addrs, value, size, add, wakes, sleepers): the stores of signal_op on many PEs' words, then each
 * PE's wake (wake.h): addrs, wakes and sleepers are int64 arrays of one length n (the word in each target PE's
 * heap as mapped here, that PE's wake word and sleeper pair); ``size`` 4 or 8; ``add``: an atomic add of value,
 * else one aligned store. Target i's wake follows its own store; waiters of target i re-check after it. */
static PyObject *signal_many(PyObject *self, PyObject *args) {
    Py_buffer a, w, s;
    unsigned long long value;
    int size, add;
    if (!PyArg_ParseTuple(args, "y*Kipy*y*", &a, &value, &size, &add, &w, &s)) return NULL;
    Py_ssize_t n = a.len / 8;
    if (a.len % 8 || w.len != a.len || s.len != a.len || (size != 4 && size != 8)) {
        PyErr_SetString(PyExc_ValueError, "signal_many: addrs, wakes and sleepers must be int64 of one length; "
                        "size 4 or 8");
        n = -1;
    }
    const uint64_t *addr = a.buf, *wake = w.buf, *slp = s.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        void *p = (void *)(uintptr_t)addr[i];
        if (size == 8 && add) __atomic_fetch_add((uint64_t *)p, (uint64_t)value, __ATOMIC_SEQ_CST);
        else if (size == 8) __atomic_store_n((uint64_t *)p, (uint64_t)value, __ATOMIC_RELEASE);
        else if (add) __atomic_fetch_add((uint32_t *)p, (uint32_t)value, __ATOMIC_SEQ_CST);
        else __atomic_store_n((uint32_t *)p, (uint32_t)value, __ATOMIC_RELEASE);
        shmemx_wake((uint32_t *)(uintptr_t)wake[i], (const uint32_t *)(uintptr_t)slp[i]);
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&w);
    PyBuffer_Release(&s);
    if (n < 0) return NULL;
    Py_RETURN_NONE;
}

/* add_u32(addr, delta) -> old: an atomic add (the sleeper counts). */
static PyObject *add_u32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "add_u32(addr, delta)"); return NULL; }
    uint32_t *a = PyLong_AsVoidPtr(args[0]);
    long d = PyLong_AsLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLong(__atomic_fetch_add(a, (uint32_t)d, __ATOMIC_SEQ_CST));
}

static PyMethodDef methods[] = {
    {"spin", spin, METH_VARARGS, "Poll a word without the interpreter lock; its value once met, else None."},
    {"sleep", sleep_on, METH_VARARGS, "Sleep on a wake word until a word meets a comparison: (code, value)."},
    {"sleep_all", sleep_all, METH_VARARGS, "Sleep on a wake word until every active word of a strided set meets a "
     "comparison: (code, first unmet)."},
    {"futex_wait", futex_wait, METH_VARARGS, "FUTEX_WAIT without the interpreter lock."},
    {"wake", (PyCFunction)(void (*)(void))wake, METH_FASTCALL, "Bump a wake word and wake its sleepers."},
    {"signal_many", signal_many, METH_VARARGS, "signal_op's stores and wakes on many PEs' words."},
    {"add_u32", (PyCFunction)(void (*)(void))add_u32, METH_FASTCALL, "Atomic add to a u32."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "Native waits and wake-ups.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
