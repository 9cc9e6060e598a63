/* fasterllama CPU kernels: the decode-time hot loops, AVX2 + FMA + F16C, threaded with OpenMP.
 *
 * Built at first use by ops/cpu_kernels.py (gcc -O3 -march=native -fopenmp) and called through
 * ctypes. The library links libgomp.so.1, which resolves to the runtime torch already loaded, so
 * these kernels and torch's own ops share one thread pool instead of stalling each other.
 * Every kernel has a PyTorch reference in ops/reference.py or ops/quantized.py: the tests'
 * oracle. All matrices are row-major and contiguous; weights are [N, K] (out x in), as in
 * F.linear. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "fasterllama CPU kernels need AVX2, FMA and F16C"
#endif

#define MT 8 /* activation rows processed together per weight row */

/* CALL(R) with R a compile-time constant equal to rows (1..MT): each count gets its own unrolled,
 * register-allocated copy of an always_inline row kernel. */
#define DISPATCH_ROWS(rows, CALL)                                                                   \
    switch (rows) {                                                                                 \
        case 8: CALL(8); break;                                                                     \
        case 7: CALL(7); break;                                                                     \
        case 6: CALL(6); break;                                                                     \
        case 5: CALL(5); break;                                                                     \
        case 4: CALL(4); break;                                                                     \
        case 3: CALL(3); break;                                                                     \
        case 2: CALL(2); break;                                                                     \
        default: CALL(1); break;                                                                    \
    }
/* Software prefetch distance into the weight stream: the hardware prefetcher alone leaves the
 * batched (several-row) kernels waiting on DRAM. Weights are read once a step, so the hint is
 * non-temporal: they pass through without pushing the KV cache and the activations out of the
 * caches (measured: fp32 batch-1 steps up to 7% faster while neighbours load the memory, equal
 * on a quiet machine). */
#ifndef PF_BYTES
#define PF_BYTES 8192
#endif
#define WEIGHT_HINT _MM_HINT_NTA
#define PREFETCH(p) _mm_prefetch((const char *)(p) + PF_BYTES, WEIGHT_HINT)

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* [sum(a[0]), ..., sum(a[7])] */
static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline __m256 u8x8_to_ps(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
static inline __m256 i8x8_to_ps(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }

/* The matmul kernels work on 32 weights at a time, as two 16-float halves: one 512-bit register
 * each where the CPU has AVX-512, two 256-bit ones otherwise. */
#if defined(__AVX512F__)
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VSET1(v) _mm512_set1_ps(v)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VHSUM(v) _mm512_reduce_add_ps(v)
/* 16 floats from memory */
#define F32X16(p, w) w[0] = _mm512_loadu_ps(p)
#define HALF_DOT(w, xp) VMUL(w[0], VLOAD(xp))
#define HALF_FMA(w, xp, acc) VFMA(w[0], VLOAD(xp), acc)
#else
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VSET1(v) _mm256_set1_ps(v)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VHSUM(v) hsum8(v)
#define F32X16(p, w) (w[0] = _mm256_loadu_ps(p), w[1] = _mm256_loadu_ps((p) + 8))
#define HALF_DOT(w, xp) _mm256_fmadd_ps(w[1], _mm256_loadu_ps((xp) + 8), _mm256_mul_ps(w[0], _mm256_loadu_ps(xp)))
#define HALF_FMA(w, xp, acc) _mm256_fmadd_ps(w[1], _mm256_loadu_ps((xp) + 8), _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xp), acc))
#endif

/* acc[r] += s * (wa . x[r, oa:oa+16] + wb . x[r, ob:ob+16]) for `rows` activation rows of stride K.
 * Few rows: a short dot-product tree per row, so one row's FMAs do not wait on each other. Many
 * rows: the rows' accumulator chains are independent, so scale the weights once and chain. */
#define CHAIN_ROWS 4
#define DOT32(rows, xb, K, oa, ob, wa, wb, s, acc, scaled)                                          \
    if ((rows) < CHAIN_ROWS) {                                                                      \
        for (int r = 0; r < (rows); r++) {                                                          \
            const float *xr = (xb) + (int64_t)r * (K);                                              \
            acc[r] = VFMA(HALF_FMA(wb, xr + (ob), HALF_DOT(wa, xr + (oa))), s, acc[r]);             \
        }                                                                                           \
    } else {                                                                                        \
        if (scaled) for (int i = 0; i < (int)(sizeof(wa) / sizeof(wa[0])); i++) wa[i] = VMUL(wa[i], s), wb[i] = VMUL(wb[i], s); \
        for (int r = 0; r < (rows); r++) {                                                          \
            const float *xr = (xb) + (int64_t)r * (K);                                              \
            acc[r] = HALF_FMA(wb, xr + (ob), HALF_FMA(wa, xr + (oa), acc[r]));                      \
        }                                                                                           \
    }

/* ---- quantized weights in panels of 32 rows ------------------------------------------------------
 * One layout for every weight-only format (w4, w8, and GGUF's Q4_0 .. Q8_0 and K-quants repacked
 * exactly): values q of `bits` bits and, per row and group of g input columns (g = K: per
 * channel), a scale s and a min m:   w = s * q + m.
 *   bits 2-6: q unsigned; without stored mins m = -2^(bits-1) * s (centred values, as in
 *   Q4_0, Q5_0, Q3_K and Q6_K). bits 8: q int8; without stored mins m = 0. bits NL4 (IQ4_NL,
 *   IQ4_XS): 4-bit indices, the value is NL4_VALUES[q] (int8), m = 0.
 *   Scales and mins are fp16 or fp32 (sbytes 2 or 4), or (sbytes 1) int8 sub-block values times an
 *   fp16 scale per gps groups (a K-quant's own form: its d times a 6-bit sub-block scale, -dmin
 *   times a 6-bit min), 1.1 bytes a group instead of 4, multiplied as they load (int8 x fp16 is
 *   exact in fp32). Otherwise a K-quant's scale (fp16 times a 6-bit
 *   sub-block scale) needs fp32 to stay exact. s * q is exact in fp32 for all of them, so
 *   fma(s, q, m) rounds once, as gguf's dequantizers do.
 * A panel holds 32 output rows column by column, so one vector is one input column's weights for
 * 16 rows: the kernels broadcast x[r, k] into FMAs with no horizontal sums, and each broadcast
 * feeds two FMAs (the whole panel). In GGUF's row layout each weight needed its own x load and a
 * reduction per row; 4-bit panels ran 1.2-1.6x faster at 1-8 activation rows, cold (a C harness
 * at SmolLM2's shapes, AVX-512).
 *   q [P, G, g, 4 * bits] bytes. A column of 4 bits: 16 bytes of nibbles (byte j: row j in the
 *      low nibble, row j + 16 in the high one). Columns of 2 bits go in pairs: 16 bytes of crumbs
 *      (byte j: bits 0-1 row j of the first, 2-3 row j of the second, 4-5 and 6-7 their rows j +
 *      16). Columns of 6 bits too: each one's 16 bytes of nibbles, then the pair's top two bits as
 *      16 bytes of crumbs (as the 2-bit ones). 3 and 5 bits go by eight columns (g a multiple of
 *      8): their nibbles (crumbs) as 4 (2) bits', then the top bit as a plane of 32 bytes (byte j:
 *      bit c is that bit of row j of column c), so any column's bits reach their place with one
 *      shift of 16 rows and a mask (a 32-bit word per column took a shuffle, a compare and two
 *      masks: 5-bit GEMVs ran 1.1x faster on Zen 1 after the change). A column of int8: 32 bytes,
 *      row j at byte j.
 *   Lanes (L5, L6: 5 and 6 bits, groups of a multiple of 8; the AVX2 build's choice, fl_value_lanes):
 *      blocks of eight columns, the values already in the 16-bit lanes the int16 GEMV multiplies.
 *      Vector v = 4 p + h of a block (column pair p, rows 8 h .. 8 h + 7) is 16 lanes, lane 2 r + e
 *      = column 2 p + e, row 8 h + r. L5: vectors 0-14 three to a lane of five 32-byte words (bits
 *      0-4, 5-9, 10-14), vector 15 as 16 bytes: 176 bytes a block (5.5 bits a value). L6: vectors
 *      0-11 two to a lane of six words (bits 0-5, 6-11), vectors 12-15 from the words' top four
 *      bits (12: word 0's and word 1's low two above them, 13: word 1's high two and word 2's; 14,
 *      15: words 3-5 alike): 192 bytes, 6 bits a value. One AND or shift gives most vectors where
 *      the planes took two shifts, two masks, an OR and a widening: 5- and 6-bit GEMVs 1.4-1.7x
 *      faster on Zen 1 (C harness, 1 and 2 threads).
 *   scales, mins [P, G, 32]. P = ceil(N / 32), the last panel padded with zero rows.
 * ops/quantized.py's pack_panels / unpack_panels define the same layout. `bits` is a compile-time
 * constant in every always_inline kernel below (each width gets its own straight-line code); the
 * scale width and the min are tested once a group. */
#define PANEL 32
#ifndef XB
#define XB 8 /* columns a block of int16 x (x_to_i16; a multiple of 8): decode logprobs 6e-4 from HF (16 columns: 1.5e-3) */
#endif
#ifndef X_INT16 /* (-DX_INT16=0: the AVX2 GEMVs on fp32 x, as AVX-512's) */
#if defined(__AVX512F__)
#define X_INT16 0
#else
#define X_INT16 1
#endif
#endif
#define PANEL_PF(p) _mm_prefetch((const char *)(p) + PF_BYTES / 4, WEIGHT_HINT) /* scales: 1/8 the bytes */
#define NL4 9 /* width code: 4-bit indices into IQ4_NL's 16 values (NL4_VALUES) */
#define L5 10 /* width codes: 5 and 6-bit values in 16-bit lanes (the layout above) */
#define L6 11
#define LANES(bits) ((bits) == L5 || (bits) == L6)
#define LANE_BLOCK(bits) ((bits) == L5 ? 176 : 192) /* bytes of eight columns */
#define VALUE_BITS(bits) ((bits) == NL4 ? 4 : (bits) == L5 ? 5 : (bits) == L6 ? 6 : (bits))
#define COL_BYTES(bits) (LANES(bits) ? LANE_BLOCK(bits) / 8 : VALUE_BITS(bits) * 4)
#define LOW_BITS(bits) (VALUE_BITS(bits) >= 4 ? 4 : 2) /* the first plane: nibbles, or 2-bit crumbs */
#define PF_COLS(bits) (VALUE_BITS(bits) == 4 ? 4 : VALUE_BITS(bits) < 4 ? 64 / COL_BYTES(bits) : 2) /* columns between prefetches */
static const int8_t NL4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}; /* kvalues_iq4nl */

typedef struct {
    const uint8_t *q;
    const void *scales, *mins; /* mins NULL: implied by bits (above) */
    int64_t sbytes;            /* 2: fp16 scales and mins, 4: fp32, 1: int8 times sup_s / sup_m */
    float centre;              /* without mins: m = -centre * s */
    const uint16_t *sup_s, *sup_m; /* sbytes 1: fp16 [P, G / gps, 32], one for gps groups */
    int64_t gps, gps_shift;        /* gps a power of two: no division where a scale loads */
} panel_w_t;

static inline panel_w_t panel_w(const uint8_t *q, const void *s, const void *m, int64_t sbytes, int bits, const void *sup_s,
                                const void *sup_m, int64_t gps) {
    panel_w_t w = {q, s, m, sbytes, m == NULL && VALUE_BITS(bits) < 8 && bits != NL4 ? (float)(1 << (VALUE_BITS(bits) - 1)) : 0.f, sup_s, sup_m, gps,
                   gps > 0 ? __builtin_ctzll((unsigned long long)gps) : 0};
    return w;
}

/* The weights of panel p from group 0 on. */
static inline panel_w_t panel_at(const panel_w_t *w, int64_t p, int64_t G, int64_t g, int bits) {
    panel_w_t o = *w;
    o.q += p * G * g * COL_BYTES(bits);
    o.scales = (const char *)w->scales + p * G * PANEL * w->sbytes;
    if (w->mins) o.mins = (const char *)w->mins + p * G * PANEL * w->sbytes;
    if (w->sbytes == 1) {
        o.sup_s = w->sup_s + p * (G / w->gps) * PANEL;
        if (w->mins) o.sup_m = w->sup_m + p * (G / w->gps) * PANEL;
    }
    return o;
}

/* Element i (group i / 32, lane i % 32) of a panel's scales -> its super-block scale's element. */
static inline int64_t sup_at(const panel_w_t *w, int64_t i) { return (i >> (5 + w->gps_shift)) * PANEL + (i & (PANEL - 1)); }

/* 8 scales (p: w->scales, sup: w->sup_s) or mins (w->mins, w->sup_m) of a panel from element i. */
static inline __m256 load8s(const panel_w_t *w, const void *p, const uint16_t *sup, int64_t i) {
    if (w->sbytes == 1)
        return _mm256_mul_ps(i8x8_to_ps(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + i))),
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sup + sup_at(w, i)))));
    return w->sbytes == 2 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))) : _mm256_loadu_ps((const float *)p + i);
}

/* One scale or min (scalar: the embedding's rows). */
static inline float load1s(const panel_w_t *w, const void *p, const uint16_t *sup, int64_t i) {
    if (w->sbytes == 1) return (float)((const int8_t *)p)[i] * _cvtsh_ss(sup[sup_at(w, i)]);
    return w->sbytes == 2 ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Column kk's bytes: its own, or (2-3 and 6 bits) from its pair's: two columns share 16 bytes of
 * crumbs, so one widening serves both and each vector of 16 rows needs one shift and one mask (6
 * bits: this column's nibbles within the pair). 3 and 5 bits: within its eight columns' bytes. */
#define PAIRED(bits) (LOW_BITS(bits) == 2 || (bits) == 6) /* columns stored in pairs */
#define PLANES(bits) ((bits) == 3 || (bits) == 5)          /* a bit plane per eight columns */
#define FIRST_BYTES(bits) (LOW_BITS(bits) == 4 ? 16 : 8)  /* a column's share of its first plane */
static inline const uint8_t *col_bytes(const uint8_t *qg, int64_t kk, const int bits) {
    if (PLANES(bits)) return qg + (kk & ~(int64_t)7) * COL_BYTES(bits) + (kk & (LOW_BITS(bits) == 2 ? 6 : 7)) * FIRST_BYTES(bits);
    return qg + (PAIRED(bits) ? kk & ~(int64_t)1 : kk) * COL_BYTES(bits) + (bits == 6 ? 16 * (kk & 1) : 0);
}

/* 6 bits: a pair's 16 bytes of crumbs of the top two bits (after both columns' nibbles), from col_bytes. */
static inline int64_t top_at(int64_t kk) { return 32 - 16 * (kk & 1); }

/* 3 and 5 bits: the 32 bytes (one a row) of plane b of column kk's eight; column kk's bit is bit kk % 8. */
static inline const uint8_t *plane_at(const uint8_t *qg, int64_t kk, const int bits, int b) {
    return qg + (kk & ~(int64_t)7) * COL_BYTES(bits) + 8 * FIRST_BYTES(bits) + 32 * b;
}

/* Bits from .. from + n - 1 of every byte of p moved to bits to .. to + n - 1, the other bits
 * cleared: one shift (an immediate where `from` is known at compile time: the GEMV loops go by
 * whole eights of columns) and a mask. */
static inline __attribute__((always_inline)) __m128i bits_at(__m128i p, int from, int to, int n) {
    const __m128i s = from == to ? p : from < to ? _mm_sll_epi16(p, _mm_cvtsi32_si128(to - from)) : _mm_srl_epi16(p, _mm_cvtsi32_si128(from - to));
    return _mm_and_si128(s, _mm_set1_epi8((char)(((1 << n) - 1) << to)));
}
/* Bit c of every byte of p moved to bit `to` (a plane's bit of column c). */
static inline __attribute__((always_inline)) __m128i plane_bit(__m128i p, int c, int to) { return bits_at(p, c, to, 1); }
static inline __attribute__((always_inline)) __m256i plane_bit256(__m256i p, int c, int to) {
    const __m256i s = c == to ? p : c < to ? _mm256_sll_epi16(p, _mm_cvtsi32_si128(to - c)) : _mm256_srl_epi16(p, _mm_cvtsi32_si128(c - to));
    return _mm256_and_si256(s, _mm256_set1_epi8((char)(1 << to)));
}

/* Columns kk of a group of g in steps of `step` by whole eights: kk % 8 is then a compile-time
 * constant in the unrolled body (plane_bit's shift). */
#define FOR_COLUMNS(kk, g, step)                                                       \
    for (int64_t kk##_8 = 0; kk##_8 < (g); kk##_8 += 8)                                \
        _Pragma("GCC unroll 8") for (int kk##_i = 0; kk##_i < 8; kk##_i += (step))     \
            for (int64_t kk = kk##_8 + kk##_i; kk < (g); kk = (g)) /* (once: kk < g) */

/* The shift of column kk's rows j < 16 in the first plane's bytes (rows j + 16: 4 more). */
static inline int low_shift(int64_t kk, const int bits) { return LOW_BITS(bits) == 2 ? 2 * (int)(kk & 1) : 0; }

/* Lanes: a block of eight columns (see the layout above) and its vector v, 16 lanes of int16. v is
 * a compile-time constant in the unrolled GEMV loops: one AND, one shift or both (L6's 12-15: two
 * shifts, a mask and an OR). */
static inline __attribute__((always_inline)) const uint8_t *lane_block(const uint8_t *qg, int64_t kk, const int bits) {
    return qg + (kk >> 3) * LANE_BLOCK(bits);
}
static inline __attribute__((always_inline)) __m256i lane_word(const uint8_t *blk, int k) { return _mm256_loadu_si256((const __m256i *)(blk + 32 * k)); }
static inline __attribute__((always_inline)) __m256i lane_vector(const uint8_t *blk, const int v, const int bits) {
    if (bits == L5) {
        if (v == 15) return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 160)));
        const __m256i w = lane_word(blk, v / 3);
        const int s = 5 * (v % 3);
        if (s == 10) return _mm256_srli_epi16(w, 10); /* (bit 15 is zero) */
        return _mm256_and_si256(s ? _mm256_srli_epi16(w, 5) : w, _mm256_set1_epi16(31));
    }
    if (v < 12) {
        const __m256i w = lane_word(blk, v / 2);
        return _mm256_and_si256(v % 2 ? _mm256_srli_epi16(w, 6) : w, _mm256_set1_epi16(63));
    }
    const int k = v < 14 ? v - 12 : v - 11; /* 12: words 0, 1; 13: 1, 2; 14: 3, 4; 15: 4, 5 */
    if (v % 2 == 0) return _mm256_or_si256(_mm256_srli_epi16(lane_word(blk, k), 12), _mm256_and_si256(_mm256_srli_epi16(lane_word(blk, k + 1), 8), _mm256_set1_epi16(0x30)));
    return _mm256_or_si256(_mm256_srli_epi16(lane_word(blk, k), 14), _mm256_and_si256(_mm256_srli_epi16(lane_word(blk, k + 1), 10), _mm256_set1_epi16(0x3C)));
}

/* Lanes: rows lane0 .. lane0 + n - 1 of column kk as bytes (the generic paths). */
static inline __attribute__((always_inline)) __m128i lane_bytes(const uint8_t *qg, int64_t kk, int lane0, const int n, const int bits) {
    const uint8_t *blk = lane_block(qg, kk, bits);
    const int p = (int)(kk & 7) >> 1;
    const __m128i e = _mm_cvtsi32_si128(16 * (int)(kk & 1));
    __m128i out = _mm_setzero_si128();
    for (int i = 0; i < n / 8; i++) {
        const __m256i vec = lane_vector(blk, 4 * p + lane0 / 8 + i, bits);
        const __m256i col = _mm256_and_si256(_mm256_srl_epi32(vec, e), _mm256_set1_epi32(0xFFFF)); /* this column's lanes */
        const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(col), _mm256_extracti128_si256(col, 1));
        const __m128i b = _mm_packus_epi16(w16, w16);
        out = i ? _mm_unpacklo_epi64(out, b) : b;
    }
    return out;
}

/* Rows lane0 .. lane0 + n - 1 (n 8 or 16, lane0 a multiple of n) of column kk's values as bytes:
 * unsigned, or int8 for 8 bits and NL4. The planes are joined byte-wise in 128-bit registers, and
 * only the whole values widen to 32-bit lanes:
 * joined after widening, a 5- or 6-bit value took twice the instructions of a 4-bit one (and the
 * AVX2 build's 256-bit integer ops are two micro-ops each on Zen 1). */
static inline __attribute__((always_inline)) __m128i panel_bytes(const uint8_t *qg, int64_t kk, int lane0, const int bits, const int n) {
#define LOAD_N(p) (n == 16 ? _mm_loadu_si128((const __m128i *)(p)) : _mm_loadl_epi64((const __m128i *)(p)))
    if (LANES(bits)) return lane_bytes(qg, kk, lane0, n, bits);
    const uint8_t *c = col_bytes(qg, kk, bits);
    if (bits == 8) return LOAD_N(c + lane0);
    const int low = LOW_BITS(bits);
    const __m128i b = LOAD_N(c + lane0 % 16);
    __m128i v;
    if (low == 4)
        v = _mm_and_si128(lane0 < 16 ? b : _mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    else
        v = _mm_and_si128(_mm_srl_epi16(b, _mm_cvtsi32_si128(low_shift(kk, bits) + 4 * (lane0 / 16))), _mm_set1_epi8(3));
    if (bits == NL4) return _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)NL4_VALUES), v); /* the nibbles through the table */
    if (bits == 6) { /* the top two bits: this column's crumbs of the pair */
        return _mm_or_si128(v, bits_at(LOAD_N(c + top_at(kk) + lane0 % 16), 2 * (int)(kk & 1) + 4 * (lane0 / 16), 4, 2));
    }
    for (int bb = 0; bb < VALUE_BITS(bits) - low; bb++) /* plane bb: byte j holds row j's bit of 8 columns */
        v = _mm_or_si128(v, plane_bit(LOAD_N(plane_at(qg, kk, bits, bb) + lane0), (int)(kk & 7), low + bb));
    return v;
#undef LOAD_N
}

/* 8 values (bytes) as floats. */
static inline __m256 panel_bytes_ps(__m128i v, const int bits) { return bits == 8 || bits == NL4 ? i8x8_to_ps(v) : u8x8_to_ps(v); }

/* Rows lane0 .. lane0 + 7 (lane0 a multiple of 8) of column kk's values, as floats. */
static inline __attribute__((always_inline)) __m256 panel_q8(const uint8_t *qg, int64_t kk, int lane0, const int bits) {
    return panel_bytes_ps(panel_bytes(qg, kk, lane0, bits, 8), bits);
}

/* Rows lane0 .. lane0 + 15 (lane0 0 or 16) of column kk's values, as floats: *a the first 8. */
static inline __attribute__((always_inline)) void panel_q16(const uint8_t *qg, int64_t kk, int lane0, const int bits, __m256 *a, __m256 *b) {
    const __m128i v = panel_bytes(qg, kk, lane0, bits, 16);
    *a = panel_bytes_ps(v, bits);
    *b = panel_bytes_ps(_mm_unpackhi_epi64(v, v), bits);
}

/* Row j's value in column kk (scalar: the embedding's rows). */
static inline int panel_value(const uint8_t *qg, int64_t kk, int64_t j, int bits) {
    if (LANES(bits)) {
        const uint8_t *blk = lane_block(qg, kk, bits);
        const int v = 4 * ((int)(kk & 7) >> 1) + (int)(j / 8), lane = 2 * (int)(j % 8) + (int)(kk & 1);
#define LANE_OF(k) (blk[32 * (k) + 2 * lane] | blk[32 * (k) + 2 * lane + 1] << 8) /* word k's 16 bits in this lane */
        if (bits == L5) return v == 15 ? blk[160 + lane] : (LANE_OF(v / 3) >> (5 * (v % 3))) & 31;
        if (v < 12) return (LANE_OF(v / 2) >> (6 * (v % 2))) & 63;
        const int k = v < 14 ? v - 12 : v - 11;
        return v % 2 == 0 ? (LANE_OF(k) >> 12) | ((LANE_OF(k + 1) >> 8) & 0x30) : (LANE_OF(k) >> 14) | ((LANE_OF(k + 1) >> 10) & 0x3C);
#undef LANE_OF
    }
    const uint8_t *c = col_bytes(qg, kk, bits);
    if (bits == 8) return (int8_t)c[j];
    const int low = LOW_BITS(bits);
    int v = (c[j % 16] >> (low_shift(kk, bits) + 4 * (j / 16))) & ((1 << low) - 1);
    if (bits == 6) return v | ((c[top_at(kk) + j % 16] >> (2 * (int)(kk & 1) + 4 * (j / 16))) & 3) << 4;
    for (int b = 0; b < VALUE_BITS(bits) - low; b++) v |= ((plane_at(qg, kk, bits, b)[j] >> (kk & 7)) & 1) << (low + b);
    return bits == NL4 ? NL4_VALUES[v] : v;
}

