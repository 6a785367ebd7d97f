// Row kernels: softmax, LayerNorm and the fused softmax + cross-entropy, each over the last
// axis of a contiguous [rows, cols] value with one block of BLOCK threads per row; and the
// column sums their weight gradients need.

// Softmax (log = 0) or LogSoftmax (log = 1) of each row.
extern "C" __global__ void softmax_rows(int log, i64 cols, const float* x, float* y) {
    const float* xr = x + blockIdx.x * cols;
    float* yr = y + blockIdx.x * cols;
    float m = NEG_INF;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, xr[j]);
    m = block_max(m);
    float s = 0.f;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += expf(xr[j] - m);
    s = block_sum(s);
    if (log) {
        float lse = m + logf(s);
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = xr[j] - lse;
    } else {
        float inv = 1.f / s;
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = expf(xr[j] - m) * inv;
    }
}

// Softmax: dX = Y ⊙ (dY − Σ dY⊙Y). LogSoftmax: dX = dY − exp(Y)·Σ dY.
extern "C" __global__ void softmax_grad_rows(int log, i64 cols, const float* dy, const float* y, float* dx) {
    const float* dyr = dy + blockIdx.x * cols;
    const float* yr = y + blockIdx.x * cols;
    float* dxr = dx + blockIdx.x * cols;
    float s = 0.f;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += log ? dyr[j] : dyr[j] * yr[j];
    s = block_sum(s);
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x)
        dxr[j] = log ? dyr[j] - expf(yr[j]) * s : yr[j] * (dyr[j] - s);
}

// The same two over an axis that is not the last: [outer, n, inner], one thread per (outer,
// inner) line walking its n elements `inner` apart. Such axes are rare (the models' softmaxes
// are over the last), so this favours plainness over speed.
extern "C" __global__ void softmax_strided(int log, i64 outer, i64 n, i64 inner, const float* x, float* y) {
    for (i64 t = first_index(); t < outer * inner; t += grid_stride()) {
        i64 base = (t / inner) * n * inner + t % inner;
        float m = NEG_INF, s = 0.f;
        for (i64 j = 0; j < n; ++j) m = fmaxf(m, x[base + j * inner]);
        for (i64 j = 0; j < n; ++j) s += expf(x[base + j * inner] - m);
        float lse = m + logf(s), inv = 1.f / s;
        for (i64 j = 0; j < n; ++j) {
            i64 at = base + j * inner;
            y[at] = log ? x[at] - lse : expf(x[at] - m) * inv;
        }
    }
}
extern "C" __global__ void softmax_grad_strided(int log, i64 outer, i64 n, i64 inner, const float* dy,
                                                const float* y, float* dx) {
    for (i64 t = first_index(); t < outer * inner; t += grid_stride()) {
        i64 base = (t / inner) * n * inner + t % inner;
        float s = 0.f;
        for (i64 j = 0; j < n; ++j) {
            i64 at = base + j * inner;
            s += log ? dy[at] : dy[at] * y[at];
        }
        for (i64 j = 0; j < n; ++j) {
            i64 at = base + j * inner;
            dx[at] = log ? dy[at] - expf(y[at]) * s : y[at] * (dy[at] - s);
        }
    }
}

// LayerNormalization of each row: Y = (x − μ)·σ⁻¹·scale + bias (bias may be null); the mean
// and σ⁻¹ are written when their outputs exist (the backward pass reads them). With `rms`,
// RMSNorm: μ = 0, so σ is the root mean square and nothing is taken out. x, scale and
// bias are f32; Y is f32, or half where mixed precision's product reads it (fuse.rs's
// layer_norm_casts), rounded once as a cast after it would round it.
// With `branch` (of Y's type, widened), the row normalized is the residual add x + branch,
// written to `sum` on the way (fuse.rs's residual_layer_norm): the same bits as the add
// followed by the LayerNorm, one read of the residual instead of three sweeps.
template <class S>
__device__ void layer_norm_rows(int rms, i64 cols, float eps, const float* x, const typename S::T* branch,
                                const float* scale, const float* bias, typename S::T* y, float* sum,
                                float* mean_out, float* inv_out) {
    const float* xr = x + blockIdx.x * cols;
    typename S::T* yr = y + blockIdx.x * cols;
    float s = 0.f;
    if (branch) {
        const typename S::T* br = branch + blockIdx.x * cols;
        float* sr = sum + blockIdx.x * cols;
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
            float a = xr[j] + S::load(br[j]);
            sr[j] = a;
            s += a;
        }
        xr = sr;  // each thread reads back only what it wrote
    } else if (!rms) {
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += xr[j];
    }
    float mu = rms ? 0.f : block_sum(s) / (float)cols;
    float v = 0.f;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
        float d = xr[j] - mu;
        v += d * d;
    }
    float inv = rsqrtf(block_sum(v) / (float)cols + eps);
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x)
        yr[j] = S::store((xr[j] - mu) * inv * scale[j] + (bias ? bias[j] : 0.f));
    if (threadIdx.x == 0) {
        if (mean_out) mean_out[blockIdx.x] = mu;
        if (inv_out) inv_out[blockIdx.x] = inv;
    }
}
extern "C" __global__ void layer_norm_rows_f32(int rms, i64 cols, float eps, const float* x, const float* branch,
                                               const float* scale, const float* bias, float* y, float* sum,
                                               float* mean_out, float* inv_out) {
    layer_norm_rows<F32>(rms, cols, eps, x, branch, scale, bias, y, sum, mean_out, inv_out);
}
extern "C" __global__ void layer_norm_rows_f16(int rms, i64 cols, float eps, const float* x, const u16* branch,
                                               const float* scale, const float* bias, u16* y, float* sum,
                                               float* mean_out, float* inv_out) {
    layer_norm_rows<F16>(rms, cols, eps, x, branch, scale, bias, y, sum, mean_out, inv_out);
}
extern "C" __global__ void layer_norm_rows_bf16(int rms, i64 cols, float eps, const float* x, const u16* branch,
                                                const float* scale, const float* bias, u16* y, float* sum,
                                                float* mean_out, float* inv_out) {
    layer_norm_rows<BF16>(rms, cols, eps, x, branch, scale, bias, y, sum, mean_out, inv_out);
}

// dX of LayerNormalization, per row: with x̂ = (x − μ)·σ⁻¹ and g = dY⊙scale,
// dX = σ⁻¹·(g − mean(g) − x̂·mean(g⊙x̂)); RMSNorm's (`rms`, μ = 0) has no mean(g) term.
// dScale and dBias are column sums (below). dY is f32,
// or half where mixed precision's product wrote it (layer_norm_casts), widened on loading.
// dx_in, when not null, is a gradient the graph added to dX (the residual branch's: fuse.rs's
// layer_norm_grad_add), added as dX is written instead of in a sweep of its own; dx_half, when
// not null, gets dX rounded to dY's half type as well (the cast the products before the
// LayerNorm read: layer_norm_casts).
// (A block walking 64 rows with dScale and dBias summed on the way, one read of dY and x, ran
// at less than half this kernel's speed on an H100: docs/PERFORMANCE.md.)
template <class S>
__device__ void layer_norm_grad_rows(int rms, i64 cols, const typename S::T* dy, const float* x,
                                     const float* scale, const float* mean, const float* inv_std,
                                     const float* dx_in, float* dx, typename S::T* dx_half) {
    i64 r = blockIdx.x;
    const typename S::T* dyr = dy + r * cols;
    const float* xr = x + r * cols;
    float* dxr = dx + r * cols;
    float mu = mean[r], inv = inv_std[r];
    float sg = 0.f, sgx = 0.f;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
        float g = S::load(dyr[j]) * scale[j];
        sg += g;
        sgx += g * (xr[j] - mu) * inv;
    }
    float mean_g = rms ? 0.f : block_sum(sg) / (float)cols;
    float mean_gx = block_sum(sgx) / (float)cols;
    const float* add = dx_in ? dx_in + r * cols : 0;
    typename S::T* half = dx_half ? dx_half + r * cols : 0;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
        float xh = (xr[j] - mu) * inv;
        float g = (add ? add[j] : 0.f) + inv * (S::load(dyr[j]) * scale[j] - mean_g - xh * mean_gx);
        dxr[j] = g;
        if (half) half[j] = S::store(g);
    }
}
extern "C" __global__ void layer_norm_grad_rows_f32(int rms, i64 cols, const float* dy, const float* x,
                                                    const float* scale, const float* mean, const float* inv_std,
                                                    const float* dx_in, float* dx, float* dx_half) {
    layer_norm_grad_rows<F32>(rms, cols, dy, x, scale, mean, inv_std, dx_in, dx, dx_half);
}
extern "C" __global__ void layer_norm_grad_rows_f16(int rms, i64 cols, const u16* dy, const float* x,
                                                    const float* scale, const float* mean, const float* inv_std,
                                                    const float* dx_in, float* dx, u16* dx_half) {
    layer_norm_grad_rows<F16>(rms, cols, dy, x, scale, mean, inv_std, dx_in, dx, dx_half);
}
extern "C" __global__ void layer_norm_grad_rows_bf16(int rms, i64 cols, const u16* dy, const float* x,
                                                     const float* scale, const float* mean, const float* inv_std,
                                                     const float* dx_in, float* dx, u16* dx_half) {
    layer_norm_grad_rows<BF16>(rms, cols, dy, x, scale, mean, inv_std, dx_in, dx, dx_half);
}

