/* One kernel job issued in one call: order after the caller's stream, upload the job's indices,
 * launch the copy kernel.  Built and loaded by offload/transfer/native.py (why: its docstring).
 *
 * The driver entry points arrive as function pointers in the context, so this file needs no
 * CUDA headers or libraries at build time, and tests can drive it with stand-in functions.
 * Every CUDA handle is an opaque pointer; CUresult is an int (0 = success).
 */
#include <stddef.h>
#include <stdint.h>

typedef int (*event_record_fn)(void *event, void *stream);
typedef int (*stream_wait_event_fn)(void *stream, void *event, unsigned int flags);
typedef int (*memcpy_htod_async_fn)(uint64_t dst, const void *src, size_t bytes, void *stream);
typedef int (*launch_kernel_fn)(void *function, unsigned int grid_x, unsigned int grid_y,
                                unsigned int grid_z, unsigned int block_x, unsigned int block_y,
                                unsigned int block_z, unsigned int shared_bytes, void *stream,
                                void **params, void **extra);

/* Mirrored field by field by native.IssueContext; keep the two in the same order. */
struct offload_issue {
    event_record_fn event_record;           /* cuEventRecord */
    stream_wait_event_fn stream_wait_event; /* cuStreamWaitEvent */
    memcpy_htod_async_fn memcpy_htod_async; /* cuMemcpyHtoDAsync_v2 */
    launch_kernel_fn launch_kernel;         /* cuLaunchKernel */
    void *function;                         /* the compiled kernel (CUfunction) */
    void **params;                          /* its parameter block, built once in Python */
    void *count_cell;                       /* the parameter cells of n and items ... */
    void *items_cell;
    int32_t count_size;                     /* ... and their widths in bytes (4 or 8) */
    int32_t items_size;
    uint32_t threads;
    uint32_t shared_bytes;
    void *stream;                           /* the engine's copy stream */
    void *ordered;                          /* the event re-recorded on the caller's stream */
    uint64_t device_index;                  /* where the kernel reads the job's indices */
    int32_t failed_step;                    /* set when a call returns non-zero */
};

enum { STEP_NONE, STEP_FITS, STEP_RECORD, STEP_WAIT, STEP_UPLOAD, STEP_LAUNCH };

static int fits(int32_t size, int64_t value) {
    return value >= 0 && (size == 8 || value <= INT32_MAX);
}

static void put(void *cell, int32_t size, int64_t value) {
    if (size == 4)
        *(int32_t *)cell = (int32_t)value;
    else
        *(int64_t *)cell = value;
}

/* Orders after ``caller`` when ``order`` is set, uploads ``bytes`` of ``staging`` (pinned),
 * sets n and items, launches ``grid`` programs.  Returns 0, the failing driver call's CUresult
 * (its step in failed_step), or -1 when n or items does not fit the kernel's compiled parameter
 * types (nothing was issued). */
int offload_issue(struct offload_issue *c, int32_t order, void *caller, const void *staging,
                  uint64_t bytes, int64_t count, int64_t items, uint32_t grid) {
    int rc;
    c->failed_step = STEP_NONE;
    if (!fits(c->count_size, count) || !fits(c->items_size, items)) {
        c->failed_step = STEP_FITS;
        return -1;
    }
    if (order) { /* caller may be NULL: the legacy default stream */
        if ((rc = c->event_record(c->ordered, caller)) != 0) {
            c->failed_step = STEP_RECORD;
            return rc;
        }
        if ((rc = c->stream_wait_event(c->stream, c->ordered, 0)) != 0) {
            c->failed_step = STEP_WAIT;
            return rc;
        }
    }
    if ((rc = c->memcpy_htod_async(c->device_index, staging, (size_t)bytes, c->stream)) != 0) {
        c->failed_step = STEP_UPLOAD;
        return rc;
    }
    put(c->count_cell, c->count_size, count);
    put(c->items_cell, c->items_size, items);
    if ((rc = c->launch_kernel(c->function, grid, 1, 1, c->threads, 1, 1, c->shared_bytes,
                               c->stream, c->params, NULL)) != 0) {
        c->failed_step = STEP_LAUNCH;
        return rc;
    }
    return 0;
}
