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

/* Copy the words [from, whole) of a unit (dst NULL: only sum them) and the zero-padded tail
 * word of its last n % WORD bytes; return their terms' sum.  The portable path, and the tail
 * of the vector one. */
static uint64_t copy_sum_scalar(uint8_t *dst, const uint8_t *src, int64_t n, int64_t from) {
    uint64_t s = 0, w;
    int64_t whole = n / WORD;
    for (int64_t i = from; i < whole; i++) {
        memcpy(&w, src + WORD * i, WORD);
        if (dst)
            memcpy(dst + WORD * i, &w, WORD);
        s += mix(w ^ ((uint64_t)(i + 1) * GOLDEN));
    }
    if (n > WORD * whole) {
        size_t tail = (size_t)(n - WORD * whole);
        w = 0;
        memcpy(&w, src + WORD * whole, tail);
        if (dst)
            memcpy(dst + WORD * whole, &w, tail);
        s += mix(w ^ ((uint64_t)(whole + 1) * GOLDEN));
    }
    return s;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define VECTOR_PATH 1
#define AVX2 __attribute__((target("avx2")))
#define LANES 4  /* words per vector */
#define CHAINS 4 /* independent vectors per step: the multiplies' latency overlaps */
#define STEP_BYTES (CHAINS * LANES * WORD)

/* z * m mod 2**64 per lane; AVX2 has no 64-bit multiply.  With z = zh:zl and m = mh:ml
 * (32-bit halves): zl*ml + ((zl*mh + zh*ml) << 32).  The cross terms are only needed mod
 * 2**32, so one 32-bit multiply by m's halves swapped (mswap = ml:mh) gives both, and adding
 * the product shifted left by 32 puts their sum in the high half. */
AVX2 static inline __m256i mul64(__m256i z, __m256i mlow, __m256i mswap) {
    __m256i low = _mm256_mul_epu32(z, mlow);
    __m256i cross = _mm256_mullo_epi32(z, mswap);
    cross = _mm256_add_epi64(cross, _mm256_slli_epi64(cross, 32));
    cross = _mm256_and_si256(cross, _mm256_set1_epi64x((long long)0xFFFFFFFF00000000ULL));
    return _mm256_add_epi64(low, cross);
}

#define SWAP_HALVES(m) ((long long)(((m) << 32) | ((m) >> 32)))

AVX2 static inline __m256i vector_mix(__m256i z) {
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 30));
    z = mul64(z, _mm256_set1_epi64x((long long)(MIX1 & 0xFFFFFFFFULL)),
              _mm256_set1_epi64x(SWAP_HALVES(MIX1)));
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 27));
    z = mul64(z, _mm256_set1_epi64x((long long)(MIX2 & 0xFFFFFFFFULL)),
              _mm256_set1_epi64x(SWAP_HALVES(MIX2)));
    return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

/* copy_sum_scalar(dst, src, n, 0) with AVX2: each word is loaded once, stored (dst not NULL)
 * and mixed in a register, CHAINS vectors at a time; whatever is left of the last step goes
 * the scalar way.  The sum is compute-bound (two emulated 64-bit multiplies per word), so the
 * copy rides along at no extra cost. */
AVX2 static uint64_t copy_sum_avx2(uint8_t *dst, const uint8_t *src, int64_t n) {
    __m256i key[CHAINS], sum[CHAINS];
    for (int c = 0; c < CHAINS; c++) {
        uint64_t first = (uint64_t)(LANES * c + 1);  /* word_key(i) = (i + 1) * GOLDEN */
        key[c] = _mm256_set_epi64x((long long)((first + 3) * GOLDEN),
                                   (long long)((first + 2) * GOLDEN),
                                   (long long)((first + 1) * GOLDEN), (long long)(first * GOLDEN));
        sum[c] = _mm256_setzero_si256();
    }
    const __m256i advance = _mm256_set1_epi64x((long long)((uint64_t)CHAINS * LANES * GOLDEN));
    int64_t at = 0;
    for (; at + STEP_BYTES <= n; at += STEP_BYTES) {
        for (int c = 0; c < CHAINS; c++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(src + at + 32 * c));
            if (dst)
                _mm256_storeu_si256((__m256i *)(dst + at + 32 * c), w);
            sum[c] = _mm256_add_epi64(sum[c], vector_mix(_mm256_xor_si256(w, key[c])));
            key[c] = _mm256_add_epi64(key[c], advance);
        }
    }
    __m256i total = sum[0];
    for (int c = 1; c < CHAINS; c++)
        total = _mm256_add_epi64(total, sum[c]);
    uint64_t lane[LANES];
    _mm256_storeu_si256((__m256i *)lane, total);
    return lane[0] + lane[1] + lane[2] + lane[3] + copy_sum_scalar(dst, src, n, at / WORD);
}
#endif

/* Whether this CPU runs the vector path (checked once per job: a load of a cached flag). */
static int vector_path(void) {
#ifdef VECTOR_PATH
    __builtin_cpu_init(); /* idempotent; needed where no constructor ran it first */
    return __builtin_cpu_supports("avx2") != 0;
#else
    return 0;
#endif
}

/* Copy n bytes (at most one unit; dst NULL: none) and return the raw sum of what was read. */
static uint64_t copy_sum(uint8_t *dst, const uint8_t *src, int64_t n, int vector) {
#ifdef VECTOR_PATH
    if (vector)
        return copy_sum_avx2(dst, src, n);
#endif
    (void)vector;
    return copy_sum_scalar(dst, src, n, 0);
}

/* 1 where offload_raw_sum takes the vector path (the tests check both paths they can run). */
int32_t offload_vector_path(void) {
    return vector_path();
}

/* The raw sum of one unit of n bytes by the portable path. */
uint64_t offload_raw_sum_scalar(const uint8_t *data, int64_t n) {
    return copy_sum_scalar(NULL, data, n, 0);
}

/* The raw sum of one unit of n bytes (the tests compare it with offload.integrity). */
uint64_t offload_raw_sum(const uint8_t *data, int64_t n) {
    return copy_sum(NULL, data, n, vector_path());
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
    int vector = vector_path();
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
                uint64_t stored = copy_sum(dst + at, src + at, len, vector) +
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
