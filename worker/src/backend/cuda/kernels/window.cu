// Convolution's data movement (im2col and its adjoint; the products are cuBLASLt's), a direct
// transposed convolution for 3 spatial dims, pooling and global average pooling, forward and
// backward. NCHW, f32, f16 or bf16 elements (sums in f32; pooling also f64, which other element
// types are widened to). A 1-D convolution runs as 2-D with height 1 (launch.rs lifts it, as the
// CPU backend's conv.rs does); pooling takes up to 3 spatial dims.

// The geometry of one 2-D window op: input C×H×W, output OH×OW, kernel, strides, dilations,
// begin pads, and the end pads that only average pooling's count_include_pad reads.
struct Geo {
    i64 c, h, w, oh, ow, kh, kw, sh, sw, dh, dw, ph, pw, ph_end, pw_end;
};

// The input row (or column) that output position `o` reads at kernel tap `k`; outside [0, size)
// when the tap falls in the padding.
__device__ __forceinline__ i64 tap_at(i64 o, i64 k, i64 stride, i64 dilation, i64 pad) {
    return o * stride + k * dilation - pad;
}

// The output position whose tap `k` reads input position `i`, or -1 when none does. A stride of
// 1 (most convolutions') divides nothing.
__device__ __forceinline__ i64 reader_of(i64 i, i64 k, i64 stride, i64 dilation, i64 pad, i64 out_size) {
    i64 t = i + pad - k * dilation;
    if (t < 0) return -1;
    if (stride != 1) {
        i64 r;
        t = divmod(t, stride, &r);
        if (r != 0) return -1;
    }
    return t < out_size ? t : -1;
}

// col[img, (c·kh + ky)·kw + kx, oy·ow + ox] = x[img, c0 + c, iy, ix], 0 in the padding, for
// the channels c0..c0+cn of `images` images: one group's operand of the convolution's product,
// an image's rows `img_stride` elements apart and a row's `row_stride` (rows · plane and plane
// image by image; plane and images · plane for the weight gradient's [rows, images, plane]).
template <class S>
__device__ void im2col(i64 images, const Geo& g, i64 c0, i64 cn, i64 img_stride, i64 row_stride,
                       const typename S::T* x, typename S::T* col) {
    i64 plane = g.oh * g.ow, rows = cn * g.kh * g.kw;
    i64 n = images * rows * plane;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 p, row, kx, ky, ox;
        i64 img = divmod(divmod(i, plane, &p), rows, &row);
        i64 c = divmod(divmod(row, g.kw, &kx), g.kh, &ky);
        i64 oy = divmod(p, g.ow, &ox);
        i64 iy = tap_at(oy, ky, g.sh, g.dh, g.ph), ix = tap_at(ox, kx, g.sw, g.dw, g.pw);
        bool inside = iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
        col[img * img_stride + row * row_stride + p] =
            inside ? x[((img * g.c + c0 + c) * g.h + iy) * g.w + ix] : S::store(0.f);
    }
}
extern "C" __global__ void im2col_f32(i64 images, Geo g, i64 c0, i64 cn, i64 img_stride, i64 row_stride, const float* x,
                                      float* col) {
    im2col<F32>(images, g, c0, cn, img_stride, row_stride, x, col);
}
extern "C" __global__ void im2col_f16(i64 images, Geo g, i64 c0, i64 cn, i64 img_stride, i64 row_stride, const u16* x,
                                      u16* col) {
    im2col<F16>(images, g, c0, cn, img_stride, row_stride, x, col);
}
extern "C" __global__ void im2col_bf16(i64 images, Geo g, i64 c0, i64 cn, i64 img_stride, i64 row_stride, const u16* x,
                                       u16* col) {
    im2col<BF16>(images, g, c0, cn, img_stride, row_stride, x, col);
}

