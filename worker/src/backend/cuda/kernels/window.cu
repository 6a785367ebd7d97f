// Convolution's data movement (im2col and its adjoint; the products are cuBLASLt's), pooling
// and global average pooling, forward and backward. NCHW, f32, f16 or bf16 elements (sums in
// f32); a 1-D window runs as 2-D with height 1 (launch.rs lifts it, as the CPU backend's conv.rs
// does).

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

// The output position whose tap `k` reads input position `i`, or -1 when none does.
__device__ __forceinline__ i64 reader_of(i64 i, i64 k, i64 stride, i64 dilation, i64 pad, i64 out_size) {
    i64 t = i + pad - k * dilation;
    if (t < 0 || t % stride != 0) return -1;
    t /= stride;
    return t < out_size ? t : -1;
}

// col[img, (c·kh + ky)·kw + kx, oy·ow + ox] = x[img, c0 + c, iy, ix], 0 in the padding, for
// the channels c0..c0+cn of `images` images: one group's operand of the convolution's product.
template <class S>
__device__ void im2col(i64 images, const Geo& g, i64 c0, i64 cn, const typename S::T* x, typename S::T* col) {
    i64 plane = g.oh * g.ow, rows = cn * g.kh * g.kw;
    i64 n = images * rows * plane;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 p = i % plane, row = (i / plane) % rows, img = i / (plane * rows);
        i64 kx = row % g.kw, ky = (row / g.kw) % g.kh, c = row / (g.kw * g.kh);
        i64 iy = tap_at(p / g.ow, ky, g.sh, g.dh, g.ph), ix = tap_at(p % g.ow, kx, g.sw, g.dw, g.pw);
        bool inside = iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
        col[i] = inside ? x[((img * g.c + c0 + c) * g.h + iy) * g.w + ix] : S::store(0.f);
    }
}
extern "C" __global__ void im2col_f32(i64 images, Geo g, i64 c0, i64 cn, const float* x, float* col) {
    im2col<F32>(images, g, c0, cn, x, col);
}
extern "C" __global__ void im2col_f16(i64 images, Geo g, i64 c0, i64 cn, const u16* x, u16* col) {
    im2col<F16>(images, g, c0, cn, x, col);
}
extern "C" __global__ void im2col_bf16(i64 images, Geo g, i64 c0, i64 cn, const u16* x, u16* col) {
    im2col<BF16>(images, g, c0, cn, x, col);
}

// The adjoint of im2col: dx[img, c0 + c, iy, ix] = Σ of the dcol entries that read it. Each
// thread gathers one input element (no atomics, so the sum's order is fixed), and the groups'
// channel ranges partition dx, so every element is written exactly once.
template <class S>
__device__ void col2im(i64 images, const Geo& g, i64 c0, i64 cn, const typename S::T* dcol, typename S::T* dx) {
    i64 plane = g.oh * g.ow, rows = cn * g.kh * g.kw;
    i64 n = images * cn * g.h * g.w;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 ix = i % g.w, iy = (i / g.w) % g.h, c = (i / (g.w * g.h)) % cn, img = i / (g.w * g.h * cn);
        const typename S::T* d = dcol + img * rows * plane;
        float s = 0.f;
        for (i64 ky = 0; ky < g.kh; ++ky) {
            i64 oy = reader_of(iy, ky, g.sh, g.dh, g.ph, g.oh);
            if (oy < 0) continue;
            for (i64 kx = 0; kx < g.kw; ++kx) {
                i64 ox = reader_of(ix, kx, g.sw, g.dw, g.pw, g.ow);
                if (ox >= 0) s += S::load(d[((c * g.kh + ky) * g.kw + kx) * plane + oy * g.ow + ox]);
            }
        }
        dx[((img * g.c + c0 + c) * g.h + iy) * g.w + ix] = S::store(s);
    }
}
extern "C" __global__ void col2im_f32(i64 images, Geo g, i64 c0, i64 cn, const float* dcol, float* dx) {
    col2im<F32>(images, g, c0, cn, dcol, dx);
}
extern "C" __global__ void col2im_f16(i64 images, Geo g, i64 c0, i64 cn, const u16* dcol, u16* dx) {
    col2im<F16>(images, g, c0, cn, dcol, dx);
}
extern "C" __global__ void col2im_bf16(i64 images, Geo g, i64 c0, i64 cn, const u16* dcol, u16* dx) {
    col2im<BF16>(images, g, c0, cn, dcol, dx);
}