/* 8 rows' scales and mins of a panel from element i (mins implied by the centre where none are stored). */
static inline void panel_scales8(const panel_w_t *w, int64_t i, __m256 *d, __m256 *m) {
    *d = load8s(w, w->scales, w->sup_s, i);
    *m = w->mins ? load8s(w, w->mins, w->sup_m, i) : _mm256_mul_ps(*d, _mm256_set1_ps(-w->centre));
}

/* The int16 and int8 GEMVs' prefetches of weights and scales: into every cache level (T0), not with
 * PREFETCH's non-temporal hint, which on Zen 1 lost lines before the GEMV reached them (8 KB
 * ahead): decode steps 1.02-1.08x there (benchmarks/ab_kernels.py, Q4_K_M and Q4_1 files, more
 * while a neighbour loads the memory), batch 2 1.01x. */
#define I16_PF(p, ahead) _mm_prefetch((const char *)(p) + (ahead), _MM_HINT_T0)

/* A group's scales and mins of 16 * nc panel rows from element si into dv, mv (the GEMVs' per-group
 * step), the next groups' prefetched. */
static inline __attribute__((always_inline)) void group_scales(const panel_w_t *w, int64_t si, int nc, float *dv, float *mv) {
    I16_PF((const char *)w->scales + si * w->sbytes, PF_BYTES / 4);
    if (w->mins) I16_PF((const char *)w->mins + si * w->sbytes, PF_BYTES / 4);
    for (int v = 0; v < 2 * nc; v++) {
        __m256 d, m;
        panel_scales8(w, si + 8 * v, &d, &m);
        _mm256_store_ps(dv + 8 * v, d);
        _mm256_store_ps(mv + 8 * v, m);
    }
}

#if defined(__AVX512F__)
/* Bit c of 16 bytes of a plane (16 rows) as a mask. */
static inline __attribute__((always_inline)) __mmask16 plane_mask16(const uint8_t *p, int c) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)p), _mm_set1_epi8((char)(1 << c)));
#else
    return (__mmask16)_mm_movemask_epi8(_mm_sll_epi16(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128(7 - c)));
#endif
}

/* Column kk's 32 values as floats (rows 0-15, 16-31), before scaling. */
static inline __attribute__((always_inline)) void panel_column(const uint8_t *qg, int64_t kk, const int bits, __m512 *qa, __m512 *qb) {
    if (LANES(bits)) { /* (not this build's choice: fl_value_lanes) */
        *qa = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lane_bytes(qg, kk, 0, 16, bits)));
        *qb = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lane_bytes(qg, kk, 16, 16, bits)));
        return;
    }
    const uint8_t *c = col_bytes(qg, kk, bits);
    if (bits == 8) {
        *qa = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
        *qb = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
        return;
    }
    const int low = LOW_BITS(bits);
    const __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    __m512i lo, hi;
    if (low == 4) {
        lo = _mm512_and_si512(i, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(i, 4);
    } else { /* the pair's crumbs: this column's at bits 0 / 4, or 2 / 6 */
        const __m128i sh = _mm_cvtsi32_si128(low_shift(kk, bits));
        lo = _mm512_and_si512(_mm512_srl_epi32(i, sh), _mm512_set1_epi32(3));
        hi = _mm512_and_si512(_mm512_srl_epi32(i, _mm_add_epi32(sh, _mm_cvtsi32_si128(4))), _mm512_set1_epi32(3));
    }
    if (bits == 6) { /* the top two bits: this column's crumbs of the pair, moved to bits 4-5 */
        const __m512i t = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + top_at(kk)))), m = _mm512_set1_epi32(0x30);
        lo = _mm512_add_epi32(lo, _mm512_and_si512(_mm512_sll_epi32(t, _mm_cvtsi32_si128(4 - 2 * (int)(kk & 1))), m));
        hi = _mm512_add_epi32(hi, _mm512_and_si512(_mm512_srl_epi32(t, _mm_cvtsi32_si128(2 * (int)(kk & 1))), m));
        *qa = _mm512_cvtepi32_ps(lo), *qb = _mm512_cvtepi32_ps(hi);
        return;
    }
    if (bits == NL4) { /* the indices through the table: a permute where a conversion would be */
        const __m512 table = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)NL4_VALUES)));
        *qa = _mm512_permutexvar_ps(lo, table), *qb = _mm512_permutexvar_ps(hi, table);
        return;
    }
    for (int b = 0; b < VALUE_BITS(bits) - low; b++) { /* bit low + b of each row: a mask-add */
        const __m512i add = _mm512_set1_epi32((1 << low) << b);
        lo = _mm512_mask_add_epi32(lo, plane_mask16(plane_at(qg, kk, bits, b), (int)(kk & 7)), lo, add);
        hi = _mm512_mask_add_epi32(hi, plane_mask16(plane_at(qg, kk, bits, b) + 16, (int)(kk & 7)), hi, add);
    }
    *qa = _mm512_cvtepi32_ps(lo), *qb = _mm512_cvtepi32_ps(hi);
}

/* Columns kk and kk + 1 (kk even) of 2-3 bits, one widening of their shared crumbs for both:
 * q[u][h] is column kk + u's rows 16 h .. 16 h + 15. */
static inline __attribute__((always_inline)) void panel_pair(const uint8_t *qg, int64_t kk, const int bits, __m512 q[2][2]) {
    const uint8_t *c = col_bytes(qg, kk, bits);
    if (bits == 6) { /* each column's nibbles, then one widening of the pair's top-bit crumbs */
        const __m512i t = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 32))), m = _mm512_set1_epi32(0x30);
        const __m512i top[2][2] = {{_mm512_and_si512(_mm512_slli_epi32(t, 4), m), _mm512_and_si512(t, m)},
                                   {_mm512_and_si512(_mm512_slli_epi32(t, 2), m), _mm512_and_si512(_mm512_srli_epi32(t, 2), m)}};
        for (int u = 0; u < 2; u++) {
            const __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16 * u)));
            q[u][0] = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_and_si512(i, _mm512_set1_epi32(15)), top[u][0]));
            q[u][1] = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_srli_epi32(i, 4), top[u][1]));
        }
        return;
    }
    const __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c)), three = _mm512_set1_epi32(3);
    __m512i v[2][2] = {{_mm512_and_si512(i, three), _mm512_and_si512(_mm512_srli_epi32(i, 4), three)},
                       {_mm512_and_si512(_mm512_srli_epi32(i, 2), three), _mm512_srli_epi32(i, 6)}};
    for (int b = 0; b < bits - 2; b++)
        for (int u = 0; u < 2; u++)
            for (int h = 0; h < 2; h++)
                v[u][h] = _mm512_mask_add_epi32(v[u][h], plane_mask16(plane_at(qg, kk, bits, b) + 16 * h, (int)((kk + u) & 7)), v[u][h], _mm512_set1_epi32(4 << b));
    for (int u = 0; u < 2; u++) q[u][0] = _mm512_cvtepi32_ps(v[u][0]), q[u][1] = _mm512_cvtepi32_ps(v[u][1]);
}

static inline __m512 load16s(const panel_w_t *w, const void *p, const uint16_t *sup, int64_t i) {
    if (w->sbytes == 1)
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + i)))),
                             _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sup + sup_at(w, i)))));
    return w->sbytes == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))) : _mm512_loadu_ps((const float *)p + i);
}

/* The mins of 16 rows from element i, given their scales d. */
static inline __m512 panel_mins16(const panel_w_t *w, int64_t i, __m512 d) {
    return w->mins ? load16s(w, w->mins, w->sup_m, i) : _mm512_mul_ps(d, _mm512_set1_ps(-w->centre));
}

/* 1-2 activation rows: each group's q . x sums in 4 independent chains (the FMA latency would
 * otherwise bound the loop), scaled once a group: scale * sum(q x) (+ min * sum(x)). */
static inline __attribute__((always_inline)) void panel_few(const float *x, const float *xsum, int64_t K, const panel_w_t *w,
    int64_t G, int64_t g, float *y, int64_t ldy, const int bits, const int rows) {
    const int has_min = w->mins != NULL || w->centre != 0.f;
    __m512 tot[2][2];
    for (int r = 0; r < rows; r++) tot[r][0] = tot[r][1] = _mm512_setzero_ps();
    for (int64_t grp = 0; grp < G; grp++) {
        const uint8_t *qg = w->q + grp * g * COL_BYTES(bits);
        const float *xg = x + grp * g;
        PANEL_PF((const char *)w->scales + grp * PANEL * w->sbytes);
        if (w->mins) PANEL_PF((const char *)w->mins + grp * PANEL * w->sbytes);
        __m512 aq[2][2][4];
        for (int r = 0; r < rows; r++) for (int h = 0; h < 2; h++) for (int u = 0; u < 4; u++) aq[r][h][u] = _mm512_setzero_ps();
        FOR_COLUMNS(kk, g, 4) {
            PREFETCH(qg + kk * COL_BYTES(bits));
            if (VALUE_BITS(bits) > 4) PREFETCH(qg + kk * COL_BYTES(bits) + 64);
            __m512 q[4][2];
            if (PAIRED(bits)) panel_pair(qg, kk, bits, q), panel_pair(qg, kk + 2, bits, q + 2);
            else for (int u = 0; u < 4; u++) panel_column(qg, kk + u, bits, &q[u][0], &q[u][1]);
            for (int u = 0; u < 4; u++) {
                for (int r = 0; r < rows; r++) {
                    const __m512 xb = _mm512_set1_ps(xg[r * K + kk + u]);
                    aq[r][0][u] = _mm512_fmadd_ps(q[u][0], xb, aq[r][0][u]);
                    aq[r][1][u] = _mm512_fmadd_ps(q[u][1], xb, aq[r][1][u]);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const int64_t i = grp * PANEL + 16 * h;
            const __m512 d = load16s(w, w->scales, w->sup_s, i);
            const __m512 mn = has_min ? panel_mins16(w, i, d) : d;
            for (int r = 0; r < rows; r++) {
                const __m512 sum = _mm512_add_ps(_mm512_add_ps(aq[r][h][0], aq[r][h][1]), _mm512_add_ps(aq[r][h][2], aq[r][h][3]));
                tot[r][h] = _mm512_fmadd_ps(d, sum, tot[r][h]);
                if (has_min) tot[r][h] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[r * G + grp]), tot[r][h]);
            }
        }
    }
    for (int r = 0; r < rows; r++) { _mm512_storeu_ps(y + r * ldy, tot[r][0]); _mm512_storeu_ps(y + r * ldy + 16, tot[r][1]); }
}

/* 3-8 activation rows: each column's 32 weights dequantized (fma(s, q, m), as the reference
 * does), then two FMAs per row: the chains of 2 x rows accumulators hide the FMA latency. */
static inline __attribute__((always_inline)) void panel_many(const float *x, int64_t K, const panel_w_t *w,
    int64_t G, int64_t g, float *y, int64_t ldy, const int bits, const int rows) {
    const int has_min = w->mins != NULL || w->centre != 0.f;
    __m512 acc[MT][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t grp = 0; grp < G; grp++) {
        const uint8_t *qg = w->q + grp * g * COL_BYTES(bits);
        const float *xg = x + grp * g;
        PANEL_PF((const char *)w->scales + grp * PANEL * w->sbytes);
        if (w->mins) PANEL_PF((const char *)w->mins + grp * PANEL * w->sbytes);
        const __m512 d0 = load16s(w, w->scales, w->sup_s, grp * PANEL), d1 = load16s(w, w->scales, w->sup_s, grp * PANEL + 16);
        __m512 m0 = _mm512_setzero_ps(), m1 = m0;
        if (has_min) m0 = panel_mins16(w, grp * PANEL, d0), m1 = panel_mins16(w, grp * PANEL + 16, d1);
        FOR_COLUMNS(kk, g, 1) {
            if (kk % PF_COLS(bits) == 0) PREFETCH(qg + kk * COL_BYTES(bits));
            __m512 w0, w1;
            panel_column(qg, kk, bits, &w0, &w1);
            if (has_min) w0 = _mm512_fmadd_ps(w0, d0, m0), w1 = _mm512_fmadd_ps(w1, d1, m1);
            else w0 = _mm512_mul_ps(w0, d0), w1 = _mm512_mul_ps(w1, d1);
            for (int r = 0; r < rows; r++) {
                const __m512 xb = _mm512_set1_ps(xg[r * K + kk]);
                acc[r][0] = _mm512_fmadd_ps(w0, xb, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(w1, xb, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < rows; r++) { _mm512_storeu_ps(y + r * ldy, acc[r][0]); _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]); }
}

static inline __attribute__((always_inline)) void panel_rows(const float *x, const float *xsum, const int16_t *xq, const float *xs,
    int64_t K, const panel_w_t *w, int64_t G, int64_t g, float *y, int64_t ldy, const int bits, const int rows) {
    (void)xq, (void)xs; /* (AVX2 only) */
    if (rows <= 2) panel_few(x, xsum, K, w, G, g, y, ldy, bits, rows <= 1 ? 1 : 2);
    else panel_many(x, K, w, G, g, y, ldy, bits, rows);
}
#else
/* AVX2 (16 ymm registers): a panel is walked in halves, so the accumulators, scales and weights
 * fit; 1-2 rows with fp32 x (panel_half_few), up to I16_MAX_ROWS with int16 x (panel_i16):
 * panel_parts_linear gives more to the GEMM kernel (GEMM_FROM_ROWS). */

/* acc += wv . xp (16-bit pairs), the sum kept in its register as it goes: left to itself GCC
 * reassociates a block's products into a tree at its end and spills them to the stack
 * (perf annotate), the accumulators of tot with them. */
static inline __attribute__((always_inline)) void madd_into(__m256i *acc, __m256i wv, __m256i xp) {
    *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(wv, xp));
    __asm__("" : "+x"(*acc));
}

/* 1-4 activation rows with x rounded to int16 (x_to_i16): two columns' values of a row as a pair of
 * int16 in each 32-bit lane, so one vpmaddwd multiplies and adds 16 weights by two x values, and
 * only a block's int32 sums (XB columns: at most 8 * 128 * 32767, far from overflow) become floats. Zen 1 runs the float route (widen, convert, FMA)
 * at half this speed: a C harness on one core with the weights in L1 gave 6.4 G weights/s against
 * 12.8 (4-bit), the conversions being what limits it. The rounding error is 1/65534 of the block's
 * largest |x| (llama.cpp's int8 rows: 1/254); the weights stay the file's values. Panel rows
 * 16 * c0 .. 16 * (c0 + nc) - 1: nc 2 (the whole panel) for one x row, 1 for two to four. */
static inline __attribute__((always_inline)) void panel_i16(const int16_t *xq, const float *xs, const float *xsum, int64_t K,
    const panel_w_t *w, int64_t G, int64_t g, int c0, float *y, int64_t ldy, const int bits, const int rows, const int nc) {
    const int has_min = w->mins != NULL || w->centre != 0.f;
    const int is_signed = bits == 8 || bits == NL4;
    const int64_t C = K / XB;
    __m256 tot[4][4];
    __m256i acc[4][4];
    float dv[32] __attribute__((aligned(32))), mv[32] __attribute__((aligned(32)));
    for (int r = 0; r < rows; r++) for (int v = 0; v < 2 * nc; v++) tot[r][v] = _mm256_setzero_ps();
    for (int64_t grp = 0; grp < G; grp++) {
        const uint8_t *qg = w->q + grp * g * COL_BYTES(bits);
        const int64_t si = grp * PANEL + 16 * c0;
        group_scales(w, si, nc, dv, mv);
        for (int64_t b = 0; b < g / XB; b++) {
            for (int r = 0; r < rows; r++) for (int v = 0; v < 2 * nc; v++) acc[r][v] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int i = 0; i < XB; i += 2) { /* (i, not kk, steps: kk % 8 is then known to the compiler: plane_bit's shifts) */
                const int64_t kk = b * XB + i;
                if (kk % PF_COLS(bits) < 2) I16_PF(qg + kk * COL_BYTES(bits), PF_BYTES);
                __m256i xp[4];
                for (int r = 0; r < rows; r++) {
                    int32_t pair;
                    memcpy(&pair, xq + r * K + grp * g + kk, sizeof pair);
                    xp[r] = _mm256_set1_epi32(pair);
                }
                if (LANES(bits)) { /* the pair's vectors as stored: one AND or shift each */
                    const uint8_t *blk = lane_block(qg, b * XB, bits) + (i >> 3) * LANE_BLOCK(bits); /* (b's block: one address a block) */
                    for (int c = 0; c < nc; c++)
                        for (int h = 0; h < 2; h++) {
                            const __m256i wv = lane_vector(blk, 4 * ((i & 7) >> 1) + 2 * (c0 + c) + h, bits);
                            for (int r = 0; r < rows; r++) madd_into(&acc[r][2 * c + h], wv, xp[r]);
                        }
                    continue;
                }
                if (bits == 4) { /* the two columns' bytes paired, widened, then split into nibbles in 16-bit lanes (1.1x) */
                    const __m128i b0 = _mm_loadu_si128((const __m128i *)col_bytes(qg, kk, bits)), b1 = _mm_loadu_si128((const __m128i *)col_bytes(qg, kk + 1, bits));
                    const __m256i wb[2] = {_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(b0, b1)), _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(b0, b1))};
                    for (int c = 0; c < nc; c++)
                        for (int h = 0; h < 2; h++) {
                            const __m256i wv = c0 + c == 0 ? _mm256_and_si256(wb[h], _mm256_set1_epi16(15)) : _mm256_srli_epi16(wb[h], 4);
                            for (int r = 0; r < rows; r++) madd_into(&acc[r][2 * c + h], wv, xp[r]);
                        }
                    continue;
                }
                for (int c = 0; c < nc; c++) {
                    const __m128i v0 = panel_bytes(qg, kk, 16 * (c0 + c), bits, 16), v1 = panel_bytes(qg, kk + 1, 16 * (c0 + c), bits, 16);
                    const __m128i lo = _mm_unpacklo_epi8(v0, v1), hi = _mm_unpackhi_epi8(v0, v1);
                    const __m256i wl = is_signed ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo);
                    const __m256i wh = is_signed ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi);
                    for (int r = 0; r < rows; r++) {
                        madd_into(&acc[r][2 * c], wl, xp[r]);
                        madd_into(&acc[r][2 * c + 1], wh, xp[r]);
                    }
                }
            }
            const float *dvb = dv;
            __asm__("" : "+r"(dvb)); /* the scales read at each block: the registers go to the sums */
            for (int r = 0; r < rows; r++) {
                const __m256 s = _mm256_set1_ps(xs[r * C + grp * (g / XB) + b]);
                for (int v = 0; v < 2 * nc; v++)
                    tot[r][v] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_load_ps(dvb + 8 * v), s), _mm256_cvtepi32_ps(acc[r][v]), tot[r][v]);
            }
        }
        if (has_min)
            for (int r = 0; r < rows; r++)
                for (int v = 0; v < 2 * nc; v++)
                    tot[r][v] = _mm256_fmadd_ps(_mm256_load_ps(mv + 8 * v), _mm256_set1_ps(xsum[r * G + grp]), tot[r][v]);
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < 2 * nc; v++) _mm256_storeu_ps(y + r * ldy + 16 * c0 + 8 * v, tot[r][v]);
}

/* 1-2 activation rows: a group's q . x in 2 chains a vector, scaled once a group (as on AVX-512). */
static inline __attribute__((always_inline)) void panel_half_few(const float *x, const float *xsum, int64_t K, const panel_w_t *w,
    int64_t G, int64_t g, int h, float *y, int64_t ldy, const int bits, const int rows) {
    const int has_min = w->mins != NULL || w->centre != 0.f;
    __m256 tot[2][2];
    for (int r = 0; r < rows; r++) tot[r][0] = tot[r][1] = _mm256_setzero_ps();
    for (int64_t grp = 0; grp < G; grp++) {
        const uint8_t *qg = w->q + grp * g * COL_BYTES(bits);
        const float *xg = x + grp * g;
        __m256 aq[2][2][2];
        for (int r = 0; r < rows; r++) for (int i = 0; i < 2; i++) aq[r][i][0] = aq[r][i][1] = _mm256_setzero_ps();
        FOR_COLUMNS(kk, g, 2) {
            PREFETCH(qg + kk * COL_BYTES(bits));
            for (int u = 0; u < 2; u++) {
                __m256 qa, qb;
                panel_q16(qg, kk + u, 16 * h, bits, &qa, &qb);
                for (int r = 0; r < rows; r++) {
                    const __m256 xb = _mm256_broadcast_ss(xg + r * K + kk + u);
                    aq[r][0][u] = _mm256_fmadd_ps(qa, xb, aq[r][0][u]);
                    aq[r][1][u] = _mm256_fmadd_ps(qb, xb, aq[r][1][u]);
                }
            }
        }
        const int64_t si = grp * PANEL + 16 * h;
        PANEL_PF((const char *)w->scales + si * w->sbytes);
        if (w->mins) PANEL_PF((const char *)w->mins + si * w->sbytes);
        __m256 d[2], m[2];
        for (int i = 0; i < 2; i++) panel_scales8(w, si + 8 * i, &d[i], &m[i]);
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < 2; i++) {
                tot[r][i] = _mm256_fmadd_ps(d[i], _mm256_add_ps(aq[r][i][0], aq[r][i][1]), tot[r][i]);
                if (has_min) tot[r][i] = _mm256_fmadd_ps(m[i], _mm256_set1_ps(xsum[r * G + grp]), tot[r][i]);
            }
    }
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 2; i++) _mm256_storeu_ps(y + r * ldy + 16 * h + 8 * i, tot[r][i]);
}

static inline __attribute__((always_inline)) void panel_rows(const float *x, const float *xsum, const int16_t *xq, const float *xs,
    int64_t K, const panel_w_t *w, int64_t G, int64_t g, float *y, int64_t ldy, const int bits, const int rows) {
#define I16_HALVES(R, r0) /* rows r0 .. r0 + R - 1, each half of the panel (c0 a constant: the lanes' vector numbers are) */            \
    panel_i16(xq + (r0) * K, xs + (r0) * (K / XB), xsum ? xsum + (r0) * G : NULL, K, w, G, g, 0, y + (r0) * ldy, ldy, bits, R, 1); \
    panel_i16(xq + (r0) * K, xs + (r0) * (K / XB), xsum ? xsum + (r0) * G : NULL, K, w, G, g, 1, y + (r0) * ldy, ldy, bits, R, 1)
    if (xq && rows <= 1) panel_i16(xq, xs, xsum, K, w, G, g, 0, y, ldy, bits, 1, 2);
    else if (xq && rows <= 4) { I16_HALVES(rows, 0); }
    else if (xq) { I16_HALVES(4, 0); I16_HALVES(rows > 4 ? rows - 4 : 1, 4); }
    else for (int h = 0; h < 2; h++) panel_half_few(x, xsum, K, w, G, g, h, y, ldy, bits, rows <= 1 ? 1 : 2);
#undef I16_HALVES
}
#endif