// The adjoint of im2col: dx[img, c0 + c, iy, ix] = Σ of the dcol entries that read it, dcol
// laid out as im2col lays out col (`img_stride`, `row_stride`). Each thread gathers one input
// element (no atomics, so the sum's order is fixed), and the groups' channel ranges partition
// dx, so every element is written exactly once.
template <class S>
__device__ void col2im(i64 images, const Geo& g, i64 c0, i64 cn, i64 img_stride, i64 row_stride,
                       const typename S::T* dcol, typename S::T* dx) {
    i64 n = images * cn * g.h * g.w;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 ix, iy, c;
        i64 img = divmod(divmod(divmod(i, g.w, &ix), g.h, &iy), cn, &c);
        const typename S::T* d = dcol + img * img_stride;
        float s = 0.f;
        for (i64 ky = 0; ky < g.kh; ++ky) {
            i64 oy = reader_of(iy, ky, g.sh, g.dh, g.ph, g.oh);
            if (oy < 0) continue;
            for (i64 kx = 0; kx < g.kw; ++kx) {
                i64 ox = reader_of(ix, kx, g.sw, g.dw, g.pw, g.ow);
                if (ox >= 0) s += S::load(d[((c * g.kh + ky) * g.kw + kx) * row_stride + oy * g.ow + ox]);
            }
        }
        dx[((img * g.c + c0 + c) * g.h + iy) * g.w + ix] = S::store(s);
    }
}
extern "C" __global__ void col2im_f32(i64 images, Geo g, i64 c0, i64 cn, i64 img_stride, i64 row_stride,
                                      const float* dcol, float* dx) {
    col2im<F32>(images, g, c0, cn, img_stride, row_stride, dcol, dx);
}
extern "C" __global__ void col2im_f16(i64 images, Geo g, i64 c0, i64 cn, i64 img_stride, i64 row_stride,
                                      const u16* dcol, u16* dx) {
    col2im<F16>(images, g, c0, cn, img_stride, row_stride, dcol, dx);
}
extern "C" __global__ void col2im_bf16(i64 images, Geo g, i64 c0, i64 cn, i64 img_stride, i64 row_stride,
                                       const u16* dcol, u16* dx) {
    col2im<BF16>(images, g, c0, cn, img_stride, row_stride, dcol, dx);
}

// y[img, ch, p] += bias[ch] over [images, channels, plane].
template <class S>
__device__ void channel_bias(i64 n, i64 channels, i64 plane, const typename S::T* bias, typename S::T* y) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 p, ch;
        divmod(divmod(i, plane, &p), channels, &ch);
        y[i] = S::store(S::load(y[i]) + S::load(bias[ch]));
    }
}
extern "C" __global__ void channel_bias_f32(i64 n, i64 channels, i64 plane, const float* bias, float* y) {
    channel_bias<F32>(n, channels, plane, bias, y);
}
extern "C" __global__ void channel_bias_f16(i64 n, i64 channels, i64 plane, const u16* bias, u16* y) {
    channel_bias<F16>(n, channels, plane, bias, y);
}
extern "C" __global__ void channel_bias_bf16(i64 n, i64 channels, i64 plane, const u16* bias, u16* y) {
    channel_bias<BF16>(n, channels, plane, bias, y);
}

// The geometry of one pooling op over up to 3 spatial dims (fewer run as 3 with leading sizes
// of 1): per dim the input and output sizes, kernel, stride, dilation, begin pad, and the end
// pad that only average pooling's count_include_pad reads.
struct Pool {
    i64 in[3], out[3], k[3], s[3], d[3], pad[3], pad_end[3];
};

// How many taps of one window along one dim average pooling with count_include_pad divides by:
// those inside the padded input [−pad_begin, size + pad_end), not those that ceil_mode hangs
// off its end (PyTorch's and ONNX Runtime's count).
__device__ __forceinline__ i64 padded_taps(const Pool& g, int dim, i64 o) {
    i64 start = o * g.s[dim] - g.pad[dim];
    i64 end = start + (g.k[dim] - 1) * g.d[dim] + 1;
    if (end > g.in[dim] + g.pad_end[dim]) end = g.in[dim] + g.pad_end[dim];
    i64 span = end - start;
    return span > 0 ? (span + g.d[dim] - 1) / g.d[dim] : 0;
}

// Input position `at` along each dim of kernel tap (t0, t1, t2) of output `o`; false when the
// tap falls in the padding. `at` is then the tap's flat offset in the input plane.
__device__ __forceinline__ bool pool_tap(const Pool& g, const i64* o, i64 t0, i64 t1, i64 t2, i64* at) {
    i64 t[3] = {t0, t1, t2}, off = 0;
    for (int dim = 0; dim < 3; ++dim) {
        i64 i = tap_at(o[dim], t[dim], g.s[dim], g.d[dim], g.pad[dim]);
        if (i < 0 || i >= g.in[dim]) return false;
        off = off * g.in[dim] + i;
    }
    *at = off;
    return true;
}