// y[img, ch, p] += bias[ch] over [images, channels, plane].
template <class S>
__device__ void channel_bias(i64 n, i64 channels, i64 plane, const typename S::T* bias, typename S::T* y) {
    for (i64 i = first_index(); i < n; i += grid_stride())
        y[i] = S::store(S::load(y[i]) + S::load(bias[(i / plane) % channels]));
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

// How many taps of one window along one dim average pooling with count_include_pad divides by:
// those inside the padded input [−pad_begin, size + pad_end), not those that ceil_mode hangs
// off its end (PyTorch's and ONNX Runtime's count).
__device__ __forceinline__ i64 padded_taps(i64 o, i64 stride, i64 k, i64 dilation, i64 pad, i64 pad_end,
                                           i64 size) {
    i64 start = o * stride - pad;
    i64 end = start + (k - 1) * dilation + 1;
    if (end > size + pad_end) end = size + pad_end;
    i64 span = end - start;
    return span > 0 ? (span + dilation - 1) / dilation : 0;
}

// What average pooling divides output (oy, ox) by: the taps inside the input, or with
// count_include_pad those inside the padded input; at least 1.
__device__ i64 average_count(const Geo& g, i64 oy, i64 ox, int include_pad) {
    i64 count = 0;
    if (include_pad) {
        count = padded_taps(oy, g.sh, g.kh, g.dh, g.ph, g.ph_end, g.h) *
                padded_taps(ox, g.sw, g.kw, g.dw, g.pw, g.pw_end, g.w);
    } else {
        for (i64 ky = 0; ky < g.kh; ++ky) {
            i64 iy = tap_at(oy, ky, g.sh, g.dh, g.ph);
            for (i64 kx = 0; kx < g.kw; ++kx) {
                i64 ix = tap_at(ox, kx, g.sw, g.dw, g.pw);
                count += iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
            }
        }
    }
    return count > 0 ? count : 1;
}

// The input position (in its plane) of the first maximum of output (oy, ox)'s window, taps in
// row-major order, or -1 for a window wholly in the padding. NaN never wins, as on the CPU.
template <class S>
__device__ i64 first_max(const Geo& g, const typename S::T* xp, i64 oy, i64 ox) {
    i64 best = -1;
    for (i64 ky = 0; ky < g.kh; ++ky) {
        i64 iy = tap_at(oy, ky, g.sh, g.dh, g.ph);
        if (iy < 0 || iy >= g.h) continue;
        for (i64 kx = 0; kx < g.kw; ++kx) {
            i64 ix = tap_at(ox, kx, g.sw, g.dw, g.pw);
            if (ix < 0 || ix >= g.w) continue;
            i64 at = iy * g.w + ix;
            if (best < 0 || S::load(xp[at]) > S::load(xp[best])) best = at;
        }
    }
    return best;
}

// MaxPool (`max`) or AveragePool over `planes` = N·C planes; one thread per output. MaxPool's
// Indices (when not null) get each maximum's flat index in X (ONNX's storage_order 0).
template <class S>
__device__ void pool(int max, int include_pad, i64 planes, const Geo& g, const typename S::T* x, typename S::T* y,
                     i64* indices) {
    i64 plane_out = g.oh * g.ow, n = planes * plane_out;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 o = i % plane_out, oy = o / g.ow, ox = o % g.ow, p = i / plane_out;
        const typename S::T* xp = x + p * g.h * g.w;
        if (max) {
            i64 at = first_max<S>(g, xp, oy, ox);
            y[i] = at < 0 ? S::store(NEG_INF) : xp[at];
            if (indices) indices[i] = p * g.h * g.w + (at < 0 ? 0 : at);
            continue;
        }
        float s = 0.f;
        for (i64 ky = 0; ky < g.kh; ++ky) {
            i64 iy = tap_at(oy, ky, g.sh, g.dh, g.ph);
            if (iy < 0 || iy >= g.h) continue;
            for (i64 kx = 0; kx < g.kw; ++kx) {
                i64 ix = tap_at(ox, kx, g.sw, g.dw, g.pw);
                if (ix >= 0 && ix < g.w) s += S::load(xp[iy * g.w + ix]);
            }
        }
        y[i] = S::store(s / (float)average_count(g, oy, ox, include_pad));
    }
}
extern "C" __global__ void pool_f32(int max, int include_pad, i64 planes, Geo g, const float* x, float* y,
                                    i64* indices) {
    pool<F32>(max, include_pad, planes, g, x, y, indices);
}
extern "C" __global__ void pool_f16(int max, int include_pad, i64 planes, Geo g, const u16* x, u16* y,
                                    i64* indices) {
    pool<F16>(max, include_pad, planes, g, x, y, indices);
}
extern "C" __global__ void pool_bf16(int max, int include_pad, i64 planes, Geo g, const u16* x, u16* y,
                                     i64* indices) {
    pool<BF16>(max, include_pad, planes, g, x, y, indices);
}

