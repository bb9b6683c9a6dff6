/* Background set-up's pre-fault loop without the GIL.  Built and loaded by
 * offload/region/background.py (why: its docstring).
 *
 * Each worker thread makes one call and stays in C until every unit is taken or `stop` is set:
 * it takes the next unit from the shared counter, populates the unit's ranges with one
 * madvise each, and publishes the unit's state.  Python's threads would instead take the GIL
 * back after every madvise, and a pool of them hands the GIL around the engine's own threads.
 *
 * state[i]: 0 while unit i is pending, 1 once populated, or -errno of the first range that
 * failed (the caller then populates that unit itself, which words the error or takes the
 * touch fallback of kernels without MADV_POPULATE_WRITE).  A failure never stops a worker:
 * every unit gets a state, so the caller never waits for one nobody takes.
 */
#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>

int64_t offload_populate_units(uint64_t base, const int64_t *ranges, const int64_t *first,
                               int64_t units, int64_t *next, int32_t *state,
                               const int32_t *stop, int32_t advice) {
    int64_t done = 0;
    while (!__atomic_load_n(stop, __ATOMIC_ACQUIRE)) {
        int64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (i >= units)
            break;
        int32_t result = 1;
        for (int64_t r = first[i]; r < first[i + 1]; r++) {
            void *address = (void *)(uintptr_t)(base + (uint64_t)ranges[2 * r]);
            if (madvise(address, (size_t)ranges[2 * r + 1], advice) != 0) {
                result = -errno;
                break;
            }
        }
        __atomic_store_n(&state[i], result, __ATOMIC_RELEASE);
        done++;
    }
    return done;
}