// Column sums of [rows, cols] in two deterministic passes: blockIdx.y takes a chunk of rows and
// writes its partial sums to partial[chunk, cols]; column_sum_finish adds the chunks in a
// fixed order.
// With `x_hat`, each element is first multiplied by (x − mean[r])·inv_std[r] (LayerNorm's
// dScale); without it the sum is plain (dBias, and ReduceSumTo over leading axes).
// The partial sums are f32 whatever the element type (a bias gradient in bf16 is summed in f32
// and rounded once).
template <class S>
__device__ void column_sum_partial(i64 rows, i64 cols, i64 rows_per_chunk, const typename S::T* v, const float* x,
                                   const float* mean, const float* inv_std, float* partial) {
    i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    i64 r0 = (i64)blockIdx.y * rows_per_chunk;
    i64 r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    float s = 0.f;
    for (i64 r = r0; r < r1; ++r) {
        float e = S::load(v[r * cols + c]);
        if (x) e *= (x[r * cols + c] - mean[r]) * inv_std[r];
        s += e;
    }
    partial[(i64)blockIdx.y * cols + c] = s;
}
extern "C" __global__ void column_sum_partial_f32(i64 rows, i64 cols, i64 rows_per_chunk, const float* v,
                                                  const float* x, const float* mean, const float* inv_std,
                                                  float* partial) {
    column_sum_partial<F32>(rows, cols, rows_per_chunk, v, x, mean, inv_std, partial);
}
extern "C" __global__ void column_sum_partial_f16(i64 rows, i64 cols, i64 rows_per_chunk, const u16* v,
                                                  const float* x, const float* mean, const float* inv_std,
                                                  float* partial) {
    column_sum_partial<F16>(rows, cols, rows_per_chunk, v, x, mean, inv_std, partial);
}
extern "C" __global__ void column_sum_partial_bf16(i64 rows, i64 cols, i64 rows_per_chunk, const u16* v,
                                                   const float* x, const float* mean, const float* inv_std,
                                                   float* partial) {
    column_sum_partial<BF16>(rows, cols, rows_per_chunk, v, x, mean, inv_std, partial);
}

// The chunks' partial sums of 32 columns per block (of up to 32 warps), added in one fixed
// order, so the bits never depend on scheduling: warp w of W takes chunks w, w + W, …, then
// one warp adds the W warps' sums in order. The chunks' loads are spread over the block's
// warps: one thread per column walking every chunk was a long chain of loads over a grid of
// a few blocks (a LayerNorm's 768 columns: 3 blocks).
template <class S>
__device__ void column_sum_finish(i64 chunks, i64 cols, const float* partial, typename S::T* out) {
    __shared__ float sums[32][33];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, warps = blockDim.x >> 5;
    i64 c = (i64)blockIdx.x * 32 + lane;
    float s = 0.f;
    if (c < cols)
        for (i64 k = w; k < chunks; k += warps) s += partial[k * cols + c];
    sums[w][lane] = s;
    __syncthreads();
    if (w == 0 && c < cols) {
        float total = 0.f;
        for (int k = 0; k < warps; ++k) total += sums[k][lane];
        out[c] = S::store(total);
    }
}
extern "C" __global__ void column_sum_finish_f32(i64 chunks, i64 cols, const float* partial, float* out) {
    column_sum_finish<F32>(chunks, cols, partial, out);
}
extern "C" __global__ void column_sum_finish_f16(i64 chunks, i64 cols, const float* partial, u16* out) {
    column_sum_finish<F16>(chunks, cols, partial, out);
}
extern "C" __global__ void column_sum_finish_bf16(i64 chunks, i64 cols, const float* partial, u16* out) {
    column_sum_finish<BF16>(chunks, cols, partial, out);
}

// A reduction over any axes (ReduceSumTo, and the Reduce ops over axes that are not the
// trailing ones, of other element types than f32, or of kinds past SumSquare): each output
// element reduces its `inner_n` input elements, one thread each; `od`/`os` walk the kept dims,
// `rd`/`rs` the reduced ones. kind is Reduce's order in graph/op.rs (0 Sum, 1 Mean, 2 Max,
// 3 Min, 4 SumSquare, 5 L1, 6 L2, 7 LogSum, 8 LogSumExp, 9 Prod); sums and products in f64, as
// the CPU backend's reduce.
template <class S>
__device__ void reduce_strided(int kind, i64 n, const Dims& od, const Strides& os, i64 inner_n, const Dims& rd,
                               const Strides& rs, const typename S::T* x, typename S::T* out) {
    typedef typename S::C C;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 base = offset_of(i, od, os);
        if (kind == 2 || kind == 3) {
            C m = kind == 2 ? (C)NEG_INF : -(C)NEG_INF;
            for (i64 j = 0; j < inner_n; ++j) {
                C v = S::load(x[base + offset_of(j, rd, rs)]);
                m = kind == 2 ? max_of(m, v) : min_of(m, v);
            }
            out[i] = S::store(m);
            continue;
        }
        // LogSumExp: the sum of e^(x − max), the maximum found first (an infinite one is the
        // result, and shifting by it would give NaN).
        double shift = 0.0;
        if (kind == 8) {
            double m = (double)NEG_INF;
            for (i64 j = 0; j < inner_n; ++j) m = max_of(m, (double)S::load(x[base + offset_of(j, rd, rs)]));
            if (m - m == 0.0) shift = m;
        }
        double s = kind == 9 ? 1.0 : 0.0;
        for (i64 j = 0; j < inner_n; ++j) {
            double v = (double)S::load(x[base + offset_of(j, rd, rs)]);
            switch (kind) {
            case 4: case 6: s += v * v; break;
            case 5: s += abs_of(v); break;
            case 8: s += exp_of(v - shift); break;
            case 9: s *= v; break;
            default: s += v;
            }
        }
        switch (kind) {
        case 1: s /= (double)inner_n; break;
        case 6: s = sqrt_of(s); break;
        case 7: s = log_of(s); break;
        case 8: s = log_of(s) + shift; break;
        }
        out[i] = S::store((C)s);
    }
}
extern "C" __global__ void reduce_strided_f32(int kind, i64 n, Dims od, Strides os, i64 inner_n, Dims rd,
                                              Strides rs, const float* x, float* out) {
    reduce_strided<F32>(kind, n, od, os, inner_n, rd, rs, x, out);
}
extern "C" __global__ void reduce_strided_f16(int kind, i64 n, Dims od, Strides os, i64 inner_n, Dims rd,
                                              Strides rs, const u16* x, u16* out) {
    reduce_strided<F16>(kind, n, od, os, inner_n, rd, rs, x, out);
}
extern "C" __global__ void reduce_strided_bf16(int kind, i64 n, Dims od, Strides os, i64 inner_n, Dims rd,
                                               Strides rs, const u16* x, u16* out) {
    reduce_strided<BF16>(kind, n, od, os, inner_n, rd, rs, x, out);
}
extern "C" __global__ void reduce_strided_f64(int kind, i64 n, Dims od, Strides os, i64 inner_n, Dims rd,
                                              Strides rs, const double* x, double* out) {
    reduce_strided<F64>(kind, n, od, os, inner_n, rd, rs, x, out);
}

