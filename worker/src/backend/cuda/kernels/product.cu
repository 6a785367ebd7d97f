// Matrix products that cuBLASLt's path (gemm.rs: f32, f16 and bf16 with f32 accumulation) does
// not take: f64 and integer matrices, one thread per element of y [batch.., m, n], summing over
// k in order in f64 (integers in wrapping 64-bit arithmetic), as the CPU's reference loop does.
// Plain loops: these types are off the training path (an ONNX graph may hand them to MatMul, or
// an Einsum written out as products), where exact agreement with the CPU counts, not speed.
//
// A's and B's batch offsets come from y's batch index through their own strides over y's batch
// dims `bd` (0 where an operand broadcasts); a transposed operand is stored [k, m] or [n, k].
template <class T, class Acc>
__device__ void matmul_plain(i64 count, i64 m, i64 n, i64 k, int trans_a, int trans_b, const Dims& bd, const T* a,
                             const Strides& sa, const T* b, const Strides& sb, T* y) {
    for (i64 e = first_index(); e < count; e += grid_stride()) {
        i64 batch = e / (m * n), r = e / n % m, c = e % n;
        const T* ab = a + offset_of(batch, bd, sa);
        const T* bb = b + offset_of(batch, bd, sb);
        Acc sum = 0;
        for (i64 p = 0; p < k; ++p)
            sum += (Acc)ab[trans_a ? p * m + r : r * k + p] * (Acc)bb[trans_b ? c * k + p : p * n + c];
        y[e] = (T)sum;
    }
}
extern "C" __global__ void matmul_plain_f64(i64 count, i64 m, i64 n, i64 k, int trans_a, int trans_b, Dims bd,
                                            const double* a, Strides sa, const double* b, Strides sb, double* y) {
    matmul_plain<double, double>(count, m, n, k, trans_a, trans_b, bd, a, sa, b, sb, y);
}
extern "C" __global__ void matmul_plain_i32(i64 count, i64 m, i64 n, i64 k, int trans_a, int trans_b, Dims bd,
                                            const int* a, Strides sa, const int* b, Strides sb, int* y) {
    matmul_plain<int, u64>(count, m, n, k, trans_a, trans_b, bd, a, sa, b, sb, y);
}
extern "C" __global__ void matmul_plain_i64(i64 count, i64 m, i64 n, i64 k, int trans_a, int trans_b, Dims bd,
                                            const i64* a, Strides sa, const i64* b, Strides sb, i64* y) {
    matmul_plain<i64, u64>(count, m, n, k, trans_a, trans_b, bd, a, sa, b, sb, y);
}