/* Panel p's rows of y [M, N] = x [M, K] @ W^T. */
static inline __attribute__((always_inline)) void panel_block(const float *x, const float *xsum, const int16_t *xq, const float *xs,
    int64_t M, int64_t K, const panel_w_t *w, int64_t N, int64_t g, float *y, int64_t ldo, int64_t p, const int bits) {
    const int64_t G = K / g;
    const panel_w_t wp = panel_at(w, p, G, g, bits);
    const int64_t valid = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
    float tail[MT * PANEL]; /* the padded last panel's outputs, before the valid ones are copied */
    for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int64_t rows = M - m0 >= MT ? MT : M - m0;
        float *yo = valid == PANEL ? y + m0 * ldo + p * PANEL : tail;
        const int64_t ldy = valid == PANEL ? ldo : PANEL;
#define PANEL_CALL(R) panel_rows(x + m0 * K, xsum ? xsum + m0 * G : NULL, xq ? xq + m0 * K : NULL, xs ? xs + m0 * (K / XB) : NULL, K, &wp, G, g, yo, ldy, bits, R)
        DISPATCH_ROWS(rows, PANEL_CALL)
#undef PANEL_CALL
        if (valid < PANEL)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < valid; j++) y[(m0 + r) * ldo + p * PANEL + j] = tail[r * PANEL + j];
    }
}

/* One copy of the panel code per width. OpenMP outlines a parallel loop's body before inlining,
 * so a width passed into the loop would be a run-time value there (measured: the 1-2 row kernels
 * ran 1.7x slower); the loops below call these instead. */
typedef void (*panel_block_fn)(const float *, const float *, const int16_t *, const float *, int64_t, int64_t, const panel_w_t *,
                               int64_t, int64_t, float *, int64_t, int64_t);
#define PANEL_WIDTH(B)                                                                                                        \
    static void panel_block_##B(const float *x, const float *xsum, const int16_t *xq, const float *xs, int64_t M, int64_t K, \
                                const panel_w_t *w, int64_t N, int64_t g, float *y, int64_t ldo, int64_t p) {                \
        panel_block(x, xsum, xq, xs, M, K, w, N, g, y, ldo, p, B);                                                            \
    }
PANEL_WIDTH(2)
PANEL_WIDTH(3)
PANEL_WIDTH(4)
PANEL_WIDTH(5)
PANEL_WIDTH(6)
PANEL_WIDTH(8)
PANEL_WIDTH(NL4)
PANEL_WIDTH(L5)
PANEL_WIDTH(L6)

/* 3 or more rows of fp32 x on AVX2 go to the GEMM kernel: its 6 x 16 register tile broadcasts x
 * once per two FMAs, where the GEMVs' quarter-panel walk (since removed) broadcast once per FMA. The
 * GEMM ran 1.0-1.37x faster at 3-8 rows and 1.3-1.7x at 16 (Zen 1, SmolLM2's shapes, 30 cold copies
 * alternating, the same sums); decode steps 1.21x at batch 8 on a Q4_K_M file, 1.31x at 16. */
#if defined(__AVX512F__)
#define GEMM_FROM_ROWS INT64_MAX /* (AVX-512: the GEMVs, 32 registers of 16 lanes, as measured there) */
#else
#define GEMM_FROM_ROWS 3
#endif

/* Row x [K] -> xq: x rounded to int16 per block of XB columns, each block scaled by its largest |x|
 * (xs: the step, largest / 32767). The AVX2 GEMVs' input (panel_i16); AVX-512 keeps fp32 x. A block
 * under X_I16_TINY counts as zeros (its inverse would overflow); one holding a NaN gets a NaN step,
 * so the NaN reaches the outputs as with fp32 x. */
#define X_I16_TINY 1e-30f
static void x_to_i16(const float *x, int64_t K, int16_t *xq, float *xs) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t c = 0; c < K / XB; c++) {
        const float *xc = x + c * XB;
        __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int k = 0; k < XB; k += 8) {
            const __m256 v = _mm256_loadu_ps(xc + k);
            m = _mm256_max_ps(m, _mm256_and_ps(v, absmask));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        const float mx = hmax8(m);
        const int tiny = !(mx >= X_I16_TINY);
        const __m256 inv = _mm256_set1_ps(tiny ? 0.f : 32767.f / mx);
        for (int k = 0; k < XB; k += 8) {
            const __m256i i = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xc + k), inv));
            _mm_storeu_si128((__m128i *)(xq + c * XB + k), _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
        }
        xs[c] = _mm256_movemask_ps(nan) ? NAN : tiny ? 0.f : mx / 32767.f;
    }
}

/* One matrix of a (fused) projection: its panels, width and group, and where its outputs go. */
typedef struct {
    panel_w_t w;
    panel_block_fn block;
    int64_t N, g, offset, bits; /* outputs [offset, offset + N) of the projection's rows */
    float *xsum;          /* per-group sums of x: the mins' term with 1-2 rows (panel_parts_linear; NULL without mins) */
} panel_part_t;

static panel_part_t panel_part(panel_w_t w, int64_t N, int64_t g, int64_t bits, int64_t offset) {
    panel_part_t part = {w, bits == L5 ? panel_block_L5 : bits == L6 ? panel_block_L6 : bits == NL4 ? panel_block_NL4 : bits == 2 ? panel_block_2 : bits == 3 ? panel_block_3 : bits == 5 ? panel_block_5 : bits == 6 ? panel_block_6 : bits == 8 ? panel_block_8 : panel_block_4, N, g, offset, bits, NULL};
    return part;
}

/* Per-group sums of x rows [M, K] (of x as rounded to int16, given xq): the mins' term with 1-2 rows. */
static float *group_sums(const float *x, const int16_t *xq, const float *xs, int64_t M, int64_t K, int64_t g) {
    const int64_t G = K / g;
    float *sums = malloc(sizeof(float) * M * G);
    for (int64_t i = 0; i < M * G; i++) {
        const int64_t k0 = (i / G) * K + (i % G) * g;
        float t = 0.f;
        if (xq) /* a block's integers summed exactly, then scaled: no chain of float adds a column */
            for (int64_t b = k0; b < k0 + g; b += XB) {
                int32_t s = 0;
                for (int j = 0; j < XB; j++) s += xq[b + j];
                t += (float)s * xs[b / XB];
            }
        else
            for (int64_t j = k0; j < k0 + g; j++) t += x[j];
        sums[i] = t;
    }
    return sums;
}

#ifndef I16_MAX_ROWS /* (-D to tune, up to MT) */
/* The most rows the int16-x GEMVs take (AVX2): the GEMM dequantizes every weight to fp32 whatever
 * the rows, which at 3-4 rows costs more than its FMAs. Decode steps of a Q4_K_M file with the
 * GEMVs to 4 rows instead of 2 (Zen 3, benchmarks/ab_kernels.py): batch 3 1.45x, batch 4 1.34x;
 * to 8 rows, batch 8 ran 0.92x (the weights re-read for each 4 rows, tot spilled). */
#define I16_MAX_ROWS 4
#endif
/* Whether the GEMVs take x rounded to int16 (x_to_i16) for groups of g: up to I16_MAX_ROWS rows on AVX2, K and g whole blocks. */
static int gemv_x_int16(int64_t M, int64_t K, int64_t g) { return X_INT16 && M <= I16_MAX_ROWS && K % XB == 0 && g % XB == 0; }

/* The columns a block of x is rounded by in fl_panel_linear for M x K inputs and groups of g (0: x
 * stays fp32): what the tests' reference (kernels.gemv_x) rounds by. */
int64_t fl_gemv_x_block(int64_t M, int64_t K, int64_t g) { return gemv_x_int16(M, K, g) ? XB : 0; }

static void panel_parts_gemm(const float *x, int64_t M, int64_t K, const panel_part_t *parts, int nparts, float *y, int64_t ldo);

/* y [M, ldo] (columns of each part at its offset) = x [M, K] @ the parts' W^T, every part's panels
 * shared out among the threads in one parallel loop: a projection fused from matrices of different
 * widths (q/k in 5 bits, v in int8) costs one fork/join, as one matrix does. */
static void panel_parts_linear(const float *x, int64_t M, int64_t K, panel_part_t *parts, int nparts, float *y, int64_t ldo) {
    int64_t first[8], P = 0; /* the first global panel of each part (nparts <= 8) */
    int rounded = 1; /* x to int16 once for all the parts */
    for (int i = 0; i < nparts; i++) first[i] = P, P += (parts[i].N + PANEL - 1) / PANEL, rounded &= gemv_x_int16(M, K, parts[i].g);
    if (M >= GEMM_FROM_ROWS && !rounded) {
        panel_parts_gemm(x, M, K, parts, nparts, y, ldo);
        return;
    }
    int16_t *xq = NULL;
    float *xs = NULL;
    if (rounded) {
        xq = malloc(sizeof(int16_t) * M * K), xs = malloc(sizeof(float) * M * (K / XB));
        for (int64_t m = 0; m < M; m++) x_to_i16(x + m * K, K, xq + m * K, xs + m * (K / XB));
    }
    for (int i = 0; i < nparts; i++)
        if (parts[i].w.mins != NULL || parts[i].w.centre != 0.f) parts[i].xsum = group_sums(x, xq, xs, M, K, parts[i].g);
#pragma omp parallel for schedule(static)
    for (int64_t gp = 0; gp < P; gp++) {
        int i = 0;
        while (i + 1 < nparts && gp >= first[i + 1]) i++;
        const panel_part_t *pt = &parts[i];
        pt->block(x, pt->xsum, xq, xs, M, K, &pt->w, pt->N, pt->g, y + pt->offset, ldo, gp - first[i]);
    }
    for (int i = 0; i < nparts; i++) free(parts[i].xsum);
    free(xq);
    free(xs);
}

/* y [M, N] = x [M, K] @ W^T for W in panels (qp, sp, mp; mp NULL: mins implied by bits; sbytes:
 * 2 for fp16 scales and mins, 4 for fp32, 1 for factored ones). Meant for small M (decode); fl_panel_gemm for large M. */
void fl_panel_linear(const float *x, int64_t M, int64_t K, const uint8_t *qp, const void *sp, const void *mp, int64_t sbytes,
                     const void *sup_s, const void *sup_m, int64_t gps, int64_t N, int64_t g, int64_t bits, float *y) {
    panel_part_t part = panel_part(panel_w(qp, sp, mp, sbytes, (int)bits, sup_s, sup_m, gps), N, g, bits, 0);
    panel_parts_linear(x, M, K, &part, 1, y, N);
}

/* ---- many activation rows (prefill): y [M, N] = x [M, K] @ W^T straight from the panels ----------
 * No float copy of W in memory: a thread dequantizes GEMM_KC columns of one panel at a time into a
 * buffer that stays in L1/L2 (fma(q, s, m): the very floats gguf's dequantizers give), then runs a
 * register-tiled kernel over GEMM_MC activation rows: GEMM_R rows x (GEMM_V vectors) of
 * accumulators, each weight vector loaded once for GEMM_R rows and each x[r, k] broadcast into
 * GEMM_V FMAs. Partial sums over the column blocks build up in a [GEMM_MC, 32] tile per thread. */
#ifndef GEMM_KC /* (-D to tune) */
#define GEMM_KC 768 /* at most this many columns dequantized at a time, in blocks of equal size (whole groups), for
                       prompts: each register tile runs a longer loop between its prologue and epilogue (1.04x whole
                       prompts on Zen 3 against 256, though 96 KB of floats no longer fit L1: docs/cpu.md) */
#endif
#define GEMM_KC_FEW 256 /* the same for at most GEMM_FEW rows (batched decode), whose few tiles reread the block from L1 */
#define GEMM_FEW 16
#ifndef GEMM_MC
#define GEMM_MC 192 /* activation rows a pass over the panels: their x block stays in L2 */
#endif
#define GEMM_V 2    /* vectors of outputs a tile row: 32 (AVX-512) or 16 (AVX2) outputs */
#if defined(__AVX512F__)
#define GEMM_R 12 /* 24 accumulators + 2 weight vectors of the 32 registers */
#else
#define GEMM_R 6 /* 12 accumulators + 2 weight vectors + a broadcast of the 16 */
#endif
#define GEMM_LANES (int)(sizeof(vf) / sizeof(float))

/* wb [kc, 32] = a panel's weights (w: panel_at's view) of groups [grp0, grp1), column by column. */
static inline __attribute__((always_inline)) void gemm_dequant(const panel_w_t *w, int64_t g, int64_t grp0, int64_t grp1, float *wb,
                                                               const int bits) {
    for (int64_t grp = grp0; grp < grp1; grp++) {
        const uint8_t *qg = w->q + grp * g * COL_BYTES(bits);
        const int64_t si = grp * PANEL;
        float *o = wb + (grp - grp0) * g * PANEL;
#if defined(__AVX512F__)
        if (!LANES(bits)) { /* a column's 32 values in two vectors (the GEMVs' panel_column): half the ops of 8-wide */
            const __m512 d0 = load16s(w, w->scales, w->sup_s, si), d1 = load16s(w, w->scales, w->sup_s, si + 16);
            const __m512 m0 = panel_mins16(w, si, d0), m1 = panel_mins16(w, si + 16, d1);
            FOR_COLUMNS(kk, g, 1) {
                __m512 qa, qb;
                panel_column(qg, kk, bits, &qa, &qb);
                _mm512_store_ps(o + kk * PANEL, _mm512_fmadd_ps(qa, d0, m0));
                _mm512_store_ps(o + kk * PANEL + 16, _mm512_fmadd_ps(qb, d1, m1));
            }
            continue;
        }
#endif
        __m256 d[4], m[4];
        for (int i = 0; i < 4; i++) {
            d[i] = load8s(w, w->scales, w->sup_s, si + 8 * i);
            m[i] = w->mins ? load8s(w, w->mins, w->sup_m, si + 8 * i) : _mm256_mul_ps(d[i], _mm256_set1_ps(-w->centre));
        }
        if (LANES(bits)) { /* by vectors: a pair's even lanes are its first column, the odd ones its second */
            for (int64_t b = 0; b < g / 8; b++)
#pragma GCC unroll 16
                for (int v = 0; v < 16; v++) {
                    const __m256i vec = lane_vector(qg + b * LANE_BLOCK(bits), v, bits);
                    const int p = v / 4, h = v % 4;
                    const __m256 first = _mm256_cvtepi32_ps(_mm256_and_si256(vec, _mm256_set1_epi32(0xFFFF)));
                    const __m256 second = _mm256_cvtepi32_ps(_mm256_srli_epi32(vec, 16));
                    _mm256_store_ps(o + (b * 8 + 2 * p) * PANEL + 8 * h, _mm256_fmadd_ps(first, d[h], m[h]));
                    _mm256_store_ps(o + (b * 8 + 2 * p + 1) * PANEL + 8 * h, _mm256_fmadd_ps(second, d[h], m[h]));
                }
            continue;
        }
        FOR_COLUMNS(kk, g, 1)
            for (int h = 0; h < 2; h++) {
                __m256 q[2];
                panel_q16(qg, kk, 16 * h, bits, &q[0], &q[1]);
                for (int i = 0; i < 2; i++) _mm256_store_ps(o + kk * PANEL + 16 * h + 8 * i, _mm256_fmadd_ps(q[i], d[2 * h + i], m[2 * h + i]));
            }
    }
}

/* out [rows, 32] (row stride ldo) = t [rows, 32] (t NULL: zeros) + x [rows, kc] (row stride ldx) @ wb [kc, 32]^T,
 * outputs [v0, v0 + GEMM_V vectors). */
static inline __attribute__((always_inline)) void gemm_tile(const float *x, int64_t ldx, const float *wb, int64_t kc, const float *t,
                                                            float *out, int64_t ldo, int v0, const int rows) {
    vf acc[GEMM_R][GEMM_V];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < GEMM_V; v++) acc[r][v] = t ? VLOAD(t + r * PANEL + (v0 + v) * GEMM_LANES) : VZERO();
    for (int64_t k = 0; k < kc; k++) {
        vf wv[GEMM_V];
        for (int v = 0; v < GEMM_V; v++) wv[v] = VLOAD(wb + k * PANEL + (v0 + v) * GEMM_LANES);
        for (int r = 0; r < rows; r++) {
            const vf xb = VSET1(x[r * ldx + k]);
            for (int v = 0; v < GEMM_V; v++) acc[r][v] = VFMA(wv[v], xb, acc[r][v]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < GEMM_V; v++) VSTORE(out + r * ldo + (v0 + v) * GEMM_LANES, acc[r][v]);
}

static void gemm_tile_any(const float *x, int64_t ldx, const float *wb, int64_t kc, const float *t, float *out, int64_t ldo, int v0, int rows) {
#define TILE_CALL(R) gemm_tile(x, ldx, wb, kc, t, out, ldo, v0, R)
    switch (rows) {
#if GEMM_R > 6
        case 12: TILE_CALL(12); break;
        case 11: TILE_CALL(11); break;
        case 10: TILE_CALL(10); break;
        case 9: TILE_CALL(9); break;
        case 8: TILE_CALL(8); break;
        case 7: TILE_CALL(7); break;
#endif
        case 6: TILE_CALL(6); break;
        case 5: TILE_CALL(5); break;
        case 4: TILE_CALL(4); break;
        case 3: TILE_CALL(3); break;
        case 2: TILE_CALL(2); break;
        default: TILE_CALL(1); break;
    }
#undef TILE_CALL
}

/* Groups of g columns in each of a K = G g wide GEMM's column blocks over mc rows: as few blocks as
 * GEMM_KC (GEMM_KC_FEW) allows, of equal size. */
static int64_t gemm_groups_a_block(int64_t G, int64_t g, int64_t mc) {
    const int64_t kc = mc > GEMM_FEW ? GEMM_KC : GEMM_KC_FEW, most = g >= kc ? 1 : kc / g, blocks = (G + most - 1) / most;
    return (G + blocks - 1) / blocks;
}

/* Panel p's outputs of y for mc <= GEMM_MC rows. wb: gemm_groups_a_block(K / g, g, mc) g x 32 floats;
 * t: GEMM_MC x 32 floats. */
static inline __attribute__((always_inline)) void gemm_panel(const float *x, int64_t mc, int64_t K, const panel_w_t *w, int64_t N,
                                                             int64_t g, float *y, int64_t ldy, int64_t p, float *wb, float *t, const int bits) {
    const int64_t G = K / g, gpb = gemm_groups_a_block(G, g, mc);
    const int64_t valid = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
    const panel_w_t wp = panel_at(w, p, G, g, bits);
    for (int64_t grp0 = 0; grp0 < G; grp0 += gpb) {
        const int64_t grp1 = grp0 + gpb < G ? grp0 + gpb : G, kc = (grp1 - grp0) * g;
        gemm_dequant(&wp, g, grp0, grp1, wb, bits);
        /* the last columns' sums go straight to y (a whole panel), the others to the tile t */
        const int to_y = grp1 == G && valid == PANEL;
        /* the next column block's bytes (the next panel's first: panels are contiguous), fetched while the tiles run */
        const char *pf = (const char *)(wp.q + grp1 * g * COL_BYTES(bits));
        const int64_t pf_lines = (gpb * g * COL_BYTES(bits) + 63) / 64, ntiles = (mc + GEMM_R - 1) / GEMM_R, per = (pf_lines + ntiles - 1) / ntiles;
        for (int64_t r0 = 0; r0 < mc; r0 += GEMM_R) {
            for (int64_t l = r0 / GEMM_R * per, e = l + per < pf_lines ? l + per : pf_lines; l < e; l++) _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
            /* and the next tile's lines of y, for writing: its stores otherwise miss (y is beyond L2), fill the store
               queue and stall the tile after them (1.05-1.08x gate_up on Zen 3) */
            if (to_y)
                for (int64_t r = r0 + GEMM_R; r < r0 + 2 * GEMM_R && r < mc; r++)
                    for (int l = 0; l < PANEL; l += 64 / (int)sizeof(float)) __builtin_prefetch(y + r * ldy + p * PANEL + l, 1, 3);
            for (int v0 = 0; v0 < PANEL / GEMM_LANES; v0 += GEMM_V)
                gemm_tile_any(x + r0 * K + grp0 * g, K, wb, kc, grp0 == 0 ? NULL : t + r0 * PANEL, to_y ? y + r0 * ldy + p * PANEL : t + r0 * PANEL,
                              to_y ? ldy : PANEL, v0, (int)(mc - r0 < GEMM_R ? mc - r0 : GEMM_R));
        }
    }
    if (valid < PANEL)
        for (int64_t r = 0; r < mc; r++) memcpy(y + r * ldy + p * PANEL, t + r * PANEL, sizeof(float) * valid);
}

typedef void (*gemm_panel_fn)(const float *, int64_t, int64_t, const panel_w_t *, int64_t, int64_t, float *, int64_t, int64_t, float *,
                              float *);
#define GEMM_WIDTH(B)                                                                                                           \
    static void gemm_panel_##B(const float *x, int64_t M, int64_t K, const panel_w_t *w, int64_t N, int64_t g, float *y,       \
                               int64_t ldy, int64_t p, float *wb, float *t) {                                                 \
        gemm_panel(x, M, K, w, N, g, y, ldy, p, wb, t, B);                                                                      \
    }
GEMM_WIDTH(2)
GEMM_WIDTH(3)
GEMM_WIDTH(4)
GEMM_WIDTH(5)
GEMM_WIDTH(6)
GEMM_WIDTH(8)
GEMM_WIDTH(NL4)
GEMM_WIDTH(L5)
GEMM_WIDTH(L6)

static gemm_panel_fn gemm_panel_for(int64_t bits) {
    return bits == L5 ? gemm_panel_L5 : bits == L6 ? gemm_panel_L6 : bits == NL4 ? gemm_panel_NL4 : bits == 2 ? gemm_panel_2 : bits == 3 ? gemm_panel_3 : bits == 5 ? gemm_panel_5 : bits == 6 ? gemm_panel_6 : bits == 8 ? gemm_panel_8 : gemm_panel_4;
}

/* Items [0, n) of a parallel loop shared out as omp's static schedule does (a contiguous share a
 * thread, so its panels stream in order and its prefetches of the next one hit), except that a
 * thread done with its share takes items from the back of the others': on a shared host one vCPU
 * is often slowed for milliseconds, and a static loop then held the other at the barrier (a
 * 128-token prompt's GEMMs: one thread idle for 4-21% of them, measured per thread). */
typedef struct {
    _Alignas(64) _Atomic uint64_t front_back; /* the share's next item (low 32 bits) and its end (high) */
} share_t;

/* Shares of [0, n) for the *nt threads a parallel region will have at most (free() them after). */
static share_t *shares_new(int64_t n, int *nt) {
    *nt = omp_get_max_threads();
    share_t *sh = aligned_alloc(64, sizeof(share_t) * *nt);
    for (int t = 0; t < *nt; t++) atomic_store(&sh[t].front_back, ((uint64_t)(n * (t + 1) / *nt) << 32) | (uint64_t)(n * t / *nt));
    return sh;
}

/* The next item for thread me, or -1 when all are taken (also those of threads the region did not get). */
static int64_t shares_next(share_t *sh, int nt, int me) {
    for (int d = 0; d < nt; d++) {
        share_t *s = &sh[(me + d) % nt];
        uint64_t v = atomic_load(&s->front_back);
        for (;;) {
            const uint64_t f = v & 0xFFFFFFFFu, b = v >> 32;
            if (f >= b) break;
            const uint64_t w = d == 0 ? v + 1 : ((b - 1) << 32) | f; /* the owner from the front, others from the back */
            if (atomic_compare_exchange_weak(&s->front_back, &v, w)) return (int64_t)(d == 0 ? f : b - 1);
        }
    }
    return -1;
}

/* The parts of a (fused) projection through the GEMM kernel, every part's panels shared out among
 * the threads in one parallel loop (as panel_parts_linear does for the GEMVs). */
static void panel_parts_gemm(const float *x, int64_t M, int64_t K, const panel_part_t *parts, int nparts, float *y, int64_t ldo) {
    int64_t first[8], P = 0, kc = 0;
    for (int i = 0; i < nparts; i++) {
        first[i] = P, P += (parts[i].N + PANEL - 1) / PANEL;
        const int64_t kci = gemm_groups_a_block(K / parts[i].g, parts[i].g, M < GEMM_MC ? M : GEMM_MC) * parts[i].g;
        kc = kci > kc ? kci : kc;
    }
    int nt;
    share_t *sh = shares_new((M + GEMM_MC - 1) / GEMM_MC * P, &nt); /* items: (block of rows, panel), rows outer */
#pragma omp parallel num_threads(nt)
    {
        float *wb = aligned_alloc(64, sizeof(float) * kc * PANEL), *t = aligned_alloc(64, sizeof(float) * GEMM_MC * PANEL);
        for (int64_t item; (item = shares_next(sh, nt, omp_get_thread_num())) >= 0;) {
            const int64_t m0 = item / P * GEMM_MC, mc = M - m0 < GEMM_MC ? M - m0 : GEMM_MC, gp = item % P;
            int i = 0;
            while (i + 1 < nparts && gp >= first[i + 1]) i++;
            const panel_part_t *pt = &parts[i];
            gemm_panel_for(pt->bits)(x + m0 * K, mc, K, &pt->w, pt->N, pt->g, y + m0 * ldo + pt->offset, ldo, gp - first[i], wb, t);
        }
        free(wb);
        free(t);
    }
    free(sh);
}