// The same reductions, kinds 0 to 7, with one block per output element: for outputs that each
// reduce many inputs (a convolution's bias gradient sums N·H·W values per channel, which one
// thread per channel reads in hundreds of milliseconds). The block's threads read neighbouring
// inputs where the reduced axes are the inner ones; their partial results meet in the block's
// tree, in f64 (max and min exactly).
template <class S>
__device__ void reduce_strided_blocks(int kind, i64 n, const Dims& od, const Strides& os, i64 inner_n,
                                      const Dims& rd, const Strides& rs, const typename S::T* x,
                                      typename S::T* out) {
    typedef typename S::C C;
    for (i64 i = blockIdx.x; i < n; i += gridDim.x) {
        i64 base = offset_of(i, od, os);
        double r = kind == 2 ? (double)NEG_INF : kind == 3 ? -(double)NEG_INF : 0.0;
        for (i64 j = threadIdx.x; j < inner_n; j += blockDim.x) {
            double v = (double)S::load(x[base + offset_of(j, rd, rs)]);
            switch (kind) {
            case 2: r = max_of(r, v); break;
            case 3: r = min_of(r, v); break;
            case 4: case 6: r += v * v; break;
            case 5: r += abs_of(v); break;
            default: r += v;
            }
        }
        if (kind == 2) r = block_max_f64(r);
        else if (kind == 3) r = -block_max_f64(-r);
        else r = block_sum_f64(r);
        switch (kind) {
        case 1: r /= (double)inner_n; break;
        case 6: r = sqrt_of(r); break;
        case 7: r = log_of(r); break;
        }
        if (threadIdx.x == 0) out[i] = S::store((C)r);
    }
}
extern "C" __global__ void reduce_strided_blocks_f32(int kind, i64 n, Dims od, Strides os, i64 inner_n, Dims rd,
                                                     Strides rs, const float* x, float* out) {
    reduce_strided_blocks<F32>(kind, n, od, os, inner_n, rd, rs, x, out);
}
extern "C" __global__ void reduce_strided_blocks_f16(int kind, i64 n, Dims od, Strides os, i64 inner_n, Dims rd,
                                                     Strides rs, const u16* x, u16* out) {
    reduce_strided_blocks<F16>(kind, n, od, os, inner_n, rd, rs, x, out);
}
extern "C" __global__ void reduce_strided_blocks_bf16(int kind, i64 n, Dims od, Strides os, i64 inner_n, Dims rd,
                                                      Strides rs, const u16* x, u16* out) {
    reduce_strided_blocks<BF16>(kind, n, od, os, inner_n, rd, rs, x, out);
}
extern "C" __global__ void reduce_strided_blocks_f64(int kind, i64 n, Dims od, Strides os, i64 inner_n, Dims rd,
                                                     Strides rs, const double* x, double* out) {
    reduce_strided_blocks<F64>(kind, n, od, os, inner_n, rd, rs, x, out);
}

// ---- SoftmaxCrossEntropyLoss over rows of class scores ([N, C], classes contiguous) ----

// The weight each row's loss counts with: weights[label] (1 without weights), 0 for an ignored
// row. A label out of [0, C) sets *fault to 1 + the row (the backend reports it, naming the
// label's row) and counts 0.
extern "C" __global__ void label_weights(i64 rows, i64 cols, const void* labels, int labels_i64, int has_ignore,
                                         i64 ignore, const float* weights, float* w, i64* fault) {
    for (i64 r = first_index(); r < rows; r += grid_stride()) {
        i64 l = labels_i64 ? ((const i64*)labels)[r] : (i64)((const int*)labels)[r];
        if (has_ignore && l == ignore) {
            w[r] = 0.f;
        } else if (l < 0 || l >= cols) {
            w[r] = 0.f;
            atomicCAS((u64*)fault, 0ull, (u64)(r + 1));
        } else {
            w[r] = weights ? weights[l] : 1.f;
        }
    }
}

// Per row: log-probabilities (when logp is not null) and the weighted negative log-likelihood,
// from scores of any float type (mixed precision's bf16 logits are read as they are, not cast to
// an f32 copy first), in f32. The row's maximum and its sum of exponentials are taken in one
// pass (each thread rescales its sum when its maximum grows, the block then rescales each
// thread's to the row's), so the scores are read twice when the log-probabilities are wanted,
// once when only the row's log-sum-exp is kept (lse not null: the loss_lse fusion).
template <class S>
__device__ void cross_entropy_row(i64 cols, const typename S::T* x, const void* labels, int labels_i64, const float* w,
                                  float* logp, float* lse_out, float* nll) {
    i64 r = blockIdx.x;
    const typename S::T* xr = x + r * cols;
    float m = NEG_INF, s = 0.f;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
        float v = S::load(xr[j]);
        if (v > m) {
            s = s * expf(m - v) + 1.f;
            m = v;
        } else if (v != NEG_INF) {  // a masked class adds nothing (and −∞ − −∞ would be NaN)
            s += expf(v - m);
        }
    }
    float row_max = block_max(m);
    float lse = row_max + logf(block_sum(s * expf(m - row_max)));
    if (logp)
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) logp[r * cols + j] = S::load(xr[j]) - lse;
    if (threadIdx.x == 0) {
        i64 l = labels_i64 ? ((const i64*)labels)[r] : (i64)((const int*)labels)[r];
        nll[r] = w[r] != 0.f ? -(S::load(xr[l]) - lse) * w[r] : 0.f;
        if (lse_out) lse_out[r] = lse;
    }
}
extern "C" __global__ void cross_entropy_rows_f32(i64 cols, const float* x, const void* labels, int labels_i64,
    const float* w, float* logp, float* lse, float* nll) {
    cross_entropy_row<F32>(cols, x, labels, labels_i64, w, logp, lse, nll);
}
extern "C" __global__ void cross_entropy_rows_f16(i64 cols, const u16* x, const void* labels, int labels_i64,
    const float* w, float* logp, float* lse, float* nll) {
    cross_entropy_row<F16>(cols, x, labels, labels_i64, w, logp, lse, nll);
}
extern "C" __global__ void cross_entropy_rows_bf16(i64 cols, const u16* x, const void* labels, int labels_i64,
    const float* w, float* logp, float* lse, float* nll) {
    cross_entropy_row<BF16>(cols, x, labels, labels_i64, w, logp, lse, nll);
}

// One block sums n values in a fixed order (thread-strided, then the block tree): the same
// bits every run. Used for the loss' sum and its mean's denominator.
extern "C" __global__ void sum_one_block(i64 n, const float* x, float* out) {
    float s = 0.f;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
    s = block_sum(s);
    if (threadIdx.x == 0) *out = s;
}

// loss = total / den (mean; den = Σ weights of the counted rows, 0/0 = NaN as ONNX says) or
// total (sum).
extern "C" __global__ void loss_finish(int mean, const float* total, const float* den, float* loss) {
    *loss = mean ? *total / *den : *total;
}

