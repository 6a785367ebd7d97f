// Attention without the T×T scores (FlashAttention's scheme), forward and backward side by
// side. One warp per row: lane c holds elements c, c + 32, … of the row's D (D ≤ MAX_HEAD), dot
// products are warp sums, and the softmax is online (a running maximum and sum, the output
// rescaled as the maximum grows). The forward pass keeps each query row's log-sum-exp; the
// backward pass recomputes the probabilities from it in two sweeps that never race: one warp
// per query row for dq, one per key row for dk and dv.
//
// q, y, dy, dq: [groups, tq, d]; k, v, dk, dv: [groups / rep, tk, d]; lse, delta: [groups, tq].
// Query group g reads key group g / rep (grouped-query attention; rep 1 without). With `inter`
// over 1, the operands are token-major: [batch, t, inter, d], the groups (batch × inter)
// interleaved row by row (head_row), and k and v [batch, t, kinter, d]. A token's rows lie
// qld elements on from the last token's in q and dq, and kld in k, v, dk and dv: inter · d and
// kinter · d, or more where q, k and v are parts of one packed operand (each token's q, k and v
// side by side); y and dy are never packed (inter · d). With `causal`, query i sees keys 0..=i
// (tq = tk).

#define MAX_HEAD 256
#define HEAD_LANES (MAX_HEAD / 32)
#define WARPS_PER_BLOCK (BLOCK / 32)

// Where row i of group g of a t-row operand starts, its tokens ld elements apart (op.rs's
// AttentionShape::q_row, y_row and kv_row).
__device__ __forceinline__ i64 head_row(i64 g, i64 i, i64 t, i64 d, i64 inter, i64 ld) {
    return (g / inter * t + i) * ld + g % inter * d;
}

__device__ __forceinline__ i64 first_warp() { return (i64)blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5); }
__device__ __forceinline__ i64 warp_stride() { return (i64)gridDim.x * WARPS_PER_BLOCK; }

// Σ a·b over a row of d elements, the warp's lanes striding over it; every lane gets the sum.
template <class S>
__device__ __forceinline__ float row_dot(const typename S::T* a, const typename S::T* b, i64 d, int lane) {
    float s = 0.f;
    for (i64 c = lane; c < d; c += 32) s += S::load(a[c]) * S::load(b[c]);
    return warp_sum(s);
}
// The same with the first row already in registers (lane's elements, as loaded).
template <class S>
__device__ __forceinline__ float held_dot(const float* held, const typename S::T* b, i64 d, int lane) {
    float s = 0.f;
    for (int r = 0; r < HEAD_LANES; ++r) {
        i64 c = lane + 32 * r;
        if (c < d) s += held[r] * S::load(b[c]);
    }
    return warp_sum(s);
}
template <class S>
__device__ __forceinline__ void hold(float* held, const typename S::T* a, i64 d, int lane) {
    for (int r = 0; r < HEAD_LANES; ++r) {
        i64 c = lane + 32 * r;
        held[r] = c < d ? S::load(a[c]) : 0.f;
    }
}

template <class S>
__device__ void attention_fwd(i64 rows, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                              const typename S::T* q, const typename S::T* k, const typename S::T* v,
                              typename S::T* y, float* lse) {
    int lane = threadIdx.x & 31;
    for (i64 row = first_warp(); row < rows; row += warp_stride()) {
        i64 g = row / tq, i = row % tq;
        float qi[HEAD_LANES], acc[HEAD_LANES];
        i64 yat = head_row(g, i, tq, d, inter, inter * d);
        hold<S>(qi, q + head_row(g, i, tq, d, inter, qld), d, lane);
        for (int r = 0; r < HEAD_LANES; ++r) acc[r] = 0.f;
        float m = NEG_INF, l = 0.f;
        i64 n = causal ? i + 1 : tk;
        for (i64 j = 0; j < n; ++j) {
            i64 kat = head_row(g / rep, j, tk, d, kinter, kld);
            const typename S::T *kj = k + kat, *vj = v + kat;
            float s = scale * held_dot<S>(qi, kj, d, lane);
            float m_new = fmaxf(m, s);
            float rescale = expf(m - m_new), e = expf(s - m_new);
            l = l * rescale + e;
            for (int r = 0; r < HEAD_LANES; ++r) {
                i64 c = lane + 32 * r;
                if (c < d) acc[r] = acc[r] * rescale + e * S::load(vj[c]);
            }
            m = m_new;
        }
        float inv = 1.f / l;
        for (int r = 0; r < HEAD_LANES; ++r) {
            i64 c = lane + 32 * r;
            if (c < d) y[yat + c] = S::store(acc[r] * inv);
        }
        if (lse && lane == 0) lse[row] = m + logf(l);
    }
}
extern "C" __global__ void attention_fwd_f32(i64 rows, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal, const float* q,
                                             const float* k, const float* v, float* y, float* lse) {
    attention_fwd<F32>(rows, tq, tk, d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, y, lse);
}
extern "C" __global__ void attention_fwd_f16(i64 rows, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal, const u16* q,
                                             const u16* k, const u16* v, u16* y, float* lse) {
    attention_fwd<F16>(rows, tq, tk, d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, y, lse);
}
extern "C" __global__ void attention_fwd_bf16(i64 rows, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                              const u16* q, const u16* k, const u16* v, u16* y, float* lse) {
    attention_fwd<BF16>(rows, tq, tk, d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, y, lse);
}

