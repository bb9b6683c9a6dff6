/* Background set-up's pre-fault loop and the leader's reservation, without the GIL.  Built and
 * loaded by offload/region/background.py (why: its docstring).
 *
 * Each worker thread makes one call and stays in C until every unit is taken or `stop` is set:
 * it takes the next unit from the shared counter, populates the unit's ranges, and publishes
 * the unit's state.  Python's threads would instead take the GIL back after every unit, and a
 * pool of them hands the GIL around the engine's own threads.
 *
 * A unit is populated by write faults, one per page (an atomic OR of 0: a write access that
 * changes no byte, whoever else writes the page), not by MADV_POPULATE_WRITE.  The advice holds
 * the process's mmap lock for reading for the whole call, and every thread of the engine that
 * maps, unmaps or protects memory (malloc growing an arena does) waits for the calls in flight:
 * 6-15 ms per wait beside 8 MiB calls on an H200 host, at any call length, priority or thread
 * count (docs/BENCHMARKS.md, "What holds the mmap lock during set-up").  A page fault takes only
 * its VMA's own lock (Linux 6.4+ anonymous, 6.7+ shared memory), so the engine's threads never
 * wait for it; older kernels take the mmap lock for one page at a time.  What is given up is a
 * call's error: a page that cannot be had is the OOM killer's (memfds, anonymous memory -- as it
 * mostly is for the advice too) or a SIGBUS (a page past a full mount, or a memfd page past the
 * commit limit of a host that refuses to overcommit), so every page that could be a SIGBUS is
 * reserved before set-up touches it (named files in `create`; memfds there too on such hosts).
 *
 * In the replicated layout a stage's ranks register, and so populate, the same pages.  Each
 * writes its own share of every range first and then maps the rest by reading each page before
 * writing it: a read fault maps a page another process populated together with its populated
 * neighbours (fault-around), so a rank takes about one fault per page it writes and one per
 * sixteen it maps, where writing every page made each rank fault every page of the stage.
 *
 * state[i]: 0 while item i is pending, 1 once done; the reservation's items also -errno of the
 * call that failed.  A failure is final: the worker sets `stop`, so no thread takes a further
 * item.  Every item below a failed one was taken before it and gets a state, so the caller,
 * which waits for items in order and stops at the first failure, never waits for one nobody
 * took.
 *
 * The pin thread registers beside the workers, unit by unit as each is populated: write faults
 * take no lock that a registration waits for, and the two overlapping is what makes background
 * set-up as fast as the blocking create (docs/BENCHMARKS.md, "Registering beside write faults").
 */
#define _GNU_SOURCE /* fallocate(2) */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <unistd.h>

/* The next item for this worker from the shared counter, or -1 once `stop` is set or none is
 * left.  Items are taken in order: every item below a taken one was taken. */
static int64_t take(int64_t *next, const int32_t *stop, int64_t count) {
    if (__atomic_load_n(stop, __ATOMIC_ACQUIRE))
        return -1;
    int64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
    return i < count ? i : -1;
}

/* Item i's state for the Python side; a failure stops every worker. */
static void publish(int32_t *state, int32_t *stop, int64_t i, int32_t result) {
    __atomic_store_n(&state[i], result, __ATOMIC_RELEASE);
    if (result < 0)
        __atomic_store_n(stop, 1, __ATOMIC_RELEASE);
}

/* Always 0, but the compiler cannot know it: an atomic OR of a constant 0 whose result is
 * unused may be compiled to nothing at all (clang does; a plain read on older clang), which
 * would leave anonymous memory mapped to the zero page instead of populated. */
static volatile uint8_t zero;

/* Write-fault pages [from, to) of those that [start, end) touches (page 0 is the one holding
 * `start`), each at an address inside the range.  With `map_first`, each page is read before
 * it is written: a read fault on a shared memory page another process has already populated
 * maps it together with its populated neighbours (the kernel's fault-around, 64 KiB by
 * default), writable, so the write that follows does not fault and most pages cost no fault at
 * all; on a page nobody populated yet the read fault allocates it as the write would.  That is
 * shared memory's (memfds, tmpfs); a file system that tracks writes (ramfs) maps a read fault's
 * pages read-only, so each write faults again, and reading first costs what writing alone did
 * plus ~5%. */