// dX = (softmax − one-hot)·scale per row, scale = dLoss·w[r] (reduction none: dLoss[r]·w[r]),
// divided by the denominator for a mean; computed in f32 and stored in dX's type (mixed
// precision's bf16 logits get a bf16 gradient, rounded once).
__device__ __forceinline__ float cross_entropy_scale(i64 r, int reduction, const float* dloss, const float* w,
                                                     const float* den) {
    if (reduction == 0) return dloss[r] * w[r];
    if (reduction == 1) return dloss[0] * w[r] / (*den == 0.f ? 1.f : *den);
    return dloss[0] * w[r];
}
template <class S>
__device__ void cross_entropy_grad_row(i64 cols, int reduction, const float* dloss, const float* logp,
                                       const void* labels, int labels_i64, const float* w, const float* den,
                                       typename S::T* dx) {
    i64 r = blockIdx.x;
    float scale = cross_entropy_scale(r, reduction, dloss, w, den);
    i64 l = labels_i64 ? ((const i64*)labels)[r] : (i64)((const int*)labels)[r];
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
        float g = expf(logp[r * cols + j]) * scale;
        dx[r * cols + j] = S::store((j == l && w[r] != 0.f) ? g - scale : g);
    }
}
extern "C" __global__ void cross_entropy_grad_rows_f32(i64 cols, int reduction, const float* dloss, const float* logp,
                                                       const void* labels, int labels_i64, const float* w,
                                                       const float* den, float* dx) {
    cross_entropy_grad_row<F32>(cols, reduction, dloss, logp, labels, labels_i64, w, den, dx);
}
extern "C" __global__ void cross_entropy_grad_rows_f16(i64 cols, int reduction, const float* dloss, const float* logp,
                                                       const void* labels, int labels_i64, const float* w,
                                                       const float* den, u16* dx) {
    cross_entropy_grad_row<F16>(cols, reduction, dloss, logp, labels, labels_i64, w, den, dx);
}
extern "C" __global__ void cross_entropy_grad_rows_bf16(i64 cols, int reduction, const float* dloss,
                                                        const float* logp, const void* labels, int labels_i64,
                                                        const float* w, const float* den, u16* dx) {
    cross_entropy_grad_row<BF16>(cols, reduction, dloss, logp, labels, labels_i64, w, den, dx);
}

// The same gradient from the scores and each row's log-sum-exp (the loss_lse fusion): the
// softmax recomputed as exp(x − lse), the same f32 the log-probabilities held, so the same bits;
// one read of the scores and one write of dX, in the scores' type.
template <class S>
__device__ void cross_entropy_lse_grad_row(i64 cols, int reduction, const float* dloss, const typename S::T* x,
                                           const float* lse, const void* labels, int labels_i64, const float* w,
                                           const float* den, typename S::T* dx) {
    i64 r = blockIdx.x;
    float scale = cross_entropy_scale(r, reduction, dloss, w, den), m = lse[r];
    i64 l = labels_i64 ? ((const i64*)labels)[r] : (i64)((const int*)labels)[r];
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) {
        float g = expf(S::load(x[r * cols + j]) - m) * scale;
        dx[r * cols + j] = S::store((j == l && w[r] != 0.f) ? g - scale : g);
    }
}
extern "C" __global__ void cross_entropy_lse_grad_rows_f32(i64 cols, int reduction, const float* dloss, const float* x,
                                                           const float* lse, const void* labels, int labels_i64,
                                                           const float* w, const float* den, float* dx) {
    cross_entropy_lse_grad_row<F32>(cols, reduction, dloss, x, lse, labels, labels_i64, w, den, dx);
}
extern "C" __global__ void cross_entropy_lse_grad_rows_f16(i64 cols, int reduction, const float* dloss, const u16* x,
                                                           const float* lse, const void* labels, int labels_i64,
                                                           const float* w, const float* den, u16* dx) {
    cross_entropy_lse_grad_row<F16>(cols, reduction, dloss, x, lse, labels, labels_i64, w, den, dx);
}
extern "C" __global__ void cross_entropy_lse_grad_rows_bf16(i64 cols, int reduction, const float* dloss, const u16* x,
                                                            const float* lse, const void* labels, int labels_i64,
                                                            const float* w, const float* den, u16* dx) {
    cross_entropy_lse_grad_row<BF16>(cols, reduction, dloss, x, lse, labels, labels_i64, w, den, dx);
}

// ---- NegativeLogLikelihoodLoss, and its gradient ----

// The label at position p (of N·D, p = n·D + k) if it counts: -1 where it is ignored; an
// out-of-range label sets *fault to 1 + p and does not count.
__device__ __forceinline__ i64 nll_label(i64 p, i64 c, const void* labels, int labels_i64, int has_ignore,
                                         i64 ignore, i64* fault) {
    i64 l = labels_i64 ? ((const i64*)labels)[p] : (i64)((const int*)labels)[p];
    if (has_ignore && l == ignore) return -1;
    if (l < 0 || l >= c) {
        if (fault) atomicCAS((u64*)fault, 0ull, (u64)(p + 1));
        return -1;
    }
    return l;
}

