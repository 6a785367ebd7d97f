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

// SGD with L2 weight decay; momentum buffer `b` (null without momentum; `first` copies the
// direction into it, as PyTorch does), optional Nesterov.
extern "C" __global__ void sgd_f32(i64 n, float lr, float gs, float momentum, int nesterov, float weight_decay,
                                   int first, float* p, const float* g, float* b) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        float d = g[i] * gs + weight_decay * p[i];
        if (b) {
            b[i] = first ? d : momentum * b[i] + d;
            d = nesterov ? d + momentum * b[i] : b[i];
        }
        p[i] -= lr * d;
    }
}

// Adam (L2 decay on the gradient) or AdamW (decoupled decay), PyTorch's order of operations:
// step_size = lr / bc1, denom = √v / √bc2 + ε.
extern "C" __global__ void adam_f32(i64 n, float lr, float gs, float beta1, float beta2, float eps,
                                    float weight_decay, int decoupled, float step_size, float bc2_sqrt, float* p,
                                    const float* g, float* m, float* v) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        float gi = g[i] * gs;
        float pi = p[i];
        if (decoupled) pi *= 1.f - lr * weight_decay;
        else gi += weight_decay * pi;
        float mi = beta1 * m[i] + (1.f - beta1) * gi;
        float vi = beta2 * v[i] + (1.f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    }
}

// LAMB, pass 1: the moments, and per block the partial sums of ‖w‖² and ‖u‖² (u the update
// direction), written to partial[2·block], partial[2·block + 1] for the host to add in order.
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

// LAMB, pass 2: w −= lr·trust·u, from the moments pass 1 left.
extern "C" __global__ void lamb_step_f32(i64 n, float lr_trust, float eps, float weight_decay, float bc1, float bc2,
                                         float* p, const float* m, const float* v) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        float u = (m[i] / bc1) / (sqrtf(v[i] / bc2) + eps) + weight_decay * p[i];
        p[i] -= lr_trust * u;
    }
}
