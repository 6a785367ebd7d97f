// BatchNormalization over N × C × plane tensors, spread over the whole GPU. Each channel's
// N·plane elements (image by image, each image's plane contiguous) are cut into `parts` shares
// of `share` elements; one block per (share, channel) sums its share (`batch_norm_partial`), a
// thread per channel adds its shares in a fixed order (`batch_norm_finish`,
// `batch_norm_grad_finish`), so the bits never depend on scheduling, and an element-wise kernel
// then writes Y or dX. One block per channel, as before, left most of a GPU idle: ResNet-50's
// first stage has 64 channels of 128 × 56 × 56 values.
//
// The statistics are summed in f64 around a shift K, the channel's first element: Σ(x − K) and
// Σ(x − K)² give the mean and the biased variance in one read, without the cancellation that
// Σx² − (Σx)²/count suffers when the mean is large against the spread. The gradient's sums
// ride in the same read: Σ dY and Σ dY·(x − K).
//
// Fused with the ReLU after it (`relu`, `z`): the forward pass writes Z = max(Y, 0) in Y's
// place, and the backward pass reads dY as dZ · (Z > 0), the ReLU's gradient as its own kernel
// takes it (elementwise.cu's unary_df), element by element as dZ is read.
//
// Under mixed precision X, Y, dY and dX are half (autocast leaves BatchNormalization in its
// input's type, as PyTorch's does) beside f32 scale, bias and statistics; the arithmetic is f32
// (f64 for the sums) either way.

// dY from dZ and the fused ReLU's output Z: dZ · ReLU'(Z), as unary_df takes it.
__device__ __forceinline__ float through_relu(float dz, float z) { return dz * (z > 0.f ? 1.f : 0.f); }

// dY at flat element `at`: dy's, or with `z` (the fused ReLU's output) through_relu.
template <class X>
__device__ __forceinline__ float grad_at(const typename X::T* dy, const typename X::T* z, i64 at) {
    float g = X::load(dy[at]);
    return z ? through_relu(g, X::load(z[at])) : g;
}

// The elements j of a channel in [begin, end) that this thread visits (j = begin + threadIdx.x,
// then blockDim.x apart), j's image and position in the plane carried from one to the next:
// a 64-bit division per element cost more than the element's own arithmetic, so one runs only
// where a step crosses into another image.
struct ChannelWalk {
    i64 j, img, p;
    __device__ ChannelWalk(i64 begin, i64 plane) : j(begin + threadIdx.x), img(j / plane), p(j % plane) {}
    __device__ void next(i64 plane) {
        j += blockDim.x;
        p += blockDim.x;
        if (p >= plane) {
            // Planes shorter than the block cross at every step: p < plane + blockDim.x, so a
            // 32-bit division does where the plane allows.
            i64 q = plane < 0x7fffff00ll ? (i64)((u32)p / (u32)plane) : p / plane;
            img += q;
            p -= q * plane;
        }
    }
    __device__ i64 at(i64 c, i64 plane, i64 ch) const { return (img * c + ch) * plane + p; }
};

// What a share's block adds up, in f64, for the slot [(ch·parts + k)·4 …]: Σ(x − K), Σ(x − K)²,
// and with dY (masked by z where not null), Σ dY, Σ dY·(x − K); the first share's block writes
// K to shifts[ch]. Launched over
// (C, parts) blocks; an empty batch launches none.
template <class X>
__device__ void batch_norm_partial(i64 n, i64 c, i64 plane, i64 share, const typename X::T* x,
                                   const typename X::T* dy, const typename X::T* z, double* partial, double* shifts) {
    i64 ch = blockIdx.x, k = blockIdx.y, parts = gridDim.y;
    i64 begin = k * share, end = begin + share < n * plane ? begin + share : n * plane;
    // An infinite or NaN first value would turn every difference into NaN: shift by 0 then
    // (the sums are not finite anyway, and an infinity stays one, as on the CPU).
    double shift = X::load(x[ch * plane]), s = 0.0, q = 0.0, g = 0.0, gd = 0.0;
    if (shift - shift != 0.0) shift = 0.0;
    for (ChannelWalk w(begin, plane); w.j < end; w.next(plane)) {
        i64 at = w.at(c, plane, ch);
        double d = (double)X::load(x[at]) - shift;
        s += d;
        q += d * d;
        if (dy) {
            double gi = grad_at<X>(dy, z, at);
            g += gi;
            gd += gi * d;
        }
    }
    double* out = partial + (ch * parts + k) * 4;
    s = block_sum_f64(s);
    q = block_sum_f64(q);
    if (dy) {
        g = block_sum_f64(g);
        gd = block_sum_f64(gd);
    }
    if (threadIdx.x == 0) {
        out[0] = s;
        out[1] = q;
        out[2] = g;
        out[3] = gd;
        if (k == 0) shifts[ch] = shift;
    }
}
extern "C" __global__ void batch_norm_partial_f32(i64 n, i64 c, i64 plane, i64 share, const float* x, const float* dy,
                                                  const float* z, double* partial, double* shifts) {
    batch_norm_partial<F32>(n, c, plane, share, x, dy, z, partial, shifts);
}
extern "C" __global__ void batch_norm_partial_f16(i64 n, i64 c, i64 plane, i64 share, const u16* x, const u16* dy,
                                                  const u16* z, double* partial, double* shifts) {
    batch_norm_partial<F16>(n, c, plane, share, x, dy, z, partial, shifts);
}
extern "C" __global__ void batch_norm_partial_bf16(i64 n, i64 c, i64 plane, i64 share, const u16* x, const u16* dy,
                                                   const u16* z, double* partial, double* shifts) {
    batch_norm_partial<BF16>(n, c, plane, share, x, dy, z, partial, shifts);
}

