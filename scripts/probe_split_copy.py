"""Probe: can two threads copying parts of one buffer beat one thread's memcpy on this machine?

The question behind the engine's cooperative copy (``shmemx/udma/_engine.c``, coop_copy): a put's payload is
copied by the engine thread, on the other core than the caller's; a caller that waits in quiet meanwhile could
copy part of it. This compiles a small C program with the system compiler (``cc``) and times, for each size, one
source -> destination copy repeated (the buffers stay the same, as in a put repeated), in five ways, alternating
sample by sample so that drift of the shared host hits them all:

* ``1 thread memcpy``: the reference (what a caller's own put does, e.g. shmem4py over OSHMEM);
* ``1 thread, chunks``: the same thread, in chunk-sized memcpys;
* ``hand-over``: a second (spinning) thread copies it all while the first waits: the engine without help;
* ``2 threads, halves``: each copies a fixed half;
* ``2 threads, chunks``: chunks claimed from the front by one thread and from the back by the other (one claim
  word), as the engine and a quiet-ing thread do.

Usage: ``python scripts/probe_split_copy.py [--sizes 1,4,16] [--chunk-kib 256] [--samples 21]`` (sizes in MiB).
Run it under the machine-wide lock; it uses both cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

SOURCE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static int64_t now_ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }
static size_t size, chunk, n_chunks;
static uint8_t *src, *dst;
static uint32_t gen, done, mode, quit;
static uint64_t claims;

static int claim(int back) {
    uint64_t c = __atomic_load_n(&claims, __ATOMIC_ACQUIRE), next;
    uint32_t k;
    do {
        uint32_t f = (uint32_t)c, r = (uint32_t)(c >> 32);
        if (f + r >= n_chunks) return 0;
        k = back ? n_chunks - 1 - r : f;
        next = back ? c + (1ULL << 32) : c + 1;
    } while (!__atomic_compare_exchange_n(&claims, &c, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    size_t off = (size_t)k * chunk, len = size - off < chunk ? size - off : chunk;
    memcpy(dst + off, src + off, len);
    return 1;
}

static void *partner(void *arg) {
    uint32_t seen = 0;
    for (;;) {
        while (__atomic_load_n(&gen, __ATOMIC_ACQUIRE) == seen) __builtin_ia32_pause();
        seen = __atomic_load_n(&gen, __ATOMIC_ACQUIRE);
        if (quit) return NULL;
        if (mode == 2) memcpy(dst, src, size);
        else if (mode == 3) memcpy(dst + size / 2, src + size / 2, size - size / 2);
        else while (claim(1)) {}
        __atomic_fetch_add(&done, 1, __ATOMIC_RELEASE);
    }
}

static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return x < y ? -1 : x > y; }

int main(int argc, char **argv) {
    size = (size_t)atol(argv[1]) << 20;
    chunk = (size_t)atol(argv[2]) << 10;
    int samples = atoi(argv[3]);
    n_chunks = (size + chunk - 1) / chunk;
    int reps = (int)((128u << 20) / size); if (reps < 2) reps = 2;
    src = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    dst = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    memset(src, 7, size); memset(dst, 1, size);
    pthread_t th; pthread_create(&th, NULL, partner, NULL);
    const char *names[] = {"1 thread memcpy", "1 thread, chunks", "hand-over", "2 threads, halves", "2 threads, chunks"};
    double *r[5];
    for (int m = 0; m < 5; m++) r[m] = calloc(samples, sizeof(double));
    for (int s = -1; s < samples; s++)
        for (int m = 0; m < 5; m++) {
            int64_t t0 = now_ns();
            for (int k = 0; k < reps; k++) {
                if (m == 0) { memcpy(dst, src, size); continue; }
                if (m == 1) { for (size_t off = 0; off < size; off += chunk) memcpy(dst + off, src + off, size - off < chunk ? size - off : chunk); continue; }
                uint32_t d = __atomic_load_n(&done, __ATOMIC_ACQUIRE);
                __atomic_store_n(&claims, 0, __ATOMIC_RELEASE);
                mode = m;
                __atomic_fetch_add(&gen, 1, __ATOMIC_RELEASE);
                if (m == 3) memcpy(dst, src, size / 2);
                else if (m == 4) while (claim(0)) {}
                while (__atomic_load_n(&done, __ATOMIC_ACQUIRE) == d) __builtin_ia32_pause();
            }
            if (s >= 0) r[m][s] = (double)reps * size / (now_ns() - t0);
        }
    for (int m = 0; m < 5; m++) qsort(r[m], samples, sizeof(double), cmp);
    double ref = r[0][samples / 2];
    for (int m = 0; m < 5; m++)
        printf("%4zu MiB  %-20s %6.2f GB/s [%5.2f..%5.2f]  %.2fx\n", size >> 20, names[m], r[m][samples / 2],
               r[m][0], r[m][samples - 1], r[m][samples / 2] / ref);
    quit = 1; __atomic_fetch_add(&gen, 1, __ATOMIC_RELEASE); pthread_join(th, NULL);
    return 0;
}
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,16", help="buffer sizes in MiB (comma-separated)")
    parser.add_argument("--chunk-kib", type=int, default=256)
    parser.add_argument("--samples", type=int, default=21)
    args = parser.parse_args(argv)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("no C compiler (cc) on PATH", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        c, exe = os.path.join(tmp, "probe.c"), os.path.join(tmp, "probe")
        with open(c, "w") as f:
            f.write(SOURCE)
        subprocess.run([cc, "-O2", "-o", exe, c, "-lpthread"], check=True)
        print(f"copy probe: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; chunks of "
              f"{args.chunk_kib} KiB; medians over {args.samples} samples, min..max; ratio to 1 thread memcpy")
        for size in args.sizes.split(","):
            out = subprocess.run([exe, size, str(args.chunk_kib), str(args.samples)], check=True, capture_output=True,
                                 text=True).stdout
            print(out, end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