// delta_i = dy_i · y_i, the row term of the softmax's gradient.
template <class S>
__device__ void attention_bwd_delta(i64 rows, i64 tq, i64 d, i64 inter, const typename S::T* dy, const typename S::T* y, float* delta) {
    int lane = threadIdx.x & 31;
    for (i64 row = first_warp(); row < rows; row += warp_stride()) {
        i64 at = head_row(row / tq, row % tq, tq, d, inter, inter * d);
        float s = row_dot<S>(dy + at, y + at, d, lane);
        if (lane == 0) delta[row] = s;
    }
}
extern "C" __global__ void attention_bwd_delta_f32(i64 rows, i64 tq, i64 d, i64 inter, const float* dy, const float* y, float* delta) {
    attention_bwd_delta<F32>(rows, tq, d, inter, dy, y, delta);
}
extern "C" __global__ void attention_bwd_delta_f16(i64 rows, i64 tq, i64 d, i64 inter, const u16* dy, const u16* y, float* delta) {
    attention_bwd_delta<F16>(rows, tq, d, inter, dy, y, delta);
}
extern "C" __global__ void attention_bwd_delta_bf16(i64 rows, i64 tq, i64 d, i64 inter, const u16* dy, const u16* y, float* delta) {
    attention_bwd_delta<BF16>(rows, tq, d, inter, dy, y, delta);
}

// dq_i = scale · Σ_j p_ij (dy_i·v_j − delta_i) k_j, one warp per query row.
template <class S>
__device__ void attention_bwd_dq(i64 rows, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale,
                                 int causal, const typename S::T* q, const typename S::T* k, const typename S::T* v,
                                 const typename S::T* dy,
                                 const float* lse, const float* delta, typename S::T* dq) {
    int lane = threadIdx.x & 31;
    for (i64 row = first_warp(); row < rows; row += warp_stride()) {
        i64 g = row / tq, i = row % tq;
        float qi[HEAD_LANES], dyi[HEAD_LANES], acc[HEAD_LANES];
        i64 at = head_row(g, i, tq, d, inter, qld);
        hold<S>(qi, q + at, d, lane);
        hold<S>(dyi, dy + head_row(g, i, tq, d, inter, inter * d), d, lane);
        for (int r = 0; r < HEAD_LANES; ++r) acc[r] = 0.f;
        i64 n = causal ? i + 1 : tk;
        for (i64 j = 0; j < n; ++j) {
            i64 kat = head_row(g / rep, j, tk, d, kinter, kld);
            const typename S::T* kj = k + kat;
            float p = expf(scale * held_dot<S>(qi, kj, d, lane) - lse[row]);
            float ds = p * (held_dot<S>(dyi, v + kat, d, lane) - delta[row]);
            for (int r = 0; r < HEAD_LANES; ++r) {
                i64 c = lane + 32 * r;
                if (c < d) acc[r] += scale * ds * S::load(kj[c]);
            }
        }
        for (int r = 0; r < HEAD_LANES; ++r) {
            i64 c = lane + 32 * r;
            if (c < d) dq[at + c] = S::store(acc[r]);
        }
    }
}
extern "C" __global__ void attention_bwd_dq_f32(i64 rows, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                                const float* q, const float* k, const float* v, const float* dy,
                                                const float* lse, const float* delta, float* dq) {
    attention_bwd_dq<F32>(rows, tq, tk, d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, dy, lse, delta, dq);
}
extern "C" __global__ void attention_bwd_dq_f16(i64 rows, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                                const u16* q, const u16* k, const u16* v, const u16* dy,
                                                const float* lse, const float* delta, u16* dq) {
    attention_bwd_dq<F16>(rows, tq, tk, d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, dy, lse, delta, dq);
}
extern "C" __global__ void attention_bwd_dq_bf16(i64 rows, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                                 const u16* q, const u16* k, const u16* v, const u16* dy,
                                                 const float* lse, const float* delta, u16* dq) {
    attention_bwd_dq<BF16>(rows, tq, tk, d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, dy, lse, delta, dq);
}