/* y [M, N] = x [M, K] @ W^T for W in panels (as fl_panel_linear), for many rows (prefill). */
void fl_panel_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qp, const void *sp, const void *mp, int64_t sbytes,
                   const void *sup_s, const void *sup_m, int64_t gps, int64_t N, int64_t g, int64_t bits, float *y) {
    const panel_part_t part = {panel_w(qp, sp, mp, sbytes, (int)bits, sup_s, sup_m, gps), NULL, N, g, 0, bits, NULL};
    panel_parts_gemm(x, M, K, &part, 1, y, N);
}

/* ---- float weights: y [M, N] = x [M, K] @ W^T for small M, K a multiple of 32 ------------------
 * MKL runs this shape (GEMV) on one core; here both cores stream the weight rows. The weights are
 * fp32, or fp16 / bf16 as a checkpoint stores them (wt): widened to fp32 in registers, exactly, so
 * a 16-bit matrix gives the very sums its fp32 copy would while streaming half the bytes. */
#define W_F32 0
#define W_F16 1
#define W_BF16 2

/* 16 weights from element i of a row of type wt, as fp32 (vf halves, as F32X16) */
static inline __attribute__((always_inline)) void w16_at(const void *w, int64_t i, vf *o, const int wt) {
    if (wt == W_F32) {
        F32X16((const float *)w + i, o);
        return;
    }
    const uint16_t *h = (const uint16_t *)w + i;
#if defined(__AVX512F__)
    const __m256i v = _mm256_loadu_si256((const __m256i *)h);
    o[0] = wt == W_F16 ? _mm512_cvtph_ps(v) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
#else
    const __m128i a = _mm_loadu_si128((const __m128i *)h), b = _mm_loadu_si128((const __m128i *)(h + 8));
    if (wt == W_F16) {
        o[0] = _mm256_cvtph_ps(a), o[1] = _mm256_cvtph_ps(b);
    } else {
        o[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
        o[1] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
    }
#endif
}

static inline int64_t w_bytes(int wt) { return wt == W_F32 ? 4 : 2; }

static inline float half_to_float(uint16_t h, int wt) {
    if (wt == W_F16) return _cvtsh_ss(h);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

static inline __attribute__((always_inline)) void float_row(const float *x, int64_t K, const void *w, int64_t len, int64_t pf,
                                                           float *y, int64_t N, const int rows, int accumulate, const int wt) {
    vf acc[MT], wa[2], wb[2];
    const vf one = VSET1(1.f);
    const char *wc = (const char *)w;
    const int64_t es = w_bytes(wt);
    for (int r = 0; r < rows; r++) acc[r] = VZERO();
    for (int64_t k = 0; k < len; k += 32) {
        _mm_prefetch(wc + (k + pf) * es, WEIGHT_HINT);
        if (es == 4) _mm_prefetch(wc + (k + pf + 16) * es, WEIGHT_HINT);
        w16_at(w, k, wa, wt);
        w16_at(w, k + 16, wb, wt);
        DOT32(rows, x, K, k, k + 16, wa, wb, one, acc, 0)
    }
    for (int r = 0; r < rows; r++) y[r * N] = (accumulate ? y[r * N] : 0.f) + VHSUM(acc[r]);
}

#if defined(__AVX512F__)
/* Two weight rows at once for 4+ activation rows: each x load feeds two FMAs (32 zmm registers
 * hold the 2 x 8 accumulators). */
static inline __attribute__((always_inline)) void float_row2(const float *x, int64_t K, const void *w, int64_t len, int64_t pf,
                                                            float *y, int64_t N, const int rows, int accumulate, const int wt) {
    __m512 a0[MT], a1[MT];
    for (int r = 0; r < rows; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    const int64_t es = w_bytes(wt);
    const char *wc = (const char *)w, *w1c = wc + K * es;
    for (int64_t k = 0; k < len; k += 32) {
        _mm_prefetch(wc + (k + pf) * es, WEIGHT_HINT);
        _mm_prefetch(w1c + (k + pf) * es, WEIGHT_HINT);
        if (es == 4) {
            _mm_prefetch(wc + (k + pf + 16) * es, WEIGHT_HINT);
            _mm_prefetch(w1c + (k + pf + 16) * es, WEIGHT_HINT);
        }
        __m512 w0a, w0b, w1a, w1b;
        w16_at(wc, k, &w0a, wt), w16_at(wc, k + 16, &w0b, wt);
        w16_at(w1c, k, &w1a, wt), w16_at(w1c, k + 16, &w1b, wt);
        for (int r = 0; r < rows; r++) {
            const __m512 xa = _mm512_loadu_ps(x + r * K + k), xb = _mm512_loadu_ps(x + r * K + k + 16);
            a0[r] = _mm512_fmadd_ps(w0b, xb, _mm512_fmadd_ps(w0a, xa, a0[r]));
            a1[r] = _mm512_fmadd_ps(w1b, xb, _mm512_fmadd_ps(w1a, xa, a1[r]));
        }
    }
    for (int r = 0; r < rows; r++) {
        y[r * N] = (accumulate ? y[r * N] : 0.f) + _mm512_reduce_add_ps(a0[r]);
        y[r * N + 1] = (accumulate ? y[r * N + 1] : 0.f) + _mm512_reduce_add_ps(a1[r]);
    }
}

static void float_rows2(const float *x, int64_t K, const void *w, int64_t len, int64_t pf, float *y, int64_t N, int rows, int acc, int wt) {
#define ROW2_F32(R) float_row2(x, K, w, len, pf, y, N, (R) < 4 ? 4 : (R), acc, W_F32) /* callers pass 4-8 rows */
#define ROW2_F16(R) float_row2(x, K, w, len, pf, y, N, (R) < 4 ? 4 : (R), acc, W_F16)
#define ROW2_BF16(R) float_row2(x, K, w, len, pf, y, N, (R) < 4 ? 4 : (R), acc, W_BF16)
    switch (wt) {
        case W_F16: DISPATCH_ROWS(rows, ROW2_F16); break;
        case W_BF16: DISPATCH_ROWS(rows, ROW2_BF16); break;
        default: DISPATCH_ROWS(rows, ROW2_F32); break;
    }
#undef ROW2_F32
#undef ROW2_F16
#undef ROW2_BF16
}
#define HAVE_ROW2 1
#else
#define HAVE_ROW2 0
static void float_rows2(const float *x, int64_t K, const void *w, int64_t len, int64_t pf, float *y, int64_t N, int rows, int acc, int wt) {
    (void)x, (void)K, (void)w, (void)len, (void)pf, (void)y, (void)N, (void)rows, (void)acc, (void)wt; /* never called */
}
#endif

static void float_rows(const float *x, int64_t K, const void *w, int64_t len, int64_t pf, float *y, int64_t N, int rows, int acc, int wt) {
#define ROW_F32(R) float_row(x, K, w, len, pf, y, N, R, acc, W_F32)
#define ROW_F16(R) float_row(x, K, w, len, pf, y, N, R, acc, W_F16)
#define ROW_BF16(R) float_row(x, K, w, len, pf, y, N, R, acc, W_BF16)
    switch (wt) {
        case W_F16: DISPATCH_ROWS(rows, ROW_F16); break;
        case W_BF16: DISPATCH_ROWS(rows, ROW_BF16); break;
        default: DISPATCH_ROWS(rows, ROW_F32); break;
    }
#undef ROW_F32
#undef ROW_F16
#undef ROW_BF16
}

/* With many activation rows and long ones, the rows' x no longer fit in L1 beside the weight
 * stream: then each thread walks its weight rows once per K block of KB columns. */
#define KB 512

/* weight [N, K] of float type wt (W_F32, W_F16, W_BF16) */
void fl_float_linear(const float *x, int64_t M, int64_t K, const void *weight, int64_t wt, int64_t N, float *y) {
    const int64_t kb = (M > 4 && K > 2 * KB) ? KB : K;
    const int64_t es = w_bytes((int)wt);
    const int64_t pf = kb == K ? PF_BYTES / es : 2 * K; /* next in the stream: 8 KB on, or 2 rows down */
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t n0 = N * t / nt, n1 = N * (t + 1) / nt;
        for (int64_t k0 = 0; k0 < K; k0 += kb) {
            const int64_t len = K - k0 < kb ? K - k0 : kb;
            const int acc = k0 > 0;
            for (int64_t n = n0; n < n1; n++) {
                const void *w = (const char *)weight + (n * K + k0) * es;
                /* 4-8 rows on column blocks: weight rows n and n + 1 at once (measured: a gain there only) */
                if (HAVE_ROW2 && kb < K && M >= 4 && M <= MT && n + 1 < n1) {
                    float_rows2(x + k0, K, w, len, pf, y + n, N, (int)M, acc, (int)wt);
                    n++;
                    continue;
                }
                for (int64_t m0 = 0; m0 < M; m0 += MT)
                    float_rows(x + m0 * K + k0, K, w, len, pf, y + m0 * N + n, N, (int)(M - m0 >= MT ? MT : M - m0), acc, (int)wt);
            }
        }
    }
}

/* ---- the small ops of a decode step: one call each instead of a handful of torch ops ---------- */

/* exp(x) for a vector of W bits (Cephes' polynomial; within 2 ulp of expf over the float range):
 * exp8 (256) and, on AVX-512, exp16 (512), the same float operations in every lane. n = round(x
 * log2(e)) to nearest even (cvtps_epi32 under the default rounding mode). */
#define DEFINE_EXP(NAME, W)                                                                                        \
    static inline __m##W NAME(__m##W x) {                                                                         \
        x = _mm##W##_min_ps(_mm##W##_max_ps(x, _mm##W##_set1_ps(-87.3365f)), _mm##W##_set1_ps(88.3762f));          \
        const __m##W##i n = _mm##W##_cvtps_epi32(_mm##W##_mul_ps(x, _mm##W##_set1_ps(1.44269504088896341f)));      \
        const __m##W fx = _mm##W##_cvtepi32_ps(n);                                                                 \
        x = _mm##W##_fnmadd_ps(fx, _mm##W##_set1_ps(0.693359375f), x);                                            \
        x = _mm##W##_fnmadd_ps(fx, _mm##W##_set1_ps(-2.12194440e-4f), x);                                         \
        __m##W y = _mm##W##_set1_ps(1.9875691500e-4f);                                                            \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(1.3981999507e-3f));                                          \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(8.3334519073e-3f));                                          \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(4.1665795894e-2f));                                          \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(1.6666665459e-1f));                                          \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(5.0000001201e-1f));                                          \
        y = _mm##W##_fmadd_ps(y, _mm##W##_mul_ps(x, x), _mm##W##_add_ps(x, _mm##W##_set1_ps(1.f)));               \
        const __m##W##i e = _mm##W##_slli_epi32(_mm##W##_add_epi32(n, _mm##W##_set1_epi32(127)), 23);             \
        return _mm##W##_mul_ps(y, _mm##W##_castsi##W##_ps(e));                                                     \
    }
DEFINE_EXP(exp8, 256)
#if defined(__AVX512F__)
DEFINE_EXP(exp16, 512)
#endif

/* out [M, K] = x * rsqrt(mean(x^2) + eps) * weight, in fp32 (K a multiple of 8). */
/* Row-wise ops go parallel from this many rows (below it a fork/join costs more than the work). */
#define PAR_ROWS 4

/* for (i = 0; i < n; i++) body, on both threads from PAR_ROWS rows (an if() clause alone would
 * still enter the OpenMP runtime for a single row). */
#define FOR_ROWS(i, n, body)                                            \
    if ((n) >= PAR_ROWS) {                                              \
        _Pragma("omp parallel for schedule(static)")                    \
        for (int64_t i = 0; i < (n); i++) body                          \
    } else {                                                            \
        for (int64_t i = 0; i < (n); i++) body                          \
    }

static inline void rms_norm_row(const float *xr, const float *weight, float eps, int64_t K, float *o) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 v = _mm256_loadu_ps(xr + k);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    const __m256 r = _mm256_set1_ps(1.f / sqrtf(hsum8(ss) / (float)K + eps));
    for (int64_t k = 0; k < K; k += 8)
        _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_loadu_ps(weight + k), _mm256_mul_ps(_mm256_loadu_ps(xr + k), r)));
}

void fl_rms_norm(const float *x, const float *weight, float eps, int64_t M, int64_t K, float *out) {
    FOR_ROWS(m, M, { rms_norm_row(x + m * K, weight, eps, K, out + m * K); })
}

static inline void add_rms_norm_row(const float *x, const float *r, const float *weight, float eps, int64_t K, float *h, float *o) {
    for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(h + k, _mm256_add_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(r + k)));
    rms_norm_row(h, weight, eps, K, o);
}

/* h [M, K] = x + residual, out = rms_norm(h) * weight: the residual add and the next norm in one
 * pass over the hidden states (a torch add beside fl_rms_norm wrote and reread h). */
void fl_add_rms_norm(const float *x, const float *residual, const float *weight, float eps, int64_t M, int64_t K, float *h, float *out) {
    FOR_ROWS(m, M, { add_rms_norm_row(x + m * K, residual + m * K, weight, eps, K, h + m * K, out + m * K); })
}

static inline void silu_and_mul_row(const float *g, const float *u, int64_t I, float *o) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= I; i += 16) { /* the same arithmetic, 16 lanes */
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < I; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
}

/* out [M, I] = silu(gate_up[:, :I]) * gate_up[:, I:] (I a multiple of 8). */
void fl_silu_and_mul(const float *gate_up, int64_t M, int64_t I, float *out) {
    FOR_ROWS(m, M, { silu_and_mul_row(gate_up + m * 2 * I, gate_up + m * 2 * I + I, I, out + m * I); })
}

/* out[m] = the index of the first largest value in row m of x [M, N], or of its first NaN if it
 * has one: what torch.argmax answers, at memory speed (torch's takes ~27 us for one 49152-wide
 * row of logits here, ~1% of a 4-bit decode step). */
static int64_t argmax_row(const float *x, int64_t N) {
    __m256 vmax[4], nan = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) vmax[j] = _mm256_set1_ps(-INFINITY);
    int64_t n = 0;
    for (; n + 32 <= N; n += 32)
        for (int j = 0; j < 4; j++) {
            const __m256 v = _mm256_loadu_ps(x + n + 8 * j);
            vmax[j] = _mm256_max_ps(vmax[j], v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
    float best = hmax8(_mm256_max_ps(_mm256_max_ps(vmax[0], vmax[1]), _mm256_max_ps(vmax[2], vmax[3])));
    int has_nan = _mm256_movemask_ps(nan) != 0;
    for (; n < N; n++) {
        has_nan |= x[n] != x[n];
        best = x[n] > best ? x[n] : best;
    }
    /* the first lane equal to best (unordered-with-itself for NaN), 8 at a time */
    const __m256 vb = _mm256_set1_ps(best);
    for (n = 0; n + 8 <= N; n += 8) {
        const __m256 v = _mm256_loadu_ps(x + n);
        const int hit = _mm256_movemask_ps(has_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, vb, _CMP_EQ_OQ));
        if (hit) return n + __builtin_ctz(hit);
    }
    for (; n < N; n++)
        if (has_nan ? x[n] != x[n] : x[n] == best) return n;
    return 0; /* not reached */
}

void fl_argmax_rows(const float *x, int64_t M, int64_t N, int64_t *out) {
    for (int64_t m = 0; m < M; m++) out[m] = argmax_row(x + m * N, N);
}

/* ---- sampling: one pass per row where the reference sampler (engine/sampler.py) makes ~20 ----
 * The same draw as sampler.apply_temperature_and_filters + draw: logits / temperature, top-k
 * (keep >= the k-th largest), top-p (keep a token while the mass of the tokens above it is <
 * top_p; among the top 256 candidates, else over a full ascending sort: remove while the mass up
 * to it is <= 1 - top_p), min-p (drop p < min_p * p(max)), then argmax of p / -log(u) with u the
 * counter-based hash of (seed, step, token). Softmax terms e = exp(l - max) are computed once: the
 * max token always survives, so every stage's softmax is e / (its sum over the kept tokens).
 * Temperature 0: argmax of the logits. Agrees with the reference to rounding (sums in another
 * order): a different token only where two candidates' scores tie to ~1e-7. */
static inline uint64_t sample_hash(uint64_t seed, uint64_t step, uint64_t idx) {
    const uint64_t m1 = 0x9E3779B97F4A7C15ULL, m2 = 0xBF58476D1CE4E5B9ULL, m3 = 0x94D049BB133111EBULL;
    uint64_t x = (seed * m1) ^ (step * m2 + idx);
    x *= m1;
    x = (x ^ (x >> 30)) * m2;
    x = (x ^ (x >> 27)) * m3;
    return x ^ (x >> 31);
}

typedef struct { float p; int32_t i; } prob_idx_t;

static int by_prob_desc(const void *a, const void *b) {
    const prob_idx_t *x = a, *y = b;
    return x->p != y->p ? (x->p < y->p ? 1 : -1) : (x->i > y->i) - (x->i < y->i);
}

/* sum of e[0..n) (8 lanes, then the tail) */
static float sum_floats(const float *e, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(e + i));
    float s = hsum8(acc);
    for (; i < n; i++) s += e[i];
    return s;
}

/* min-heap of (p, i) by p: restore the heap property below slot at */
static void heap_down(prob_idx_t *h, int64_t size, int64_t at) {
    for (;;) {
        int64_t least = at, l = 2 * at + 1, r = l + 1;
        if (l < size && h[l].p < h[least].p) least = l;
        if (r < size && h[r].p < h[least].p) least = r;
        if (least == at) return;
        const prob_idx_t t = h[at]; h[at] = h[least]; h[least] = t;
        at = least;
    }
}

/* the m largest values of x[0..n) above `above` as (value, index) pairs in h, a min-heap (h[0]: the
 * m-th largest); returns how many (fewer than m when fewer pass). One pass: values are compared
 * with the heap's min 8 at a time, and only the few above it (~m log(n / m) of them) enter. A
 * quickselect took 0.4 ms on a real row of logits (its pivots fall badly on their order). */
static int64_t top_m(const float *x, int64_t n, int64_t m, float above, prob_idx_t *h) {
    int64_t size = 0, i = 0;
    for (; i < n && size < m; i++)
        if (x[i] > above) h[size++] = (prob_idx_t){x[i], (int32_t)i};
    if (size < m) return size;
    for (int64_t j = size / 2 - 1; j >= 0; j--) heap_down(h, size, j);
    for (; i < n && i % 8; i++)
        if (x[i] > h[0].p) { h[0] = (prob_idx_t){x[i], (int32_t)i}; heap_down(h, size, 0); }
    for (; i + 8 <= n; i += 8) {
        int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(h[0].p), _CMP_GT_OQ));
        while (hits) {
            const int64_t j = i + __builtin_ctz(hits);
            hits &= hits - 1;
            if (x[j] > h[0].p) { h[0] = (prob_idx_t){x[j], (int32_t)j}; heap_down(h, size, 0); }
        }
    }
    for (; i < n; i++)
        if (x[i] > h[0].p) { h[0] = (prob_idx_t){x[i], (int32_t)i}; heap_down(h, size, 0); }
    return size;
}

/* top-p over the kept tokens (e > 0 marks them), e updated in place (0: removed): the most likely
 * 256 tokens sorted (then 4,096, then all, where those hold less than top_p of the mass), a token
 * kept while the mass above it is < top_p */
static void top_p_mask(float *e, prob_idx_t *cand, float *mark, int64_t V, float top_p) {
    const float sum = sum_floats(e, V), inv = 1.0f / sum;
    for (int64_t want = 256;; want *= 16) {
        const int64_t c = top_m(e, V, want < V ? want : V, 0.0f, cand);
        for (int64_t j = 0; j < c; j++) cand[j].p *= inv; /* e -> p */
        qsort(cand, (size_t)c, sizeof(prob_idx_t), by_prob_desc);
        float mass = 0.0f;
        for (int64_t j = 0; j < c; j++) mass += cand[j].p;
        if (c == want && want < V && mass < top_p) continue; /* the nucleus reaches past these candidates */
        double cs = 0.0;
        int64_t kept = 0;
        for (; kept < c; kept++) {
            cs += cand[kept].p;
            if (!((float)cs - cand[kept].p < top_p)) break;
        }
        if (c == 0) return; /* every token banned (e all 0): nothing to keep; the caller draws no real token */
        kept = kept > 0 ? kept : 1; /* the top token always stays */
        memset(mark, 0, (size_t)V * sizeof(float));
        for (int64_t j = 0; j < kept; j++) mark[cand[j].i] = 1.0f;
        for (int64_t i = 0; i < V; i++)
            if (mark[i] == 0.0f) e[i] = 0.0f;
        return;
    }
}


/* one row's token; scratch for V floats (l, tmp) and V candidates */
static int64_t sample_row(const float *x, int64_t V, float temperature, int64_t k, float top_p, float min_p, uint64_t seed, uint64_t step,
                          float *l, float *tmp, prob_idx_t *cand) {
    if (temperature == 0.0f) return argmax_row(x, V);
    const __m256 vt = _mm256_set1_ps(temperature);
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), vt);
        _mm256_storeu_ps(l + i, v);
        vmx = _mm256_max_ps(vmx, v);
    }
    float mx = hmax8(vmx);
    for (; i < V; i++) { l[i] = x[i] / temperature; mx = l[i] > mx ? l[i] : mx; }
    float floor_l = -INFINITY; /* top-k: keep l >= the k-th largest */
    if (k > 0 && k < V && top_m(l, V, k, -INFINITY, cand) == k) floor_l = cand[0].p; /* the k-th largest (fewer finite: all stay) */
    /* e = exp(l - max) where kept, else 0 (in place of l; -inf logits are never kept) */
    float *e = l;
    const __m256 vmax = _mm256_set1_ps(mx), vfloor = _mm256_set1_ps(floor_l), vninf = _mm256_set1_ps(-INFINITY);
    for (i = 0; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(l + i);
        const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(v, vfloor, _CMP_GE_OQ), _mm256_cmp_ps(v, vninf, _CMP_NEQ_OQ));
        _mm256_storeu_ps(e + i, _mm256_and_ps(exp8(_mm256_sub_ps(v, vmax)), keep));
    }
    for (; i < V; i++) e[i] = l[i] >= floor_l && l[i] != -INFINITY ? expf(l[i] - mx) : 0.0f;
    if (top_p < 1.0f) top_p_mask(e, cand, tmp, V, top_p);
    float sum = sum_floats(e, V);
    if (min_p > 0.0f) { /* drop p < min_p * p(max) (the max token's e is 1) */
        const float thr = min_p * (1.0f / sum);
        for (i = 0; i < V; i++)
            if (e[i] > 0.0f && e[i] / sum < thr) e[i] = 0.0f;
        sum = sum_floats(e, V);
    }
    /* argmax of p / n, n = -log(u) >= 1 - u: a token whose p / (1 - u) cannot pass the best
     * so far skips the log */
    const float inv = 1.0f / sum;
    float best = -1.0f;
    int64_t arg = 0;
    for (i = 0; i < V; i++) {
        if (e[i] == 0.0f) continue;
        const double u = ((double)(sample_hash(seed, step, (uint64_t)i) >> 40) + 0.5) / 16777216.0;
        if ((double)(e[i] * inv) * (1.0 + 1e-6) < (double)best * (1.0 - u)) continue;
        const float s = e[i] / sum / (float)(-log(u));
        if (s > best) { best = s; arg = i; }
    }
    return arg;
}

