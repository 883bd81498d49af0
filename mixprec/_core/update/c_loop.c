/* mixprec's fused update for CPUs: one pass over a parameter's memory per step.
 *
 * Built by c_loop.py with the -D defines of one spec.StepKind (the optimizer, the
 * update mode, the dtype of the weight, the gradient and each state, each scalar's position
 * SC_*), compiled with the
 * machine's C compiler at -O3 -march=native, vectorized by the compiler. Every expression is
 * the one compiled_step.py hands to torch.compile and state_codes.py runs eagerly, in the same order,
 * so the result is torch's up to fp32 rounding order (no contraction into FMA: -ffp-contract=off).
 *
 * Defines: ADAM (else SGD), DECOUPLED, MOMENTUM, NESTEROV; UPDATE 0 nearest, 1 kahan,
 * 2 stochastic; W16 (weight, and Kahan compensation) 1 bf16, 2 fp16; G 0 fp32, 1 bf16,
 * 2 fp16; S1, S2 (exp_avg / exp_avg_sq, or the momentum buffer as S1): 0 fp32, 1 bf16,
 * 2 fp16, 8 codes of 8 bits, 4 codes of 4 bits, with S1K / S2K 1 for "sqrt" codes, 0 signed
 * (then S?MAG, S?MB, S?EMIN: magnitude bits, mantissa bits, lowest binade; S?E4M3 1 where
 * the code is torch's float8_e4m3fn; S?SRC 1 where this step reads fp32 values r1 / r2
 * instead of the codes, as after a checkpoint that held the state decoded).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256
#define TINY 7.888609052210118e-31f /* 2**-100 */

