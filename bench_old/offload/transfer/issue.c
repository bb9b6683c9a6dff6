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

/* ------------------------------------------------------------------ staged jobs */

typedef int (*memcpy_batch_fn)(const uint64_t *dsts, const uint64_t *srcs, const uint64_t *sizes,
                               size_t count, void *attrs, void *attr_indices, size_t num_attrs,
                               void *stream);

enum { STAGED_CELLS = 7 }; /* n, items, tensors, first entry, first tensor, stage, stage sums */
enum { SLICE_FIELDS = 8 }; /* per slice: first entry, entries, first tensor, tensors, stage,
                              stage sums, first copy, copies */

/* Mirrored field by field by native.StagedContext; keep the two in the same order. */
struct offload_staged {
    event_record_fn event_record;           /* cuEventRecord */
    stream_wait_event_fn stream_wait_event; /* cuStreamWaitEvent */
    launch_kernel_fn launch_kernel;         /* cuLaunchKernel */
    memcpy_batch_fn memcpy_batch;           /* cuMemcpyBatchAsync_v2 */
    void *function;                         /* the staged pass (CUfunction) */
    void **params;                          /* its parameter block, built once in Python */
    void *cells[STAGED_CELLS];              /* the parameter cells a slice changes ... */
    int32_t sizes[STAGED_CELLS];            /* ... and their widths in bytes (4 or 8) */
    uint32_t threads;
    uint32_t shared_bytes;
    void *stream;                           /* the engine's stream: the staged passes */
    void *dma_stream;                       /* the copy engines' stream */
    void *start;                            /* event: a load's start on the engine stream */
    void **pass_streams;                    /* per ring slot: a load's scatters from it */
    void **staged;                          /* per ring slot: its rows are staged */
    void **free_slot;                       /* per ring slot: its rows may be reused */
    int64_t slots;
    int64_t pieces;                         /* work items per page of the widest tensor */
    int64_t rows_per_step;                  /* work items per program and step */
    int64_t max_programs;
    void *attrs;                            /* the batched copies' one attribute set */
    void *attr_indices;
    int32_t failed_step;
};

enum { STAGED_NONE, STAGED_FITS, STAGED_RECORD, STAGED_WAIT, STAGED_COPY, STAGED_LAUNCH };

#define CALL(step, expr)              \
    do {                              \
        if ((rc = (expr)) != 0) {     \
            c->failed_step = (step);  \
            return rc;                \
        }                             \
    } while (0)

static int64_t slice_value(const int64_t *slice, int cell, int64_t n) {
    switch (cell) {
    case 0: return n;
    case 1: return 0; /* items: computed by the caller */
    case 2: return slice[3];
    case 3: return slice[0];
    case 4: return slice[2];
    case 5: return slice[4];
    default: return slice[5];
    }
}

/* The engine stream waits for every scatter of a load's slices ``from`` .. ``to`` (each
 * ring slot's last use among them: a slot's scatters run in order on its own stream). */