// dX of pooling, gathered per input element from the outputs whose windows read it: max
// pooling takes dY of the windows whose first maximum it is, average pooling dY / count. The
// readers are visited in increasing output order (taps from the last back), the order in which
// the CPU backend scatters, so the sums agree bit for bit.
template <class S>
__device__ void pool_grad(int max, int include_pad, i64 planes, const Geo& g, const typename S::T* dy,
                          const typename S::T* x, typename S::T* dx) {
    i64 plane_in = g.h * g.w, n = planes * plane_in;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 at = i % plane_in, iy = at / g.w, ix = at % g.w, p = i / plane_in;
        const typename S::T* xp = x + p * plane_in;
        const typename S::T* dyp = dy + p * g.oh * g.ow;
        float s = 0.f;
        for (i64 ky = g.kh - 1; ky >= 0; --ky) {
            i64 oy = reader_of(iy, ky, g.sh, g.dh, g.ph, g.oh);
            if (oy < 0) continue;
            for (i64 kx = g.kw - 1; kx >= 0; --kx) {
                i64 ox = reader_of(ix, kx, g.sw, g.dw, g.pw, g.ow);
                if (ox < 0) continue;
                float d = S::load(dyp[oy * g.ow + ox]);
                if (max) {
                    if (first_max<S>(g, xp, oy, ox) == at) s += d;
                } else {
                    s += d / (float)average_count(g, oy, ox, include_pad);
                }
            }
        }
        dx[i] = S::store(s);
    }
}
extern "C" __global__ void pool_grad_f32(int max, int include_pad, i64 planes, Geo g, const float* dy,
                                         const float* x, float* dx) {
    pool_grad<F32>(max, include_pad, planes, g, dy, x, dx);
}
extern "C" __global__ void pool_grad_f16(int max, int include_pad, i64 planes, Geo g, const u16* dy, const u16* x,
                                         u16* dx) {
    pool_grad<F16>(max, include_pad, planes, g, dy, x, dx);
}
extern "C" __global__ void pool_grad_bf16(int max, int include_pad, i64 planes, Geo g, const u16* dy, const u16* x,
                                          u16* dx) {
    pool_grad<BF16>(max, include_pad, planes, g, dy, x, dx);
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