static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float from_bf16(uint16_t b) { return u2f((uint32_t)b << 16); }
static inline uint16_t to_bf16(float f) {  /* round to nearest even; NaN -> quiet NaN */
    uint32_t u = f2u(f);
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : r;
}
/* fp16 by bit arithmetic, not _Float16 (gcc before 12 has none on x86; this vectorizes) */
static inline float from_f16(uint16_t h) {  /* exact */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7FFFu;
    uint32_t normal = (em << 13) + ((uint32_t)(127 - 15) << 23);
    uint32_t special = (em << 13) | 0x7F800000u;  /* inf, NaN (payload kept) */
    float tiny = (float)em * 0x1p-24f;          /* subnormals and zero */
    float v = em >= 0x7C00u ? u2f(special) : (em >= 0x0400u ? u2f(normal) : tiny);
    return u2f(f2u(v) | sign);
}
static inline uint16_t to_f16(float f) {  /* round to nearest even; NaN -> quiet NaN */
    uint32_t x = f2u(f), a = x & 0x7FFFFFFFu;
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t sub = f2u(u2f(a) + 0.5f) - f2u(0.5f);  /* below 2**-14: multiples of 2**-24 */
    uint32_t nrm = (a + ((uint32_t)(15 - 127) << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
    uint32_t r = a > 0x7F800000u ? 0x7E00u
               : a >= 0x477FF000u ? 0x7C00u  /* 65520 and up round to inf */
               : a < 0x38800000u ? sub : nrm;
    return (uint16_t)(r | sign);
}

/* float -> float8_e4m3fn, round to nearest even, for |f| < 464 (store_block's values); NaN and
 * larger to 0x7F (a NaN), the sign kept. */
static inline uint8_t to_e4m3(float f) {
    uint32_t b = f2u(f), sign = b & 0x80000000u;
    b ^= sign;
    uint32_t sub = f2u(u2f(b) + u2f(141u << 23)) - (141u << 23);
    uint32_t nrm = (b + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((b >> 20) & 1u)) >> 20;
    uint32_t r = b >= (1087u << 20) ? 0x7Fu : (b < (121u << 23) ? sub : nrm);
    return (uint8_t)(r | (sign >> 24));
}

/* A gradient coded as float8_e4m3fn with a float32 scale per BLOCK (coded.py's code(), op for
 * op: the block's largest magnitude / 448, 1 where it is 0; each value / its scale, rounded to
 * nearest even). g: n elements, kind 2 bf16, 3 fp16, 4 fp32; the last block's padding codes 0. */
#define CODE_BLOCKS(T, LOAD)                                                                 \
    do {                                                                                     \
        const T *x = (const T *)g;                                                           \
        for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                          \
            int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                                   \
            uint32_t mu = 0; /* |x| >= 0: ordered as its bits; inf and NaN above 0x7F7FFFFF */ \
            for (int64_t i = 0; i < len; i++) {                                              \
                uint32_t a = f2u(LOAD(x[b0 + i])) & 0x7FFFFFFFu;                             \
                mu = a > mu ? a : mu;                                                        \
            }                                                                                \
            bad |= mu >= 0x7F800000u;                                                        \
            float s = u2f(mu) / 448.0f;                                                      \
            s = s == 0.0f ? 1.0f : s;                                                        \
            scales[b0 / BLOCK] = s;                                                          \
            for (int64_t i = 0; i < len; i++) codes[b0 + i] = to_e4m3(LOAD(x[b0 + i]) / s);  \
            for (int64_t i = len; i < BLOCK; i++) codes[b0 + i] = 0;                         \
        }                                                                                    \
    } while (0)
#define AS_IS(v) (v)

int mixprec_code_grad(int64_t n, const void *g, int kind, uint8_t *codes, float *scales) {
    uint32_t bad = 0;  /* returns whether every element was finite, as mixprec_finite */
    if (kind == 4) CODE_BLOCKS(float, AS_IS);
    else if (kind == 2) CODE_BLOCKS(uint16_t, from_bf16);
    else CODE_BLOCKS(uint16_t, from_f16);
    return !bad;
}

/* float8_e4m3fn -> float, exactly (0x7F and 0xFF are NaN). */
static inline float from_e4m3(uint8_t c) {
    uint32_t sign = (uint32_t)(c & 0x80u) << 24, e = (c >> 3) & 0xFu, m = c & 7u;
    float v = e ? u2f(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f; /* m 2**-9 */
    v = (c & 0x7Fu) == 0x7Fu ? u2f(0x7FC00000u) : v;
    return u2f(f2u(v) | sign);
}

/* The gradient decoded: the code's value * scale (* coef where use_coef), rounded to bf16
 * (kind 2) or fp16 (3) -- coded.py's _decoded, op for op. */
void mixprec_decode_grad(int64_t n, const uint8_t *codes, const float *scales, float coef,
                         int use_coef, uint16_t *out, int kind) {
    float tab[256];  /* every code's value, once a call (a lookup beats a branch per element) */
    for (int c = 0; c < 256; c++) tab[c] = from_e4m3((uint8_t)c);
    for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {
        int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;
        const float s = scales[b0 / BLOCK];
        for (int64_t i = 0; i < len; i++) {
            float x = tab[codes[b0 + i]] * s;
            x = use_coef ? x * coef : x;
            out[b0 + i] = kind == 2 ? to_bf16(x) : to_f16(x);
        }
    }
}

/* Whether every element of ``g`` (n elements; kind 2 bf16, 3 fp16, 4 fp32) is
 * finite: no exponent field of all ones. Built into every library (FINITE_ONLY: only this). */
int mixprec_finite(int64_t n, const void *g, int kind) {
    uint32_t any = 0;
    if (kind == 4) {
        const uint32_t *x = (const uint32_t *)g;
        for (int64_t i = 0; i < n; i++) any |= (x[i] & 0x7F800000u) == 0x7F800000u;
    } else {
        const uint16_t *x = (const uint16_t *)g;
        const uint16_t e = kind == 2 ? 0x7F80u : 0x7C00u;
        for (int64_t i = 0; i < n; i++) any |= (x[i] & e) == e;
    }
    return !any;
}

#ifndef FINITE_ONLY
#if W16 == 1
#define W_LOAD(p, i) from_bf16((p)[i])
#define W_ROUND(x) to_bf16(x)
#define W_WIDEN(h) from_bf16(h)
#else
#define W_LOAD(p, i) from_f16((p)[i])
#define W_ROUND(x) to_f16(x)
#define W_WIDEN(h) from_f16(h)
#endif

#if G == 0
typedef float g_t;
#define G_LOAD(p, i) ((p)[i])
#elif G == 1
typedef uint16_t g_t;
#define G_LOAD(p, i) from_bf16((p)[i])
#else
typedef uint16_t g_t;
#define G_LOAD(p, i) from_f16((p)[i])
#endif

/* One state: a value per element, and for codes the per-block scale and layout. */
#define PLAIN_LOAD(K, p, i) ((K) == 0 ? ((const float *)(p))[i] \
    : (K) == 1 ? from_bf16(((const uint16_t *)(p))[i]) : from_f16(((const uint16_t *)(p))[i]))
static inline void plain_store(int k, void *p, int64_t i, float x) {
    if (k == 0) ((float *)p)[i] = x;
    else if (k == 1) ((uint16_t *)p)[i] = to_bf16(x);
    else ((uint16_t *)p)[i] = to_f16(x);
}

/* The codes of the block at element ``at`` (``n`` of them) as one byte each: the codes
 * themselves for 8 bits, unpacked into ``tmp`` (low nibble first) for 4 bits. */
static inline const uint8_t *block_codes(int bits, const uint8_t *c, int64_t at, int n,
                                         uint8_t *tmp) {
    if (bits == 8) return c + at;
    const uint8_t *b = c + (at >> 1);  /* at is even: a row length is even for 4-bit codes */
    for (int k = 0; k < n / 2; k++) {
        tmp[2 * k] = b[k] & 15;
        tmp[2 * k + 1] = b[k] >> 4;
    }
    return tmp;
}

/* the fp32 value of code ``code`` (block scale ``s``) */
static inline float decode(uint32_t code, float s, int e4m3, int sqrtk, int mag, int mb,
                           int emin) {
    if (e4m3) {  /* torch's float8_e4m3fn: s eeee mmm, bias 7, 0x7F a NaN */
        uint32_t mag7 = code & 0x7Fu;
        float v = mag7 >= 8u ? u2f((mag7 << 20) + (120u << 23)) : (float)mag7 * 0x1p-9f;
        v = mag7 == 0x7Fu ? NAN : v;
        return u2f(f2u(v) | ((code & 0x80u) << 24)) * s;  /* v >= 0: the sign bit negates */
    }
    uint32_t ic = sqrtk ? code : code & ((1u << mag) - 1);
    float v = u2f((ic + (((uint32_t)(127 + emin) << mb) - 1)) << (23 - mb)) * s;
    if (sqrtk) return v * v;
    v = ic == 0 ? 0.0f : v;
    return v * (1.0f - 2.0f * (float)(code >> mag));
}

static inline uint32_t encode(float x, float r, int sqrtk, int mag, int mb, int emin) {
    int shift = 23 - mb;
    float a = fabsf(x) * r;
    int32_t i = (int32_t)f2u(a) + ((1 << (shift - 1)) - ((((127 + emin) << mb) - 1) << shift));
    int32_t c = i >> shift, lo = sqrtk ? 1 : 0, hi = (1 << mag) - 1;
    c = c < lo ? lo : (c > hi ? hi : c);
    return sqrtk ? (uint32_t)c : ((uint32_t)c | ((uint32_t)(x < 0) << mag));
}

/* the larger of ``top`` and |x|, as bit patterns: non-negative floats order as their bits, and a
 * NaN's pattern is above every number's, so a block's largest comes out NaN as torch's amax */
#define TOP(top, x) ((f2u(x) & 0x7FFFFFFFu) > (top) ? (f2u(x) & 0x7FFFFFFFu) : (top))

/* Codes of block ``t`` (``n`` values, the largest |t| ``top`` as TOP gives it) into ``codes``
 * from element ``at``; its scale to ``*s``. */
static inline __attribute__((always_inline)) void store_block(
    const float *t, uint32_t top, int n, uint8_t *codes, int64_t at, float *s, int bits,
    int e4m3, int sqrtk, int mag, int mb, int emin, float largest) {
    float amax = u2f(top);
    amax = amax < TINY ? 0.0f : amax;
    if (e4m3) {
        *s = amax / 448.0f;
        float q = amax > 0 ? (1.0f / amax) * 448.0f : 0.0f;
        /* |t * q| <= 448 (1 + 3 eps) < 464 for finite t, so to_e4m3 rounds it to at most 448
         * as the clamp to +-448 of state_codes.py would: no clamp needed here */
        for (int j = 0; j < n; j++) codes[at + j] = to_e4m3(t[j] * q);
        return;
    }
    float sc = amax / largest;
    *s = sc;
    float r = sc > 0 ? 1.0f / sc : 0.0f;
    if (bits == 8) {
        for (int j = 0; j < n; j++) codes[at + j] = (uint8_t)encode(t[j], r, sqrtk, mag, mb, emin);
        return;
    }
    uint8_t tmp[BLOCK];
    for (int j = 0; j < n; j++) tmp[j] = (uint8_t)encode(t[j], r, sqrtk, mag, mb, emin);
    uint8_t *out = codes + (at >> 1);  /* blocks start at even elements (even row lengths) */
    for (int k = 0; k < n / 2; k++) out[k] = (uint8_t)(tmp[2 * k] | (tmp[2 * k + 1] << 4));
}

static inline uint32_t random16(uint32_t i, uint32_t base, uint32_t mix) {  /* rounding.py */
    uint32_t h = i + base;
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h ^= mix;
    h *= 0x846CA68Bu;
    return h >> 16;
}

static inline void write_weight(uint16_t *w, uint16_t *c, int64_t i, uint32_t h, float w32,
                                uint32_t base, uint32_t mix) {
#if UPDATE == 2
    (void)c;
    w[i] = (uint16_t)((f2u(w32) + random16(h, base, mix)) >> 16);
#else
    (void)h; (void)base; (void)mix;
    uint16_t low = W_ROUND(w32);
    w[i] = low;
#if UPDATE == 1
    c[i] = W_ROUND(w32 - W_WIDEN(low));
#else
    (void)c;
#endif
#endif
}

#if UPDATE == 1
#define W_IN(w, c, i) (W_LOAD(w, i) + W_LOAD(c, i))
#else
#define W_IN(w, c, i) W_LOAD(w, i)
#endif

#ifdef ADAM
/* the scalars, each at the position spec.py's SCALARS gives it (the SC_* defines):
 * compiled_step.py's adam step, term for term */
#define STEP_ELEM(i, h, M_IN, V_IN, M_OUT, V_OUT)                                            \
    {                                                                                        \
        float w32 = W_IN(w, c, i);                                                           \
        float g32 = G_LOAD(g, i) * s_sign;                                                   \
        DECAY                                                                                \
        float m0 = M_IN, v0 = V_IN;                                                          \
        float m32 = b1hi ? g32 - (g32 - m0) * (1.0f - s_b1c) : m0 + s_b1c * (g32 - m0);      \
        float v32 = v0 * s_b2 + s_b2c * g32 * g32;                                           \
        w32 = w32 + s_step * (m32 / (sqrtf(v32) / s_bc2 + s_eps));                           \
        M_OUT;                                                                               \
        V_OUT;                                                                               \
        write_weight(w, c, i, h, w32, base, mix);                                            \
    }
#ifdef DECOUPLED
#define DECAY w32 = w32 * s_dec;
#else
#define DECAY g32 = s_wd != 0.0f ? g32 + w32 * s_wd : g32; /* torch skips wd 0 (inf w) */
#endif
#define SCALARS float s_dec = sc[SC_DECAY], s_wd = sc[SC_COUPLED_WD], s_sign = sc[SC_SIGN], \
    s_b1c = sc[SC_ONE_MINUS_BETA1], s_b2 = sc[SC_BETA2], s_b2c = sc[SC_ONE_MINUS_BETA2],       \
    s_step = sc[SC_NEG_STEP_SIZE], s_bc2 = sc[SC_SQRT_BC2], s_eps = sc[SC_EPS];                 \
    (void)s_dec; (void)s_wd;
#else
/* the scalars at their SC_* positions (spec.py): compiled_step.py's sgd step */
#ifdef MOMENTUM  /* the buffer b = momentum * b + (1 - dampening) * g, stored */
#define BUFFER(M_IN, M_OUT) float m32 = M_IN * s_mom + g32 * s_damp; M_OUT;
#ifdef NESTEROV
#define DIRECTION(b32) (g32 + (b32) * s_mom)
#else
#define DIRECTION(b32) (b32)
#endif
#else  /* plain SGD: no state; the direction is the gradient */
#define BUFFER(M_IN, M_OUT) float m32 = g32;
#define DIRECTION(b32) (b32)
#endif
#define STEP_ELEM(i, h, M_IN, V_IN, M_OUT, V_OUT)                                            \
    {                                                                                        \
        float w32 = W_IN(w, c, i);                                                           \
        float g32 = G_LOAD(g, i) * s_sign;                                                   \
        g32 = s_wd != 0.0f ? g32 + w32 * s_wd : g32;                                         \
        BUFFER(M_IN, M_OUT)                                                                  \
        w32 = w32 + DIRECTION(m32) * s_lr;                                                   \
        write_weight(w, c, i, h, w32, base, mix);                                            \
    }
#define SCALARS float s_sign = sc[SC_SIGN], s_wd = sc[SC_WD], s_mom = sc[SC_MOMENTUM],       \
    s_damp = sc[SC_ONE_MINUS_DAMPENING], s_lr = sc[SC_NEG_LR]; (void)s_mom; (void)s_damp;
#endif

/* LOOP twice, for 1 - beta1 >= 0.5 and below: each copy's lerp (torch's two forms) is then
 * fixed, not selected per element */
#ifdef ADAM
#define SPLIT_B1(LOOP) \
    if (s_b1c >= 0.5f) { const int b1hi = 1; LOOP } else { const int b1hi = 0; LOOP }
#else
#define SPLIT_B1(LOOP) { LOOP }
#endif

#ifndef S1
#define S1 0
#endif
#ifndef S2
#define S2 0
#endif
#ifndef S1SRC
#define S1SRC 0
#endif
#ifndef S2SRC
#define S2SRC 0
#endif
#define CODED(S) ((S) == 8 || (S) == 4)

#if CODED(S1) || CODED(S2)
/* One block of ``n`` elements from ``at`` (inside one row): the step, with the new values of
 * coded states kept in t1 / t2, then each coded state's block scale and codes (state_codes.py's
 * store_). ``q1`` / ``q2``: the block's scales. */
static inline __attribute__((always_inline)) void coded_block(
    uint16_t *restrict w, uint16_t *restrict c, const g_t *restrict g, void *restrict s1,
    float *restrict q1, const float *restrict r1, void *restrict s2, float *restrict q2,
    const float *restrict r2, const float *restrict sc, uint32_t base, uint32_t mix,
    const int64_t at, const int n) {
    SCALARS
    float t1[BLOCK], t2[BLOCK];
    uint32_t top1 = 0, top2 = 0;  /* the largest |t1|, |t2| as bit patterns (see store_block) */
    (void)top1; (void)top2;
    uint8_t u1[BLOCK], u2[BLOCK];
    (void)t1; (void)t2; (void)u1; (void)u2; (void)q1; (void)q2; (void)s2; (void)r1; (void)r2;
#if CODED(S1) && S1SRC
#define M_READ(j) r1[at + (j)]
#define M_WRITE(j, x) t1[j] = (x); top1 = TOP(top1, t1[j])
#elif CODED(S1)
    const float d1 = *q1;
    const uint8_t *c1 = block_codes(S1, (const uint8_t *)s1, at, n, u1);
#define M_READ(j) decode(c1[j], d1, S1E4M3, S1K, S1MAG, S1MB, S1EMIN)
#define M_WRITE(j, x) t1[j] = (x); top1 = TOP(top1, t1[j])
#else
#define M_READ(j) PLAIN_LOAD(S1, s1, at + (j))
#define M_WRITE(j, x) plain_store(S1, s1, at + (j), (x))
#endif
#if CODED(S2) && S2SRC
#define V_READ(j) r2[at + (j)]
#define V_WRITE(j, x) t2[j] = (S2K ? sqrtf(x) : (x)); top2 = TOP(top2, t2[j])
#elif CODED(S2)
    const float d2 = *q2;
    const uint8_t *c2 = block_codes(S2, (const uint8_t *)s2, at, n, u2);
#define V_READ(j) decode(c2[j], d2, S2E4M3, S2K, S2MAG, S2MB, S2EMIN)
#define V_WRITE(j, x) t2[j] = (S2K ? sqrtf(x) : (x)); top2 = TOP(top2, t2[j])
#else
#define V_READ(j) PLAIN_LOAD(S2, s2, at + (j))
#define V_WRITE(j, x) plain_store(S2, s2, at + (j), (x))
#endif
    const uint32_t h0 = (uint32_t)at;  /* the rounding's key: the index mod 2**32 */
    SPLIT_B1(for (int j = 0; j < n; j++) {
        const int64_t i = at + j;
        STEP_ELEM(i, h0 + (uint32_t)j, M_READ(j), V_READ(j), M_WRITE(j, m32), V_WRITE(j, v32))
    })
#if CODED(S1)
    store_block(t1, top1, n, (uint8_t *)s1, at, q1, S1, S1E4M3, S1K, S1MAG, S1MB, S1EMIN,
                S1LARGEST);
#endif
#if CODED(S2)
    store_block(t2, top2, n, (uint8_t *)s2, at, q2, S2, S2E4M3, S2K, S2MAG, S2MB, S2EMIN,
                S2LARGEST);
#endif
}
#undef M_READ
#undef M_WRITE
#undef V_READ
#undef V_WRITE
#endif

#if CODED(S1) || CODED(S2)
/* Row ``r`` of ``cols`` elements, block by block; full blocks with their size a constant. */
static void coded_row(uint16_t *restrict w, uint16_t *restrict c, const g_t *restrict g,
                      void *restrict s1, float *restrict q1, const float *restrict r1,
                      void *restrict s2, float *restrict q2, const float *restrict r2,
                      const float *restrict sc, uint32_t base, uint32_t mix, int64_t r,
                      int64_t cols) {
    const int64_t nblk = (cols + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t at = r * cols + b * BLOCK;
        const int64_t left = cols - b * BLOCK;
        float *p1 = CODED(S1) ? q1 + r * nblk + b : q1;
        float *p2 = CODED(S2) ? q2 + r * nblk + b : q2;
        if (left >= BLOCK)
            coded_block(w, c, g, s1, p1, r1, s2, p2, r2, sc, base, mix, at, BLOCK);
        else
            coded_block(w, c, g, s1, p1, r1, s2, p2, r2, sc, base, mix, at, (int)left);
    }
}
#endif

/* rows x cols elements; s1/s2 the states (values, or codes with scales q1/q2, and r1/r2 the
 * fp32 values to read instead of the codes where S?SRC); base/mix: the stochastic rounding's
 * keys (rounding.py); threads: OpenMP threads over rows (codes) or runs of CHUNK elements. Built
 * with -fopenmp the team comes from the libgomp torch already loaded (same soname), so the
 * workers torch's own parallel regions keep warm run it; without OpenMP the pragmas are
 * ignored and one thread steps everything. Every element's result is the same either way. */
#define CHUNK 4096
void mixprec_step(int64_t rows, int64_t cols, uint16_t *restrict w, uint16_t *restrict c,
                  const g_t *restrict g, void *restrict s1, float *restrict q1,
                  const float *restrict r1, void *restrict s2, float *restrict q2,
                  const float *restrict r2, const float *restrict sc, uint32_t base,
                  uint32_t mix, int threads) {
    (void)q1; (void)q2; (void)s2; (void)r1; (void)r2; (void)threads;
#if !CODED(S1) && !CODED(S2)
    SCALARS
    int64_t n = rows * cols;
    float *f1 = (float *)s1, *f2 = (float *)s2;
    uint16_t *h1 = (uint16_t *)s1, *h2 = (uint16_t *)s2;
    (void)f1; (void)f2; (void)h1; (void)h2;
#if S1 == 0
#define M_READ(i) f1[i]
#define M_WRITE(i, x) f1[i] = (x)
#elif S1 == 1
#define M_READ(i) from_bf16(h1[i])
#define M_WRITE(i, x) h1[i] = to_bf16(x)
#else
#define M_READ(i) from_f16(h1[i])
#define M_WRITE(i, x) h1[i] = to_f16(x)
#endif
#if S2 == 0
#define V_READ(i) f2[i]
#define V_WRITE(i, x) f2[i] = (x)
#elif S2 == 1
#define V_READ(i) from_bf16(h2[i])
#define V_WRITE(i, x) h2[i] = to_bf16(x)
#else
#define V_READ(i) from_f16(h2[i])
#define V_WRITE(i, x) h2[i] = to_f16(x)
#endif
    if (threads <= 1) {  /* no OpenMP call at all: one thread as without -fopenmp */
        SPLIT_B1(uint32_t h = 0; for (int64_t i = 0; i < n; i++, h++)
                 STEP_ELEM(i, h, M_READ(i), V_READ(i), M_WRITE(i, m32), V_WRITE(i, v32)))
        return;
    }
    const int64_t runs = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < runs; k++) {
        const int64_t end = (k + 1) * CHUNK < n ? (k + 1) * CHUNK : n;
        SPLIT_B1(uint32_t h = (uint32_t)(k * CHUNK);
                 for (int64_t i = k * CHUNK; i < end; i++, h++)
                 STEP_ELEM(i, h, M_READ(i), V_READ(i), M_WRITE(i, m32), V_WRITE(i, v32)))
    }
#else
    /* codes: per block of one row (coded_block); full blocks with their size a constant */
    if (threads <= 1) {  /* no OpenMP call at all: one thread as without -fopenmp */
        for (int64_t r = 0; r < rows; r++)
            coded_row(w, c, g, s1, q1, r1, s2, q2, r2, sc, base, mix, r, cols);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        coded_row(w, c, g, s1, q1, r1, s2, q2, r2, sc, base, mix, r, cols);
#endif
}
#endif /* FINITE_ONLY */
