// The training step's own kernels: gradient accumulation, the squared norm behind global
// clipping, and the optimizer updates (the formulas of optim::cpu_step, element for element).

extern "C" __global__ void accumulate_f32(i64 n, float* dst, float keep, const float* src, float scale) {
    for (i64 i = first_index(); i < n; i += grid_stride())
        dst[i] = keep == 0.f ? src[i] * scale : dst[i] * keep + src[i] * scale;
}

// Σ x² in f64: each block writes its partial sum; the host adds the partials in order, so the
// result does not depend on scheduling (a resumed run clips exactly as the first did).
extern "C" __global__ void sum_squares_partial(i64 n, const float* x, double* partial) {
    double s = 0.0;
    for (i64 i = first_index(); i < n; i += grid_stride()) s += (double)x[i] * (double)x[i];
    s = block_sum_f64(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// The updates of SGD and Adam are multi-tensor: one launch updates every weight of a parameter
// group, each block one piece of one weight (PyTorch's multi_tensor_apply, llm.c's fused
// AdamW over one flat buffer). A piece holds the addresses of its first element in the weight,
// its gradient and the update's state buffers (null where the update keeps fewer), and its
// length; the host cuts the weights into pieces and writes the table.
struct Piece {
    float* p;
    const float* g;
    float* s0;
    float* s1;
    i64 n;
};

// SGD with L2 weight decay; momentum buffer s0 (null without momentum; `first` copies the
// direction into it, as PyTorch does), optional Nesterov.
extern "C" __global__ void sgd_f32(const Piece* pieces, float lr, float gs, float momentum, int nesterov,
                                   float weight_decay, int first) {
    const Piece c = pieces[blockIdx.x];
    for (i64 i = threadIdx.x; i < c.n; i += blockDim.x) {
        float d = c.g[i] * gs + weight_decay * c.p[i];
        if (c.s0) {
            c.s0[i] = first ? d : momentum * c.s0[i] + d;
            d = nesterov ? d + momentum * c.s0[i] : c.s0[i];
        }
        c.p[i] -= lr * d;
    }
}

// Adam (L2 decay on the gradient) or AdamW (decoupled decay), PyTorch's order of operations:
// step_size = lr / bc1, denom = √v / √bc2 + ε; s0 and s1 are the first and second moments.
extern "C" __global__ void adam_f32(const Piece* pieces, float lr, float gs, float beta1, float beta2, float eps,
                                    float weight_decay, int decoupled, float step_size, float bc2_sqrt) {
    const Piece c = pieces[blockIdx.x];
    for (i64 i = threadIdx.x; i < c.n; i += blockDim.x) {
        float gi = c.g[i] * gs;
        float pi = c.p[i];
        if (decoupled) pi *= 1.f - lr * weight_decay;
        else gi += weight_decay * pi;
        float mi = beta1 * c.s0[i] + (1.f - beta1) * gi;
        float vi = beta2 * c.s1[i] + (1.f - beta2) * gi * gi;
        c.s0[i] = mi;
        c.s1[i] = vi;
        c.p[i] = pi - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    }
}

// LAMB, pass 1: the moments, and per block the partial sums of ‖w‖² and ‖u‖² (u the update
// direction), written to partial[2·block], partial[2·block + 1].
extern "C" __global__ void lamb_moments_f32(i64 n, float gs, float beta1, float beta2, float eps,
                                            float weight_decay, float bc1, float bc2, const float* p,
                                            const float* g, float* m, float* v, double* partial) {
    double wn = 0.0, un = 0.0;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        float gi = g[i] * gs;
        float mi = beta1 * m[i] + (1.f - beta1) * gi;
        float vi = beta2 * v[i] + (1.f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float u = (mi / bc1) / (sqrtf(vi / bc2) + eps) + weight_decay * p[i];
        wn += (double)p[i] * (double)p[i];
        un += (double)u * (double)u;
    }
    wn = block_sum_f64(wn);
    un = block_sum_f64(un);
    if (threadIdx.x == 0) {
        partial[2 * blockIdx.x] = wn;
        partial[2 * blockIdx.x + 1] = un;
    }
}

// LAMB, between the passes, in one block: the trust ratio ‖w‖ / ‖u‖ (1 where either is 0) from
// pass 1's `blocks` pairs of partials, on the device, so that the host need not wait for it.
extern "C" __global__ void lamb_trust_f32(i64 blocks, const double* partial, float* trust) {
    double wn = 0.0, un = 0.0;
    for (i64 b = threadIdx.x; b < blocks; b += blockDim.x) {
        wn += partial[2 * b];
        un += partial[2 * b + 1];
    }
    wn = block_sum_f64(wn);
    un = block_sum_f64(un);
    if (threadIdx.x == 0) *trust = wn > 0.0 && un > 0.0 ? (float)(sqrt(wn) / sqrt(un)) : 1.f;
}

// LAMB, pass 2: w −= lr·trust·u, from the moments pass 1 left.
extern "C" __global__ void lamb_step_f32(i64 n, float lr, const float* trust, float eps, float weight_decay,
                                         float bc1, float bc2, float* p, const float* m, const float* v) {
    const float lr_trust = lr * *trust;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        float u = (m[i] / bc1) / (sqrtf(v[i] / bc2) + eps) + weight_decay * p[i];
        p[i] -= lr_trust * u;
    }
}

// Adasum (parallel/adasum.rs) of the pairs of a data-parallel exchange, multi-tensor like the
// updates: each piece a slice of one tensor's pair, x the lower rank's values and y the higher
// rank's, out (x or y, this rank's) receiving ca·x + cb·y. Its dot products x·y, x·x and y·y
// are summed in f64 per piece (adasum_dots) and then per tensor in piece order (adasum_sums):
// both ranks of a pair launch the same pieces on the same values, so they compute the same
// floats, with no wait for the host.
struct AdasumPiece {
    const float* x;
    const float* y;
    float* out;
    i64 n;
    i64 tensor;
};

extern "C" __global__ void adasum_dots(const AdasumPiece* pieces, double* partial) {
    const AdasumPiece c = pieces[blockIdx.x];
    double xy = 0.0, xx = 0.0, yy = 0.0;
    for (i64 i = threadIdx.x; i < c.n; i += blockDim.x) {
        double a = c.x[i], b = c.y[i];
        xy += a * b;
        xx += a * a;
        yy += b * b;
    }
    xy = block_sum_f64(xy);
    xx = block_sum_f64(xx);
    yy = block_sum_f64(yy);
    if (threadIdx.x == 0) {
        partial[3 * blockIdx.x] = xy;
        partial[3 * blockIdx.x + 1] = xx;
        partial[3 * blockIdx.x + 2] = yy;
    }
}

// Tensor t's pieces are first[t] .. first[t + 1] - 1; its dot products are their partials added
// in order.
extern "C" __global__ void adasum_sums(i64 tensors, const i64* first, const double* partial, double* dots) {
    for (i64 t = first_index(); t < tensors; t += grid_stride()) {
        double xy = 0.0, xx = 0.0, yy = 0.0;
        for (i64 p = first[t]; p < first[t + 1]; ++p) {
            xy += partial[3 * p];
            xx += partial[3 * p + 1];
            yy += partial[3 * p + 2];
        }
        dots[3 * t] = xy;
        dots[3 * t + 1] = xx;
        dots[3 * t + 2] = yy;
    }
}

// out = (1 − x·y / 2‖x‖²)·x + (1 − x·y / 2‖y‖²)·y, in f64 and rounded once; a zero vector's
// coefficient is 1.
extern "C" __global__ void adasum_apply(const AdasumPiece* pieces, const double* dots) {
    const AdasumPiece c = pieces[blockIdx.x];
    const double* d = dots + 3 * c.tensor;
    double cx = d[1] > 0.0 ? 1.0 - d[0] / (2.0 * d[1]) : 1.0;
    double cy = d[2] > 0.0 ? 1.0 - d[0] / (2.0 * d[2]) : 1.0;
    for (i64 i = threadIdx.x; i < c.n; i += blockDim.x) c.out[i] = (float)(cx * (double)c.x[i] + cy * (double)c.y[i]);
}