/* row b of fl_sample_rows, with its own scratch (rows run on both threads) */
static int64_t sample_row_b(const float *logits, int64_t b, int64_t V, const float *temperature, const int64_t *top_k, const float *top_p,
                            const float *min_p, const int64_t *seeds, const int64_t *steps) {
    float *l = malloc((size_t)V * sizeof(float));
    float *tmp = malloc((size_t)V * sizeof(float));
    prob_idx_t *cand = malloc((size_t)V * sizeof(prob_idx_t));
    const int64_t token = sample_row(logits + b * V, V, temperature[b], top_k[b], top_p[b], min_p[b], (uint64_t)seeds[b], (uint64_t)steps[b],
                                     l, tmp, cand);
    free(l);
    free(tmp);
    free(cand);
    return token;
}

void fl_sample_rows(const float *logits, int64_t B, int64_t V, const float *temperature, const int64_t *top_k, const float *top_p,
                    const float *min_p, const int64_t *seeds, const int64_t *steps, int64_t *out) {
    FOR_ROWS(b, B, { out[b] = sample_row_b(logits, b, V, temperature, top_k, top_p, min_p, seeds, steps); })
}

/* The KV cache is paged: per layer K and V hold blocks of bs rows (bs = 1 << shift, a power of
 * two >= 8) for each KV head, row r of head h of block b at b * sb + h * sh + r * D floats; key
 * position p of a sequence sits in block table[p >> shift], row p & (bs - 1). The engine lays a
 * head's blocks out one after another (sb = bs * D, sh = blocks * bs * D): a sequence's blocks,
 * mostly consecutive, then read as one stream per head, as a cache slot did (with each block's
 * heads side by side, decode attention ran 1.5x slower at 16-token blocks). */
typedef struct {
    const float *k, *v;   /* the layer's caches, advanced to one KV head (head * sh) */
    const int32_t *table; /* the sequence's block table */
    int64_t shift, stride, D; /* stride: sb, floats from one block to the next */
} kv_pages_t;

static inline int64_t page_row(const kv_pages_t *pg, int64_t p) {
    return (int64_t)pg->table[p >> pg->shift] * pg->stride + (p & ((1 << pg->shift) - 1)) * pg->D;
}

static inline int64_t log2_exact(int64_t x) {
    int64_t s = 0;
    while ((1LL << s) < x) s++;
    return s;
}

static inline void rope_store_token(const float *src, const float *c, const float *s, int64_t base, int64_t H, int64_t KVH,
                                    int64_t D, float *k_cache, float *v_cache, int64_t sh, float *q_out) {
    const int64_t half = D / 2, heads = base >= 0 ? H + KVH : H; /* base: the row's offset for head 0; -1: a padding row, q only */
    /* The cache rows written here are cold: ask for all their lines at once (with intent to
     * write) instead of missing on them one store at a time. */
    for (int64_t h = 0; h < KVH && base >= 0; h++)
        for (int64_t i = 0; i < D; i += 16) {
            _mm_prefetch((const char *)(k_cache + base + h * sh + i), _MM_HINT_ET0);
            _mm_prefetch((const char *)(v_cache + base + h * sh + i), _MM_HINT_ET0);
        }
    for (int64_t h = 0; h < heads; h++) {
        const float *x = src + h * D;
        float *o = h < H ? q_out + h * D : k_cache + base + (h - H) * sh;
        for (int64_t i = 0; i < half; i++) {
            o[i] = x[i] * c[i] - x[i + half] * s[i];
            o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
    }
    for (int64_t h = 0; h < KVH && base >= 0; h++) {
        const float *x = src + (H + KVH + h) * D;
        float *o = v_cache + base + h * sh;
        for (int64_t i = 0; i < D; i++) o[i] = x[i];
    }
}

/* Rotate-half RoPE on the q and k parts of a fused qkv row, k and v stored into the cache.
 * qkv [T, (H + 2 KVH) * D]; cos, sin [T, D]; paged caches (bs, sb, sh: see kv_pages_t); token t's
 * K/V go to block slot_mapping[t] / bs, row slot_mapping[t] % bs (nowhere for -1); q_out [T, H, D]. */
void fl_rope_store_kv(const float *qkv, const float *cos, const float *sin, const int64_t *slot_mapping, int64_t T,
                      int64_t H, int64_t KVH, int64_t D, float *k_cache, float *v_cache, int64_t bs, int64_t sb, int64_t sh,
                      float *q_out) {
    const int64_t row = (H + 2 * KVH) * D;
    FOR_ROWS(t, T, {
        const int64_t slot = slot_mapping[t];
        const int64_t base = slot >= 0 ? slot / bs * sb + slot % bs * D : -1;
        rope_store_token(qkv + t * row, cos + t * D, sin + t * D, base, H, KVH, D, k_cache, v_cache, sh, q_out + t * H * D);
    })
}

#define ID256(v) (v)
#if defined(__AVX512F__)
#define FOLD512(v) _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))
#endif

/* exp(p - mx) in place over p[0, L), returning the sum (the softmax's denominator). */
static inline float exp_shifted(float *p, int64_t L, float mx) {
#if defined(__AVX512F__)
    const __m512 wmx = _mm512_set1_ps(mx);
    __m512 wsum = _mm512_setzero_ps();
    for (int64_t l = 0; l < L; l += 16) { /* 16 lanes, the last 1-15 masked */
        const __mmask16 live = L - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - l)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, p + l), wmx)));
        _mm512_mask_storeu_ps(p + l, live, e);
        wsum = _mm512_add_ps(wsum, e);
    }
    return _mm512_reduce_add_ps(wsum);
#else
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    int64_t l = 0;
    for (; l + 8 <= L; l += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + l), vmx));
        _mm256_storeu_ps(p + l, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    if (l < L) { /* the last 1-7 keys: one masked vector */
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(L - l)), lane));
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(p + l, _mm256_castps_si256(live)), vmx)), live);
        _mm256_maskstore_ps(p + l, _mm256_castps_si256(live), e);
        vsum = _mm256_add_ps(vsum, e);
    }
    return hsum8(vsum);
#endif
}

#define GROUP_MAX 8
/* Decode attention, the query heads that share one KV head together (up to GROUP_MAX of them a
 * pass): each K and V row is read once for all of them. Head by head (before 2026-11-26), the
 * later heads re-read the group's rows from L2 (8 sequences x 166 keys, SmolLM2's 9 / 3 heads:
 * 1.5x slower from cache; 1.1x from DRAM without the prefetches below).
 * Written for 256-bit and 512-bit vectors: KEYS(G) keys a scores step (G x KEYS accumulators,
 * each K row loaded once) and COLS(G) columns of V a pass fit each width's registers.
 *
 * q, out: [G, D] (consecutive heads); p: scratch of G x (L + 8). The K/V streams are short (a
 * few rows per token), so the next rows are fetched ahead: K 16 rows on and V while the scores
 * run, and the next job's K (next_K, next_L rows) while V is summed. With `partial` (a part of
 * the keys), out gets the unnormalized sum and partial[2g], partial[2g + 1] head g's score max
 * and sum of exps. */
#define GROUP_KERNELS(SUFFIX, VEC, LANES, ZERO, LOAD, STORE, FMA, SET1, MUL, TO256, KEYS, COLS)                      \
    static inline __attribute__((always_inline)) void group_scores_##SUFFIX(const float *q, const float *K, int64_t D,  \
                                                                             const int G, const int n, __m256 *dots) { \
        VEC a[GROUP_MAX][8];                                                                                         \
        for (int g = 0; g < G; g++)                                                                                  \
            for (int j = 0; j < n; j++) a[g][j] = ZERO();                                                            \
        for (int64_t d = 0; d < D; d += LANES) {                                                                     \
            VEC qd[GROUP_MAX];                                                                                       \
            for (int g = 0; g < G; g++) qd[g] = LOAD(q + g * D + d);                                                 \
            for (int j = 0; j < n; j++) {                                                                            \
                const VEC k = LOAD(K + j * D + d);                                                                   \
                for (int g = 0; g < G; g++) a[g][j] = FMA(qd[g], k, a[g][j]);                                        \
            }                                                                                                        \
        }                                                                                                            \
        for (int g = 0; g < G; g++) {                                                                                \
            __m256 r[8];                                                                                             \
            for (int j = 0; j < 8; j++) r[j] = j < n ? TO256(a[g][j]) : _mm256_setzero_ps();                         \
            dots[g] = hsum8x8(r);                                                                                    \
        }                                                                                                            \
    }                                                                                                                \
    /* out[g] columns d0 .. d0 + nv * LANES - 1 = sum_j p[g][j] V[j] * inv[g], V rows k0 .. k0 + L - 1 of pg, a  \
     * block's rows at a time (the first pass, d0 = 0, fetching the next job's K rows) */                         \
    static inline __attribute__((always_inline)) void group_v_pass_##SUFFIX(                                         \
        const float *p, int64_t stride, const kv_pages_t *pg, int64_t k0, int64_t L, int64_t D, int64_t d0,          \
        const float *inv, float *out, const int G, const int nv, const kv_pages_t *next, int64_t next_k0,            \
        int64_t next_L) {                                                                                            \
        const int64_t bs = 1LL << pg->shift;                                                                         \
        const float *nk = next->k;                                                                                   \
        VEC acc[GROUP_MAX][64 / LANES];                                                                              \
        for (int g = 0; g < G; g++)                                                                                  \
            for (int v = 0; v < 64 / LANES; v++) acc[g][v] = ZERO(); /* (all: nv <= 64 / LANES, unknown to GCC) */   \
        for (int64_t j0 = 0; j0 < L;) {                                                                              \
            const int64_t left = bs - ((k0 + j0) & (bs - 1)), run = L - j0 < left ? L - j0 : left;                   \
            const float *vb = pg->v + page_row(pg, k0 + j0) + d0;                                                    \
            for (int64_t r = 0; r < run; r++) {                                                                      \
                const int64_t j = j0 + r;                                                                            \
                const float *vr = vb + r * D;                                                                        \
                if (d0 == 0 && j < next_L) { /* the next job's K row j: a table lookup at its blocks' starts */      \
                    nk = j == 0 || ((next_k0 + j) & (bs - 1)) == 0 ? next->k + page_row(next, next_k0 + j) : nk + D; \
                    for (int64_t i = 0; i < D; i += 16) _mm_prefetch((const char *)(nk + i), _MM_HINT_T0);           \
                }                                                                                                    \
                VEC pj[GROUP_MAX];                                                                                   \
                for (int g = 0; g < G; g++) pj[g] = SET1(p[g * stride + j]);                                         \
                for (int v = 0; v < nv; v++) {                                                                       \
                    const VEC vv = LOAD(vr + v * LANES);                                                             \
                    for (int g = 0; g < G; g++) acc[g][v] = FMA(pj[g], vv, acc[g][v]);                               \
                }                                                                                                    \
            }                                                                                                        \
            j0 += run;                                                                                               \
        }                                                                                                            \
        for (int g = 0; g < G; g++)                                                                                  \
            for (int v = 0; v < nv; v++) STORE(out + g * D + d0 + v * LANES, MUL(acc[g][v], SET1(inv[g])));         \
    }                                                                                                                \
    /* out[g] = sum_j p[g][j] V[j] * inv[g] in passes of COLS(G) columns: a whole pass's vector count a constant   \
     * (the accumulators in registers; as a run-time count GCC kept flags of which were written) */              \
    static inline __attribute__((always_inline)) void group_weighted_v_##SUFFIX(                                     \
        const float *p, int64_t stride, const kv_pages_t *pg, int64_t k0, int64_t L, int64_t D, const float *inv,    \
        float *out, const int G, const kv_pages_t *next, int64_t next_k0, int64_t next_L) {                          \
        const int dc = COLS(G);                                                                                      \
        for (int64_t d0 = 0; d0 < D; d0 += dc) {                                                                     \
            if (D - d0 >= dc)                                                                                        \
                group_v_pass_##SUFFIX(p, stride, pg, k0, L, D, d0, inv, out, G, COLS(G) / LANES, next, next_k0, next_L); \
            else                                                                                                     \
                group_v_pass_##SUFFIX(p, stride, pg, k0, L, D, d0, inv, out, G, (int)((D - d0) / LANES), next, next_k0, next_L); \
        }                                                                                                            \
    }                                                                                                                \
    static inline __attribute__((always_inline)) void attend_group_##SUFFIX(                                         \
        const float *q, const kv_pages_t *pg, int64_t k0, int64_t L, int64_t D, float scale, float *p, float *out,   \
        const int G, const kv_pages_t *next, int64_t next_k0, int64_t next_L, float *partial) {                      \
        const int n = KEYS(G);                                                                                       \
        const int64_t stride = L + 8;                                                                                \
        __m256 vmax[GROUP_MAX], dots[GROUP_MAX];                                                                     \
        for (int g = 0; g < G; g++) vmax[g] = _mm256_set1_ps(-INFINITY);                                             \
        const __m256 vscale = _mm256_set1_ps(scale);                                                                 \
        int64_t l0 = 0;                                                                                              \
        for (; l0 + n <= L; l0 += n) { /* k0 % 8 == 0 and n | 8 | bs: the n rows share a block */                  \
            const int64_t row = page_row(pg, k0 + l0);                                                               \
            const float *K = pg->k + row;                                                                            \
            if (n == 8) group_scores_##SUFFIX(q, K, D, G, 8, dots);                                                  \
            else if (n == 4) group_scores_##SUFFIX(q, K, D, G, 4, dots);                                             \
            else if (n == 2) group_scores_##SUFFIX(q, K, D, G, 2, dots);                                             \
            else group_scores_##SUFFIX(q, K, D, G, 1, dots);                                                         \
            for (int64_t i = 0; i < n * D; i += 16) _mm_prefetch((const char *)(pg->v + row + i), _MM_HINT_T0);     \
            if (l0 + 16 + n <= L) { /* K, 16 rows on */                                                              \
                const float *ahead = pg->k + page_row(pg, k0 + l0 + 16);                                             \
                for (int64_t i = 0; i < n * D; i += 16) _mm_prefetch((const char *)(ahead + i), _MM_HINT_T0);        \
            }                                                                                                        \
            for (int g = 0; g < G; g++) {                                                                            \
                const __m256 sc = _mm256_mul_ps(dots[g], vscale);                                                    \
                _mm256_storeu_ps(p + g * stride + l0, sc); /* lanes past n: overwritten by the next step */          \
                vmax[g] = _mm256_max_ps(vmax[g], n == 8 ? sc : _mm256_blend_ps(_mm256_set1_ps(-INFINITY), sc, (1 << n) - 1)); \
            }                                                                                                        \
        }                                                                                                            \
        for (; l0 < L; l0++) {                                                                                       \
            group_scores_##SUFFIX(q, pg->k + page_row(pg, k0 + l0), D, G, 1, dots);                                  \
            for (int g = 0; g < G; g++) {                                                                            \
                const __m256 sc = _mm256_mul_ps(dots[g], vscale);                                                    \
                p[g * stride + l0] = _mm256_cvtss_f32(sc);                                                           \
                vmax[g] = _mm256_max_ps(vmax[g], _mm256_blend_ps(_mm256_set1_ps(-INFINITY), sc, 1));                 \
            }                                                                                                        \
        }                                                                                                            \
        float inv[GROUP_MAX];                                                                                        \
        for (int g = 0; g < G; g++) {                                                                                \
            const float mx = hmax8(vmax[g]), sum = exp_shifted(p + g * stride, L, mx);                               \
            inv[g] = partial ? 1.f : 1.f / sum;                                                                      \
            if (partial) partial[2 * g] = mx, partial[2 * g + 1] = sum;                                              \
        }                                                                                                            \
        group_weighted_v_##SUFFIX(p, stride, pg, k0, L, D, inv, out, G, next, next_k0, next_L);                      \
    }

/* 16 ymm registers: fewer keys a step and fewer V columns a pass as G grows */
#define KEYS256(G) ((G) <= 1 ? 8 : (G) <= 2 ? 4 : (G) <= 4 ? 2 : 1)
#define COLS256(G) ((G) <= 1 ? 64 : (G) <= 2 ? 32 : (G) <= 4 ? 16 : 8)
GROUP_KERNELS(256, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_fmadd_ps, _mm256_set1_ps,
              _mm256_mul_ps, ID256, KEYS256, COLS256)
#if defined(__AVX512F__)
#define KEYS512(G) ((G) <= 3 ? 8 : (G) <= 6 ? 4 : 2)
#define COLS512(G) ((G) <= 6 ? 64 : 32)
GROUP_KERNELS(512, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_fmadd_ps, _mm512_set1_ps,
              _mm512_mul_ps, FOLD512, KEYS512, COLS512)
#endif

/* One function per group size: all eight inlined into one function, GCC spilled the scores' K
 * vectors to the stack */
#define GROUP_FN_256(R)                                                                                                          \
    static __attribute__((noinline)) void attend_group_256_##R(const float *q, const kv_pages_t *pg, int64_t k0, int64_t L,    \
                                                               int64_t D, float scale, float *p, float *out, const kv_pages_t *next, \
                                                               int64_t next_k0, int64_t next_L, float *partial) {            \
        attend_group_256(q, pg, k0, L, D, scale, p, out, R, next, next_k0, next_L, partial);                                  \
    }
GROUP_FN_256(1)
GROUP_FN_256(2)
GROUP_FN_256(3)
GROUP_FN_256(4)
GROUP_FN_256(5)
GROUP_FN_256(6)
GROUP_FN_256(7)
GROUP_FN_256(8)
static void attend_group_any_256(const float *q, const kv_pages_t *pg, int64_t k0, int64_t L, int64_t D, float scale, float *p,
                                 float *out, int64_t G, const kv_pages_t *next, int64_t next_k0, int64_t next_L, float *partial) {
#define GROUP_CALL(R) attend_group_256_##R(q, pg, k0, L, D, scale, p, out, next, next_k0, next_L, partial)
    DISPATCH_ROWS(G, GROUP_CALL)
#undef GROUP_CALL
}
#if defined(__AVX512F__)
static void attend_group_any_512(const float *q, const kv_pages_t *pg, int64_t k0, int64_t L, int64_t D, float scale, float *p,
                                 float *out, int64_t G, const kv_pages_t *next, int64_t next_k0, int64_t next_L, float *partial) {
#define GROUP_CALL(R) attend_group_512(q, pg, k0, L, D, scale, p, out, R, next, next_k0, next_L, partial)
    DISPATCH_ROWS(G, GROUP_CALL)
#undef GROUP_CALL
}
#endif

static int64_t gcd64(int64_t a, int64_t b) { return b ? gcd64(b, a % b) : a; }

/* A job: sequence b's KV head kh, keys [k0, k0 + len) (one part of `parts`). */
typedef struct {
    int64_t b, kh, k0, len;
} attn_job_t;

static attn_job_t attn_job(int64_t j, int64_t KVH, int64_t parts, const int64_t *lengths) {
    attn_job_t job = {j / (KVH * parts), j / parts % KVH, 0, 0};
    const int64_t s = j % parts, L = lengths[job.b];
    job.k0 = L * s / parts & ~(int64_t)7; /* on a multiple of 8 keys: a scores step's rows share a block */
    job.len = (s + 1 == parts ? L : L * (s + 1) / parts & ~(int64_t)7) - job.k0;
    return job;
}

/* One query per sequence against its cached keys: q [B, H, D] -> out [B, H, D]; sequence b reads
 * key positions 0..lengths[b]-1 through its block table block_tables[b * bt_stride ..] (paged
 * caches: bs, sb, sh as in kv_pages_t); query head h uses kv head h / (H / KVH).
 * D % 8 == 0, D <= 256. Jobs are (sequence, KV head, key part): when the (sequence, KV head) pairs do not
 * divide evenly between the threads (SmolLM2 at batch 1: 3 pairs, 2 threads), each pair's keys
 * are split into `parts` and the parts' results merged by their score maxima (the flash-decoding
 * combine). Small steps run on one thread: a fork/join costs more than they do. */
void fl_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                         int64_t bt_stride, const int64_t *lengths, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs,
                         int64_t sb, int64_t sh, float scale, float *out) {
    const int64_t group = H / KVH, pairs = B * KVH, shift = log2_exact(bs);
#if defined(__AVX512F__)
    const int wide = D % 16 == 0;
#endif
    int64_t work = 0, longest = 0;
    for (int64_t b = 0; b < B; b++) work += lengths[b] * H * D, longest = lengths[b] > longest ? lengths[b] : longest;
    const int parallel = work > (1 << 14);
    const int64_t nt = parallel ? omp_get_max_threads() : 1;
    int64_t parts = nt / gcd64(pairs, nt);
    if (parts > 64) parts = 64;
    while (parts > 1 && longest / parts < 64) parts--; /* parts of at least 64 keys */
    const int64_t jobs = pairs * parts;
    float *partial = parts > 1 ? malloc(sizeof(float) * jobs * group * (D + 2)) : NULL; /* [jobs][group][D], then [jobs][group][2] */
    float *stats = partial ? partial + jobs * group * D : NULL;
#pragma omp parallel if (parallel)
    {
        const int64_t need = group * (longest / parts + 17); /* a part: up to 8 keys past L / parts, + 8 lanes */
        float stack_p[need <= 16384 ? need : 1], *p = need <= 16384 ? stack_p : malloc(sizeof(float) * need);
        /* the static schedule by hand: each thread knows the job it runs next, to prefetch its keys */
        const int64_t nth = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t j0 = jobs * t / nth, j1 = jobs * (t + 1) / nth;
        for (int64_t j = j0; j < j1; j++) {
            const attn_job_t job = attn_job(j, KVH, parts, lengths), next = attn_job(j + 1 < j1 ? j + 1 : j, KVH, parts, lengths);
            const kv_pages_t pg = {k_cache + job.kh * sh, v_cache + job.kh * sh, block_tables + job.b * bt_stride, shift, sb, D};
            const kv_pages_t npg = {k_cache + next.kh * sh, v_cache + next.kh * sh, block_tables + next.b * bt_stride, shift, sb, D};
            const int64_t first = (job.b * H + job.kh * group) * D;
            for (int64_t h0 = 0; h0 < group; h0 += GROUP_MAX) { /* heads h0 .. h0 + G - 1 of the group */
                const int64_t G = group - h0 < GROUP_MAX ? group - h0 : GROUP_MAX;
                const int64_t next_L = j + 1 < j1 && h0 + G == group ? next.len : 0;
                float *o = partial ? partial + (j * group + h0) * D : out + first + h0 * D;
                float *st = stats ? stats + (j * group + h0) * 2 : NULL;
#if defined(__AVX512F__)
                if (wide)
                    attend_group_any_512(q + first + h0 * D, &pg, job.k0, job.len, D, scale, p, o, G, &npg, next.k0, next_L, st);
                else
#endif
                    attend_group_any_256(q + first + h0 * D, &pg, job.k0, job.len, D, scale, p, o, G, &npg, next.k0, next_L, st);
            }
        }
        if (p != stack_p) free(p);
        if (partial) {
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * H; bh++) { /* out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M) */
                const int64_t b = bh / H, h = bh % H, g = h % group, pair = b * KVH + h / group;
                float m = -INFINITY, l = 0.f, w[64];
                for (int64_t s = 0; s < parts; s++) m = fmaxf(m, stats[((pair * parts + s) * group + g) * 2]);
                for (int64_t s = 0; s < parts; s++) {
                    const float *st = stats + ((pair * parts + s) * group + g) * 2;
                    w[s] = st[1] > 0.f ? expf(st[0] - m) : 0.f;
                    l += st[1] * w[s];
                }
                float *ob = out + bh * D;
                for (int64_t d = 0; d < D; d++) ob[d] = 0.f;
                for (int64_t s = 0; s < parts; s++)
                    for (int64_t d = 0; d < D; d++) ob[d] += w[s] * partial[((pair * parts + s) * group + g) * D + d];
                for (int64_t d = 0; d < D; d++) ob[d] /= l;
            }
        }
    }
    free(partial);
}

/* ---- prefill attention: a sequence's new queries against its cache, causal (flash attention) ---
 * Query blocks of PF_BQ positions x the G heads of one KV head (all share the block's K/V) walk
 * the key blocks of PF_BK keys up to their diagonal, keeping a running max and sum per row
 * (online softmax), so scores never exceed one block. Both products are register-tiled GEMMs:
 * S = Q K^T from K^T blocks transposed once per call, O += P V from the cache rows. */