static void touch_pages(uintptr_t start, uintptr_t end, uintptr_t page, uint64_t from,
                        uint64_t to, int map_first) {
    uintptr_t first = start & ~(page - 1);
    uint8_t nothing = zero;
    for (uint64_t k = from; k < to; k++) {
        uintptr_t at = first + k * page;
        uint8_t *byte = (uint8_t *)(at < start ? start : at);
        if (map_first)
            (void)*(volatile uint8_t *)byte;
        __atomic_fetch_or(byte, nothing, __ATOMIC_RELAXED);
    }
}

/* Populate [start, start + length) as the `share`th of `shares` processes that populate the
 * same shared pages (the replicated layout's ranks of one stage walk the same slots).  Each
 * writes its own share of the range's pages first, then the rest from its share's end round to
 * its start, reading first: the others wrote those pages meanwhile (or will), and mapping pages
 * others populated by fault-around costs about a sixteenth of a fault each (`map_first`,
 * above).  Alone (`shares` 1) the range is written in order, page by page. */
static void populate_range(uintptr_t start, int64_t length, uintptr_t page, int64_t share,
                           int64_t shares) {
    if (length <= 0)
        return;
    uintptr_t end = start + (uintptr_t)length;
    uint64_t pages = (uint64_t)((end - (start & ~(page - 1)) + page - 1) / page);
    uint64_t own_from = pages * (uint64_t)share / (uint64_t)shares;
    uint64_t own_to = pages * (uint64_t)(share + 1) / (uint64_t)shares;
    touch_pages(start, end, page, own_from, own_to, 0);
    touch_pages(start, end, page, own_to, pages, shares > 1);
    touch_pages(start, end, page, 0, own_from, shares > 1);
}

int64_t offload_populate_units(uint64_t base, const int64_t *ranges, const int64_t *first,
                               int64_t units, int64_t *next, int32_t *state, int32_t *stop,
                               int64_t share, int64_t shares) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    int64_t done = 0;
    for (int64_t i; (i = take(next, stop, units)) >= 0; done++) {
        for (int64_t r = first[i]; r < first[i + 1]; r++)
            populate_range((uintptr_t)(base + (uint64_t)ranges[2 * r]), ranges[2 * r + 1], page,
                           share, shares);
        publish(state, stop, i, 1);
    }
    return done;
}

/* The node leader's reservation of a node region's memfds (`BackgroundReservation`), file by
 * file in row order and `piece` bytes at a time, with fallocate(2) itself: shmem allocates
 * there, and no emulation ever writes to a file.  state[i]: 0 while file i is pending (or was
 * left part-way by `stop`), 1 once reserved -- its descriptor is then closed here -- or
 * -errno of the call that failed, which sets `stop` (the rest is left to the ranks' pre-fault,
 * whose faults allocate it; memory that is not there is then the OOM killer's, as for any
 * allocation, and hosts that refuse to overcommit reserve in `create` instead of here).  Holds
 * no GIL, like the loop above. */
int64_t offload_reserve_files(const int32_t *fds, const int64_t *lengths, int64_t files,
                              int64_t *next, int32_t *state, int32_t *stop, int64_t piece) {
    int64_t done = 0;
    for (int64_t i; (i = take(next, stop, files)) >= 0;) {
        int32_t result = 1;
        for (int64_t at = 0; at < lengths[i] && result > 0; at += piece) {
            if (__atomic_load_n(stop, __ATOMIC_ACQUIRE)) {
                result = 0;
                break;
            }
            int64_t length = lengths[i] - at < piece ? lengths[i] - at : piece;
            int rc;
            do
                rc = fallocate(fds[i], 0, (off_t)at, (off_t)length);
            while (rc != 0 && errno == EINTR);
            if (rc != 0)
                result = -errno;
        }
        if (result == 1)
            close(fds[i]);
        publish(state, stop, i, result);
        done += result == 1;
    }
    return done;
}