// Channel ch's sums over its `parts` shares, in share order (out: the four sums of the partial).
__device__ void channel_sums(i64 ch, i64 parts, const double* partial, double* out) {
    for (int i = 0; i < 4; ++i) out[i] = 0.0;
    for (i64 k = 0; k < parts; ++k)
        for (int i = 0; i < 4; ++i) out[i] += partial[(ch * parts + k) * 4 + i];
}

// The batch's mean and biased variance of channel ch from its sums around the shift K.
__device__ void channel_stats(const double* sums, double shift, double count, double* mean, double* var) {
    double m = sums[0] / count;
    *mean = shift + m;
    double v = sums[1] / count - m * m;
    *var = v < 0.0 ? 0.0 : v;  // rounding can take a constant channel's below 0; a NaN stays
}

// Per channel, `stats` gets the mean and σ⁻¹ that Y is normalized with: the batch's (training:
// from the shares' sums, parts ≥ 1) or the running ones. In training, new_mean and new_var (when
// not null) get the running statistics updated with ONNX's momentum: running·momentum +
// batch·(1 − momentum).
// An empty batch has no shift (its statistics are 0/0, as on the CPU).
extern "C" __global__ void batch_norm_finish(int training, i64 n, i64 c, i64 plane, i64 parts, float eps,
                                             float momentum, const double* partial, const double* shifts,
                                             const float* running_mean, const float* running_var, float* stats,
                                             float* new_mean, float* new_var) {
    for (i64 ch = first_index(); ch < c; ch += grid_stride()) {
        float mean = running_mean[ch], var = running_var[ch];
        if (training) {
            double sums[4], m, v;
            channel_sums(ch, parts, partial, sums);
            channel_stats(sums, parts ? shifts[ch] : 0.0, (double)(n * plane), &m, &v);
            mean = (float)m;
            var = (float)v;
            if (new_mean) new_mean[ch] = running_mean[ch] * momentum + mean * (1.f - momentum);
            if (new_var) new_var[ch] = running_var[ch] * momentum + var * (1.f - momentum);
        }
        stats[ch * 4] = mean;
        stats[ch * 4 + 1] = 1.f / sqrtf(var + eps);
    }
}

// Training-mode backward, per channel: the mean and σ⁻¹ recomputed from X, dBias = Σ dY and
// dScale = Σ dY·x̂; `stats` gets mean, σ⁻¹, dBias/count and dScale/count for dX.
extern "C" __global__ void batch_norm_grad_finish(i64 n, i64 c, i64 plane, i64 parts, float eps,
                                                  const double* partial, const double* shifts, float* stats,
                                                  float* dscale, float* dbias) {
    for (i64 ch = first_index(); ch < c; ch += grid_stride()) {
        double sums[4], mean, var, shift = parts ? shifts[ch] : 0.0, count = (double)(n * plane);
        channel_sums(ch, parts, partial, sums);
        channel_stats(sums, shift, count, &mean, &var);
        float m = (float)mean, inv = 1.f / sqrtf((float)var + eps);
        // Σ dY·(x − mean) = Σ dY·(x − K) − (mean − K)·Σ dY, with the f32 mean that dX and the
        // CPU use; an empty batch's sums are 0.
        double centered = sums[3] - ((double)m - shift) * sums[2];
        float db = (float)sums[2], ds = count > 0.0 ? (float)(centered * (double)inv) : 0.f;
        stats[ch * 4] = m;
        stats[ch * 4 + 1] = inv;
        stats[ch * 4 + 2] = db / (float)count;
        stats[ch * 4 + 3] = ds / (float)count;
        if (dscale) dscale[ch] = ds;
        if (dbias) dbias[ch] = db;
    }
}

// The channel of flat element i of an N × C × plane tensor: 32-bit divisions where the tensor
// allows (a 64-bit one is a routine of dozens of instructions).
__device__ __forceinline__ i64 channel_of(i64 i, i64 total, i64 c, i64 plane) {
    if (total <= 0xffffffffll) return (i64)(((u32)i / (u32)plane) % (u32)c);
    return (i / plane) % c;
}