#if defined(__AVX512F__)
#define VLANES 16
#define PF_QR 6 /* query rows a tile: 6 x 4 accumulators of the 32 registers */
#define PF_QV 4
#else
#define VLANES 8
#define PF_QR 6 /* 6 x 2 accumulators of the 16 registers (2 x 4 left the FMA latency no slack: 0.88x) */
#define PF_QV 2 /* vectors a tile row: keys of S, dimensions of O */
#endif
#define PF_BK (8 * VLANES) /* keys a block: scored PF_QV vectors at a time (2000-token prompts 1.05x faster than 4 vectors a block) */
#define PF_BQ 12           /* query positions a block, a multiple of PF_QR */

int64_t fl_vector_lanes(void) { return VLANES; }

/* Whether 5 and 6-bit weights go into lanes (L5, L6) here: where the GEMVs take int16 x (AVX2),
 * which the lanes feed directly; the AVX-512 GEMVs read any layout through panel_column. */
int64_t fl_value_lanes(void) { return X_INT16; }

/* S[r][0, PF_BK) = sum_d Qt[r][d] Kt[d][.], rows r < PF_QR */
static inline void pf_scores_tile(const float *Qt, int64_t D, const float *Kt, float *S) {
    vf acc[PF_QR][PF_QV];
    for (int r = 0; r < PF_QR; r++)
        for (int v = 0; v < PF_QV; v++) acc[r][v] = VZERO();
    for (int64_t d = 0; d < D; d++) {
        const float *kd = Kt + d * PF_BK;
        vf kv[PF_QV];
        for (int v = 0; v < PF_QV; v++) kv[v] = VLOAD(kd + v * VLANES);
        for (int r = 0; r < PF_QR; r++) {
            const vf qb = VSET1(Qt[r * D + d]);
            for (int v = 0; v < PF_QV; v++) acc[r][v] = VFMA(qb, kv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < PF_QR; r++)
        for (int v = 0; v < PF_QV; v++) VSTORE(S + r * PF_BK + v * VLANES, acc[r][v]);
}

/* O[r][d0, d0 + nv lanes) = O * alpha[r] + sum_{j < jn} P[r][j] V[j][.], rows r < PF_QR; V[j]: a cache row */
static inline __attribute__((always_inline)) void pf_pv_tile(const float *P, const float *const *V, int64_t jn, int64_t D, int64_t d0, const int nv, const float *alpha,
                              float *O) {
    vf acc[PF_QR][PF_QV];
    for (int r = 0; r < PF_QR; r++)
        for (int v = 0; v < PF_QV; v++) acc[r][v] = v < nv ? VMUL(VLOAD(O + r * D + d0 + v * VLANES), VSET1(alpha[r])) : VZERO();
    for (int64_t j = 0; j < jn; j++) {
        const float *vj = V[j] + d0;
        vf vv[PF_QV];
        for (int v = 0; v < PF_QV; v++) vv[v] = v < nv ? VLOAD(vj + v * VLANES) : VZERO();
        for (int r = 0; r < PF_QR; r++) {
            const vf pb = VSET1(P[r * PF_BK + j]);
            for (int v = 0; v < PF_QV; v++) acc[r][v] = VFMA(pb, vv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < PF_QR; r++)
        for (int v = 0; v < nv; v++) VSTORE(O + r * D + d0 + v * VLANES, acc[r][v]);
}

/* One row's scores s[0, PF_BK) of which keys [0, lim) are visible: s becomes exp(s - m_new) (0
 * past lim); returns alpha = exp(m_old - m_new) and updates the running max m and sum l. */
static inline float pf_softmax_row(float *s, int64_t lim, float *m, float *l) {
#if defined(__AVX512F__)
    __m512 wmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < PF_BK; j += 16) {
        const int64_t n = lim - j < 0 ? 0 : lim - j > 16 ? 16 : lim - j;
        wmax = _mm512_mask_max_ps(wmax, (__mmask16)((1u << n) - 1), wmax, _mm512_loadu_ps(s + j));
    }
    const float m_new = fmaxf(*m, _mm512_reduce_max_ps(wmax));
#else
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < PF_BK; j += 8) {
        const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(lim - j)), lane));
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + j), live));
    }
    const float m_new = fmaxf(*m, hmax8(vmax));
#endif
    if (m_new == -INFINITY) { /* nothing visible yet */
        for (int64_t j = 0; j < PF_BK; j++) s[j] = 0.f;
        return 1.f;
    }
    const int64_t seen = lim < 0 ? 0 : lim;
    const float sum = exp_shifted(s, seen, m_new);
    for (int64_t j = seen; j < PF_BK; j++) s[j] = 0.f;
    const float alpha = expf(*m - m_new);
    *l = *l * alpha + sum;
    *m = m_new;
    return alpha;
}

/* q [n, H, D] (positions start .. start + n - 1 of the sequence whose block table is `table`, with
 * K/V of positions 0 .. start + n - 1 stored in the paged caches: bs, sb, sh as in kv_pages_t) -> out [n, H, D].
 * D a multiple of VLANES (fl_vector_lanes()). */
void fl_prefill_attention(const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int64_t start, int64_t n,
                          int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t sb, int64_t sh, float scale, float *out) {
    const int64_t G = H / KVH, total = start + n, nblk = (total + PF_BK - 1) / PF_BK, nq = (n + PF_BQ - 1) / PF_BQ;
    const int64_t shift = log2_exact(bs);
    const int64_t R = G * PF_BQ; /* rows of a job: head g, position i at row g * PF_BQ + i */
    float *kt = aligned_alloc(64, sizeof(float) * KVH * nblk * D * PF_BK); /* [KVH][nblk][D][PF_BK], zero past total */
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < KVH * nblk; t++) {
        const int64_t kh = t / nblk, j0 = t % nblk * PF_BK, jn = total - j0 < PF_BK ? total - j0 : PF_BK;
        const kv_pages_t pg = {k_cache + kh * sh, v_cache, table, shift, sb, D};
        float *dst = kt + t * D * PF_BK;
        for (int64_t j = 0; j < PF_BK; j++) {
            const float *K = j < jn ? pg.k + page_row(&pg, j0 + j) : NULL;
            for (int64_t d = 0; d < D; d++) dst[d * PF_BK + j] = K ? K[d] : 0.f;
        }
    }
#pragma omp parallel
    {
        float *Qt = aligned_alloc(64, sizeof(float) * (2 * R * D + R * PF_BK + 3 * R + 16));
        float *O = Qt + R * D, *S = O + R * D, *m = S + R * PF_BK, *l = m + R, *alpha = l + R;
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < KVH * nq; job++) { /* the longest query blocks (the last) first */
            const int64_t kh = job % KVH, i0 = (nq - 1 - job / KVH) * PF_BQ, qn = n - i0 < PF_BQ ? n - i0 : PF_BQ;
            for (int64_t r = 0; r < R; r++) {
                const int64_t g = r / PF_BQ, i = r % PF_BQ;
                const float *qr = q + ((i0 + i) * H + kh * G + g) * D;
                for (int64_t d = 0; d < D; d++) Qt[r * D + d] = i < qn ? qr[d] * scale : 0.f, O[r * D + d] = 0.f;
                m[r] = -INFINITY, l[r] = 0.f;
            }
            const int64_t kend = start + i0 + qn; /* keys the last position sees */
            for (int64_t j0 = 0; j0 < kend; j0 += PF_BK) {
                const int64_t jn = kend - j0 < PF_BK ? kend - j0 : PF_BK;
                const float *Kt = kt + (kh * nblk + j0 / PF_BK) * D * PF_BK;
                for (int64_t r0 = 0; r0 < R; r0 += PF_QR)
                    for (int64_t c = 0; c < jn; c += PF_QV * VLANES) pf_scores_tile(Qt + r0 * D, D, Kt + c, S + r0 * PF_BK + c);
                for (int64_t r = 0; r < R; r++) { /* position start + i0 + i sees keys up to itself */
                    const int64_t see = start + i0 + r % PF_BQ + 1 - j0;
                    alpha[r] = pf_softmax_row(S + r * PF_BK, see < jn ? see : jn, m + r, l + r);
                }
                const float *V[PF_BK];
                const kv_pages_t pg = {k_cache, v_cache + kh * sh, table, shift, sb, D};
                for (int64_t j = 0; j < jn; j++) V[j] = pg.v + page_row(&pg, j0 + j);
                for (int64_t r0 = 0; r0 < R; r0 += PF_QR)
                    for (int64_t d0 = 0; d0 < D; d0 += PF_QV * VLANES)
                        if (D - d0 >= PF_QV * VLANES) pf_pv_tile(S + r0 * PF_BK, V, jn, D, d0, PF_QV, alpha + r0, O + r0 * D); /* (no lane tests in the loop) */
                        else pf_pv_tile(S + r0 * PF_BK, V, jn, D, d0, (int)((D - d0) / VLANES), alpha + r0, O + r0 * D);
            }
            for (int64_t r = 0; r < R; r++) {
                const int64_t g = r / PF_BQ, i = r % PF_BQ;
                if (i >= qn) continue;
                float *o = out + ((i0 + i) * H + kh * G + g) * D;
                const float inv = 1.f / l[r];
                for (int64_t d = 0; d < D; d++) o[d] = O[r * D + d] * inv;
            }
        }
        free(Qt);
    }
    free(kt);
}

/* ---- w8a8: int8 activations x int8 weights, exact int32 sums (quantized.py's reference) --------
 * y [M, N] = float(sum_k xq[m, k] w[n, k]) * xs[m] * ws[n] (+ bias[n]). With AVX-512 VNNI,
 * vpdpbusd multiplies unsigned by signed bytes: x + 128 is unsigned, and 128 * sum_k w[n, k]
 * (wsum) comes off again. Without it, AVX2's maddubs on |w| and x * sign(w) (pairs stay within
 * int16: 2 * 127 * 127 < 32768). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline __attribute__((always_inline)) void w8a8_row(const uint8_t *xu, int64_t K, const int8_t *w, int32_t wsum,
                                                            int32_t *acc_out, const int rows) {
    __m512i acc[MT];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        _mm_prefetch((const char *)(w + k + PF_BYTES), WEIGHT_HINT);
        const __m512i wv = _mm512_loadu_si512((const void *)(w + k));
        for (int r = 0; r < rows; r++) acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512((const void *)(xu + r * K + k)), wv);
    }
    if (k < K) { /* a last 32 columns */
        const __mmask64 mk = (__mmask64)((1ULL << (K - k)) - 1);
        const __m512i wv = _mm512_maskz_loadu_epi8(mk, w + k);
        for (int r = 0; r < rows; r++) acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_maskz_loadu_epi8(mk, xu + r * K + k), wv);
    }
    for (int r = 0; r < rows; r++) acc_out[r] = _mm512_reduce_add_epi32(acc[r]) - 128 * wsum;
}
#define W8A8_X_UNSIGNED 1
#else
static inline __attribute__((always_inline)) void w8a8_row(const uint8_t *xs8, int64_t K, const int8_t *w, int32_t wsum,
                                                            int32_t *acc_out, const int rows) {
    (void)wsum;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[MT];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; k += 32) {
        _mm_prefetch((const char *)(w + k + PF_BYTES), WEIGHT_HINT);
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k)), aw = _mm256_sign_epi8(wv, wv);
        for (int r = 0; r < rows; r++) {
            const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xs8 + r * K + k)), wv);
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones));
        }
    }
    for (int r = 0; r < rows; r++) {
        const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[r]), _mm256_extracti128_si256(acc[r], 1));
        const __m128i s2 = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        acc_out[r] = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
    }
}
#define W8A8_X_UNSIGNED 0
#endif

/* xq [M, K] int8 (K a multiple of 32), w [N, K] int8; wsum [N] = row sums of w (VNNI only). */
void fl_w8a8_linear(const int8_t *xq, const float *xs, int64_t M, int64_t K, const int8_t *w, const float *ws,
                    const int32_t *wsum, int64_t N, const float *bias, float *y) {
    const uint8_t *xu = (const uint8_t *)xq;
    uint8_t *shifted = NULL;
    if (W8A8_X_UNSIGNED) {
        shifted = aligned_alloc(64, (M * K + 63) & ~(int64_t)63);
        for (int64_t i = 0; i < M * K; i++) shifted[i] = (uint8_t)xq[i] ^ 0x80; /* x + 128 */
        xu = shifted;
    }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            int32_t acc[MT];
            const int rows = (int)(M - m0 >= MT ? MT : M - m0);
#define W8A8_CALL(R) w8a8_row(xu + m0 * K, K, w + n * K, wsum ? wsum[n] : 0, acc, R)
            DISPATCH_ROWS(rows, W8A8_CALL)
#undef W8A8_CALL
            for (int r = 0; r < rows; r++) {
                const float v = (float)acc[r] * xs[m0 + r] * ws[n];
                y[(m0 + r) * N + n] = bias ? v + bias[n] : v;
            }
        }
    }
    free(shifted);
}

/* Per-token int8 quantization, as quantized.quantize_per_token: q = clamp(round(x / s), -127, 127)
 * with s = absmax(row) / 127, or s = *static_scale where that covers the row (or `clip`). K a
 * multiple of 8. */
static inline void quantize_row(const float *x, int64_t K, const float *static_scale, int64_t clip, int8_t *q, float *scale_out) {
    float s;
    if (static_scale && clip) {
        s = *static_scale;
    } else {
        __m256 m = _mm256_setzero_ps();
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        for (int64_t k = 0; k < K; k += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + k), absmask));
        const float amax = hmax8(m);
        s = static_scale && !(amax > *static_scale * 127.f) ? *static_scale : fmaxf(amax, 1e-12f) / 127.f;
    }
    *scale_out = s;
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    for (int64_t k = 0; k < K; k += 8) { /* clamp, then round half to even: the same as round, then clamp */
        const __m256i i = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), vs), lo), hi));
        const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
        _mm_storel_epi64((__m128i *)(q + k), _mm_packs_epi16(p16, p16));
    }
}

void fl_quantize_rows(const float *x, int64_t M, int64_t K, const float *static_scale, int64_t clip, int8_t *q, float *scales) {
    FOR_ROWS(m, M, { quantize_row(x + m * K, K, static_scale, clip, q + m * K, scales + m); })
}

/* ---- prefill with int8 activations (quantization "gguf-a8"): y = xhat @ W^T ---------------------
 * xhat: each row of x rounded to int8 per chunk of E = min(g, 32) columns (scale absmax / 127), as
 * llama.cpp's integer dot products take activations; the weights stay exactly the file's. A group's
 * values go into bytes (v = d * s + m'; VNNI: s = q - 2^(bits-1), centred, 8-bit and IQ4 values as
 * they are; AVX2: see A8_UNSIGNED), and a chunk's sum over k of s * xq is exact in int32: one
 * integer dot product (AVX-512 VNNI: vpdpbusd, 64 multiply-adds against 16 for an fp32 FMA) then
 * one float multiply-add per chunk: d * xs * sum (+ m' * xs * sum_k xq where the type has mins).
 * A thread makes a panel's bytes a block of A8_KC columns at a time ([k / 4][32 outputs][4], the
 * dot product's order) and runs a register tile of A8_R rows x 32 outputs over A8_MC rows. */
static inline int32_t load_i32(const void *p) { /* four bytes of x, broadcast to every lane */
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define A8_VNNI 1 /* vpdpbusd takes x + 128 unsigned; each chunk's sum starts at -128 * sum(s) */
#define A8_R 6    /* 12 int32 + 12 float accumulators, 2 weight vectors */
#define A8_V 2
typedef __m512i a8i;
typedef __m512 a8f;
#define A8_ZERO() _mm512_setzero_si512()
#define A8_LOADI(p) _mm512_loadu_si512((const void *)(p))
#define A8_ABS(w) (w)
#define A8F_LOAD(p) _mm512_loadu_ps(p)
#define A8F_STORE(p, v) _mm512_storeu_ps(p, v)
#define A8F_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define A8F_MUL(a, b) _mm512_mul_ps(a, b)
#define A8F_SET1(v) _mm512_set1_ps(v)
#define A8F_ZERO() _mm512_setzero_ps()
#define A8_DOT(acc, xb, w, aw) _mm512_dpbusd_epi32(acc, xb, w)
#define A8_BCAST(p) _mm512_set1_epi32(load_i32(p))
#define A8_TOF(v) _mm512_cvtepi32_ps(v)
#else
#define A8_VNNI 0 /* AVX2: maddubs (A8_UNSIGNED below; signed values: |w| and x * sign(w), a pair within int16) */
#define A8_R 2
#define A8_V 2
typedef __m256i a8i;
typedef __m256 a8f;
#define A8_ZERO() _mm256_setzero_si256()
#define A8_LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define A8_ABS(w) _mm256_sign_epi8(w, w)
#define A8F_LOAD(p) _mm256_loadu_ps(p)
#define A8F_STORE(p, v) _mm256_storeu_ps(p, v)
#define A8F_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define A8F_MUL(a, b) _mm256_mul_ps(a, b)
#define A8F_SET1(v) _mm256_set1_ps(v)
#define A8F_ZERO() _mm256_setzero_ps()
#define A8_DOT(acc, xb, w, aw) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, w)), _mm256_set1_epi16(1)))
#define A8_BCAST(p) _mm256_set1_epi32(load_i32(p))
#define A8_TOF(v) _mm256_cvtepi32_ps(v)
#endif
#define A8_LANES (int)(sizeof(a8i) / sizeof(int32_t))
/* AVX2: 2-6 bit values stay unsigned (q, not q - 2^(bits-1); the offset joins the mins' term), so
 * maddubs takes them as they are (no sign fix-up), and two k-quads' pairs add in int16 before one
 * madd widens them: 2 * 2 * 63 * 127 < 32768. int8 and IQ4 values are signed: the sign trick. */
#define A8_UNSIGNED(bits) (!A8_VNNI && (bits) != 8 && (bits) != NL4)
#define A8_KC 256 /* columns made bytes at a time (rounded to whole groups) */
#define A8_MC 256 /* activation rows a pass over the panels: int8, 4x the rows fp32's GEMM_MC holds */

/* Column kk's 32 values as bytes (rows 0-31 in bytes 0-31), centred unless A8_UNSIGNED. */
static inline __attribute__((always_inline)) __m256i panel_i8(const uint8_t *qg, int64_t kk, const int bits) {
    if (LANES(bits)) {
        const __m256i v = _mm256_set_m128i(lane_bytes(qg, kk, 16, 16, bits), lane_bytes(qg, kk, 0, 16, bits));
        return A8_UNSIGNED(bits) ? v : _mm256_sub_epi8(v, _mm256_set1_epi8((char)(1 << (VALUE_BITS(bits) - 1))));
    }
    const uint8_t *c = col_bytes(qg, kk, bits);
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)c);
    const int low = LOW_BITS(bits);
    const __m128i mask = _mm_set1_epi8((char)((1 << low) - 1));
    const __m128i b = _mm_srl_epi16(_mm_loadu_si128((const __m128i *)c), _mm_cvtsi32_si128(low_shift(kk, bits)));
    __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
    if (bits == NL4) return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)NL4_VALUES)), v);
    if (bits == 6) { /* the top two bits: this column's crumbs of the pair */
        const __m128i t = _mm_srl_epi16(_mm_loadu_si128((const __m128i *)(c + top_at(kk))), _mm_cvtsi32_si128(2 * (int)(kk & 1)));
        const __m128i three = _mm_set1_epi8(3);
        v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(t, 4), three), _mm_and_si128(t, three)), 4));
    } else {
        for (int bb = 0; bb < VALUE_BITS(bits) - low; bb++) /* a plane's 32 bytes: row j's bit of 8 columns */
            v = _mm256_or_si256(v, plane_bit256(_mm256_loadu_si256((const __m256i *)plane_at(qg, kk, bits, bb)), (int)(kk & 7), low + bb));
    }
    return A8_UNSIGNED(bits) ? v : _mm256_sub_epi8(v, _mm256_set1_epi8((char)(1 << (VALUE_BITS(bits) - 1))));
}

/* Four columns' bytes -> dst [32 outputs][4 columns]. */
static inline void a8_store4(int8_t *dst, __m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    const __m256i a = _mm256_unpacklo_epi8(c0, c1), b = _mm256_unpacklo_epi8(c2, c3);
    const __m256i a2 = _mm256_unpackhi_epi8(c0, c1), b2 = _mm256_unpackhi_epi8(c2, c3);
    const __m256i e = _mm256_unpacklo_epi16(a, b), f = _mm256_unpackhi_epi16(a, b);     /* rows 0-3 | 16-19, 4-7 | 20-23 */
    const __m256i g = _mm256_unpacklo_epi16(a2, b2), h = _mm256_unpackhi_epi16(a2, b2); /* rows 8-11 | 24-27, 12-15 | 28-31 */
    _mm256_storeu_si256((__m256i *)dst, _mm256_permute2x128_si256(e, f, 0x20));
    _mm256_storeu_si256((__m256i *)(dst + 32), _mm256_permute2x128_si256(g, h, 0x20));
    _mm256_storeu_si256((__m256i *)(dst + 64), _mm256_permute2x128_si256(e, f, 0x31));
    _mm256_storeu_si256((__m256i *)(dst + 96), _mm256_permute2x128_si256(g, h, 0x31));
}

/* A panel's groups [grp0, grp1) -> wb (bytes), wd / wm (scale d and m' of each chunk's 32 outputs)
 * and wneg (VNNI: -128 * the chunk's sum of bytes, where its int32 sums start). */
static inline __attribute__((always_inline)) void a8_prep(const panel_w_t *w, int64_t g, int E, int64_t grp0, int64_t grp1, int8_t *wb,
                                                          float *wd, float *wm, int32_t *wneg, const int bits) {
    const float off = bits == 8 || bits == NL4 || A8_UNSIGNED(bits) ? 0.f : (float)(1 << (VALUE_BITS(bits) - 1));
    for (int64_t grp = grp0; grp < grp1; grp++) {
        const uint8_t *qg = w->q + grp * g * COL_BYTES(bits);
        const int64_t si = grp * PANEL, k0 = (grp - grp0) * g;
        __m256 d[4], m[4];
        for (int i = 0; i < 4; i++) {
            d[i] = load8s(w, w->scales, w->sup_s, si + 8 * i);
            if (w->mins) m[i] = _mm256_fmadd_ps(d[i], _mm256_set1_ps(off), load8s(w, w->mins, w->sup_m, si + 8 * i));
            else if (A8_UNSIGNED(bits)) m[i] = _mm256_mul_ps(d[i], _mm256_set1_ps(-w->centre)); /* the centre: a min */
        }
        if (LANES(bits)) { /* two pairs' vectors packed to bytes and interleaved: 8 rows x 4 columns each */
            FOR_COLUMNS(kk, g, 4) {
                const uint8_t *blk = lane_block(qg, kk, bits);
                const int p0 = (int)(kk & 7) >> 1;
                for (int h = 0; h < 4; h++) {
                    const __m256i va = lane_vector(blk, 4 * p0 + h, bits), vb = lane_vector(blk, 4 * (p0 + 1) + h, bits);
                    const __m128i pa = _mm_packus_epi16(_mm256_castsi256_si128(va), _mm256_extracti128_si256(va, 1));
                    const __m128i pb = _mm_packus_epi16(_mm256_castsi256_si128(vb), _mm256_extracti128_si256(vb, 1));
                    __m256i rows8 = _mm256_set_m128i(_mm_unpackhi_epi16(pa, pb), _mm_unpacklo_epi16(pa, pb));
                    if (!A8_UNSIGNED(bits)) rows8 = _mm256_sub_epi8(rows8, _mm256_set1_epi8((char)(1 << (VALUE_BITS(bits) - 1))));
                    _mm256_storeu_si256((__m256i *)(wb + (k0 + kk) * PANEL + 32 * h), rows8);
                }
            }
        } else
            FOR_COLUMNS(kk, g, 4)
                a8_store4(wb + (k0 + kk) * PANEL, panel_i8(qg, kk, bits), panel_i8(qg, kk + 1, bits), panel_i8(qg, kk + 2, bits),
                          panel_i8(qg, kk + 3, bits));
        for (int64_t e0 = 0; e0 < g; e0 += E) {
            const int64_t ci = (k0 + e0) / E;
            for (int i = 0; i < 4; i++) {
                _mm256_storeu_ps(wd + ci * PANEL + 8 * i, d[i]);
                if (w->mins || A8_UNSIGNED(bits)) _mm256_storeu_ps(wm + ci * PANEL + 8 * i, m[i]);
            }
#if A8_VNNI
            for (int v = 0; v < PANEL / 16; v++) {
                __m512i s = _mm512_setzero_si512();
                for (int64_t kq = 0; kq < E / 4; kq++)
                    s = _mm512_dpbusd_epi32(s, _mm512_set1_epi8(1), _mm512_loadu_si512((const void *)(wb + (k0 + e0 + 4 * kq) * PANEL + 64 * v)));
                _mm512_storeu_si512((void *)(wneg + ci * PANEL + 16 * v), _mm512_mullo_epi32(s, _mm512_set1_epi32(-128)));
            }
#else
            (void)wneg;
#endif
        }
    }
}

