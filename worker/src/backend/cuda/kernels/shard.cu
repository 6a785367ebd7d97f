// Tensor parallelism's vocab-parallel ops (parallel/tensor.rs; the CPU's cpu/kernels/shard.rs):
// an embedding lookup in a slice of the table's rows, and the per-row pieces of a cross-entropy
// over a slice of the classes. The all-reduces between them are the executor's.

__device__ __forceinline__ i64 label_at(const void* labels, int wide, i64 r) {
    return wide ? ((const i64*)labels)[r] : (i64)((const int*)labels)[r];
}

// table [rows, cols] (rows start.. of the whole), ids [count] -> y [count, cols]: each id's row,
// zeros for ids outside the slice. A negative id sets *fault to 1 + its position.
extern "C" __global__ void shard_gather_f32(i64 count, i64 rows, i64 cols, i64 start, const float* table,
                                            const void* ids, int ids_i64, float* y, i64* fault) {
    i64 n = count * cols;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 col;
        i64 k = divmod(i, cols, &col), id = label_at(ids, ids_i64, k);
        if (id < 0) atomicCAS((u64*)fault, 0ull, (u64)(k + 1));
        i64 r = id - start;
        y[i] = (id >= 0 && r < rows && r >= 0) ? table[r * cols + col] : 0.f;
    }
}

// dTable (zeroed first by the backend) += dY at the ids inside the slice. atomicAdd, as
// gather_grad_f32: rows hit by several ids add in an unspecified order.
extern "C" __global__ void shard_gather_grad_f32(i64 count, i64 rows, i64 cols, i64 start, const float* dy,
                                                 const void* ids, int ids_i64, float* dtable) {
    i64 n = count * cols;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 col;
        i64 r = label_at(ids, ids_i64, divmod(i, cols, &col)) - start;
        if (r >= 0 && r < rows) atomicAdd(&dtable[r * cols + col], dy[i]);
    }
}

// The label's column in this slice of `cols` classes starting at `start`, or -1 (outside it, or
// ignored).
__device__ __forceinline__ i64 local_label(const void* labels, int wide, i64 r, i64 start, i64 cols,
                                           int has_ignore, i64 ignore) {
    i64 l = label_at(labels, wide, r);
    if (has_ignore && l == ignore) return -1;
    l -= start;
    return l >= 0 && l < cols ? l : -1;
}

// Per row of scores [N, cols] (one block each): sums = Σ_j exp(x_j − max), targets = x[label] −
// max where the label is in this slice (0 elsewhere).
extern "C" __global__ void vocab_shard_ce_rows(i64 cols, i64 start, int has_ignore, i64 ignore, const float* x,
                                               const void* labels, int labels_i64, const float* max, float* sums,
                                               float* targets) {
    i64 r = blockIdx.x;
    const float* xr = x + r * cols;
    float m = max[r], s = 0.f;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += expf(xr[j] - m);
    s = block_sum(s);
    if (threadIdx.x == 0) {
        sums[r] = s;
        i64 l = local_label(labels, labels_i64, r, start, cols, has_ignore, ignore);
        targets[r] = l < 0 ? 0.f : xr[l] - m;
    }
}

// dScores = dΣexp·exp(x − max) + dTarget at the label's column.
extern "C" __global__ void vocab_shard_ce_grad(i64 n, i64 cols, i64 start, int has_ignore, i64 ignore,
                                               const float* dsums, const float* dtargets, const float* x,
                                               const void* labels, int labels_i64, const float* max, float* dx) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 col;
        i64 r = divmod(i, cols, &col);
        float d = dsums[r] * expf(x[i] - max[r]);
        if (local_label(labels, labels_i64, r, start, cols, has_ignore, ignore) == col) d += dtargets[r];
        dx[i] = d;
    }
}

// Whether row r's loss counts (its label is not the ignored one).
__device__ __forceinline__ bool counts(const void* labels, int wide, i64 r, int has_ignore, i64 ignore) {
    return !(has_ignore && label_at(labels, wide, r) == ignore);
}

// The loss from the all-reduced pieces, one block: per row ln Σexp − target where it counts;
// reduction 0 (none) writes each row, 1 (mean) and 2 (sum) one value, summed in f64. A mean
// over no counted row is 0/0 = NaN, as SoftmaxCrossEntropyLoss gives.
extern "C" __global__ void vocab_parallel_loss(int reduction, int has_ignore, i64 ignore, i64 n, const float* sums,
                                               const float* targets, const void* labels, int labels_i64,
                                               float* y) {
    double total = 0.0, kept = 0.0;
    for (i64 r = threadIdx.x; r < n; r += blockDim.x) {
        bool k = counts(labels, labels_i64, r, has_ignore, ignore);
        float per = k ? logf(sums[r]) - targets[r] : 0.f;
        if (reduction == 0) y[r] = per;
        total += (double)per;
        kept += k ? 1.0 : 0.0;
    }
    total = block_sum_f64(total);
    kept = block_sum_f64(kept);
    if (reduction != 0 && threadIdx.x == 0) y[0] = (float)(reduction == 1 ? total / kept : total);
}

// dΣexp = w/Σexp, dTarget = −w, with w the row's share of dLoss (0 where it does not count).
extern "C" __global__ void vocab_parallel_loss_grad(int reduction, int has_ignore, i64 ignore, i64 n,
                                                    const float* dloss, const float* sums, const void* labels,
                                                    int labels_i64, float* dsums, float* dtargets) {
    double kept = 0.0;
    for (i64 r = threadIdx.x; r < n; r += blockDim.x) kept += counts(labels, labels_i64, r, has_ignore, ignore);
    kept = block_sum_f64(kept);
    float den = reduction == 1 && kept > 0.0 ? (float)kept : 1.f;
    for (i64 r = threadIdx.x; r < n; r += blockDim.x) {
        float w = 0.f;
        if (counts(labels, labels_i64, r, has_ignore, ignore)) w = reduction == 0 ? dloss[r] : dloss[0] / den;
        dsums[r] = w / sums[r];
        dtargets[r] = -w;
    }
}