// Y = (X − mean)·σ⁻¹·scale + bias (max(Y, 0) with `relu`), the mean and σ⁻¹ from `stats`;
// four elements at a time where each plane's length is a multiple of four (the four then share
// a channel).
__device__ __forceinline__ float normalized(float x, const float* st, float scale, float bias, int relu) {
    float y = (x - st[0]) * st[1] * scale + bias;
    return relu ? max_of(y, 0.f) : y;
}
template <class S>
__device__ void batch_norm_apply(i64 total, i64 c, i64 plane, int relu, const typename S::T* x, const float* stats,
                                 const float* scale, const float* bias, typename S::T* y) {
    typedef typename S::T T;
    if (plane % 4 == 0 && aligned16(x) && aligned16(y)) {
        for (i64 v = first_index(); v < total / 4; v += grid_stride()) {
            i64 ch = channel_of(v * 4, total, c, plane);
            const float* st = stats + ch * 4;
            float s = scale[ch], b = bias[ch];
            Vec<T, 4> in = ld_vec<T, 4>(x + v * 4), out;
            for (int e = 0; e < 4; ++e) out.e[e] = S::store(normalized(S::load(in.e[e]), st, s, b, relu));
            st_vec<T, 4>(y + v * 4, out);
        }
        return;
    }
    for (i64 i = first_index(); i < total; i += grid_stride()) {
        i64 ch = channel_of(i, total, c, plane);
        y[i] = S::store(normalized(S::load(x[i]), stats + ch * 4, scale[ch], bias[ch], relu));
    }
}
extern "C" __global__ void batch_norm_apply_f32(i64 total, i64 c, i64 plane, int relu, const float* x, const float* stats,
                                                const float* scale, const float* bias, float* y) {
    batch_norm_apply<F32>(total, c, plane, relu, x, stats, scale, bias, y);
}
extern "C" __global__ void batch_norm_apply_f16(i64 total, i64 c, i64 plane, int relu, const u16* x, const float* stats,
                                                const float* scale, const float* bias, u16* y) {
    batch_norm_apply<F16>(total, c, plane, relu, x, stats, scale, bias, y);
}
extern "C" __global__ void batch_norm_apply_bf16(i64 total, i64 c, i64 plane, int relu, const u16* x, const float* stats,
                                                 const float* scale, const float* bias, u16* y) {
    batch_norm_apply<BF16>(total, c, plane, relu, x, stats, scale, bias, y);
}

// dX = scale·σ⁻¹·(dY − dBias/count − x̂·dScale/count), x̂ = (x − mean)·σ⁻¹, from `stats`.
__device__ __forceinline__ float batch_norm_dx(float dy, float x, const float* st, float scale) {
    float xh = (x - st[0]) * st[1];
    return scale * st[1] * (dy - st[2] - xh * st[3]);
}
// dY masked by z where not null (`grad_at`).
template <class S>
__device__ void batch_norm_grad_apply(i64 total, i64 c, i64 plane, const typename S::T* dy, const typename S::T* z,
                                      const typename S::T* x, const float* stats, const float* scale,
                                      typename S::T* dx) {
    typedef typename S::T T;
    if (plane % 4 == 0 && aligned16(dy) && aligned16(x) && aligned16(dx) && (!z || aligned16(z))) {
        for (i64 v = first_index(); v < total / 4; v += grid_stride()) {
            i64 ch = channel_of(v * 4, total, c, plane);
            Vec<T, 4> g = ld_vec<T, 4>(dy + v * 4), in = ld_vec<T, 4>(x + v * 4), out;
            Vec<T, 4> m = z ? ld_vec<T, 4>(z + v * 4) : g;
            for (int e = 0; e < 4; ++e) {
                float gi = S::load(g.e[e]);
                if (z) gi = through_relu(gi, S::load(m.e[e]));
                out.e[e] = S::store(batch_norm_dx(gi, S::load(in.e[e]), stats + ch * 4, scale[ch]));
            }
            st_vec<T, 4>(dx + v * 4, out);
        }
        return;
    }
    for (i64 i = first_index(); i < total; i += grid_stride()) {
        i64 ch = channel_of(i, total, c, plane);
        dx[i] = S::store(batch_norm_dx(grad_at<S>(dy, z, i), S::load(x[i]), stats + ch * 4, scale[ch]));
    }
}
extern "C" __global__ void batch_norm_grad_apply_f32(i64 total, i64 c, i64 plane, const float* dy, const float* z,
                                                     const float* x, const float* stats, const float* scale, float* dx) {
    batch_norm_grad_apply<F32>(total, c, plane, dy, z, x, stats, scale, dx);
}
extern "C" __global__ void batch_norm_grad_apply_f16(i64 total, i64 c, i64 plane, const u16* dy, const u16* z,
                                                     const u16* x, const float* stats, const float* scale, u16* dx) {
    batch_norm_grad_apply<F16>(total, c, plane, dy, z, x, stats, scale, dx);
}
extern "C" __global__ void batch_norm_grad_apply_bf16(i64 total, i64 c, i64 plane, const u16* dy, const u16* z,
                                                      const u16* x, const float* stats, const float* scale, u16* dx) {
    batch_norm_grad_apply<BF16>(total, c, plane, dy, z, x, stats, scale, dx);
}