/* acc tile t [rows, 32] (+)= the chunks [0, nch) of rows x (xq int8 [rows, ldx], xs / xsum [rows, ldc])
 * against the prepared weights, outputs [v0, v0 + A8_V vectors). */
static inline __attribute__((always_inline)) void a8_tile(const uint8_t *xq, int64_t ldx, const float *xs, const float *xsum, int64_t ldc,
                                                          const int8_t *wb, const float *wd, const float *wm, const int32_t *wneg,
                                                          int64_t nch, const int E, float *t, int v0, int first, const int rows,
                                                          const int u8w) {
    a8f acc[A8_R][A8_V];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < A8_V; v++) acc[r][v] = first ? A8F_ZERO() : A8F_LOAD(t + r * PANEL + (v0 + v) * A8_LANES);
    for (int64_t c = 0; c < nch; c++) {
        a8i ai[A8_R][A8_V];
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < A8_V; v++) ai[r][v] = A8_VNNI ? A8_LOADI(wneg + c * PANEL + (v0 + v) * A8_LANES) : A8_ZERO();
#if !A8_VNNI
        if (u8w) { /* unsigned bytes: maddubs as it is, two k-quads a widening */
            for (int kq = 0; kq < E / 4; kq += 2) {
                const int8_t *wk = wb + (c * E + 4 * kq) * PANEL + v0 * A8_LANES * 4;
                a8i w0[A8_V], w1[A8_V];
                for (int v = 0; v < A8_V; v++) w0[v] = A8_LOADI(wk + v * A8_LANES * 4), w1[v] = A8_LOADI(wk + 4 * PANEL + v * A8_LANES * 4);
                for (int r = 0; r < rows; r++) {
                    const a8i x0 = A8_BCAST(xq + r * ldx + c * E + 4 * kq), x1 = A8_BCAST(xq + r * ldx + c * E + 4 * kq + 4);
                    for (int v = 0; v < A8_V; v++)
                        ai[r][v] = _mm256_add_epi32(ai[r][v], _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w0[v], x0),
                                                                                                 _mm256_maddubs_epi16(w1[v], x1)),
                                                                                _mm256_set1_epi16(1)));
                }
            }
        } else
#endif
        for (int kq = 0; kq < E / 4; kq++) {
            const int8_t *wk = wb + (c * E + 4 * kq) * PANEL + v0 * A8_LANES * 4;
            a8i wv[A8_V], aw[A8_V];
            for (int v = 0; v < A8_V; v++) {
                wv[v] = A8_LOADI(wk + v * A8_LANES * 4);
                aw[v] = A8_ABS(wv[v]);
            }
            (void)aw; /* VNNI: unused */
            for (int r = 0; r < rows; r++) {
                const a8i xb = A8_BCAST(xq + r * ldx + c * E + 4 * kq);
                for (int v = 0; v < A8_V; v++) ai[r][v] = A8_DOT(ai[r][v], xb, wv[v], aw[v]);
            }
        }
        for (int v = 0; v < A8_V; v++) {
            const a8f d = A8F_LOAD(wd + c * PANEL + (v0 + v) * A8_LANES);
            for (int r = 0; r < rows; r++) acc[r][v] = A8F_FMA(A8_TOF(ai[r][v]), A8F_MUL(d, A8F_SET1(xs[r * ldc + c])), acc[r][v]);
            if (wm) {
                const a8f m = A8F_LOAD(wm + c * PANEL + (v0 + v) * A8_LANES);
                for (int r = 0; r < rows; r++) acc[r][v] = A8F_FMA(m, A8F_SET1(xsum[r * ldc + c]), acc[r][v]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < A8_V; v++) A8F_STORE(t + r * PANEL + (v0 + v) * A8_LANES, acc[r][v]);
}

static void a8_tile_any(const uint8_t *xq, int64_t ldx, const float *xs, const float *xsum, int64_t ldc, const int8_t *wb, const float *wd,
                        const float *wm, const int32_t *wneg, int64_t nch, int E, float *t, int v0, int first, int rows, int u8w) {
#define A8_CALL(R, E_, U) a8_tile(xq, ldx, xs, xsum, ldc, wb, wd, wm, wneg, nch, E_, t, v0, first, R, U)
#if A8_VNNI
#define A8_ROWS(R) (E == 16 ? A8_CALL(R, 16, 0) : A8_CALL(R, 32, 0))
#else
#define A8_ROWS(R) (u8w ? (E == 16 ? A8_CALL(R, 16, 1) : A8_CALL(R, 32, 1)) : (E == 16 ? A8_CALL(R, 16, 0) : A8_CALL(R, 32, 0)))
#endif
    switch (rows) {
#if A8_R > 2
        case 6: A8_ROWS(6); break;
        case 5: A8_ROWS(5); break;
        case 4: A8_ROWS(4); break;
        case 3: A8_ROWS(3); break;
#endif
        case 2: A8_ROWS(2); break;
        default: A8_ROWS(1); break;
    }
#undef A8_ROWS
#undef A8_CALL
}

typedef struct {
    int8_t *wb;
    float *wd, *wm;
    int32_t *wneg;
} a8_buf_t;

/* Panel p's outputs of y for mc <= A8_MC rows of quantized x (xq [mc, K], xs / xsum [mc, K / E]). */
static inline __attribute__((always_inline)) void a8_panel(const uint8_t *xq, const float *xs, const float *xsum, int64_t mc, int64_t K,
                                                           const panel_w_t *w, int64_t N, int64_t g, int E, float *y, int64_t p,
                                                           const a8_buf_t *b, float *t, const int bits) {
    const int64_t G = K / g, gpb = g >= A8_KC ? 1 : A8_KC / g, C = K / E;
    const int64_t valid = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
    const panel_w_t wp = panel_at(w, p, G, g, bits);
    for (int64_t grp0 = 0; grp0 < G; grp0 += gpb) {
        const int64_t grp1 = grp0 + gpb < G ? grp0 + gpb : G, c0 = grp0 * g / E;
        a8_prep(&wp, g, E, grp0, grp1, b->wb, b->wd, b->wm, b->wneg, bits);
        for (int64_t r0 = 0; r0 < mc; r0 += A8_R)
            for (int v0 = 0; v0 < PANEL / A8_LANES; v0 += A8_V)
                a8_tile_any(xq + r0 * K + grp0 * g, K, xs + r0 * C + c0, xsum + r0 * C + c0, C, b->wb, b->wd,
                            w->mins || A8_UNSIGNED(bits) ? b->wm : NULL, b->wneg, (grp1 - grp0) * g / E, E, t + r0 * PANEL, v0, grp0 == 0,
                            (int)(mc - r0 < A8_R ? mc - r0 : A8_R), A8_UNSIGNED(bits));
    }
    for (int64_t r = 0; r < mc; r++) memcpy(y + r * N + p * PANEL, t + r * PANEL, sizeof(float) * valid);
}

typedef void (*a8_panel_fn)(const uint8_t *, const float *, const float *, int64_t, int64_t, const panel_w_t *, int64_t, int64_t, int,
                            float *, int64_t, const a8_buf_t *, float *);
#define A8_WIDTH(B)                                                                                                                  \
    static void a8_panel_##B(const uint8_t *xq, const float *xs, const float *xsum, int64_t mc, int64_t K, const panel_w_t *w,     \
                             int64_t N, int64_t g, int E, float *y, int64_t p, const a8_buf_t *b, float *t) {                      \
        a8_panel(xq, xs, xsum, mc, K, w, N, g, E, y, p, b, t, B);                                                                   \
    }
A8_WIDTH(2)
A8_WIDTH(3)
A8_WIDTH(4)
A8_WIDTH(5)
A8_WIDTH(6)
A8_WIDTH(8)
A8_WIDTH(NL4)
A8_WIDTH(L5)
A8_WIDTH(L6)

/* Row x [K] -> xq (int8; VNNI: + 128), and per chunk of E columns its scale and scale * sum(xq). */
static inline void a8_quantize_row(const float *x, int64_t K, int E, uint8_t *xq, float *xs, float *xsum) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t c = 0; c < K / E; c++) {
        const float *xc = x + c * E;
        __m256 m = _mm256_setzero_ps();
        for (int k = 0; k < E; k += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xc + k), absmask));
        const float s = fmaxf(hmax8(m), 1e-12f) / 127.f;
        const __m256 vs = _mm256_set1_ps(s);
        __m256i isum = _mm256_setzero_si256();
        for (int k = 0; k < E; k += 8) { /* |x| <= absmax: within +-127 before rounding (half to even) */
            const __m256i i = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(xc + k), vs));
            isum = _mm256_add_epi32(isum, i);
            const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
            __m128i p8 = _mm_packs_epi16(p16, p16);
            if (A8_VNNI) p8 = _mm_xor_si128(p8, _mm_set1_epi8((char)0x80));
            _mm_storel_epi64((__m128i *)(xq + c * E + k), p8);
        }
        const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
        const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        xs[c] = s;
        xsum[c] = s * (float)_mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
    }
}

/* ---- decode with int8 activations (quantization "gguf-a8"): 1-2 rows ----------------------------
 * x rounded to int8 by chunk (a8_quantize_row), a column pair's bytes as (x_k, x_k+1) against the
 * two columns' values paired by row: one maddubs multiplies 16 weights by 2 x values and adds them
 * in int16 (unsigned 2-6 bit values times int8: at most 63 * 127 a product), a few pairs add in
 * int16 before widening, and a chunk's int32 sums become floats once (d * xs). Per 64 weights of a
 * 4-bit panel: ~22 micro-ops on Zen 1 against the int16 GEMV's ~40 (its widenings and per-8-column
 * float flushes). Signed values (8 bits, IQ4_NL) multiply as |w| times x with w's sign. */
#define A8G_PAIRS(bits) ((bits) == 8 || (bits) == NL4 ? 1 : VALUE_BITS(bits) <= 5 ? 4 : 2) /* column pairs an int16 lane adds: 4 * 2 * 31 * 127, 2 * 2 * 63 * 127, 2 * 128 * 127 < 32768 */
static inline __attribute__((always_inline)) void panel_a8_gemv(const int8_t *xq, const float *xs, const float *xsum, int64_t K,
    const panel_w_t *w, int64_t G, int64_t g, int64_t E, int c0, float *y, int64_t ldy, const int bits, const int rows, const int nc) {
    const int has_min = w->mins != NULL || w->centre != 0.f;
    const int64_t C = K / E, per_group = g / E;
    __m256 tot[2][4];
    __m256i acc[2][4];
    __m128i a16[2][4];
    float dv[32] __attribute__((aligned(32))), mv[32] __attribute__((aligned(32)));
    for (int r = 0; r < rows; r++) for (int v = 0; v < 2 * nc; v++) tot[r][v] = _mm256_setzero_ps();
    for (int64_t grp = 0; grp < G; grp++) {
        const uint8_t *qg = w->q + grp * g * COL_BYTES(bits);
        const int64_t si = grp * PANEL + 16 * c0;
        group_scales(w, si, nc, dv, mv);
        for (int r = 0; r < rows; r++) for (int v = 0; v < 2 * nc; v++) acc[r][v] = _mm256_setzero_si256();
        for (int64_t b = 0; b < g / 8; b++) {
#pragma GCC unroll 8
            for (int i = 0; i < 8; i += 2) { /* (i, not kk, steps: kk % 8 is known to the compiler, as in panel_i16) */
                const int64_t kk = b * 8 + i;
                if (kk % PF_COLS(bits) < 2) I16_PF(qg + kk * COL_BYTES(bits), PF_BYTES);
                if (i % (2 * A8G_PAIRS(bits)) == 0)
                    for (int r = 0; r < rows; r++) for (int v = 0; v < 2 * nc; v++) a16[r][v] = _mm_setzero_si128();
                __m128i xb[2];
                for (int r = 0; r < rows; r++) {
                    int16_t pair;
                    memcpy(&pair, xq + r * K + grp * g + kk, sizeof pair);
                    xb[r] = _mm_set1_epi16(pair);
                }
                __m128i b4[2]; /* 4 bits: the pair's bytes (row j's nibble and row j + 16's) paired before the nibbles split */
                if (bits == 4) {
                    const __m128i b0 = _mm_loadu_si128((const __m128i *)col_bytes(qg, kk, bits)), b1 = _mm_loadu_si128((const __m128i *)col_bytes(qg, kk + 1, bits));
                    b4[0] = _mm_unpacklo_epi8(b0, b1), b4[1] = _mm_unpackhi_epi8(b0, b1);
                }
                for (int c = 0; c < nc; c++) {
                    __m128i lo, hi; /* rows 16 (c0 + c) + 0..7 and + 8..15, the two columns' values side by side */
                    if (bits == 4) {
                        const __m128i m = _mm_set1_epi8(0x0F);
                        lo = c0 + c == 0 ? _mm_and_si128(b4[0], m) : _mm_and_si128(_mm_srli_epi16(b4[0], 4), m);
                        hi = c0 + c == 0 ? _mm_and_si128(b4[1], m) : _mm_and_si128(_mm_srli_epi16(b4[1], 4), m);
                    } else if (LANES(bits)) { /* the pair's vectors packed to bytes, lanes in order */
                        const uint8_t *blk = lane_block(qg, kk, bits);
                        const __m256i v0 = lane_vector(blk, 4 * ((i & 7) >> 1) + 2 * (c0 + c), bits), v1 = lane_vector(blk, 4 * ((i & 7) >> 1) + 2 * (c0 + c) + 1, bits);
                        lo = _mm_packus_epi16(_mm256_castsi256_si128(v0), _mm256_extracti128_si256(v0, 1));
                        hi = _mm_packus_epi16(_mm256_castsi256_si128(v1), _mm256_extracti128_si256(v1, 1));
                    } else {
                        const __m128i v0 = panel_bytes(qg, kk, 16 * (c0 + c), bits, 16), v1 = panel_bytes(qg, kk + 1, 16 * (c0 + c), bits, 16);
                        lo = _mm_unpacklo_epi8(v0, v1), hi = _mm_unpackhi_epi8(v0, v1);
                    }
                    const int sgn = bits == 8 || bits == NL4;
                    for (int r = 0; r < rows; r++) {
                        a16[r][2 * c] = _mm_add_epi16(a16[r][2 * c], sgn ? _mm_maddubs_epi16(_mm_abs_epi8(lo), _mm_sign_epi8(xb[r], lo)) : _mm_maddubs_epi16(lo, xb[r]));
                        a16[r][2 * c + 1] = _mm_add_epi16(a16[r][2 * c + 1], sgn ? _mm_maddubs_epi16(_mm_abs_epi8(hi), _mm_sign_epi8(xb[r], hi)) : _mm_maddubs_epi16(hi, xb[r]));
                    }
                }
                if ((i + 2) % (2 * A8G_PAIRS(bits)) == 0)
                    for (int r = 0; r < rows; r++)
                        for (int v = 0; v < 2 * nc; v++) acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_cvtepi16_epi32(a16[r][v]));
            }
            if ((b + 1) * 8 % E == 0) { /* a chunk's end: its int32 sums times d * its x scale */
                const int64_t ch = grp * per_group + (b * 8) / E;
                for (int r = 0; r < rows; r++) {
                    const __m256 s = _mm256_set1_ps(xs[r * C + ch]);
                    for (int v = 0; v < 2 * nc; v++) {
                        tot[r][v] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_load_ps(dv + 8 * v), s), _mm256_cvtepi32_ps(acc[r][v]), tot[r][v]);
                        acc[r][v] = _mm256_setzero_si256();
                    }
                }
            }
        }
        if (has_min)
            for (int r = 0; r < rows; r++) {
                float xg = 0.f; /* the group's sum of rounded x: its chunks' s * sum(xq) */
                for (int64_t ch = grp * per_group; ch < (grp + 1) * per_group; ch++) xg += xsum[r * C + ch];
                for (int v = 0; v < 2 * nc; v++) tot[r][v] = _mm256_fmadd_ps(_mm256_load_ps(mv + 8 * v), _mm256_set1_ps(xg), tot[r][v]);
            }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < 2 * nc; v++) _mm256_storeu_ps(y + r * ldy + 16 * c0 + 8 * v, tot[r][v]);
}

/* Panel p's rows of y [M <= 2, ldo] (its valid outputs) from rounded x. */
static inline __attribute__((always_inline)) void panel_a8_block(const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K,
    const panel_w_t *w, int64_t N, int64_t g, int64_t E, float *y, int64_t ldo, int64_t p, const int bits) {
    const int64_t G = K / g, valid = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
    const panel_w_t wp = panel_at(w, p, G, g, bits);
    float tail[2 * PANEL];
    float *yo = valid == PANEL ? y + p * PANEL : tail;
    const int64_t ldy = valid == PANEL ? ldo : PANEL;
    if (M <= 1) panel_a8_gemv(xq, xs, xsum, K, &wp, G, g, E, 0, yo, ldy, bits, 1, 2);
    else panel_a8_gemv(xq, xs, xsum, K, &wp, G, g, E, 0, yo, ldy, bits, 2, 1), panel_a8_gemv(xq, xs, xsum, K, &wp, G, g, E, 1, yo, ldy, bits, 2, 1);
    if (valid < PANEL)
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < valid; j++) y[r * ldo + p * PANEL + j] = tail[r * PANEL + j];
}
typedef void (*panel_a8_block_fn)(const int8_t *, const float *, const float *, int64_t, int64_t, const panel_w_t *, int64_t, int64_t,
                                  int64_t, float *, int64_t, int64_t);
#define A8G_WIDTH(B)                                                                                                                \
    static void panel_a8_block_##B(const int8_t *xq, const float *xs, const float *xsum, int64_t M, int64_t K, const panel_w_t *w,  \
                                   int64_t N, int64_t g, int64_t E, float *y, int64_t ldo, int64_t p) {                            \
        panel_a8_block(xq, xs, xsum, M, K, w, N, g, E, y, ldo, p, B);                                                               \
    }
A8G_WIDTH(2)
A8G_WIDTH(3)
A8G_WIDTH(4)
A8G_WIDTH(5)
A8G_WIDTH(6)
A8G_WIDTH(8)
A8G_WIDTH(NL4)
A8G_WIDTH(L5)
A8G_WIDTH(L6)

/* y [M <= 2, ldo] (from column offset) = xhat @ W^T: the parts' panels in one parallel loop, x
 * rounded once. Parts of 8 bits or IQ4_NL run the float GEMVs on xhat's floats. */
static int64_t a8_chunk(int64_t g) { return g < 32 ? g : 32; }

/* Rows of x rounded to int8 per chunk of E columns: xq signed, xs and xsum per chunk (a8_quantize_row). */
static void a8_round_rows(const float *x, int64_t M, int64_t K, int64_t E, int8_t *xq, float *xs, float *xsum) {
    for (int64_t m = 0; m < M; m++) {
        a8_quantize_row(x + m * K, K, (int)E, (uint8_t *)xq + m * K, xs + m * (K / E), xsum + m * (K / E));
        if (A8_VNNI) for (int64_t k = 0; k < K; k++) xq[m * K + k] ^= (int8_t)0x80; /* (stored + 128 for vpdpbusd) */
    }
}

/* y [M <= 2, ldo] (from each part's column offset) = xhat @ the parts' W^T: their panels in one
 * parallel loop, x rounded once (parts of different chunk sizes: one after another). */
static void panel_parts_a8_gemv(const float *x, int64_t M, int64_t K, panel_part_t *parts, int nparts, float *y, int64_t ldo) {
    const int64_t E = a8_chunk(parts[0].g);
    for (int i = 1; i < nparts; i++)
        if (a8_chunk(parts[i].g) != E) {
            for (int j = 0; j < nparts; j++) panel_parts_a8_gemv(x, M, K, parts + j, 1, y, ldo);
            return;
        }
    int8_t *xq = malloc(M * K);
    float *xs = malloc(sizeof(float) * M * (K / E)), *xsum = malloc(sizeof(float) * M * (K / E));
    a8_round_rows(x, M, K, E, xq, xs, xsum);
    int64_t first[8], P = 0;
    for (int i = 0; i < nparts; i++) first[i] = P, P += (parts[i].N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t gp = 0; gp < P; gp++) {
        int i = 0;
        while (i + 1 < nparts && gp >= first[i + 1]) i++;
        const panel_part_t *pt = &parts[i];
        const int b = (int)pt->bits;
        const panel_a8_block_fn fn = b == L5 ? panel_a8_block_L5 : b == L6 ? panel_a8_block_L6 : b == 2 ? panel_a8_block_2 : b == 3 ? panel_a8_block_3 : b == 5 ? panel_a8_block_5 : b == 6 ? panel_a8_block_6
                                     : b == 8 ? panel_a8_block_8 : b == NL4 ? panel_a8_block_NL4 : panel_a8_block_4;
        fn(xq, xs, xsum, M, K, &pt->w, pt->N, pt->g, E, y + pt->offset, ldo, gp - first[i]);
    }
    free(xq), free(xs), free(xsum);
}

/* y [M, N] = xhat [M, K] @ W^T for W in panels (as fl_panel_gemm), x rounded to int8 per row and
 * chunk of min(g, 32) columns (quantized.round_activations); g a multiple of 16 or 16 itself. */
void fl_panel_gemm_a8(const float *x, int64_t M, int64_t K, const uint8_t *qp, const void *sp, const void *mp, int64_t sbytes,
                      const void *sup_s, const void *sup_m, int64_t gps, int64_t N, int64_t g, int64_t bits, float *y) {
    const panel_w_t w = panel_w(qp, sp, mp, sbytes, (int)bits, sup_s, sup_m, gps);
    if (M <= 2) { /* decode: the GEMVs */
        panel_part_t part = panel_part(w, N, g, bits, 0);
        panel_parts_a8_gemv(x, M, K, &part, 1, y, N);
        return;
    }
    const a8_panel_fn panel = bits == L5 ? a8_panel_L5 : bits == L6 ? a8_panel_L6 : bits == NL4 ? a8_panel_NL4 : bits == 2 ? a8_panel_2 : bits == 3 ? a8_panel_3 : bits == 5 ? a8_panel_5 : bits == 6 ? a8_panel_6 : bits == 8 ? a8_panel_8 : a8_panel_4;
    const int E = g < 32 ? (int)g : 32;
    const int64_t P = (N + PANEL - 1) / PANEL, kc = (g >= A8_KC ? g : A8_KC / g * g), C = K / E;
    uint8_t *xq = aligned_alloc(64, (M * K + 63) & ~(int64_t)63);
    float *xs = malloc(sizeof(float) * M * C), *xsum = malloc(sizeof(float) * M * C);
    FOR_ROWS(m, M, { a8_quantize_row(x + m * K, K, E, xq + m * K, xs + m * C, xsum + m * C); })
#pragma omp parallel
    {
        a8_buf_t b = {aligned_alloc(64, kc * PANEL), aligned_alloc(64, sizeof(float) * kc / E * PANEL),
                      aligned_alloc(64, sizeof(float) * kc / E * PANEL), aligned_alloc(64, sizeof(int32_t) * kc / E * PANEL)};
        float *t = aligned_alloc(64, sizeof(float) * A8_MC * PANEL);
        for (int64_t m0 = 0; m0 < M; m0 += A8_MC) { /* all panels over one block of rows: it stays in L2 */
            const int64_t mc = M - m0 < A8_MC ? M - m0 : A8_MC;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < P; p++) panel(xq + m0 * K, xs + m0 * C, xsum + m0 * C, mc, K, &w, N, g, E, y + m0 * N, p, &b, t);
        }
        free(b.wb);
        free(b.wd);
        free(b.wm);
        free(b.wneg);
        free(t);
    }
    free(xq);
    free(xs);
    free(xsum);
}

