/* Row-invariant attention over a paged KV pool (CPU).
 *
 * One query row (one token) at a time, with the query heads that share a KV head together:
 * its keys are an explicit slot list in position order (the prefix its request shares, then
 * the row's own extra slots: its ancestors and itself in a tree, or nothing more for a causal
 * row whose prefix already ends at itself), and every reduction runs in an order fixed by the
 * key's index in that list and the head dimension alone:
 *   1. s_j = scale * dot(q, k_j): 16 lanes over hd (lane l sums d = l, l+16, ... in order; a
 *      head dimension not a multiple of 16 is zero-padded), then the lanes summed in a fixed
 *      tree (8, 4, 2, 1 apart);
 *   2. m = max_j s_j (exact in any order);
 *   3. p_j = exp(s_j - m) by a fixed polynomial (exp_neg), z = sum_j p_j left to right;
 *   4. o = sum_j p_j * v_j left to right (each output element its own accumulator), o /= z.
 * Nothing depends on how many rows share the call, where the row sits, how long the other
 * rows' key lists are, or how many threads run: the property batch-invariant kernels give.
 * Memory traffic per row and KV head: read n·hd keys and n·hdv values; write group·hdv.
 *
 * Built by workbench/kernels/cpu_build.py with -O3 -ffp-contract=off (no fused multiply-add
 * that the compiler may or may not form) and without -ffast-math (no reassociation); GCC
 * vector extensions give the 16 lanes (one AVX-512 register, two AVX2 ones) with the same
 * arithmetic on every machine.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define MAX_HD 512   /* head dims up to this (MLA's latent 576 is refused by the wrapper) */
#define MAX_HEADS 64 /* (row, query head) pairs of one block and KV head */