// What average pooling divides output `o` by: the taps inside the input, or with
// count_include_pad those inside the padded input; at least 1.
__device__ i64 average_count(const Pool& g, const i64* o, int include_pad) {
    i64 count = 1;
    if (include_pad) {
        for (int dim = 0; dim < 3; ++dim) count *= padded_taps(g, dim, o[dim]);
    } else {
        count = 0;
        i64 at;
        for (i64 t0 = 0; t0 < g.k[0]; ++t0)
            for (i64 t1 = 0; t1 < g.k[1]; ++t1)
                for (i64 t2 = 0; t2 < g.k[2]; ++t2) count += pool_tap(g, o, t0, t1, t2, &at);
    }
    return count > 0 ? count : 1;
}

// The input position (in its plane) of the first maximum of output `o`'s window, taps in
// row-major order, or -1 for a window wholly in the padding. A NaN wins only at the window's
// first tap inside the input (as in the CPU backend's general pooling; its f32 path for 1-D
// and 2-D windows passes over NaN).
template <class S>
__device__ i64 first_max(const Pool& g, const typename S::T* xp, const i64* o) {
    i64 best = -1, at;
    for (i64 t0 = 0; t0 < g.k[0]; ++t0)
        for (i64 t1 = 0; t1 < g.k[1]; ++t1)
            for (i64 t2 = 0; t2 < g.k[2]; ++t2)
                if (pool_tap(g, o, t0, t1, t2, &at) && (best < 0 || S::load(xp[at]) > S::load(xp[best]))) best = at;
    return best;
}

// Output position `o` (per dim) of flat index `i` in an output plane.
__device__ __forceinline__ void pool_position(const Pool& g, i64 i, i64* o) {
    o[0] = divmod(divmod(i, g.out[2], &o[2]), g.out[1], &o[1]);
}

// MaxPool (`max`) or AveragePool over `planes` = N·C planes; one thread per output. MaxPool's
// Indices (when not null) get each maximum's flat index in X (ONNX's storage_order 0). Averages
// sum in the compute type (f32 for the half types, whose last bits may then differ from the CPU
// backend's general path, which sums in f64).
template <class S>
__device__ void pool(int max, int include_pad, i64 planes, const Pool& g, const typename S::T* x, typename S::T* y,
                     i64* indices) {
    typedef typename S::C C;
    i64 plane_in = g.in[0] * g.in[1] * g.in[2], plane_out = g.out[0] * g.out[1] * g.out[2];
    i64 n = planes * plane_out;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 o[3], at, in_plane;
        i64 p = divmod(i, plane_out, &in_plane);
        pool_position(g, in_plane, o);
        const typename S::T* xp = x + p * plane_in;
        if (max) {
            i64 best = first_max<S>(g, xp, o);
            y[i] = best < 0 ? S::store((C)NEG_INF) : xp[best];
            if (indices) indices[i] = p * plane_in + (best < 0 ? 0 : best);
            continue;
        }
        C s = 0;
        for (i64 t0 = 0; t0 < g.k[0]; ++t0)
            for (i64 t1 = 0; t1 < g.k[1]; ++t1)
                for (i64 t2 = 0; t2 < g.k[2]; ++t2)
                    if (pool_tap(g, o, t0, t1, t2, &at)) s += S::load(xp[at]);
        y[i] = S::store(s / (C)average_count(g, o, include_pad));
    }
}
extern "C" __global__ void pool_f32(int max, int include_pad, i64 planes, Pool g, const float* x, float* y,
                                    i64* indices) {
    pool<F32>(max, include_pad, planes, g, x, y, indices);
}
extern "C" __global__ void pool_f16(int max, int include_pad, i64 planes, Pool g, const u16* x, u16* y,
                                    i64* indices) {
    pool<F16>(max, include_pad, planes, g, x, y, indices);
}
extern "C" __global__ void pool_bf16(int max, int include_pad, i64 planes, Pool g, const u16* x, u16* y,
                                     i64* indices) {
    pool<BF16>(max, include_pad, planes, g, x, y, indices);
}
extern "C" __global__ void pool_f64(int max, int include_pad, i64 planes, Pool g, const double* x, double* y,
                                    i64* indices) {
    pool<F64>(max, include_pad, planes, g, x, y, indices);
}