/* ---- a whole decode step over all layers in one call ------------------------------------------
 * What the model's forward does for B single-token sequences (see model/llama.py), without a
 * Python round trip per op: ~300 ops a step would otherwise cost more than the attention. */
typedef struct fl_linear {
    int64_t kind; /* 0: fp32 weights, 1: quantized panels (bits, sbytes, sup_s, sup_m, gps: see panel_w_t), 3: w8a8,
                   4: panel matrices side by side (parts: nparts kind-1 linears, their outputs in order) */
    int64_t n, k, g, bits, sbytes;
    const void *w, *scales, *mins;
    const void *sup_s, *sup_m;
    int64_t gps;
    const struct fl_linear *parts;
    int64_t nparts;
    const float *bias;     /* or NULL */
    const int32_t *wsum;   /* w8a8: row sums of w */
    const float *in_scale; /* w8a8: the static activation scale, or NULL for per-token scales */
    int64_t clip;          /* w8a8, static: rows beyond the scale's range saturate (else: their own scale) */
    int64_t a8;            /* kinds 1 and 4: x rounded to int8 by chunk (quantization "gguf-a8") */
    int64_t wtype;         /* kind 0: the weights' float type (W_F32, W_F16, W_BF16) */
} fl_linear_t;

typedef struct {
    const float *attn_norm, *mlp_norm;
    fl_linear_t qkv, o, gate_up, down;
    float *k_cache, *v_cache;
} fl_layer_t;

#define GEMV_MAX_ROWS 16 /* rows up to which a step's panels go through the GEMVs, past it the GEMM (kernels.GEMV_MAX_ROWS) */

/* xq, xs: room for M rows of int8 activations and their scales (w8a8) */
static void run_linear(const fl_linear_t *L, const float *x, int64_t M, float *y, int8_t *xq, float *xs) {
    if (L->kind == 3 && M > MT && L->k > 2 * KB) {
        /* w8a8 (row layout) past MT rows, long rows: one call per MT rows. Within one call each weight
         * row's MT-row passes would re-read all M rows of x from L2 (the row-layout 4-bit down_proj
         * took 3.8x its batch-8 time at batch 16); streaming the weights twice costs less. Panels
         * walk a panel's columns (L1-resident) once per MT rows instead: no split needed (batch 16
         * with and without it: 15.90 vs 15.64 ms a step, ab_kernels.py). fp32 has column blocks. */
        for (int64_t m0 = 0; m0 < M; m0 += MT)
            run_linear(L, x + m0 * L->k, M - m0 < MT ? M - m0 : MT, y + m0 * L->n, xq, xs);
        return;
    }
    if (L->kind == 3) {
        fl_quantize_rows(x, M, L->k, L->in_scale, L->clip, xq, xs);
        fl_w8a8_linear(xq, xs, M, L->k, (const int8_t *)L->w, (const float *)L->scales, L->wsum, L->n, L->bias, y);
        return;
    }
    if (L->kind == 0) fl_float_linear(x, M, L->k, L->w, L->wtype, L->n, y);
    else {
        const fl_linear_t *ps = L->kind == 4 ? L->parts : L;
        const int n = L->kind == 4 ? (int)L->nparts : 1;
        panel_part_t parts[8];
        for (int i = 0, off = 0; i < n; off += (int)ps[i].n, i++)
            parts[i] = panel_part(panel_w(ps[i].w, ps[i].scales, ps[i].mins, ps[i].sbytes, (int)ps[i].bits, ps[i].sup_s, ps[i].sup_m, ps[i].gps),
                                  ps[i].n, ps[i].g, ps[i].bits, off);
        if (!L->a8 && M > GEMV_MAX_ROWS) panel_parts_gemm(x, M, L->k, parts, n, y, L->n); /* (AVX-512's GEMVs would take any M) */
        else if (!L->a8) panel_parts_linear(x, M, L->k, parts, n, y, L->n);
        else if (M <= 2) panel_parts_a8_gemv(x, M, L->k, parts, n, y, L->n);
        else /* the a8 GEMM, a part at a time */
            for (int i = 0; i < n; i++) {
                float *yi = n == 1 ? y : malloc(sizeof(float) * M * ps[i].n);
                fl_panel_gemm_a8(x, M, L->k, ps[i].w, ps[i].scales, ps[i].mins, ps[i].sbytes, ps[i].sup_s, ps[i].sup_m, ps[i].gps, ps[i].n,
                                 ps[i].g, ps[i].bits, yi);
                if (n > 1) {
                    for (int64_t m = 0; m < M; m++) memcpy(y + m * L->n + parts[i].offset, yi + m * ps[i].n, sizeof(float) * ps[i].n);
                    free(yi);
                }
            }
    }
    if (L->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < L->n; n++) y[m * L->n + n] += L->bias[n];
}

/* Activation buffers start on a cache line: with 8 rows, a GEMV's x loads outnumber its weight
 * loads 8:1, and a 64-byte load that straddles two lines costs two (malloc aligns to 16 only). */
static float *floats64(int64_t n) { return aligned_alloc(64, (sizeof(float) * n + 63) & ~(size_t)63); }

static void add_into(float *h, const float *d, int64_t n) {
    for (int64_t i = 0; i < n; i++) h[i] += d[i];
}

/* h [B, K] = rows tokens[b] of an embedding table described like a linear (fp32 or panels),
 * dequantized as the model's embedding does it: float(q) * scale + min. */
static void embed_rows(const fl_linear_t *E, const int64_t *tokens, int64_t B, float *h) {
    const int64_t K = E->k, g = E->g, G = K / g;
    const panel_w_t w = panel_w(E->w, E->scales, E->mins, E->sbytes, (int)E->bits, E->sup_s, E->sup_m, E->gps);
    for (int64_t b = 0; b < B; b++) {
        const int64_t t = tokens[b];
        float *o = h + b * K;
        if (E->kind == 0) { /* float rows, widened as the model's embedding does */
            if (E->wtype == W_F32) memcpy(o, (const float *)E->w + t * K, sizeof(float) * K);
            else
                for (int64_t k = 0; k < K; k++) o[k] = half_to_float(((const uint16_t *)E->w)[t * K + k], (int)E->wtype);
            continue;
        }
        const int64_t p = t / PANEL, j = t % PANEL; /* row t is lane t % 32 of its panel's columns */
        const panel_w_t wp = panel_at(&w, p, G, g, (int)E->bits);
        for (int64_t grp = 0; grp < G; grp++) {
            const uint8_t *q = wp.q + grp * g * COL_BYTES(E->bits);
            const int64_t si = grp * PANEL + j;
            const float s = load1s(&wp, wp.scales, wp.sup_s, si);
            const float m = wp.mins == NULL ? -wp.centre * s : load1s(&wp, wp.mins, wp.sup_m, si);
            for (int64_t kk = 0; kk < g; kk++) o[grp * g + kk] = (float)panel_value(q, kk, j, (int)E->bits) * s + m;
        }
    }
}

/* out [n, K] = rows ids[0..n) of W in panels as floats (as fl_panel_linear's arguments; the ids
 * < N): the quantized embedding's lookup for a prompt, without gathering whole panels. */
void fl_panel_rows(const uint8_t *qp, const void *sp, const void *mp, int64_t sbytes, const void *sup_s, const void *sup_m, int64_t gps,
                   int64_t K, int64_t g, int64_t bits, const int64_t *ids, int64_t n, float *out) {
    fl_linear_t E;
    memset(&E, 0, sizeof(E));
    E.kind = 1, E.k = K, E.g = g, E.bits = bits, E.sbytes = sbytes, E.w = qp, E.scales = sp, E.mins = mp, E.sup_s = sup_s, E.sup_m = sup_m, E.gps = gps;
    FOR_ROWS(i, n, { embed_rows(&E, ids + i, 1, out + i * K); })
}

/* cos, sin [B, D] = the rotate-half RoPE tables of each token's position, as the model builds
 * them: angle = float(position) * inv_freq[i] for i < D/2, repeated for the second half. */
static void rope_tables(const int64_t *positions, int64_t B, const float *inv_freq, int64_t D, float *cos_out, float *sin_out) {
    const int64_t half = D / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < half; i++) {
            const float angle = (float)positions[b] * inv_freq[i];
            cos_out[b * D + i] = cos_out[b * D + half + i] = cosf(angle);
            sin_out[b * D + i] = sin_out[b * D + half + i] = sinf(angle);
        }
}

/* One decode step, tokens [B] in, logits [B, vocab] out: embedding, every layer, final norm and
 * lm_head. inv_freq [D/2]: RoPE frequencies; slot_mapping, positions [B] (where each token's K/V
 * go, see fl_rope_store_kv); block_tables [B, bt_stride]; lengths [B] = positions + 1; caches paged
 * with blocks of bs rows (sb, sh as in kv_pages_t).
 * profile: NULL, or 11 doubles that accumulate the seconds spent in each stage (order below). */
enum { ST_NORM, ST_QKV, ST_ROPE, ST_ATTN, ST_O, ST_GATE_UP, ST_SILU, ST_DOWN, ST_RESIDUAL, ST_EMBED, ST_LM_HEAD };
#define STAGE(id, call) do { double t0_ = profile ? omp_get_wtime() : 0; call; if (profile) profile[id] += omp_get_wtime() - t0_; } while (0)
/* seq_offsets NULL: B sequences decoding one token each (lengths: their lengths with it); else
 * n_seqs packed sequences, rows seq_offsets[s] .. seq_offsets[s + 1] - 1 of sequence s at positions
 * seq_starts[s] .. (a prompt or a chunk of one: prefill attention, causal, over its cached prefix;
 * lengths then holds those of the one-token sequences, in order).
 * out_rows NULL: logits [B, vocab] of every row, else [n_out, vocab] of those rows (n_out 0: none). rope_cos,
 * rope_sin [B, D]: the RoPE tables (the model's, to the bit), NULL: computed here from inv_freq. */
void fl_decode_forward(const fl_layer_t *layers, int64_t n_layers, const int64_t *tokens, const fl_linear_t *embed, int64_t B,
                       int64_t hidden, int64_t H, int64_t KVH, int64_t D, int64_t inter, int64_t bs, int64_t sb, int64_t sh, float eps,
                       const float *inv_freq, const int64_t *slot_mapping, const int64_t *positions, const int32_t *block_tables,
                       int64_t bt_stride, const int64_t *lengths, int64_t n_seqs, const int64_t *seq_offsets, const int64_t *seq_starts,
                       int64_t n_out, const int64_t *out_rows, const float *rope_cos, const float *rope_sin, const float *final_norm,
                       const fl_linear_t *lm_head, float *logits, double *profile) {
    const int64_t qkv_n = (H + 2 * KVH) * D;
    float *h = floats64(B * hidden), *out = floats64(B * hidden);
    float *x = floats64(B * hidden), *y = floats64(B * hidden), *qkv = floats64(B * qkv_n), *q = floats64(B * H * D);
    float *att = floats64(B * H * D), *gu = floats64(B * 2 * inter), *act = floats64(B * inter), *xs = floats64(B);
    const int64_t widest = inter > H * D ? (inter > hidden ? inter : hidden) : (H * D > hidden ? H * D : hidden);
    int8_t *xq = aligned_alloc(64, (B * widest + 63) & ~(int64_t)63);
    float *cos_t = floats64(B * D), *sin_t = floats64(B * D);
    if (rope_cos) memcpy(cos_t, rope_cos, sizeof(float) * B * D), memcpy(sin_t, rope_sin, sizeof(float) * B * D);
    else rope_tables(positions, B, inv_freq, D, cos_t, sin_t);
    STAGE(ST_EMBED, embed_rows(embed, tokens, B, h));
    const float scale = 1.f / sqrtf((float)D);
    for (int64_t i = 0; i < n_layers; i++) {
        const fl_layer_t *L = layers + i;
        /* the previous layer's residual add (its down projection in y) with this layer's first norm */
        if (i == 0) STAGE(ST_NORM, fl_rms_norm(h, L->attn_norm, eps, B, hidden, x));
        else STAGE(ST_NORM, fl_add_rms_norm(y, h, L->attn_norm, eps, B, hidden, h, x));
        STAGE(ST_QKV, run_linear(&L->qkv, x, B, qkv, xq, xs));
        STAGE(ST_ROPE, fl_rope_store_kv(qkv, cos_t, sin_t, slot_mapping, B, H, KVH, D, L->k_cache, L->v_cache, bs, sb, sh, q));
        if (!seq_offsets) STAGE(ST_ATTN, fl_decode_attention(q, L->k_cache, L->v_cache, block_tables, bt_stride, lengths, B, H, KVH, D, bs, sb, sh, scale, att));
        else /* a run of one-token sequences in one decode call (lengths: theirs, in order), a prompt's rows in a prefill call */
            for (int64_t s = 0, d = 0, e; s < n_seqs; s = e) {
                const int64_t lo = seq_offsets[s], n = seq_offsets[s + 1] - lo;
                for (e = s + 1; n == 1 && e < n_seqs && seq_offsets[e + 1] - seq_offsets[e] == 1; e++) {}
                if (n == 1) STAGE(ST_ATTN, fl_decode_attention(q + lo * H * D, L->k_cache, L->v_cache, block_tables + s * bt_stride, bt_stride, lengths + d, e - s, H, KVH, D, bs, sb, sh, scale, att + lo * H * D));
                else if (n > 1) STAGE(ST_ATTN, fl_prefill_attention(q + lo * H * D, L->k_cache, L->v_cache, block_tables + s * bt_stride, seq_starts[s], n, H, KVH, D, bs, sb, sh, scale, att + lo * H * D));
                if (n == 1) d += e - s;
            }
        STAGE(ST_O, run_linear(&L->o, att, B, y, xq, xs));
        STAGE(ST_NORM, fl_add_rms_norm(y, h, L->mlp_norm, eps, B, hidden, h, x));
        STAGE(ST_GATE_UP, run_linear(&L->gate_up, x, B, gu, xq, xs));
        STAGE(ST_SILU, fl_silu_and_mul(gu, B, inter, act));
        STAGE(ST_DOWN, run_linear(&L->down, act, B, y, xq, xs));
    }
    if (n_layers > 0) STAGE(ST_RESIDUAL, add_into(h, y, B * hidden)); /* the last layer's (the others' went with the next norm) */
    if (n_out == 0) { /* no row samples: a prompt's middle chunk, its K/V all the step is for */
    } else if (out_rows) { /* only these rows' logits: gather their hidden states first */
        for (int64_t r = 0; r < n_out; r++) memcpy(y + r * hidden, h + out_rows[r] * hidden, sizeof(float) * hidden);
        STAGE(ST_NORM, fl_rms_norm(y, final_norm, eps, n_out, hidden, out));
        STAGE(ST_LM_HEAD, run_linear(lm_head, out, n_out, logits, xq, xs));
    } else {
        STAGE(ST_NORM, fl_rms_norm(h, final_norm, eps, B, hidden, out));
        STAGE(ST_LM_HEAD, run_linear(lm_head, out, B, logits, xq, xs));
    }
    free(h); free(out); free(x); free(y); free(qkv); free(q); free(att); free(gu); free(act); free(xs); free(xq); free(cos_t); free(sin_t);
}

/* ---- quantizers' search for each group's scale and min (quant/quantize.py search_scale_min) ------
 * x ~ scale * L + min with L in [0, nmax]: llama.cpp's make_qkx2_quants, the reference's steps and
 * rounding (ties to even) in the same order, with eight groups in the lanes of a vector, so each
 * group's sums run over its values one after another (the reference sums in torch's order: the
 * same choice but for the last bits of near-ties). A 135M model's w4 groups: ~1 s against ~13 s
 * for the reference's ~40 tensor ops a candidate. */
#define SEARCH_LANES 8

typedef struct { __m256 l, l2, xl; } level_sums8;

static inline __m256 levels_at8(__m256 t, __m256 shifted, __m256 top) {
    __m256 l = _mm256_round_ps(_mm256_mul_ps(t, shifted), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_min_ps(_mm256_max_ps(l, _mm256_setzero_ps()), top);
}

/* the weighted error of x ~ scale * L + min over each lane's group */
static inline __m256 search_err8(const float *X, const float *W, const float *S, int64_t g, __m256 t, __m256 top, __m256 scale, __m256 mn,
                                 level_sums8 s, __m256 sum_w, __m256 sum_x, __m256 sum_x2, int use_mad) {
    const __m256 two = _mm256_set1_ps(2.0f);
    if (!use_mad) { /* scale*(scale*sum_l2 + 2*(mn*sum_l - sum_xl)) + mn*(mn*sum_w - 2*sum_x) + sum_x2, at least 0 */
        __m256 a = _mm256_mul_ps(scale, _mm256_add_ps(_mm256_mul_ps(scale, s.l2), _mm256_mul_ps(two, _mm256_sub_ps(_mm256_mul_ps(mn, s.l), s.xl))));
        __m256 b = _mm256_mul_ps(mn, _mm256_sub_ps(_mm256_mul_ps(mn, sum_w), _mm256_mul_ps(two, sum_x)));
        return _mm256_max_ps(_mm256_add_ps(_mm256_add_ps(a, b), sum_x2), _mm256_setzero_ps());
    }
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 e = _mm256_setzero_ps();
    for (int64_t i = 0; i < g; i++) {
        const __m256 l = levels_at8(t, _mm256_loadu_ps(S + i * SEARCH_LANES), top);
        const __m256 d = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(scale, l), mn), _mm256_loadu_ps(X + i * SEARCH_LANES));
        e = _mm256_add_ps(e, _mm256_mul_ps(_mm256_loadu_ps(W + i * SEARCH_LANES), _mm256_andnot_ps(sign, d)));
    }
    return e;
}

static inline level_sums8 search_sums8(const float *X, const float *W, const float *S, int64_t g, __m256 t, __m256 top) {
    level_sums8 s = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < g; i++) {
        const __m256 l = levels_at8(t, _mm256_loadu_ps(S + i * SEARCH_LANES), top);
        const __m256 wl = _mm256_mul_ps(_mm256_loadu_ps(W + i * SEARCH_LANES), l);
        s.l = _mm256_add_ps(s.l, wl);
        s.l2 = _mm256_add_ps(s.l2, _mm256_mul_ps(wl, l));
        s.xl = _mm256_add_ps(s.xl, _mm256_mul_ps(wl, _mm256_loadu_ps(X + i * SEARCH_LANES)));
    }
    return s;
}

/* groups [n0, n0 + count) of x, w [n, g] (count <= 8; missing lanes are groups of zeros, never live) */
static void search_scale_min8(const float *x, const float *w, int64_t n0, int64_t count, int64_t g, int64_t nmax, float rmin, float rdelta,
                              int64_t nstep, int use_mad, float *scale_out, float *min_out, float *levels_out, float *buf) {
    float *X = buf, *W = buf + g * SEARCH_LANES, *S = buf + 2 * g * SEARCH_LANES;
    for (int64_t i = 0; i < g; i++)
        for (int64_t j = 0; j < SEARCH_LANES; j++) {
            X[i * SEARCH_LANES + j] = j < count ? x[(n0 + j) * g + i] : 0.0f;
            W[i * SEARCH_LANES + j] = j < count ? w[(n0 + j) * g + i] : 0.0f;
        }
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), top = _mm256_set1_ps((float)nmax);
    __m256 xmin = _mm256_loadu_ps(X), xmax = xmin;
    __m256 sum_w = zero, sum_x = zero, sum_x2 = zero;
    for (int64_t i = 0; i < g; i++) {
        const __m256 xi = _mm256_loadu_ps(X + i * SEARCH_LANES), wi = _mm256_loadu_ps(W + i * SEARCH_LANES), wx = _mm256_mul_ps(wi, xi);
        xmin = _mm256_min_ps(xmin, xi);
        xmax = _mm256_max_ps(xmax, xi);
        sum_w = _mm256_add_ps(sum_w, wi);
        sum_x = _mm256_add_ps(sum_x, wx);
        sum_x2 = _mm256_add_ps(sum_x2, _mm256_mul_ps(wx, xi));
    }
    xmin = _mm256_min_ps(xmin, zero);
    const __m256 rng = _mm256_sub_ps(xmax, xmin);
    const __m256 live = _mm256_cmp_ps(rng, zero, _CMP_GT_OQ);
    const __m256 inv_rng = _mm256_and_ps(live, _mm256_div_ps(one, _mm256_blendv_ps(one, rng, live)));
    for (int64_t i = 0; i < g; i++)
        _mm256_storeu_ps(S + i * SEARCH_LANES, _mm256_sub_ps(_mm256_loadu_ps(X + i * SEARCH_LANES), xmin));

    __m256 scale = _mm256_and_ps(live, _mm256_div_ps(rng, top)), mn = xmin, factor = top;
    __m256 t = _mm256_mul_ps(top, inv_rng);
    __m256 best = search_err8(X, W, S, g, t, top, scale, mn, search_sums8(X, W, S, g, t, top), sum_w, sum_x, sum_x2, use_mad);
    for (int64_t step = 0; step <= nstep; step++) {
        const __m256 c = _mm256_set1_ps((float)((double)nmax + (double)rmin + (double)rdelta * (double)step));
        t = _mm256_mul_ps(c, inv_rng);
        const level_sums8 s = search_sums8(X, W, S, g, t, top);
        const __m256 det = _mm256_sub_ps(_mm256_mul_ps(sum_w, s.l2), _mm256_mul_ps(s.l, s.l));
        const __m256 ok = _mm256_cmp_ps(det, zero, _CMP_GT_OQ);
        const __m256 safe = _mm256_blendv_ps(one, det, ok);
        __m256 c_scale = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sum_w, s.xl), _mm256_mul_ps(sum_x, s.l)), safe);
        __m256 c_min = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(s.l2, sum_x), _mm256_mul_ps(s.l, s.xl)), safe);
        const __m256 positive = _mm256_cmp_ps(c_min, zero, _CMP_GT_OQ); /* the min may only go down: refit through zero */
        const __m256 through_zero = _mm256_div_ps(s.xl, _mm256_blendv_ps(one, s.l2, _mm256_cmp_ps(s.l2, zero, _CMP_GT_OQ)));
        c_scale = _mm256_blendv_ps(c_scale, through_zero, positive);
        c_min = _mm256_andnot_ps(positive, c_min);
        const __m256 c_err = search_err8(X, W, S, g, t, top, c_scale, c_min, s, sum_w, sum_x, sum_x2, use_mad);
        const __m256 take = _mm256_and_ps(_mm256_and_ps(live, ok), _mm256_cmp_ps(c_err, best, _CMP_LT_OQ));
        best = _mm256_blendv_ps(best, c_err, take);
        scale = _mm256_blendv_ps(scale, c_scale, take);
        mn = _mm256_blendv_ps(mn, c_min, take);
        factor = _mm256_blendv_ps(factor, c, take);
    }
    float sc[SEARCH_LANES], mi[SEARCH_LANES];
    _mm256_storeu_ps(sc, scale);
    _mm256_storeu_ps(mi, mn);
    t = _mm256_mul_ps(factor, inv_rng);
    for (int64_t i = 0; i < g; i++) _mm256_storeu_ps(X + i * SEARCH_LANES, levels_at8(t, _mm256_loadu_ps(S + i * SEARCH_LANES), top));
    for (int64_t j = 0; j < count; j++) {
        scale_out[n0 + j] = sc[j];
        min_out[n0 + j] = mi[j];
        for (int64_t i = 0; i < g; i++) levels_out[(n0 + j) * g + i] = X[i * SEARCH_LANES + j];
    }
}

void fl_search_scale_min(const float *x, const float *w, int64_t n, int64_t g, int64_t nmax, float rmin, float rdelta, int64_t nstep,
                         int64_t use_mad, float *scale, float *mins, float *levels) {
    const int64_t blocks = (n + SEARCH_LANES - 1) / SEARCH_LANES;
#pragma omp parallel
    {
        float *buf = malloc(sizeof(float) * 3 * g * SEARCH_LANES);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * SEARCH_LANES;
            search_scale_min8(x, w, n0, n - n0 < SEARCH_LANES ? n - n0 : SEARCH_LANES, g, nmax, rmin, rdelta, nstep, (int)use_mad, scale, mins,
                              levels, buf);
        }
        free(buf);
    }
}
