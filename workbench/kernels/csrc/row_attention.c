/* Row-invariant attention over a paged KV pool (CPU).
 *
 * One query row (one token, one head) at a time: its keys are an explicit slot list in
 * position order (the prefix its request shares, then the row's own extra slots: its
 * ancestors and itself in a tree, or the causal run before it), and every reduction runs in
 * an order fixed by the key's index in that list and the head dimension alone:
 *   1. s_j = scale * dot(q, k_j): 16 lanes over hd (lane l sums d = l, l+16, ...), then the
 *      lanes summed in a fixed tree;
 *   2. m = max_j s_j (exact in any order);
 *   3. p_j = exp(s_j - m), z = sum_j p_j left to right;
 *   4. o = sum_j p_j * v_j left to right (each output element its own accumulator), o /= z.
 * Nothing depends on how many rows share the call, where the row sits, how long the other
 * rows' key lists are, or how many threads run: the property batch-invariant kernels give.
 * Memory traffic per row and head: read n·hd keys and n·hd values; write hd outputs.
 *
 * Built by workbench/kernels/cpu_build.py with -O3 -ffp-contract=off (no fused multiply-add
 * that the compiler may or may not form) and without -ffast-math (no reassociation).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float f32_id(float x) { return x; }

/* exp(x) for x <= 0 (a softmax's shifted scores), a fixed polynomial so the compiler can
 * vectorize it (libm's expf is a call per element): x = k·ln2 + r, |r| <= ln2/2, e^r by its
 * degree-6 Taylor polynomial in Horner form (relative error < 2e-7, about libm's), times 2^k
 * built in the exponent bits. Below -87 the result is 0 (float32 underflow). */
static inline float exp_neg(float x) {
    if (x < -87.0f) x = -87.0f;
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

/* One kernel per pool element type (float32, bfloat16; LOAD reads one element as float32).
 * q: (T, H, hd) float32; out: (T, H, hdv) float32; k_pool: (S, Hkv, hd) of one layer,
 * contiguous; v_pool: (S, Hkv, ·) with v_row elements per slot and head (hdv; a latent pool's
 * values are the first hdv of each key: v_row = hd). Row t's keys: its prefix
 * slots[pre_off[t] : pre_off[t] + pre_len[t]], then its own ext[ext_off[t] : ext_off[t + 1]].
 * Items (row, head) lo..hi-1 are computed, so callers may split a call across threads;
 * scratch: at least the longest row's key count of floats, one per concurrent call. */
#define ROW_ATTENTION(NAME, T_ELEM, LOAD)                                                      \
static float NAME##_dot(const float *q, const T_ELEM *k, int64_t hd) {                          \
    float acc[LANES];                                                                           \
    for (int l = 0; l < LANES; l++) acc[l] = 0.0f;                                              \
    int64_t d = 0;                                                                              \
    for (; d + LANES <= hd; d += LANES)                                                         \
        for (int l = 0; l < LANES; l++) acc[l] += q[d + l] * LOAD(k[d + l]);                    \
    for (int l = 0; d + l < hd; l++) acc[l] += q[d + l] * LOAD(k[d + l]);                       \
    for (int w = LANES / 2; w > 0; w /= 2) /* a fixed pairwise tree over the lanes */           \
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];                                       \
    return acc[0];                                                                              \
}                                                                                               \
void NAME(const float *q, const T_ELEM *k_pool, const T_ELEM *v_pool, const int64_t *slots,     \
          const int64_t *pre_off, const int64_t *pre_len, const int64_t *ext,                   \
          const int64_t *ext_off, int64_t T, int64_t H, int64_t Hkv, int64_t hd, int64_t hdv,   \
          int64_t v_row, float scale, float *out, float *scratch, int64_t lo, int64_t hi) {   \
    const int64_t group = H / Hkv;                                                              \
    for (int64_t item = lo; item < hi; item++) {                                                \
        const int64_t t = item / H, h = item % H, g = h / group;                                \
        const float *qr = q + (t * H + h) * hd;                                                 \
        float *s = scratch;                                                                     \
        const int64_t np = pre_len[t], ne = ext_off[t + 1] - ext_off[t], n = np + ne;           \
        const int64_t *pre = slots + pre_off[t], *own = ext + ext_off[t];                       \
        float m = -INFINITY;                                                                    \
        for (int64_t j = 0; j < n; j++) {                                                       \
            const int64_t slot = j < np ? pre[j] : own[j - np];                                 \
            s[j] = NAME##_dot(qr, k_pool + (slot * Hkv + g) * hd, hd) * scale;                  \
            if (s[j] > m) m = s[j];                                                             \
        }                                                                                       \
        float z = 0.0f;                                                                         \
        for (int64_t j = 0; j < n; j++) {                                                       \
            s[j] = exp_neg(s[j] - m);                                                           \
        }                                                                                       \
        for (int64_t j = 0; j < n; j++) z += s[j];                                              \
        float *o = out + (t * H + h) * hdv;                                                     \
        for (int64_t e = 0; e < hdv; e++) o[e] = 0.0f;                                          \
        for (int64_t j = 0; j < n; j++) {                                                       \
            const int64_t slot = j < np ? pre[j] : own[j - np];                                 \
            const T_ELEM *v = v_pool + (slot * Hkv + g) * v_row;                                \
            const float p = s[j];                                                               \
            for (int64_t e = 0; e < hdv; e++) o[e] += p * LOAD(v[e]);                           \
        }                                                                                       \
        for (int64_t e = 0; e < hdv; e++) o[e] /= z;                                            \
    }                                                                                           \
}

ROW_ATTENTION(row_attention_f32, float, f32_id)
ROW_ATTENTION(row_attention_bf16, uint16_t, bf16_to_f32)