// ConvTranspose over up to 3 spatial dims (3-D, which the products' im2col does not cover), one
// thread per output element: y[img, ch, p] = bias[ch] + Σ over the group's cg input channels c
// and the taps t whose window of the convolution `g` (input Y, output X) reads p, of
// x[img, c, that window] · w[c, ch mod mg, t]. W is [C, mg, taps]; bias may be null.
template <class S>
__device__ void conv_transpose_direct(i64 images, i64 group, i64 cg, i64 mg, const Pool& g, const typename S::T* x,
                                      const typename S::T* w, const typename S::T* bias, typename S::T* y) {
    i64 plane_y = g.in[0] * g.in[1] * g.in[2], plane_x = g.out[0] * g.out[1] * g.out[2];
    i64 taps = g.k[0] * g.k[1] * g.k[2], channels = group * mg;
    i64 n = images * channels * plane_y;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 p, ch, in_group, in[3], o[3];
        i64 img = divmod(divmod(i, plane_y, &p), channels, &ch);
        i64 gr = divmod(ch, mg, &in_group);
        in[0] = divmod(divmod(p, g.in[2], &in[2]), g.in[1], &in[1]);
        const typename S::T* xg = x + (img * group + gr) * cg * plane_x;
        const typename S::T* wg = w + (gr * cg * mg + in_group) * taps;
        float s = bias ? S::load(bias[ch]) : 0.f;
        for (i64 t0 = 0; t0 < g.k[0]; ++t0) {
            if ((o[0] = reader_of(in[0], t0, g.s[0], g.d[0], g.pad[0], g.out[0])) < 0) continue;
            for (i64 t1 = 0; t1 < g.k[1]; ++t1) {
                if ((o[1] = reader_of(in[1], t1, g.s[1], g.d[1], g.pad[1], g.out[1])) < 0) continue;
                for (i64 t2 = 0; t2 < g.k[2]; ++t2) {
                    if ((o[2] = reader_of(in[2], t2, g.s[2], g.d[2], g.pad[2], g.out[2])) < 0) continue;
                    i64 at = (o[0] * g.out[1] + o[1]) * g.out[2] + o[2], t = (t0 * g.k[1] + t1) * g.k[2] + t2;
                    for (i64 c = 0; c < cg; ++c) s += S::load(xg[c * plane_x + at]) * S::load(wg[c * mg * taps + t]);
                }
            }
        }
        y[i] = S::store(s);
    }
}
extern "C" __global__ void conv_transpose_direct_f32(i64 images, i64 group, i64 cg, i64 mg, Pool g, const float* x,
                                                     const float* w, const float* bias, float* y) {
    conv_transpose_direct<F32>(images, group, cg, mg, g, x, w, bias, y);
}
extern "C" __global__ void conv_transpose_direct_f16(i64 images, i64 group, i64 cg, i64 mg, Pool g, const u16* x,
                                                     const u16* w, const u16* bias, u16* y) {
    conv_transpose_direct<F16>(images, group, cg, mg, g, x, w, bias, y);
}
extern "C" __global__ void conv_transpose_direct_bf16(i64 images, i64 group, i64 cg, i64 mg, Pool g, const u16* x,
                                                      const u16* w, const u16* bias, u16* y) {
    conv_transpose_direct<BF16>(images, group, cg, mg, g, x, w, bias, y);
}

// MaxPool's gradient, first pass: the position in its input plane of each output's first
// maximum (first_max; -1 for a window wholly in the padding), so that the gather below compares
// one int per reader where it scanned each reader's whole window again for every input element
// (ResNet-50's max-pool gradient took 20 ms that way).
template <class S>
__device__ void pool_argmax(i64 planes, const Pool& g, const typename S::T* x, int* best) {
    i64 plane_in = g.in[0] * g.in[1] * g.in[2], plane_out = g.out[0] * g.out[1] * g.out[2];
    for (i64 i = first_index(); i < planes * plane_out; i += grid_stride()) {
        i64 o[3], in_plane;
        i64 p = divmod(i, plane_out, &in_plane);
        pool_position(g, in_plane, o);
        best[i] = (int)first_max<S>(g, x + p * plane_in, o);
    }
}
extern "C" __global__ void pool_argmax_f32(i64 planes, Pool g, const float* x, int* best) {
    pool_argmax<F32>(planes, g, x, best);
}
extern "C" __global__ void pool_argmax_f16(i64 planes, Pool g, const u16* x, int* best) {
    pool_argmax<F16>(planes, g, x, best);
}
extern "C" __global__ void pool_argmax_bf16(i64 planes, Pool g, const u16* x, int* best) {
    pool_argmax<BF16>(planes, g, x, best);
}