// Each position's weight: w[label] (1 without weights), 0 where the label does not count.
template <class S>
__device__ void nll_weights(i64 positions, i64 c, const void* labels, int labels_i64, int has_ignore, i64 ignore,
                            const typename S::T* w, typename S::T* counted, i64* fault) {
    for (i64 p = first_index(); p < positions; p += grid_stride()) {
        i64 l = nll_label(p, c, labels, labels_i64, has_ignore, ignore, fault);
        counted[p] = S::store(l < 0 ? (typename S::C)0 : (w ? S::load(w[l]) : (typename S::C)1));
    }
}
// Each position's loss over log-probabilities [N, C, D]: −x[n, label, k]·w[label], or 0.
template <class S>
__device__ void nll(i64 positions, i64 c, i64 d, const typename S::T* x, const void* labels, int labels_i64,
                    int has_ignore, i64 ignore, const typename S::T* w, typename S::T* per, i64* fault) {
    typedef typename S::C C;
    for (i64 p = first_index(); p < positions; p += grid_stride()) {
        i64 l = nll_label(p, c, labels, labels_i64, has_ignore, ignore, fault);
        C wl = l < 0 ? (C)0 : (w ? S::load(w[l]) : (C)1);
        per[p] = S::store(l < 0 ? (C)0 : -S::load(x[((p / d) * c + l) * d + p % d]) * wl);
    }
}
// dX (zeroed first by the backend) at each counted position's label: −w[label]·dLoss (dLoss per
// position, or the one value), divided by *den for a mean.
template <class S>
__device__ void nll_grad(i64 positions, i64 c, i64 d, int per_position, const typename S::T* dloss,
                         const typename S::T* den, const void* labels, int labels_i64, int has_ignore, i64 ignore,
                         const typename S::T* w, typename S::T* dx) {
    typedef typename S::C C;
    for (i64 p = first_index(); p < positions; p += grid_stride()) {
        i64 l = nll_label(p, c, labels, labels_i64, has_ignore, ignore, (i64*)0);
        if (l < 0) continue;
        C g = S::load(dloss[per_position ? p : 0]) * (w ? S::load(w[l]) : (C)1);
        dx[((p / d) * c + l) * d + p % d] = S::store(-(den ? g / S::load(*den) : g));
    }
}
extern "C" __global__ void nll_weights_f32(i64 positions, i64 c, const void* labels, int labels_i64, int has_ignore,
                                           i64 ignore, const float* w, float* counted, i64* fault) {
    nll_weights<F32>(positions, c, labels, labels_i64, has_ignore, ignore, w, counted, fault);
}
extern "C" __global__ void nll_weights_f16(i64 positions, i64 c, const void* labels, int labels_i64, int has_ignore,
                                           i64 ignore, const u16* w, u16* counted, i64* fault) {
    nll_weights<F16>(positions, c, labels, labels_i64, has_ignore, ignore, w, counted, fault);
}
extern "C" __global__ void nll_weights_bf16(i64 positions, i64 c, const void* labels, int labels_i64, int has_ignore,
                                            i64 ignore, const u16* w, u16* counted, i64* fault) {
    nll_weights<BF16>(positions, c, labels, labels_i64, has_ignore, ignore, w, counted, fault);
}
extern "C" __global__ void nll_weights_f64(i64 positions, i64 c, const void* labels, int labels_i64, int has_ignore,
                                           i64 ignore, const double* w, double* counted, i64* fault) {
    nll_weights<F64>(positions, c, labels, labels_i64, has_ignore, ignore, w, counted, fault);
}
extern "C" __global__ void nll_f32(i64 positions, i64 c, i64 d, const float* x, const void* labels, int labels_i64,
                                   int has_ignore, i64 ignore, const float* w, float* per, i64* fault) {
    nll<F32>(positions, c, d, x, labels, labels_i64, has_ignore, ignore, w, per, fault);
}
extern "C" __global__ void nll_f16(i64 positions, i64 c, i64 d, const u16* x, const void* labels, int labels_i64,
                                   int has_ignore, i64 ignore, const u16* w, u16* per, i64* fault) {
    nll<F16>(positions, c, d, x, labels, labels_i64, has_ignore, ignore, w, per, fault);
}
extern "C" __global__ void nll_bf16(i64 positions, i64 c, i64 d, const u16* x, const void* labels, int labels_i64,
                                    int has_ignore, i64 ignore, const u16* w, u16* per, i64* fault) {
    nll<BF16>(positions, c, d, x, labels, labels_i64, has_ignore, ignore, w, per, fault);
}
extern "C" __global__ void nll_f64(i64 positions, i64 c, i64 d, const double* x, const void* labels, int labels_i64,
                                   int has_ignore, i64 ignore, const double* w, double* per, i64* fault) {
    nll<F64>(positions, c, d, x, labels, labels_i64, has_ignore, ignore, w, per, fault);
}
extern "C" __global__ void nll_grad_f32(i64 positions, i64 c, i64 d, int per_position, const float* dloss,
                                        const float* den, const void* labels, int labels_i64, int has_ignore,
                                        i64 ignore, const float* w, float* dx) {
    nll_grad<F32>(positions, c, d, per_position, dloss, den, labels, labels_i64, has_ignore, ignore, w, dx);
}
extern "C" __global__ void nll_grad_f16(i64 positions, i64 c, i64 d, int per_position, const u16* dloss,
                                        const u16* den, const void* labels, int labels_i64, int has_ignore,
                                        i64 ignore, const u16* w, u16* dx) {
    nll_grad<F16>(positions, c, d, per_position, dloss, den, labels, labels_i64, has_ignore, ignore, w, dx);
}
extern "C" __global__ void nll_grad_bf16(i64 positions, i64 c, i64 d, int per_position, const u16* dloss,
                                         const u16* den, const void* labels, int labels_i64, int has_ignore,
                                         i64 ignore, const u16* w, u16* dx) {
    nll_grad<BF16>(positions, c, d, per_position, dloss, den, labels, labels_i64, has_ignore, ignore, w, dx);
}
extern "C" __global__ void nll_grad_f64(i64 positions, i64 c, i64 d, int per_position, const double* dloss,
                                        const double* den, const void* labels, int labels_i64, int has_ignore,
                                        i64 ignore, const double* w, double* dx) {
    nll_grad<F64>(positions, c, d, per_position, dloss, den, labels, labels_i64, has_ignore, ignore, w, dx);
}

// ---- Gather along an axis, and its gradient (the embedding's) ----

// out[o, k, i] = data[o, ids[k], i]; negative ids count from the end; an id out of range sets
// *fault to 1 + its position and writes zeros. One entry point per element width.
template <typename T>
__device__ void gather(i64 outer, i64 dim, i64 inner, i64 count, const T* data, const void* ids, int ids_i64,
                       T* out, i64* fault) {
    i64 n = outer * count * inner;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 e, k;
        i64 o = divmod(divmod(i, inner, &e), count, &k);
        i64 id = ids_i64 ? ((const i64*)ids)[k] : (i64)((const int*)ids)[k];
        if (id < 0) id += dim;
        if (id < 0 || id >= dim) {
            atomicCAS((u64*)fault, 0ull, (u64)(k + 1));
            out[i] = (T)0;
        } else {
            out[i] = data[(o * dim + id) * inner + e];
        }
    }
}
extern "C" __global__ void gather_b8(i64 outer, i64 dim, i64 inner, i64 count, const u8* data, const void* ids,
                                     int ids_i64, u8* out, i64* fault) {
    gather<u8>(outer, dim, inner, count, data, ids, ids_i64, out, fault);
}
extern "C" __global__ void gather_b16(i64 outer, i64 dim, i64 inner, i64 count, const u16* data, const void* ids,
                                      int ids_i64, u16* out, i64* fault) {
    gather<u16>(outer, dim, inner, count, data, ids, ids_i64, out, fault);
}
extern "C" __global__ void gather_b32(i64 outer, i64 dim, i64 inner, i64 count, const u32* data, const void* ids,
                                      int ids_i64, u32* out, i64* fault) {
    gather<u32>(outer, dim, inner, count, data, ids, ids_i64, out, fault);
}
extern "C" __global__ void gather_b64(i64 outer, i64 dim, i64 inner, i64 count, const u64* data, const void* ids,
                                      int ids_i64, u64* out, i64* fault) {
    gather<u64>(outer, dim, inner, count, data, ids, ids_i64, out, fault);
}

// dData (zeroed first by the backend) += dY scattered at the ids. atomicAdd: rows hit by
// several ids add in an unspecified order, so the last bits can differ between runs.
extern "C" __global__ void gather_grad_f32(i64 outer, i64 dim, i64 inner, i64 count, const float* dy,
                                           const void* ids, int ids_i64, float* dx) {
    i64 n = outer * count * inner;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 e, k;
        i64 o = divmod(divmod(i, inner, &e), count, &k);
        i64 id = ids_i64 ? ((const i64*)ids)[k] : (i64)((const int*)ids)[k];
        if (id < 0) id += dim;
        if (id >= 0 && id < dim) atomicAdd(&dx[(o * dim + id) * inner + e], dy[i]);
    }
}

// ---- GatherElements, and its gradient ----

// The offset in data (strides sd) of the element that index position i (of the indices' shape
// d) addresses: i's coordinates, the one along `axis` replaced by the index; -1 for an index
// out of range.
__device__ __forceinline__ i64 element_offset(i64 i, const Dims& d, int axis, i64 dim, const Strides& sd,
                                              const void* ids, int ids_i64) {
    i64 id = ids_i64 ? ((const i64*)ids)[i] : (i64)((const int*)ids)[i];
    if (id < 0) id += dim;
    if (id < 0 || id >= dim) return -1;
    i64 off = 0, j = i;
    for (int k = (int)d.rank - 1; k >= 0; --k) {
        i64 c = j % d.size[k];
        j /= d.size[k];
        off += (k == axis ? id : c) * sd.at[k];
    }
    return off;
}

// out[i] = data[element_offset(i)]; an index out of range sets *fault to 1 + its position and
// writes zero. One entry point per element width.
template <typename T>
__device__ void gather_elements(i64 n, const Dims& d, int axis, i64 dim, const Strides& sd, const T* data,
                                const void* ids, int ids_i64, T* out, i64* fault) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 at = element_offset(i, d, axis, dim, sd, ids, ids_i64);
        if (at < 0) atomicCAS((u64*)fault, 0ull, (u64)(i + 1));
        out[i] = at < 0 ? (T)0 : data[at];
    }
}
extern "C" __global__ void gather_elements_b8(i64 n, Dims d, int axis, i64 dim, Strides sd, const u8* data,
                                              const void* ids, int ids_i64, u8* out, i64* fault) {
    gather_elements<u8>(n, d, axis, dim, sd, data, ids, ids_i64, out, fault);
}
extern "C" __global__ void gather_elements_b16(i64 n, Dims d, int axis, i64 dim, Strides sd, const u16* data,
                                               const void* ids, int ids_i64, u16* out, i64* fault) {
    gather_elements<u16>(n, d, axis, dim, sd, data, ids, ids_i64, out, fault);
}
extern "C" __global__ void gather_elements_b32(i64 n, Dims d, int axis, i64 dim, Strides sd, const u32* data,
                                               const void* ids, int ids_i64, u32* out, i64* fault) {
    gather_elements<u32>(n, d, axis, dim, sd, data, ids, ids_i64, out, fault);
}
extern "C" __global__ void gather_elements_b64(i64 n, Dims d, int axis, i64 dim, Strides sd, const u64* data,
                                               const void* ids, int ids_i64, u64* out, i64* fault) {
    gather_elements<u64>(n, d, axis, dim, sd, data, ids, ids_i64, out, fault);
}

