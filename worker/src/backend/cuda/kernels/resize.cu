// Resize and its gradient as a separable resampling (backend/cpu/kernels/resize.rs computes the
// taps, launch/resize.rs uploads them): along each resized axis an output coordinate reads a row
// of input coordinates with weights, and an output element sums, over every combination of its
// axes' taps, the weights' product times the input element there. One thread per output
// element; the terms in the CPU backend's order (the innermost axis's taps turning fastest), in
// f32 (f64 for f64), so that the gradient, a gather over the transposed taps, needs no atomics.

// Where each axis's taps are: the offset of its row starts in `starts` (−1: the axis keeps its
// coordinates) and of its taps in `srcs` and `weights`. A source of −1 marks an output outside
// the input (tf_crop_and_resize), which takes `fill`.
struct Taps {
    i64 rows[MAX_DIMS];
    i64 first[MAX_DIMS];
};

template <class S>
__device__ void resample(i64 n, const Dims& out, const Dims& in, const Taps& t, const i64* starts, const i64* srcs,
                         const float* weights, float fill, const typename S::T* x, typename S::T* y) {
    typedef typename S::C C;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 lo[MAX_DIMS], hi[MAX_DIMS], at[MAX_DIMS], step[MAX_DIMS];
        i64 rest = i, base = 0, stride = 1;
        int m = 0;
        bool outside = false, empty = false;
        for (int d = (int)out.rank - 1; d >= 0; --d) {
            i64 o = rest % out.size[d];
            rest /= out.size[d];
            if (t.rows[d] < 0) {
                base += o * stride;
            } else {
                lo[m] = at[m] = t.first[d] + starts[t.rows[d] + o];
                hi[m] = t.first[d] + starts[t.rows[d] + o + 1];
                step[m] = stride;
                outside |= lo[m] < hi[m] && srcs[lo[m]] < 0;
                empty |= lo[m] == hi[m];
                ++m;
            }
            stride *= in.size[d];
        }
        if (outside) {
            y[i] = S::store((C)fill);
            continue;
        }
        C s = 0;
        while (!empty) {
            C w = 1;
            i64 off = base;
            for (int a = 0; a < m; ++a) {
                w *= (C)weights[at[a]];
                off += srcs[at[a]] * step[a];
            }
            s += w * S::load(x[off]);
            int a = 0;
            for (; a < m; ++a) {
                if (++at[a] < hi[a]) break;
                at[a] = lo[a];
            }
            if (a == m) break;
        }
        y[i] = S::store(s);
    }
}
extern "C" __global__ void resample_f32(i64 n, Dims out, Dims in, Taps t, const i64* starts, const i64* srcs,
                                        const float* weights, float fill, const float* x, float* y) {
    resample<F32>(n, out, in, t, starts, srcs, weights, fill, x, y);
}
extern "C" __global__ void resample_f16(i64 n, Dims out, Dims in, Taps t, const i64* starts, const i64* srcs,
                                        const float* weights, float fill, const u16* x, u16* y) {
    resample<F16>(n, out, in, t, starts, srcs, weights, fill, x, y);
}
extern "C" __global__ void resample_bf16(i64 n, Dims out, Dims in, Taps t, const i64* starts, const i64* srcs,
                                         const float* weights, float fill, const u16* x, u16* y) {
    resample<BF16>(n, out, in, t, starts, srcs, weights, fill, x, y);
}
extern "C" __global__ void resample_f64(i64 n, Dims out, Dims in, Taps t, const i64* starts, const i64* srcs,
                                        const float* weights, float fill, const double* x, double* y) {
    resample<F64>(n, out, in, t, starts, srcs, weights, fill, x, y);
}
