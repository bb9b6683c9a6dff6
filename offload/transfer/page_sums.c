/* SPDX-License-Identifier: Apache-2.0
 *
 * The host backend's copy with page checksums, in one pass over the bytes (built and loaded by
 * offload/transfer/host.py; the definition is offload/integrity.py, which the tests hold this
 * file to).
 *
 * Why native: the numpy form of the checksum is a dozen whole-array calls per tensor and job,
 * a fixed cost many times a small job's copy; here each word is read once, copied, and mixed
 * while it is in a register.  Plain C over raw addresses (ctypes.CDLL: the GIL is released).
 * The caller has checked every index against the plan, so nothing here range-checks.
 */
#include <stdint.h>
#include <string.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define MIX1 0xBF58476D1CE4E5B9ULL
#define MIX2 0x94D049BB133111EBULL
#define UNIT_BYTES 16384
#define WORD 8

/* One row of the per-tensor table the caller passes, in int64 columns. */
enum { KV_BASE, KV_STRIDE, PAGE, HOST_BASE, TRAILER_BASE, UNITS, KEY, COLUMNS };

static inline uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * MIX1;
    z = (z ^ (z >> 27)) * MIX2;
    return z ^ (z >> 31);
}

static inline uint64_t identity(uint64_t key, uint64_t chunk, uint64_t generation,
                                uint64_t position, uint64_t unit) {
    return mix(mix(mix(mix(key ^ chunk) ^ generation) ^ position) ^ unit);
}

/* NOTE: x86-64 hosts get an AVX2 clone of the sum (chosen at load time by the dynamic loader);
 * gcc vectorises this plain loop there, about 1.3x the scalar form, and the library is built
 * once per host for any CPU of it. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* The raw sum of n bytes at p: one mixed term per little-endian word, the tail zero-padded. */
CLONES static uint64_t raw_sum(const uint8_t *p, int64_t n) {
    uint64_t s = 0, w;
    int64_t whole = n / WORD;
    for (int64_t i = 0; i < whole; i++) {
        memcpy(&w, p + WORD * i, WORD);
        s += mix(w ^ ((uint64_t)(i + 1) * GOLDEN));
    }
    if (n > WORD * whole) {
        w = 0;
        memcpy(&w, p + WORD * whole, (size_t)(n - WORD * whole));
        s += mix(w ^ ((uint64_t)(whole + 1) * GOLDEN));
    }
    return s;
}

/* Copy n bytes (at most one unit) and return the raw sum of what was copied, read back from
 * the destination while it is still in cache. */
static uint64_t copy_sum(uint8_t *dst, const uint8_t *src, int64_t n) {
    memcpy(dst, src, (size_t)n);
    return raw_sum(dst, n);
}

/* The raw sum of one unit of n bytes (the tests compare it with offload.integrity). */
uint64_t offload_raw_sum(const uint8_t *data, int64_t n) {
    return raw_sum(data, n);
}

/* Move one job: entry i copies block blocks[i] of every tensor to or from host page
 * host_pages[i] (chunk * bpc + position).  With integrity, each unit's stored sum is the raw
 * sum plus its identity (generation: generations[host page], as renewed for this job): a store
 * writes it into the trailer; a load compares and, on a mismatch, overwrites the loaded unit
 * with all-ones bytes (poison) and counts it.  Tensor-major order, so first_bad (tensor, entry,
 * unit) is the first mismatch in the order offload/transfer/host.py's numpy path reports.
 * Returns the number of mismatched units (0 for a store or without integrity). */
int64_t offload_host_job(const int64_t *table, int64_t num_tensors, int64_t row_stride,
                         int64_t bpc, const int64_t *blocks, const int64_t *host_pages,
                         int64_t n, const int64_t *generations, int32_t load, int32_t integrity,
                         int64_t *first_bad) {
    int64_t bad = 0;
    for (int64_t t = 0; t < num_tensors; t++) {
        const int64_t *row = table + COLUMNS * t;
        int64_t page = row[PAGE], units = row[UNITS];
        uint64_t key = (uint64_t)row[KEY];
        for (int64_t i = 0; i < n; i++) {
            int64_t chunk = host_pages[i] / bpc, position = host_pages[i] % bpc;
            uint8_t *kv = (uint8_t *)(intptr_t)(row[KV_BASE] + blocks[i] * row[KV_STRIDE]);
            uint8_t *host = (uint8_t *)(intptr_t)(row[HOST_BASE] + chunk * row_stride +
                                                  position * page);
            uint8_t *dst = load ? kv : host;
            const uint8_t *src = load ? host : kv;
            if (!integrity) {
                memcpy(dst, src, (size_t)page);
                continue;
            }
            uint64_t *sums = (uint64_t *)(intptr_t)(row[TRAILER_BASE] + chunk * row_stride +
                                                    WORD * position * units);
            uint64_t generation = (uint64_t)generations[host_pages[i]];
            for (int64_t u = 0; u < units; u++) {
                int64_t at = u * UNIT_BYTES;
                int64_t len = page - at < UNIT_BYTES ? page - at : UNIT_BYTES;
                uint64_t stored = copy_sum(dst + at, src + at, len) +
                                  identity(key, (uint64_t)chunk, generation,
                                           (uint64_t)position, (uint64_t)u);
                if (!load) {
                    sums[u] = stored;
                } else if (sums[u] != stored) {
                    memset(dst + at, 0xFF, (size_t)len);
                    if (bad++ == 0) {
                        first_bad[0] = t;
                        first_bad[1] = i;
                        first_bad[2] = u;
                    }
                }
            }
        }
    }
    return bad;
}