// dData (zeroed first by the backend) += dY at element_offset(i). atomicAdd: elements hit by
// several indices add in an unspecified order.
extern "C" __global__ void gather_elements_grad_f32(i64 n, Dims d, int axis, i64 dim, Strides sd, const float* dy,
                                                    const void* ids, int ids_i64, float* dx) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 at = element_offset(i, d, axis, dim, sd, ids, ids_i64);
        if (at >= 0) atomicAdd(&dx[at], dy[i]);
    }
}

// A scatter's reduction (1 add, 2 mul, 3 max, 4 min) of an update into the element, in f64;
// max_of and min_of ignore a NaN operand, as the CPU's f64::max and f64::min.
__device__ __forceinline__ double scatter_combine(int reduction, double acc, double v) {
    return reduction == 1 ? acc + v : reduction == 2 ? acc * v : reduction == 3 ? max_of(acc, v) : min_of(acc, v);
}

// ScatterElements over out (a copy of data made first by the backend): each element of out
// visits the index positions in order (m of them, of the indices' shape d) and takes (reduction
// 0) or combines in f64 (1 add, 2 mul, 3 max, 4 min) every update whose element_offset is its
// own. No atomics, so repeated indices give the CPU's result; the cost is out's elements times m.
template <typename T>
__device__ void scatter_elements(i64 n, i64 m, const Dims& d, int axis, i64 dim, const Strides& sd, const T* updates,
                                 const void* ids, int ids_i64, T* out) {
    for (i64 e = first_index(); e < n; e += grid_stride())
        for (i64 i = 0; i < m; ++i)
            if (element_offset(i, d, axis, dim, sd, ids, ids_i64) == e) out[e] = updates[i];
}
extern "C" __global__ void scatter_elements_b8(i64 n, i64 m, Dims d, int axis, i64 dim, Strides sd,
                                               const u8* updates, const void* ids, int ids_i64, u8* out) {
    scatter_elements<u8>(n, m, d, axis, dim, sd, updates, ids, ids_i64, out);
}
extern "C" __global__ void scatter_elements_b16(i64 n, i64 m, Dims d, int axis, i64 dim, Strides sd,
                                                const u16* updates, const void* ids, int ids_i64, u16* out) {
    scatter_elements<u16>(n, m, d, axis, dim, sd, updates, ids, ids_i64, out);
}
extern "C" __global__ void scatter_elements_b32(i64 n, i64 m, Dims d, int axis, i64 dim, Strides sd,
                                                const u32* updates, const void* ids, int ids_i64, u32* out) {
    scatter_elements<u32>(n, m, d, axis, dim, sd, updates, ids, ids_i64, out);
}
extern "C" __global__ void scatter_elements_b64(i64 n, i64 m, Dims d, int axis, i64 dim, Strides sd,
                                                const u64* updates, const void* ids, int ids_i64, u64* out) {
    scatter_elements<u64>(n, m, d, axis, dim, sd, updates, ids, ids_i64, out);
}
template <class S>
__device__ void scatter_elements_reduce(int reduction, i64 n, i64 m, const Dims& d, int axis, i64 dim,
                                        const Strides& sd, const typename S::T* updates, const void* ids,
                                        int ids_i64, typename S::T* out) {
    for (i64 e = first_index(); e < n; e += grid_stride()) {
        double acc = (double)S::load(out[e]);
        for (i64 i = 0; i < m; ++i) {
            if (element_offset(i, d, axis, dim, sd, ids, ids_i64) != e) continue;
            acc = scatter_combine(reduction, acc, (double)S::load(updates[i]));
        }
        out[e] = S::store((typename S::C)acc);
    }
}
extern "C" __global__ void scatter_elements_reduce_f32(int reduction, i64 n, i64 m, Dims d, int axis, i64 dim,
                                                       Strides sd, const float* updates, const void* ids, int ids_i64,
                                                       float* out) {
    scatter_elements_reduce<F32>(reduction, n, m, d, axis, dim, sd, updates, ids, ids_i64, out);
}
extern "C" __global__ void scatter_elements_reduce_f16(int reduction, i64 n, i64 m, Dims d, int axis, i64 dim,
                                                       Strides sd, const u16* updates, const void* ids, int ids_i64,
                                                       u16* out) {
    scatter_elements_reduce<F16>(reduction, n, m, d, axis, dim, sd, updates, ids, ids_i64, out);
}
extern "C" __global__ void scatter_elements_reduce_bf16(int reduction, i64 n, i64 m, Dims d, int axis, i64 dim,
                                                        Strides sd, const u16* updates, const void* ids, int ids_i64,
                                                        u16* out) {
    scatter_elements_reduce<BF16>(reduction, n, m, d, axis, dim, sd, updates, ids, ids_i64, out);
}
extern "C" __global__ void scatter_elements_reduce_f64(int reduction, i64 n, i64 m, Dims d, int axis, i64 dim,
                                                       Strides sd, const double* updates, const void* ids, int ids_i64,
                                                       double* out) {
    scatter_elements_reduce<F64>(reduction, n, m, d, axis, dim, sd, updates, ids, ids_i64, out);
}

// ---- GatherND and ScatterND ----

// The offset in data of the slice that k-tuple t of the indices names: its batch's base (tuples
// per batch, elements per batch) plus Σ index_j · stride_j over the k indexed dims (sizes kd,
// strides ks); -1 for an index out of range.
__device__ i64 nd_offset(i64 t, i64 per_batch, i64 batch_stride, const Dims& kd, const Strides& ks, const void* ids,
                         int ids_i64) {
    i64 at = (t / per_batch) * batch_stride;
    for (int j = 0; j < (int)kd.rank; ++j) {
        i64 q = t * kd.rank + j;
        i64 id = ids_i64 ? ((const i64*)ids)[q] : (i64)((const int*)ids)[q];
        if (id < 0) id += kd.size[j];
        if (id < 0 || id >= kd.size[j]) return -1;
        at += id * ks.at[j];
    }
    return at;
}