// dX of pooling, gathered per input element from the outputs whose windows read it: max
// pooling takes dY of the windows whose first maximum it is (`best`, pool_argmax's), average
// pooling dY / count. The readers are visited in increasing output order (taps from the last
// back), the order in which the CPU backend scatters, so the sums agree bit for bit.
template <class S>
__device__ void pool_grad(int max, int include_pad, i64 planes, const Pool& g, const typename S::T* dy,
                          const int* best, typename S::T* dx) {
    i64 plane_in = g.in[0] * g.in[1] * g.in[2], plane_out = g.out[0] * g.out[1] * g.out[2];
    i64 n = planes * plane_in;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 at, in[3];
        i64 p = divmod(i, plane_in, &at);
        in[0] = divmod(divmod(at, g.in[2], &in[2]), g.in[1], &in[1]);
        const typename S::T* dyp = dy + p * plane_out;
        float s = 0.f;
        i64 o[3];
        for (i64 t0 = g.k[0] - 1; t0 >= 0; --t0) {
            if ((o[0] = reader_of(in[0], t0, g.s[0], g.d[0], g.pad[0], g.out[0])) < 0) continue;
            for (i64 t1 = g.k[1] - 1; t1 >= 0; --t1) {
                if ((o[1] = reader_of(in[1], t1, g.s[1], g.d[1], g.pad[1], g.out[1])) < 0) continue;
                for (i64 t2 = g.k[2] - 1; t2 >= 0; --t2) {
                    if ((o[2] = reader_of(in[2], t2, g.s[2], g.d[2], g.pad[2], g.out[2])) < 0) continue;
                    i64 oi = (o[0] * g.out[1] + o[1]) * g.out[2] + o[2];
                    float d = S::load(dyp[oi]);
                    if (max) {
                        if (best[p * plane_out + oi] == at) s += d;
                    } else {
                        s += d / (float)average_count(g, o, include_pad);
                    }
                }
            }
        }
        dx[i] = S::store(s);
    }
}
extern "C" __global__ void pool_grad_f32(int max, int include_pad, i64 planes, Pool g, const float* dy,
                                         const int* best, float* dx) {
    pool_grad<F32>(max, include_pad, planes, g, dy, best, dx);
}
extern "C" __global__ void pool_grad_f16(int max, int include_pad, i64 planes, Pool g, const u16* dy, const int* best,
                                         u16* dx) {
    pool_grad<F16>(max, include_pad, planes, g, dy, best, dx);
}
extern "C" __global__ void pool_grad_bf16(int max, int include_pad, i64 planes, Pool g, const u16* dy, const int* best,
                                          u16* dx) {
    pool_grad<BF16>(max, include_pad, planes, g, dy, best, dx);
}

// GlobalAveragePool: one block per N·C plane.
template <class S>
__device__ void mean_rows(i64 cols, const typename S::T* x, typename S::T* y) {
    const typename S::T* xr = x + blockIdx.x * cols;
    float s = 0.f;
    for (i64 j = threadIdx.x; j < cols; j += blockDim.x) s += S::load(xr[j]);
    s = block_sum(s);
    if (threadIdx.x == 0) y[blockIdx.x] = S::store(s / (float)cols);
}
extern "C" __global__ void mean_rows_f32(i64 cols, const float* x, float* y) { mean_rows<F32>(cols, x, y); }
extern "C" __global__ void mean_rows_f16(i64 cols, const u16* x, u16* y) { mean_rows<F16>(cols, x, y); }
extern "C" __global__ void mean_rows_bf16(i64 cols, const u16* x, u16* y) { mean_rows<BF16>(cols, x, y); }
