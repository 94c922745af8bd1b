/* The writer's side of the wake-word protocol (shmemx/shm/waits.py), for the native code of every layer.
 *
 * A writer into PE p's memory stores its data, then bumps p's wake word with a locked add (a full fence on
 * x86: the data is visible first) and wakes the word's sleepers only if one announced itself; when one already
 * had, FUTEX_WAKE_OP does the add and the wake in one system call. ``sleepers`` points at the pair
 * (n_sleepers, n_remote_sleepers) of p's control block. Control.wake (control.py) calls the same function.
 */
#ifndef SHMEMX_WAKE_H
#define SHMEMX_WAKE_H

#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SHMEMX_FUTEX_ADD_ONE (1 << 28 | 1 << 12) /* FUTEX_OP(FUTEX_OP_ADD, 1, FUTEX_OP_CMP_EQ, 0) */

static inline int shmemx_sleepers(const uint32_t *sleepers) {
    return (__atomic_load_n(sleepers, __ATOMIC_SEQ_CST) | __atomic_load_n(sleepers + 1, __ATOMIC_SEQ_CST)) != 0;
}

static inline void shmemx_wake(uint32_t *wake, const uint32_t *sleepers) {
    if (shmemx_sleepers(sleepers)) {
        syscall(SYS_futex, wake, FUTEX_WAKE_OP, 0x7FFFFFFF, NULL, wake, SHMEMX_FUTEX_ADD_ONE);
        return;
    }
    __atomic_fetch_add(wake, 1, __ATOMIC_SEQ_CST);
    if (shmemx_sleepers(sleepers))
        syscall(SYS_futex, wake, FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
}

#endif