// GatherND: out[e] = data[slice of tuple e / inner, element e % inner]; an index out of range
// sets *fault to 1 + the tuple's position and writes zero.
template <typename T>
__device__ void gather_nd(i64 n, i64 inner, i64 per_batch, i64 batch_stride, const Dims& kd, const Strides& ks,
                          const T* data, const void* ids, int ids_i64, T* out, i64* fault) {
    for (i64 e = first_index(); e < n; e += grid_stride()) {
        i64 t = e / inner, at = nd_offset(t, per_batch, batch_stride, kd, ks, ids, ids_i64);
        if (at < 0) atomicCAS((u64*)fault, 0ull, (u64)(t + 1));
        out[e] = at < 0 ? (T)0 : data[at + e % inner];
    }
}
extern "C" __global__ void gather_nd_b8(i64 n, i64 inner, i64 per_batch, i64 batch_stride, Dims kd, Strides ks,
                                        const u8* data, const void* ids, int ids_i64, u8* out, i64* fault) {
    gather_nd<u8>(n, inner, per_batch, batch_stride, kd, ks, data, ids, ids_i64, out, fault);
}
extern "C" __global__ void gather_nd_b16(i64 n, i64 inner, i64 per_batch, i64 batch_stride, Dims kd, Strides ks,
                                         const u16* data, const void* ids, int ids_i64, u16* out, i64* fault) {
    gather_nd<u16>(n, inner, per_batch, batch_stride, kd, ks, data, ids, ids_i64, out, fault);
}
extern "C" __global__ void gather_nd_b32(i64 n, i64 inner, i64 per_batch, i64 batch_stride, Dims kd, Strides ks,
                                         const u32* data, const void* ids, int ids_i64, u32* out, i64* fault) {
    gather_nd<u32>(n, inner, per_batch, batch_stride, kd, ks, data, ids, ids_i64, out, fault);
}
extern "C" __global__ void gather_nd_b64(i64 n, i64 inner, i64 per_batch, i64 batch_stride, Dims kd, Strides ks,
                                         const u64* data, const void* ids, int ids_i64, u64* out, i64* fault) {
    gather_nd<u64>(n, inner, per_batch, batch_stride, kd, ks, data, ids, ids_i64, out, fault);
}
// dData (zeroed first by the backend) += dY at the slices GatherND read (atomicAdd: tuples may
// repeat).
extern "C" __global__ void gather_nd_grad_f32(i64 n, i64 inner, i64 per_batch, i64 batch_stride, Dims kd,
                                              Strides ks, const float* dy, const void* ids, int ids_i64, float* dx) {
    for (i64 e = first_index(); e < n; e += grid_stride()) {
        i64 at = nd_offset(e / inner, per_batch, batch_stride, kd, ks, ids, ids_i64);
        if (at >= 0) atomicAdd(&dx[at + e % inner], dy[e]);
    }
}

// ScatterND over out (a copy of data made first by the backend): each element of out visits
// the tuples in order and takes (reduction 0) or combines (1 add, 2 mul, 3 max, 4 min) the
// update of every slice that covers it. No atomics, so the order, and with repeated tuples the
// result, is the CPU's; the cost is the out elements times the tuples.
template <typename T>
__device__ __forceinline__ bool nd_update(i64 e, i64 t, i64 inner, const Dims& kd, const Strides& ks, const void* ids,
                                          int ids_i64, const T* updates, T* v) {
    i64 at = nd_offset(t, 1, 0, kd, ks, ids, ids_i64);
    if (at < 0 || e < at || e >= at + inner) return false;
    *v = updates[t * inner + (e - at)];
    return true;
}
template <typename T>
__device__ void scatter_nd(i64 n, i64 tuples, i64 inner, const Dims& kd, const Strides& ks, const T* updates,
                           const void* ids, int ids_i64, T* out) {
    for (i64 e = first_index(); e < n; e += grid_stride()) {
        T v;
        for (i64 t = 0; t < tuples; ++t)
            if (nd_update(e, t, inner, kd, ks, ids, ids_i64, updates, &v)) out[e] = v;
    }
}
extern "C" __global__ void scatter_nd_b8(i64 n, i64 tuples, i64 inner, Dims kd, Strides ks, const u8* updates,
                                         const void* ids, int ids_i64, u8* out) {
    scatter_nd<u8>(n, tuples, inner, kd, ks, updates, ids, ids_i64, out);
}
extern "C" __global__ void scatter_nd_b16(i64 n, i64 tuples, i64 inner, Dims kd, Strides ks, const u16* updates,
                                          const void* ids, int ids_i64, u16* out) {
    scatter_nd<u16>(n, tuples, inner, kd, ks, updates, ids, ids_i64, out);
}
extern "C" __global__ void scatter_nd_b32(i64 n, i64 tuples, i64 inner, Dims kd, Strides ks, const u32* updates,
                                          const void* ids, int ids_i64, u32* out) {
    scatter_nd<u32>(n, tuples, inner, kd, ks, updates, ids, ids_i64, out);
}
extern "C" __global__ void scatter_nd_b64(i64 n, i64 tuples, i64 inner, Dims kd, Strides ks, const u64* updates,
                                          const void* ids, int ids_i64, u64* out) {
    scatter_nd<u64>(n, tuples, inner, kd, ks, updates, ids, ids_i64, out);
}
template <class S>
__device__ void scatter_nd_reduce(int reduction, i64 n, i64 tuples, i64 inner, const Dims& kd, const Strides& ks,
                                  const typename S::T* updates, const void* ids, int ids_i64, typename S::T* out) {
    // In f64 and rounded once, as the CPU's.
    for (i64 e = first_index(); e < n; e += grid_stride()) {
        typename S::T u;
        double acc = (double)S::load(out[e]);
        for (i64 t = 0; t < tuples; ++t) {
            if (!nd_update(e, t, inner, kd, ks, ids, ids_i64, updates, &u)) continue;
            acc = scatter_combine(reduction, acc, (double)S::load(u));
        }
        out[e] = S::store((typename S::C)acc);
    }
}
extern "C" __global__ void scatter_nd_reduce_f32(int reduction, i64 n, i64 tuples, i64 inner, Dims kd, Strides ks,
                                                 const float* updates, const void* ids, int ids_i64, float* out) {
    scatter_nd_reduce<F32>(reduction, n, tuples, inner, kd, ks, updates, ids, ids_i64, out);
}
extern "C" __global__ void scatter_nd_reduce_f16(int reduction, i64 n, i64 tuples, i64 inner, Dims kd, Strides ks,
                                                 const u16* updates, const void* ids, int ids_i64, u16* out) {
    scatter_nd_reduce<F16>(reduction, n, tuples, inner, kd, ks, updates, ids, ids_i64, out);
}
extern "C" __global__ void scatter_nd_reduce_bf16(int reduction, i64 n, i64 tuples, i64 inner, Dims kd, Strides ks,
                                                  const u16* updates, const void* ids, int ids_i64, u16* out) {
    scatter_nd_reduce<BF16>(reduction, n, tuples, inner, kd, ks, updates, ids, ids_i64, out);
}
extern "C" __global__ void scatter_nd_reduce_f64(int reduction, i64 n, i64 tuples, i64 inner, Dims kd, Strides ks,
                                                 const double* updates, const void* ids, int ids_i64, double* out) {
    scatter_nd_reduce<F64>(reduction, n, tuples, inner, kd, ks, updates, ids, ids_i64, out);
}

// ---- CumSum ----

// Running sums along an axis of `len` elements `inner` apart, one thread per line (outer ·
// inner of them): floats summed in f64 and integers in i64 (wrapping, as u64), each stored once
// into the element's type, as the CPU's.
template <class S, typename A>
__device__ void cumsum(int exclusive, int reverse, i64 lines, i64 len, i64 inner, const typename S::T* x,
                       typename S::T* y) {
    for (i64 i = first_index(); i < lines; i += grid_stride()) {
        i64 base = (i / inner) * len * inner + i % inner;
        A acc = 0;
        for (i64 k = 0; k < len; ++k) {
            i64 at = base + (reverse ? len - 1 - k : k) * inner;
            A v = (A)S::load(x[at]);
            if (exclusive) y[at] = S::store((typename S::C)acc);
            acc = (A)(acc + v);
            if (!exclusive) y[at] = S::store((typename S::C)acc);
        }
    }
}
struct I32S {
    typedef int T;
    typedef int C;
    static __device__ __forceinline__ int load(int v) { return v; }
    static __device__ __forceinline__ int store(int v) { return v; }
};
struct I64S {
    typedef i64 T;
    typedef i64 C;
    static __device__ __forceinline__ i64 load(i64 v) { return v; }
    static __device__ __forceinline__ i64 store(i64 v) { return v; }
};
extern "C" __global__ void cumsum_f32(int exclusive, int reverse, i64 lines, i64 len, i64 inner, const float* x,
                                      float* y) {
    cumsum<F32, double>(exclusive, reverse, lines, len, inner, x, y);
}
extern "C" __global__ void cumsum_f16(int exclusive, int reverse, i64 lines, i64 len, i64 inner, const u16* x,
                                      u16* y) {
    cumsum<F16, double>(exclusive, reverse, lines, len, inner, x, y);
}
extern "C" __global__ void cumsum_bf16(int exclusive, int reverse, i64 lines, i64 len, i64 inner, const u16* x,
                                       u16* y) {
    cumsum<BF16, double>(exclusive, reverse, lines, len, inner, x, y);
}
extern "C" __global__ void cumsum_f64(int exclusive, int reverse, i64 lines, i64 len, i64 inner, const double* x,
                                      double* y) {
    cumsum<F64, double>(exclusive, reverse, lines, len, inner, x, y);
}
extern "C" __global__ void cumsum_i32(int exclusive, int reverse, i64 lines, i64 len, i64 inner, const int* x,
                                      int* y) {
    cumsum<I32S, u64>(exclusive, reverse, lines, len, inner, x, y);
}
extern "C" __global__ void cumsum_i64(int exclusive, int reverse, i64 lines, i64 len, i64 inner, const i64* x,
                                      i64* y) {
    cumsum<I64S, u64>(exclusive, reverse, lines, len, inner, x, y);
}