// dk_j = scale · Σ_i ds_ij q_i and dv_j = Σ_i p_ij dy_i, one warp per key row (rows: key
// groups × tk), over the queries that see key j (i ≥ j when causal) of every query group the
// key group serves.
template <class S>
__device__ void attention_bwd_dkv(i64 rows, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale,
                                  int causal, const typename S::T* q, const typename S::T* k, const typename S::T* v,
                                  const typename S::T* dy,
                                  const float* lse, const float* delta, typename S::T* dk, typename S::T* dv) {
    int lane = threadIdx.x & 31;
    for (i64 row = first_warp(); row < rows; row += warp_stride()) {
        i64 g = row / tk, j = row % tk;
        float kj[HEAD_LANES], vj[HEAD_LANES], acc_k[HEAD_LANES], acc_v[HEAD_LANES];
        i64 at = head_row(g, j, tk, d, kinter, kld);
        hold<S>(kj, k + at, d, lane);
        hold<S>(vj, v + at, d, lane);
        for (int r = 0; r < HEAD_LANES; ++r) acc_k[r] = acc_v[r] = 0.f;
        // The query groups key group g serves, in order.
        for (i64 gq = g * rep; gq < (g + 1) * rep; ++gq)
            for (i64 i = causal ? j : 0; i < tq; ++i) {
                i64 qrow = gq * tq + i;
                const typename S::T* qi = q + head_row(gq, i, tq, d, inter, qld);
                const typename S::T* dyi = dy + head_row(gq, i, tq, d, inter, inter * d);
                float p = expf(scale * held_dot<S>(kj, qi, d, lane) - lse[qrow]);
                float ds = p * (held_dot<S>(vj, dyi, d, lane) - delta[qrow]);
                for (int r = 0; r < HEAD_LANES; ++r) {
                    i64 c = lane + 32 * r;
                    if (c < d) {
                        acc_k[r] += scale * ds * S::load(qi[c]);
                        acc_v[r] += p * S::load(dyi[c]);
                    }
                }
            }
        for (int r = 0; r < HEAD_LANES; ++r) {
            i64 c = lane + 32 * r;
            if (c < d) {
                dk[at + c] = S::store(acc_k[r]);
                dv[at + c] = S::store(acc_v[r]);
            }
        }
    }
}
extern "C" __global__ void attention_bwd_dkv_f32(i64 rows, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                                 const float* q, const float* k, const float* v, const float* dy,
                                                 const float* lse, const float* delta, float* dk, float* dv) {
    attention_bwd_dkv<F32>(rows, tq, tk, d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, dy, lse, delta, dk, dv);
}
extern "C" __global__ void attention_bwd_dkv_f16(i64 rows, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                                 const u16* q, const u16* k, const u16* v, const u16* dy,
                                                 const float* lse, const float* delta, u16* dk, u16* dv) {
    attention_bwd_dkv<F16>(rows, tq, tk, d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, dy, lse, delta, dk, dv);
}
extern "C" __global__ void attention_bwd_dkv_bf16(i64 rows, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                                  const u16* q, const u16* k, const u16* v, const u16* dy,
                                                  const float* lse, const float* delta, u16* dk, u16* dv) {
    attention_bwd_dkv<BF16>(rows, tq, tk, d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, dy, lse, delta, dk, dv);
}
