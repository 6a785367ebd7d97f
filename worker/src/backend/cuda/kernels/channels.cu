// BatchNormalization over NC… tensors: one block per channel, which reads that channel's
// N × plane elements (strided by the other channels). The statistics are the CPU backend's
// (conv.rs): mean and biased variance summed in f64, two passes, then rounded to f32.

// Channel `ch`'s elements j = threadIdx.x, +blockDim.x, … (0 ≤ j < n·plane) as this thread visits
// them, j's image and position in the plane carried from one to the next: dividing j by the
// plane for each element (64-bit, a routine of dozens of instructions) cost more than the
// element's own arithmetic; now a division runs only where a step crosses into another image.
struct ChannelWalk {
    i64 img, p;
    // An empty plane has no elements: the walk starts past every image.
    __device__ explicit ChannelWalk(i64 plane)
        : img(plane ? (i64)threadIdx.x / plane : (i64)1 << 62), p(plane ? (i64)threadIdx.x % plane : 0) {}
    __device__ bool within(i64 n) const { return img < n; }
    __device__ void next(i64 plane) {
        p += blockDim.x;
        if (p >= plane) {
            img += p / plane;
            p %= plane;
        }
    }
    __device__ i64 at(i64 c, i64 plane, i64 ch) const { return (img * c + ch) * plane + p; }
};

// The batch mean and biased variance of channel `ch`, to every thread of the block.
__device__ void channel_stats(i64 n, i64 c, i64 plane, const float* x, i64 ch, float* mean, float* var) {
    i64 count = n * plane;
    double s = 0.0;
    for (ChannelWalk w(plane); w.within(n); w.next(plane)) s += (double)x[w.at(c, plane, ch)];
    double m = block_sum_f64(s) / (double)count;
    double q = 0.0;
    for (ChannelWalk w(plane); w.within(n); w.next(plane)) {
        double d = (double)x[w.at(c, plane, ch)] - m;
        q += d * d;
    }
    *mean = (float)m;
    *var = (float)(block_sum_f64(q) / (double)count);
}

// Y = (X − mean)·σ⁻¹·scale + bias with the batch's statistics (training) or the running ones.
// In training, new_mean and new_var (when not null) get the running statistics updated with
// ONNX's momentum: running·momentum + batch·(1 − momentum).
extern "C" __global__ void batch_norm_channels(int training, i64 n, i64 c, i64 plane, float eps, float momentum,
                                               const float* x, const float* scale, const float* bias,
                                               const float* running_mean, const float* running_var, float* y,
                                               float* new_mean, float* new_var) {
    i64 ch = blockIdx.x;
    float mean = running_mean[ch], var = running_var[ch];
    if (training) channel_stats(n, c, plane, x, ch, &mean, &var);
    float inv = 1.f / sqrtf(var + eps);
    for (ChannelWalk w(plane); w.within(n); w.next(plane)) {
        i64 at = w.at(c, plane, ch);
        y[at] = (x[at] - mean) * inv * scale[ch] + bias[ch];
    }
    if (training && threadIdx.x == 0) {
        if (new_mean) new_mean[ch] = running_mean[ch] * momentum + mean * (1.f - momentum);
        if (new_var) new_var[ch] = running_var[ch] * momentum + var * (1.f - momentum);
    }
}

// Training-mode backward with the batch statistics recomputed from X:
// dBias = Σ dY, dScale = Σ dY·x̂, dX = scale·σ⁻¹·(dY − dBias/count − x̂·dScale/count).
extern "C" __global__ void batch_norm_grad_channels(i64 n, i64 c, i64 plane, float eps, const float* dy,
                                                    const float* x, const float* scale, float* dx, float* dscale,
                                                    float* dbias) {
    i64 ch = blockIdx.x, count = n * plane;
    float mean, var;
    channel_stats(n, c, plane, x, ch, &mean, &var);
    float inv = 1.f / sqrtf(var + eps);
    float sb = 0.f, ss = 0.f;
    for (ChannelWalk w(plane); w.within(n); w.next(plane)) {
        i64 at = w.at(c, plane, ch);
        sb += dy[at];
        ss += dy[at] * (x[at] - mean) * inv;
    }
    float db = block_sum(sb), ds = block_sum(ss);
    for (ChannelWalk w(plane); w.within(n); w.next(plane)) {
        i64 at = w.at(c, plane, ch);
        float xh = (x[at] - mean) * inv;
        dx[at] = scale[ch] * inv * (dy[at] - db / (float)count - xh * ds / (float)count);
    }
    if (threadIdx.x == 0) {
        if (dscale) dscale[ch] = ds;
        if (dbias) dbias[ch] = db;
    }
}