// ---- ArgMax and ArgMin ----

// Integer element types for the families that compare elements as they are.
struct I32 {
    typedef int T;
    typedef int C;
    static __device__ __forceinline__ int load(int v) { return v; }
};
struct I64 {
    typedef i64 T;
    typedef i64 C;
    static __device__ __forceinline__ i64 load(i64 v) { return v; }
};

// out[i] = the index along the axis (len elements `stride` apart, from the element at output
// i's offset `os` over the kept dims `od`) of the largest (max) or smallest element: the first
// of equal ones, the last with `last`; a NaN is the extreme (numpy's argmax), as the CPU's.
template <class S>
__device__ void arg_extreme(int max, int last, i64 n, const Dims& od, const Strides& os, i64 len, i64 stride,
                            const typename S::T* x, i64* out) {
    typedef typename S::C C;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        const typename S::T* row = x + offset_of(i, od, os);
        C best = S::load(row[0]);
        i64 at = 0;
        for (i64 k = 1; k < len && best == best; ++k) {
            C v = S::load(row[k * stride]);
            bool beats = v != v || (last ? (max ? v >= best : v <= best) : (max ? v > best : v < best));
            if (beats) best = v, at = k;
        }
        out[i] = at;
    }
}
extern "C" __global__ void arg_extreme_f32(int max, int last, i64 n, Dims od, Strides os, i64 len, i64 stride,
                                           const float* x, i64* out) {
    arg_extreme<F32>(max, last, n, od, os, len, stride, x, out);
}
extern "C" __global__ void arg_extreme_f16(int max, int last, i64 n, Dims od, Strides os, i64 len, i64 stride,
                                           const u16* x, i64* out) {
    arg_extreme<F16>(max, last, n, od, os, len, stride, x, out);
}
extern "C" __global__ void arg_extreme_bf16(int max, int last, i64 n, Dims od, Strides os, i64 len, i64 stride,
                                            const u16* x, i64* out) {
    arg_extreme<BF16>(max, last, n, od, os, len, stride, x, out);
}
extern "C" __global__ void arg_extreme_f64(int max, int last, i64 n, Dims od, Strides os, i64 len, i64 stride,
                                           const double* x, i64* out) {
    arg_extreme<F64>(max, last, n, od, os, len, stride, x, out);
}
extern "C" __global__ void arg_extreme_i32(int max, int last, i64 n, Dims od, Strides os, i64 len, i64 stride,
                                           const int* x, i64* out) {
    arg_extreme<I32>(max, last, n, od, os, len, stride, x, out);
}
extern "C" __global__ void arg_extreme_i64(int max, int last, i64 n, Dims od, Strides os, i64 len, i64 stride,
                                           const i64* x, i64* out) {
    arg_extreme<I64>(max, last, n, od, os, len, stride, x, out);
}

// ---- TopK's indices ----

// Whether element a (at index ia of its line) comes before b (at ib) in TopK's output: the
// larger first (the smaller, without `largest`), a NaN above every number, equal ones in index
// order; the CPU's order (cpu/kernels/index.rs).
template <class C>
__device__ __forceinline__ bool top_k_before(int largest, C a, i64 ia, C b, i64 ib) {
    bool a_nan = a != a, b_nan = b != b;
    if (a_nan || b_nan) return a_nan && b_nan ? ia < ib : (largest ? a_nan : b_nan);
    if (a != b) return largest ? a > b : a < b;
    return ia < ib;
}

// One thread per element of x (n elements; lines of len elements `inner` apart, k kept of each):
// an element counts those of its line that come before it, and where fewer than k do, writes
// its index at that rank. O(len) per element, O(len²) per line: simple, and enough for the
// lines TopK takes in the models we train; a per-line sort would be the next step for long ones.
template <class S>
__device__ void top_k_indices(int largest, i64 n, i64 len, i64 inner, i64 k, const typename S::T* x, i64* out) {
    typedef typename S::C C;
    for (i64 e = first_index(); e < n; e += grid_stride()) {
        i64 o = e / (len * inner), p = e / inner % len, i = e % inner;
        const typename S::T* line = x + o * len * inner + i;
        C v = S::load(line[p * inner]);
        i64 rank = 0;
        for (i64 q = 0; q < len && rank < k; ++q) rank += top_k_before<C>(largest, S::load(line[q * inner]), q, v, p);
        if (rank < k) out[(o * k + rank) * inner + i] = p;
    }
}
extern "C" __global__ void top_k_indices_f32(int largest, i64 n, i64 len, i64 inner, i64 k, const float* x,
                                             i64* out) {
    top_k_indices<F32>(largest, n, len, inner, k, x, out);
}
extern "C" __global__ void top_k_indices_f16(int largest, i64 n, i64 len, i64 inner, i64 k, const u16* x,
                                             i64* out) {
    top_k_indices<F16>(largest, n, len, inner, k, x, out);
}
extern "C" __global__ void top_k_indices_bf16(int largest, i64 n, i64 len, i64 inner, i64 k, const u16* x,
                                              i64* out) {
    top_k_indices<BF16>(largest, n, len, inner, k, x, out);
}
extern "C" __global__ void top_k_indices_f64(int largest, i64 n, i64 len, i64 inner, i64 k, const double* x,
                                             i64* out) {
    top_k_indices<F64>(largest, n, len, inner, k, x, out);
}
extern "C" __global__ void top_k_indices_i32(int largest, i64 n, i64 len, i64 inner, i64 k, const int* x,
                                             i64* out) {
    top_k_indices<I32>(largest, n, len, inner, k, x, out);
}
extern "C" __global__ void top_k_indices_i64(int largest, i64 n, i64 len, i64 inner, i64 k, const i64* x,
                                             i64* out) {
    top_k_indices<I64>(largest, n, len, inner, k, x, out);
}

// ReduceMax/Min/Sum/Mean/SumSquare over the trailing `cols` elements of each row (one block
// per row). Sums are taken in f64, as the CPU backend's reduce does; kind is Reduce's order in
// graph/op.rs (0 Sum, 1 Mean, 2 Max, 3 Min, 4 SumSquare).
extern "C" __global__ void reduce_rows(int kind, i64 cols, const float* x, float* y) {
    const float* xr = x + blockIdx.x * cols;
    if (kind == 2 || kind == 3) {
        float sign = kind == 2 ? 1.f : -1.f, m = NEG_INF;
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, sign * xr[j]);
        m = block_max(m);
        if (threadIdx.x == 0) y[blockIdx.x] = sign * m;
        return;
    }
    double s = 0.0;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += kind == 4 ? (double)xr[j] * (double)xr[j] : (double)xr[j];
    s = block_sum_f64(s);
    if (threadIdx.x == 0) y[blockIdx.x] = (float)(kind == 1 ? s / (double)cols : s);
}