static int follow_scatters(struct offload_staged *c, int64_t first_slot, int64_t from,
                           int64_t to) {
    int64_t s;
    for (s = to; s >= from && s > to - c->slots; s--) {
        int rc = c->stream_wait_event(c->stream, c->free_slot[(first_slot + s) % c->slots], 0);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* Issues a whole-chunk job of ``slices`` slices (``slice``: SLICE_FIELDS values each) through
 * the ring from slot ``first_slot`` on: per slice one staged pass on the engine stream and one
 * batched copy of its rows on the DMA stream, ordered by the ring slot's two events
 * (offload/transfer/staged.py says how); a load first follows the engine stream where
 * ``after_engine`` is set.  ``srcs``, ``dsts`` and ``sizes`` are the job's copies.  A
 * layer-wise load gives ``marks`` > 0: once slice ``mark_after[k]`` is issued, the engine
 * stream follows every scatter since the previous mark and records ``mark_events[k]`` (a
 * layer group is back once it fires).  Returns 0, the failing driver call's CUresult (its step
 * in failed_step), or -1 when a value does not fit the kernel's compiled parameter types
 * (nothing was issued). */
int offload_issue_staged(struct offload_staged *c, int32_t load, int32_t after_engine,
                         int64_t first_slot, int64_t n, int64_t slices, const int64_t *slice,
                         const uint64_t *srcs, const uint64_t *dsts, const uint64_t *sizes,
                         int64_t marks, const int64_t *mark_after, void *const *mark_events) {
    int rc;
    int64_t s, mark = 0, marked = -1;
    int cell;
    c->failed_step = STAGED_NONE;
    for (s = 0; s < marks; s++) /* in order, each a slice of this job: else no mark records */
        if (!load || mark_after[s] >= slices || mark_after[s] <= (s ? mark_after[s - 1] : -1)) {
            c->failed_step = STAGED_FITS;
            return -1;
        }
    for (s = 0; s < slices; s++) {
        const int64_t *f = slice + s * SLICE_FIELDS;
        int64_t items = f[1] * f[3] * c->pieces;
        for (cell = 0; cell < STAGED_CELLS; cell++) {
            int64_t value = cell == 1 ? items : slice_value(f, cell, n);
            if (cell < 5 && !fits(c->sizes[cell], value)) {
                c->failed_step = STAGED_FITS;
                return -1;
            }
        }
    }
    if (load) { /* the scatters follow the engine stream's work so far (the caller's too) */
        CALL(STAGED_RECORD, c->event_record(c->start, c->stream));
        if (after_engine)
            CALL(STAGED_WAIT, c->stream_wait_event(c->dma_stream, c->start, 0));
        for (s = 0; s < slices && s < c->slots; s++)
            CALL(STAGED_WAIT, c->stream_wait_event(c->pass_streams[(first_slot + s) % c->slots],
                                                   c->start, 0));
    }
    for (s = 0; s < slices; s++) {
        const int64_t *f = slice + s * SLICE_FIELDS;
        int64_t r = (first_slot + s) % c->slots;
        int64_t items = f[1] * f[3] * c->pieces;
        int64_t steps = (items + c->rows_per_step - 1) / c->rows_per_step;
        uint32_t grid = (uint32_t)(steps < c->max_programs ? (steps > 0 ? steps : 1)
                                                            : c->max_programs);
        for (cell = 0; cell < STAGED_CELLS; cell++)
            put(c->cells[cell], c->sizes[cell], cell == 1 ? items : slice_value(f, cell, n));
        if (load) { /* the slot's last use, by this job or an earlier one */
            void *pass = c->pass_streams[r];
            CALL(STAGED_WAIT, c->stream_wait_event(c->dma_stream, c->free_slot[r], 0));
            CALL(STAGED_COPY, c->memcpy_batch(dsts + f[6], srcs + f[6], sizes + f[6],
                                              (size_t)f[7], c->attrs, c->attr_indices, 1,
                                              c->dma_stream));
            CALL(STAGED_RECORD, c->event_record(c->staged[r], c->dma_stream));
            CALL(STAGED_WAIT, c->stream_wait_event(pass, c->staged[r], 0));
            CALL(STAGED_LAUNCH, c->launch_kernel(c->function, grid, 1, 1, c->threads, 1, 1,
                                                 c->shared_bytes, pass, c->params, NULL));
            CALL(STAGED_RECORD, c->event_record(c->free_slot[r], pass));
            if (mark < marks && mark_after[mark] == s) {
                CALL(STAGED_WAIT, follow_scatters(c, first_slot, marked + 1, s));
                CALL(STAGED_RECORD, c->event_record(mark_events[mark], c->stream));
                marked = s;
                mark++;
            }
        } else {
            if (s >= c->slots)
                CALL(STAGED_WAIT, c->stream_wait_event(c->stream, c->free_slot[r], 0));
            CALL(STAGED_LAUNCH, c->launch_kernel(c->function, grid, 1, 1, c->threads, 1, 1,
                                                 c->shared_bytes, c->stream, c->params, NULL));
            CALL(STAGED_RECORD, c->event_record(c->staged[r], c->stream));
            CALL(STAGED_WAIT, c->stream_wait_event(c->dma_stream, c->staged[r], 0));
            CALL(STAGED_COPY, c->memcpy_batch(dsts + f[6], srcs + f[6], sizes + f[6],
                                              (size_t)f[7], c->attrs, c->attr_indices, 1,
                                              c->dma_stream));
            CALL(STAGED_RECORD, c->event_record(c->free_slot[r], c->dma_stream));
        }
    }
    if (load) /* the job's completion, recorded on the engine stream, follows every scatter */
        CALL(STAGED_WAIT, follow_scatters(c, first_slot, marked + 1, slices - 1));
    else if (slices > 0) /* ... and every copy of a store */
        CALL(STAGED_WAIT, c->stream_wait_event(
                              c->stream, c->free_slot[(first_slot + slices - 1) % c->slots], 0));
    return 0;
}