typedef float v16 __attribute__((vector_size(LANES * sizeof(float))));
typedef uint32_t v16u __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t v16h __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef int32_t v16i __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline v16 load_f32(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v16 load_bf16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16; /* bf16 is the top half of a float */
    v16 v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* the lanes summed in a fixed tree: lane l += lane l+8, then l+4, l+2, l+1 */
static inline float tree_sum(v16 a) {
    const v16i s8 = {8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16i s4 = {4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7};
    const v16i s2 = {2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3};
    const v16i s1 = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    a = a + __builtin_shuffle(a, s8);
    a = a + __builtin_shuffle(a, s4);
    a = a + __builtin_shuffle(a, s2);
    a = a + __builtin_shuffle(a, s1);
    return a[0];
}

/* exp(x) for x <= 0 (a softmax's shifted scores), a fixed polynomial so the compiler can
 * vectorize it (libm's expf is a call per element): x = k·ln2 + r, |r| <= ln2/2, e^r by its
 * degree-6 Taylor polynomial in Horner form (relative error < 2e-7, about libm's), times 2^k
 * built in the exponent bits. Below -87 the result is 0 (float32 underflow). */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float k = (float)(int)(x * 1.44269504f - 0.5f);
    const float r = (x - k * 0.693145752f) - k * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const uint32_t bits = (uint32_t)((int)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* exp_neg on 16 lanes at once, lane by lane the same arithmetic (vector selects by masks) */
static inline v16 select16(v16i mask, v16 a, v16 b) {
    v16i ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    v16i r = (mask & ia) | (~mask & ib);
    v16 out;
    memcpy(&out, &r, sizeof out);
    return out;
}

static inline v16 exp_neg16(v16 x) {
    const v16 lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f,
                    -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    x = select16(x < lo, lo, x);
    const v16 k = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f - 0.5f, v16i),
                                          v16);
    const v16 r = (x - k * 0.693145752f) - k * 1.42860677e-6f;
    v16 p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const v16i bits = (__builtin_convertvector(k, v16i) + 127) << 23;
    v16 scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* One kernel per pool element type (LOAD reads 16 elements as float32 lanes, ONE one).
 * q: (T, H, hd) float32; out: (T, H, hdv) float32; k_pool: (S, Hkv, hd) of one layer,
 * contiguous; v_pool: (S, Hkv, ·) with v_row elements per slot and head (hdv; a latent pool's
 * values are the first hdv of each key: v_row = hd). Row t's keys: its prefix
 * slots[pre_off[t] : pre_off[t] + pre_len[t]], then its own ext[ext_off[t] : ext_off[t + 1]].
 * Rows are taken in blocks (block[b] .. block[b+1]-1: rows of one request, which share their
 * prefix's first `common` keys): a shared key is loaded once for the block, and every row
 * still sums its own keys in its own order, so the blocking changes no bit. Items (block, KV
 * head) lo..hi-1 are computed, so callers may split a call across threads; scratch: at least
 * (rows of the largest block × group, rounded up to 16) × (the longest row's key count)
 * floats per call. */
#define ROW_ATTENTION(NAME, T_ELEM, LOAD, ONE)                                                  \
static inline void NAME##_keys(const T_ELEM *k, int64_t hd, int64_t chunks, v16 *kv) {          \
    if (hd % LANES == 0) {                                                                      \
        for (int64_t c = 0; c < chunks; c++) kv[c] = LOAD(k + c * LANES);                       \
    } else {                                                                                    \
        float kpad[MAX_HD + LANES] = {0};                                                       \
        for (int64_t d = 0; d < hd; d++) kpad[d] = ONE(k[d]);                                   \
        for (int64_t c = 0; c < chunks; c++) kv[c] = load_f32(kpad + c * LANES);               \
    }                                                                                           \
}                                                                                               \
void NAME(const float *q, const T_ELEM *k_pool, const T_ELEM *v_pool, const int64_t *slots,     \
          const int64_t *pre_off, const int64_t *pre_len, const int64_t *ext,                   \
          const int64_t *ext_off, const int64_t *block, int64_t H, int64_t Hkv, int64_t hd,     \
          int64_t hdv, int64_t v_row, float scale, float *out, float *scratch,                  \
          int64_t max_keys, int64_t lo, int64_t hi) {                                           \
    const int64_t group = H / Hkv, chunks = (hd + LANES - 1) / LANES;                           \
    const int64_t vch = hdv / LANES, vfull = vch * LANES;                                       \
    static __thread v16 qv[MAX_HEADS][MAX_HD / LANES], ov[MAX_HEADS][MAX_HD / LANES];           \
    v16 kv[MAX_HD / LANES];                                                                     \
    float z[MAX_HEADS];                                                                         \
    int64_t na[MAX_HEADS];                                                                      \
    (void)max_keys;                                                                             \
    for (int64_t item = lo; item < hi; item++) {                                                \
        const int64_t b = item / Hkv, g = item % Hkv, r0 = block[b], nr = block[b + 1] - r0;   \
        const int64_t nh = nr * group; /* (row, head) pairs a = row·group + head */            \
        const int64_t nhp = (nh + LANES - 1) / LANES * LANES;                                   \
        int64_t common = pre_len[r0], longest = 0;                                              \
        for (int64_t i = 0; i < nr; i++) {                                                      \
            const int64_t t = r0 + i, n = pre_len[t] + ext_off[t + 1] - ext_off[t];             \
            common = pre_len[t] < common ? pre_len[t] : common;                                 \
            longest = n > longest ? n : longest;                                                \
            for (int64_t h = 0; h < group; h++) { /* queries, zero-padded lanes */             \
                float qpad[MAX_HD + LANES];                                                     \
                memcpy(qpad, q + (t * H + g * group + h) * hd, hd * sizeof(float));            \
                for (int64_t d = hd; d < chunks * LANES; d++) qpad[d] = 0.0f;                   \
                for (int64_t c = 0; c < chunks; c++)                                            \
                    qv[i * group + h][c] = load_f32(qpad + c * LANES);                          \
                na[i * group + h] = n;                                                          \
            }                                                                                   \
        }                                                                                       \
        /* scratch is key-major: s[j·nhp + a], key j's weights for every pair together */      \
        float *s = scratch;                                                                     \
        const int64_t *pre = slots + pre_off[r0];                                               \
        /* 1. scores: the shared keys once for the block, then each row's own */               \
        for (int64_t j = 0; j < common; j++) {                                                  \
            NAME##_keys(k_pool + (pre[j] * Hkv + g) * hd, hd, chunks, kv);                      \
            for (int64_t a = 0; a < nh; a++) {                                                  \
                v16 acc = qv[a][0] * kv[0];                                                     \
                for (int64_t c = 1; c < chunks; c++) acc = acc + qv[a][c] * kv[c];              \
                s[j * nhp + a] = tree_sum(acc) * scale;                                          \
            }                                                                                   \
        }                                                                                       \
        for (int64_t i = 0; i < nr; i++) {                                                      \
            const int64_t t = r0 + i, np = pre_len[t], n = np + ext_off[t + 1] - ext_off[t];    \
            const int64_t *own = ext + ext_off[t];                                              \
            for (int64_t j = common; j < n; j++) {                                              \
                const int64_t slot = j < np ? pre[j] : own[j - np];                             \
                NAME##_keys(k_pool + (slot * Hkv + g) * hd, hd, chunks, kv);                    \
                for (int64_t h = 0; h < group; h++) {                                           \
                    const int64_t a = i * group + h;                                            \
                    v16 acc = qv[a][0] * kv[0];                                                 \
                    for (int64_t c = 1; c < chunks; c++) acc = acc + qv[a][c] * kv[c];          \
                    s[j * nhp + a] = tree_sum(acc) * scale;                                      \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        /* 2. max, 3. exp and the denominator, each pair over its own keys in order: 16 pairs  \
           a vector (the pairs padded to nhp; a pair past its own keys keeps its max and adds  \
           an exact 0 to z) */                                                                  \
        for (int64_t a = 0; a < nhp; a += LANES) {                                              \
            v16 mv = (v16){0} - INFINITY, zv = (v16){0};                                         \
            v16i nv;                                                                            \
            for (int64_t l = 0; l < LANES; l++) nv[l] = a + l < nh ? (int32_t)na[a + l] : 0;    \
            for (int64_t j = 0; j < longest; j++) {                                             \
                const v16i live = (v16i){0} + (int32_t)j < nv;                                  \
                const v16 x = select16(live, load_f32(s + j * nhp + a), mv);                    \
                mv = select16(x > mv, x, mv);                                                   \
            }                                                                                   \
            for (int64_t j = 0; j < longest; j++) {                                             \
                const v16i live = (v16i){0} + (int32_t)j < nv;                                  \
                const v16 e = exp_neg16(load_f32(s + j * nhp + a) - mv);                        \
                const v16 w = select16(live, e, (v16){0});                                      \
                memcpy(s + j * nhp + a, &w, sizeof w);                                          \
                zv = zv + w;                                                                    \
            }                                                                                   \
            for (int64_t l = 0; l < LANES && a + l < nh; l++) z[a + l] = zv[l];                 \
        }                                                                                       \
        /* 4. o = sum_j p_j v_j: the shared values once for the block, then each row's own */  \
        for (int64_t a = 0; a < nh; a++)                                                        \
            for (int64_t c = 0; c < vch; c++) ov[a][c] = (v16){0};                              \
        for (int64_t j = 0; j < common; j++) {                                                  \
            const T_ELEM *v = v_pool + (pre[j] * Hkv + g) * v_row;                              \
            for (int64_t c = 0; c < vch; c++) kv[c] = LOAD(v + c * LANES);                      \
            for (int64_t a = 0; a < nh; a++) {                                                  \
                const float w = s[j * nhp + a];                                                  \
                for (int64_t c = 0; c < vch; c++) ov[a][c] = ov[a][c] + w * kv[c];              \
            }                                                                                   \
        }                                                                                       \
        for (int64_t i = 0; i < nr; i++) {                                                      \
            const int64_t t = r0 + i, np = pre_len[t], n = np + ext_off[t + 1] - ext_off[t];    \
            const int64_t *own = ext + ext_off[t];                                              \
            for (int64_t j = common; j < n; j++) {                                              \
                const int64_t slot = j < np ? pre[j] : own[j - np];                             \
                const T_ELEM *v = v_pool + (slot * Hkv + g) * v_row;                            \
                for (int64_t c = 0; c < vch; c++) kv[c] = LOAD(v + c * LANES);                  \
                for (int64_t h = 0; h < group; h++) {                                           \
                    const int64_t a = i * group + h;                                            \
                    const float w = s[j * nhp + a];                                              \
                    for (int64_t c = 0; c < vch; c++) ov[a][c] = ov[a][c] + w * kv[c];          \
                }                                                                               \
            }                                                                                   \
            for (int64_t h = 0; h < group; h++) {                                               \
                const int64_t a = i * group + h;                                                \
                float *o = out + (t * H + g * group + h) * hdv;                                 \
                for (int64_t c = 0; c < vch; c++) {                                             \
                    v16 r = ov[a][c] / z[a];                                                    \
                    memcpy(o + c * LANES, &r, sizeof r);                                        \
                }                                                                               \
                for (int64_t e = vfull; e < hdv; e++) { /* a head dim's tail, if any */        \
                    float acc = 0.0f;                                                           \
                    for (int64_t j = 0; j < n; j++) {                                           \
                        const int64_t slot = j < np ? pre[j] : own[j - np];                     \
                        acc += s[j * nhp + a] * ONE(v_pool[(slot * Hkv + g) * v_row + e]);      \
                    }                                                                           \
                    o[e] = acc / z[a];                                                          \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
}

static inline float bf16_one(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float f32_one(float x) { return x; }
static inline v16 load_f32c(const float *p) { return load_f32(p); }

ROW_ATTENTION(row_attention_f32, float, load_f32c, f32_one)
ROW_ATTENTION(row_attention_bf16, uint16_t, load_bf16, bf16_one)
