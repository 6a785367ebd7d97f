//! Convolution (im2col + GEMM), transposed convolution (a convolution's data gradient),
//! pooling and batch normalization, forward and backward, for 1-D and 2-D spatial inputs (1-D
//! runs as 2-D with height 1); convolutions over more dims, or of other element types than
//! f32, run through plain f64 loops. Layout NCHW.

use super::matmul::{parallelism, sgemm, Mat};
use super::KResult;
use crate::error::BackendError;
use crate::op::{PoolKind, Window};
use crate::refused;
use crate::tensor::{DType, TensorView, TensorViewMut};
use gemm_common::Parallelism;
use rayon::prelude::*;

/// Geometry of a 2-D window op, with 1-D lifted to 2-D. The CUDA backend's window kernels
/// take the same (backend/cuda/launch.rs).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geo {
    pub(crate) c: usize,
    pub(crate) h: usize,
    pub(crate) w: usize,
    pub(crate) oh: usize,
    pub(crate) ow: usize,
    pub(crate) kh: usize,
    pub(crate) kw: usize,
    pub(crate) sh: usize,
    pub(crate) sw: usize,
    pub(crate) dh: usize,
    pub(crate) dw: usize,
    pub(crate) ph: usize,
    pub(crate) pw: usize,
    /// End pads: only the divisor of average pooling with count_include_pad reads them.
    pub(crate) ph_end: usize,
    pub(crate) pw_end: usize,
}

pub(crate) fn geo(win: &Window, x: &[usize], y: &[usize]) -> Result<Geo, BackendError> {
    match x.len() {
        4 => Ok(Geo {
            c: x[1],
            h: x[2],
            w: x[3],
            oh: y[2],
            ow: y[3],
            kh: win.kernel[0],
            kw: win.kernel[1],
            sh: win.strides[0],
            sw: win.strides[1],
            dh: win.dilations[0],
            dw: win.dilations[1],
            ph: win.pads[0],
            pw: win.pads[1],
            ph_end: win.pads[2],
            pw_end: win.pads[3],
        }),
        3 => Ok(Geo {
            c: x[1],
            h: 1,
            w: x[2],
            oh: 1,
            ow: y[2],
            kh: 1,
            kw: win.kernel[0],
            sh: 1,
            sw: win.strides[0],
            dh: 1,
            dw: win.dilations[0],
            ph: 0,
            pw: win.pads[0],
            ph_end: 0,
            pw_end: win.pads[1],
        }),
        r => refused!("{}-D spatial windows are not implemented (1-D and 2-D are)", r.saturating_sub(2)),
    }
}

impl Geo {
    /// Input coordinate of output (oy, ox) at kernel tap (ky, kx), if inside the input.
    #[inline]
    fn tap(&self, oy: usize, ox: usize, ky: usize, kx: usize) -> Option<(usize, usize)> {
        let iy = (oy * self.sh + ky * self.dh) as isize - self.ph as isize;
        let ix = (ox * self.sw + kx * self.dw) as isize - self.pw as isize;
        (iy >= 0 && ix >= 0 && (iy as usize) < self.h && (ix as usize) < self.w).then_some((iy as usize, ix as usize))
    }
}

/// col[(c·kh+ky)·kw+kx, oy·ow+ox] = x[c, iy, ix] (0 in the padding), for channels `c0..c0+cn`.
fn im2col(g: &Geo, x: &[f32], c0: usize, cn: usize, col: &mut [f32]) {
    let plane = g.oh * g.ow;
    for c in 0..cn {
        let xc = &x[(c0 + c) * g.h * g.w..];
        for ky in 0..g.kh {
            for kx in 0..g.kw {
                let row = &mut col[((c * g.kh + ky) * g.kw + kx) * plane..][..plane];
                for oy in 0..g.oh {
                    for ox in 0..g.ow {
                        row[oy * g.ow + ox] = g.tap(oy, ox, ky, kx).map_or(0.0, |(iy, ix)| xc[iy * g.w + ix]);
                    }
                }
            }
        }
    }
}

/// The adjoint of im2col: dx[c, iy, ix] += dcol[...].
fn col2im(g: &Geo, dcol: &[f32], c0: usize, cn: usize, dx: &mut [f32]) {
    let plane = g.oh * g.ow;
    for c in 0..cn {
        let dxc = &mut dx[(c0 + c) * g.h * g.w..][..g.h * g.w];
        for ky in 0..g.kh {
            for kx in 0..g.kw {
                let row = &dcol[((c * g.kh + ky) * g.kw + kx) * plane..][..plane];
                for oy in 0..g.oh {
                    for ox in 0..g.ow {
                        if let Some((iy, ix)) = g.tap(oy, ox, ky, kx) {
                            dxc[iy * g.w + ix] += row[oy * g.ow + ox];
                        }
                    }
                }
            }
        }
    }
}

/// A 1×1 window that maps every input position to the same output position: X is its own
/// im2col matrix. (End pads alone would still grow the output, hence the size check.)
pub(crate) fn is_pointwise(g: &Geo) -> bool {
    g.kh == 1 && g.kw == 1 && g.sh == 1 && g.sw == 1 && g.ph == 0 && g.pw == 0 && g.oh == g.h && g.ow == g.w
}

pub fn conv(
    win: &Window,
    group: usize,
    x: &TensorView,
    w: &TensorView,
    bias: Option<TensorView>,
    y: &mut TensorViewMut,
) -> KResult {
    if x.dtype != DType::F32 || x.shape.len() > 4 {
        return conv_nd(win, group, x, w, bias, y);
    }
    let g = geo(win, x.shape, y.shape)?;
    let m = y.shape[1];
    let (cg, mg) = (g.c / group, m / group);
    let kdim = cg * g.kh * g.kw;
    let plane = g.oh * g.ow;
    let (xs, ws) = (x.as_slice::<f32>(), w.as_slice::<f32>());
    let b = bias.map(|b| b.as_slice::<f32>());
    let per_image = |i: usize, yi: &mut [f32], par: Parallelism| {
        let xi = &xs[i * g.c * g.h * g.w..(i + 1) * g.c * g.h * g.w];
        let mut col = if is_pointwise(&g) { Vec::new() } else { vec![0f32; kdim * plane] };
        for gr in 0..group {
            let src: &[f32] = if is_pointwise(&g) {
                &xi[gr * cg * plane..(gr + 1) * cg * plane]
            } else {
                im2col(&g, xi, gr * cg, cg, &mut col);
                &col
            };
            let yg = &mut yi[gr * mg * plane..(gr + 1) * mg * plane];
            if let Some(b) = b {
                for (k, row) in yg.chunks_mut(plane).enumerate() {
                    row.fill(b[gr * mg + k]);
                }
            }
            // y_g[mg × plane] = W_g[mg × kdim] · col[kdim × plane]
            unsafe {
                sgemm(
                    mg,
                    plane,
                    kdim,
                    yg.as_mut_ptr(),
                    plane as isize,
                    ws.as_ptr(),
                    Mat { offset: gr * mg * kdim, rs: kdim as isize, cs: 1 },
                    src.as_ptr(),
                    Mat { offset: 0, rs: plane as isize, cs: 1 },
                    b.is_some(),
                    1.0,
                    par,
                )
            };
        }
    };
    each_image(y.as_mut_slice::<f32>(), m * plane, parallelism(mg, plane, kdim), per_image);
    Ok(())
}

/// Splits a flat index into a multi-index over `dims` (row-major).
fn unflatten(mut flat: usize, dims: &[usize], out: &mut [usize]) {
    for d in (0..dims.len()).rev() {
        out[d] = flat % dims[d];
        flat /= dims[d];
    }
}

/// The taps of the window at output position `at` that fall inside the input: (tap index in
/// the kernel, element offset in the input plane), for any number of spatial dims.
fn window_taps(win: &Window, kernel: &[usize], at: &[usize], size_in: &[usize], taps: &mut Vec<(usize, usize)>) {
    let nd = at.len();
    let in_strides = crate::tensor::strides(size_in);
    let mut tap = vec![0usize; nd];
    taps.clear();
    for t in 0..kernel.iter().product() {
        unflatten(t, kernel, &mut tap);
        let mut off = 0;
        let inside = (0..nd).all(|d| {
            let i = (at[d] * win.strides[d] + tap[d] * win.dilations[d]) as isize - win.pads[d] as isize;
            off += i.max(0) as usize * in_strides[d];
            i >= 0 && (i as usize) < size_in[d]
        });
        if inside {
            taps.push((t, off));
        }
    }
}

/// Convolution over any number of spatial dims, computed in f64 with plain loops: the general
/// path behind [`conv`]'s f32 1-D/2-D GEMM one (float64 models, 3-D convolutions).
fn conv_nd(
    win: &Window,
    group: usize,
    x: &TensorView,
    w: &TensorView,
    bias: Option<TensorView>,
    y: &mut TensorViewMut,
) -> KResult {
    let (n, c, m) = (x.shape[0], x.shape[1], y.shape[1]);
    let (cg, mg) = (c / group, m / group);
    let (size_in, size_out, kernel) = (&x.shape[2..], y.shape[2..].to_vec(), &w.shape[2..]);
    let (plane_in, plane_out): (usize, usize) = (size_in.iter().product(), size_out.iter().product());
    let kernel_taps: usize = kernel.iter().product();
    let (xs, ws) = (x.to_f64_vec(), w.to_f64_vec());
    let b = bias.map(|b| b.to_f64_vec());
    let mut out = vec![0f64; n * m * plane_out];
    let (mut at, mut taps) = (vec![0usize; size_out.len()], Vec::new());
    for o in 0..plane_out {
        unflatten(o, &size_out, &mut at);
        window_taps(win, kernel, &at, size_in, &mut taps);
        for i in 0..n {
            for oc in 0..m {
                let gr = oc / mg;
                let mut acc = b.as_ref().map_or(0.0, |b| b[oc]);
                for ic in 0..cg {
                    let xc = &xs[(i * c + gr * cg + ic) * plane_in..];
                    let wc = &ws[(oc * cg + ic) * kernel_taps..];
                    acc += taps.iter().map(|&(t, off)| xc[off] * wc[t]).sum::<f64>();
                }
                out[(i * m + oc) * plane_out + o] = acc;
            }
        }
    }
    super::write_f64(&out, y);
    Ok(())
}

/// dY, X, W → dX, dW, dB.
pub fn conv_grad(
    win: &Window,
    group: usize,
    dy: &TensorView,
    x: &TensorView,
    w: &TensorView,
    outs: &mut [TensorViewMut],
) -> KResult {
    let [dx, dw, db] = outs else { return refused!("ConvGrad needs 3 outputs") };
    conv_data_grad(win, group, dy, w, dx)?;
    conv_weight_grad(win, group, dy, x, dw)?;
    channel_sums(dy, db);
    Ok(())
}

/// ConvTranspose: Y = the data gradient of a convolution of `win` whose input is Y, taken at X
/// (X [N, C, D...] in the place of dY, W [C, M/group, k...]), plus the bias.
pub fn conv_transpose(
    win: &Window,
    group: usize,
    x: &TensorView,
    w: &TensorView,
    bias: Option<TensorView>,
    y: &mut TensorViewMut,
) -> KResult {
    conv_data_grad(win, group, x, w, y)?;
    if let Some(b) = bias {
        add_channel_bias(&b, y);
    }
    Ok(())
}

/// dY, X, W → dX, dW, dB of ConvTranspose: dX is dY convolved with W, dW is the convolution's
/// weight gradient with X as the output's gradient and dY as the input.
pub fn conv_transpose_grad(
    win: &Window,
    group: usize,
    dy: &TensorView,
    x: &TensorView,
    w: &TensorView,
    outs: &mut [TensorViewMut],
) -> KResult {
    let [dx, dw, db] = outs else { return refused!("ConvTransposeGrad needs 3 outputs") };
    conv(win, group, dy, w, None, dx)?;
    conv_weight_grad(win, group, x, dy, dw)?;
    channel_sums(dy, db);
    Ok(())
}

/// Runs `f(image, its slice of out, parallelism)` over `out`'s images of `per_image` elements:
/// the images in parallel when there are enough of them, else one by one, each product
/// spreading over the threads (`par`).
fn each_image(out: &mut [f32], per_image: usize, par: Parallelism, f: impl Fn(usize, &mut [f32], Parallelism) + Sync) {
    if out.len() / per_image.max(1) >= rayon::current_num_threads() {
        out.par_chunks_mut(per_image).enumerate().for_each(|(i, o)| f(i, o, Parallelism::None));
    } else {
        out.chunks_mut(per_image).enumerate().for_each(|(i, o)| f(i, o, par));
    }
}

/// dX of a convolution from dY and W: per image and group dcol = W_gᵀ · dY_g, then col2im.
fn conv_data_grad(win: &Window, group: usize, dy: &TensorView, w: &TensorView, dx: &mut TensorViewMut) -> KResult {
    if dy.dtype != DType::F32 || dx.shape.len() > 4 {
        return conv_data_grad_nd(win, group, dy, w, dx);
    }
    let g = geo(win, dx.shape, dy.shape)?;
    let m = dy.shape[1];
    let (cg, mg) = (g.c / group, m / group);
    let (kdim, plane) = (cg * g.kh * g.kw, g.oh * g.ow);
    let (dys, ws) = (dy.as_slice::<f32>(), w.as_slice::<f32>());
    let image = g.c * g.h * g.w;
    each_image(dx.as_mut_slice::<f32>(), image, parallelism(kdim, plane, mg), |i, dxi, par| {
        dxi.fill(0.0);
        let dyi = &dys[i * m * plane..(i + 1) * m * plane];
        let mut dcol = vec![0f32; kdim * plane];
        for gr in 0..group {
            // dcol[kdim × plane] = W_gᵀ[kdim × mg] · dY_g[mg × plane]
            unsafe {
                sgemm(
                    kdim,
                    plane,
                    mg,
                    dcol.as_mut_ptr(),
                    plane as isize,
                    ws.as_ptr(),
                    Mat { offset: gr * mg * kdim, rs: 1, cs: kdim as isize },
                    dyi.as_ptr(),
                    Mat { offset: gr * mg * plane, rs: plane as isize, cs: 1 },
                    false,
                    1.0,
                    par,
                )
            };
            if is_pointwise(&g) {
                dxi[gr * cg * plane..(gr + 1) * cg * plane].copy_from_slice(&dcol);
            } else {
                col2im(&g, &dcol, gr * cg, cg, dxi);
            }
        }
    });
    Ok(())
}

/// dW of a convolution from dY and X: per image and group dW_g += dY_g · colᵀ, each image's
/// part summed after.
fn conv_weight_grad(win: &Window, group: usize, dy: &TensorView, x: &TensorView, dw: &mut TensorViewMut) -> KResult {
    if dy.dtype != DType::F32 || x.shape.len() > 4 {
        return conv_weight_grad_nd(win, group, dy, x, dw);
    }
    let g = geo(win, x.shape, dy.shape)?;
    let (n, m) = (x.shape[0], dy.shape[1]);
    let (cg, mg) = (g.c / group, m / group);
    let (kdim, plane) = (cg * g.kh * g.kw, g.oh * g.ow);
    let (dys, xs) = (dy.as_slice::<f32>(), x.as_slice::<f32>());
    let image = g.c * g.h * g.w;
    let partial_dw: Vec<Vec<f32>> = (0..n)
        .into_par_iter()
        .map(|i| {
            let xi = &xs[i * image..(i + 1) * image];
            let dyi = &dys[i * m * plane..(i + 1) * m * plane];
            let mut dwp = vec![0f32; m * kdim];
            let mut col = vec![0f32; kdim * plane];
            for gr in 0..group {
                if is_pointwise(&g) {
                    col.copy_from_slice(&xi[gr * cg * plane..(gr + 1) * cg * plane]);
                } else {
                    im2col(&g, xi, gr * cg, cg, &mut col);
                }
                // dW_g[mg × kdim] = dY_g[mg × plane] · colᵀ[plane × kdim]
                unsafe {
                    sgemm(
                        mg,
                        kdim,
                        plane,
                        dwp[gr * mg * kdim..].as_mut_ptr(),
                        kdim as isize,
                        dyi.as_ptr(),
                        Mat { offset: gr * mg * plane, rs: plane as isize, cs: 1 },
                        col.as_ptr(),
                        Mat { offset: 0, rs: 1, cs: plane as isize },
                        false,
                        1.0,
                        Parallelism::None,
                    )
                };
            }
            dwp
        })
        .collect();
    let dws = dw.as_mut_slice::<f32>();
    dws.fill(0.0);
    for p in partial_dw {
        dws.iter_mut().zip(p).for_each(|(a, b)| *a += b);
    }
    Ok(())
}

/// dX of a convolution over any number of spatial dims, in f64 with plain loops: each dY
/// element added to the inputs its window read, times the taps' weights.
fn conv_data_grad_nd(win: &Window, group: usize, dy: &TensorView, w: &TensorView, dx: &mut TensorViewMut) -> KResult {
    let (n, c, m) = (dx.shape[0], dx.shape[1], dy.shape[1]);
    let (cg, mg) = (c / group, m / group);
    let (size_in, size_out, kernel) = (dx.shape[2..].to_vec(), &dy.shape[2..], &w.shape[2..]);
    let (plane_in, plane_out): (usize, usize) = (size_in.iter().product(), size_out.iter().product());
    let kernel_taps: usize = kernel.iter().product();
    let (dys, ws) = (dy.to_f64_vec(), w.to_f64_vec());
    let mut out = vec![0f64; n * c * plane_in];
    let (mut at, mut taps) = (vec![0usize; size_out.len()], Vec::new());
    for o in 0..plane_out {
        unflatten(o, size_out, &mut at);
        window_taps(win, kernel, &at, &size_in, &mut taps);
        for i in 0..n {
            for oc in 0..m {
                let (gr, g) = (oc / mg, dys[(i * m + oc) * plane_out + o]);
                for ic in 0..cg {
                    let xc = (i * c + gr * cg + ic) * plane_in;
                    let wc = &ws[(oc * cg + ic) * kernel_taps..];
                    for &(t, off) in &taps {
                        out[xc + off] += g * wc[t];
                    }
                }
            }
        }
    }
    super::write_f64(&out, dx);
    Ok(())
}

/// dW of a convolution over any number of spatial dims, in f64 with plain loops.
fn conv_weight_grad_nd(win: &Window, group: usize, dy: &TensorView, x: &TensorView, dw: &mut TensorViewMut) -> KResult {
    let (n, c, m) = (x.shape[0], x.shape[1], dy.shape[1]);
    let (cg, mg) = (c / group, m / group);
    let (size_in, size_out, kernel) = (&x.shape[2..], &dy.shape[2..], dw.shape[2..].to_vec());
    let (plane_in, plane_out): (usize, usize) = (size_in.iter().product(), size_out.iter().product());
    let kernel_taps: usize = kernel.iter().product();
    let (dys, xs) = (dy.to_f64_vec(), x.to_f64_vec());
    let mut out = vec![0f64; m * cg * kernel_taps];
    let (mut at, mut taps) = (vec![0usize; size_out.len()], Vec::new());
    for o in 0..plane_out {
        unflatten(o, size_out, &mut at);
        window_taps(win, &kernel, &at, size_in, &mut taps);
        for i in 0..n {
            for oc in 0..m {
                let (gr, g) = (oc / mg, dys[(i * m + oc) * plane_out + o]);
                for ic in 0..cg {
                    let xc = &xs[(i * c + gr * cg + ic) * plane_in..];
                    let wc = (oc * cg + ic) * kernel_taps;
                    for &(t, off) in &taps {
                        out[wc + t] += g * xc[off];
                    }
                }
            }
        }
    }
    super::write_f64(&out, dw);
    Ok(())
}

/// dB[k] = Σ over images and positions of dY[·, k, ·].
fn channel_sums(dy: &TensorView, db: &mut TensorViewMut) {
    let (n, m) = (dy.shape[0], dy.shape[1]);
    let plane: usize = dy.shape[2..].iter().product();
    if dy.dtype == DType::F32 && db.dtype == DType::F32 {
        let dys = dy.as_slice::<f32>();
        for (k, o) in db.as_mut_slice::<f32>().iter_mut().enumerate() {
            *o = (0..n).map(|i| dys[(i * m + k) * plane..(i * m + k + 1) * plane].iter().sum::<f32>()).sum();
        }
        return;
    }
    let dys = dy.to_f64_vec();
    let sums: Vec<f64> = (0..m)
        .map(|k| (0..n).map(|i| dys[(i * m + k) * plane..(i * m + k + 1) * plane].iter().sum::<f64>()).sum())
        .collect();
    super::write_f64(&sums, db);
}

/// y[·, k, ·] += b[k].
fn add_channel_bias(b: &TensorView, y: &mut TensorViewMut) {
    let (m, plane) = (y.shape[1], y.shape[2..].iter().product::<usize>().max(1));
    if y.dtype == DType::F32 && b.dtype == DType::F32 {
        let bs = b.as_slice::<f32>();
        for (row, ys) in y.as_mut_slice::<f32>().chunks_mut(plane).enumerate() {
            ys.iter_mut().for_each(|v| *v += bs[row % m]);
        }
        return;
    }
    let (bs, mut ys) = (b.to_f64_vec(), y.as_view().to_f64_vec());
    ys.iter_mut().enumerate().for_each(|(k, v)| *v += bs[k / plane % m]);
    super::write_f64(&ys, y);
}

/// The positions (input index) each output reads, per window: the shared loop of pooling.
fn pool_windows(g: &Geo, mut f: impl FnMut(usize, &mut dyn Iterator<Item = Option<usize>>)) {
    for oy in 0..g.oh {
        for ox in 0..g.ow {
            let mut it = (0..g.kh)
                .flat_map(move |ky| (0..g.kw).map(move |kx| (ky, kx)))
                .map(|(ky, kx)| g.tap(oy, ox, ky, kx).map(|(iy, ix)| iy * g.w + ix));
            f(oy * g.ow + ox, &mut it);
        }
    }
}

/// How many taps of one window, along one dim, average pooling with count_include_pad divides
/// by: those inside the padded input `[-pad_begin, size + pad_end)`, not those hanging off its
/// end because of ceil_mode (as PyTorch and ONNX Runtime count).
fn padded_taps(o: usize, stride: usize, kernel: usize, dilation: usize, pads: (usize, usize), size: usize) -> usize {
    let start = (o * stride) as isize - pads.0 as isize;
    let end = (start + ((kernel - 1) * dilation + 1) as isize).min((size + pads.1) as isize);
    ((end - start).max(0) as usize).div_ceil(dilation)
}

/// How many taps an average counts: the ones inside the input, or with count_include_pad
/// those inside the padded input ([`padded_taps`]).
fn average_count(g: &Geo, oy: usize, ox: usize, include_pad: bool) -> usize {
    if !include_pad {
        return (0..g.kh)
            .flat_map(|ky| (0..g.kw).map(move |kx| (ky, kx)))
            .filter(|&(ky, kx)| g.tap(oy, ox, ky, kx).is_some())
            .count();
    }
    padded_taps(oy, g.sh, g.kh, g.dh, (g.ph, g.ph_end), g.h) * padded_taps(ox, g.sw, g.kw, g.dw, (g.pw, g.pw_end), g.w)
}

/// MaxPool and AveragePool. Outputs: Y, and for MaxPool optionally Indices (int64, the flat
/// row-major index of each maximum in X, as ONNX's storage_order 0 numbers them).
pub fn pool(kind: PoolKind, win: &Window, x: &TensorView, outs: &mut [TensorViewMut]) -> KResult {
    if x.dtype != DType::F32 || x.shape.len() > 4 || outs.len() > 1 {
        return pool_nd(kind, win, x, outs);
    }
    let y = &mut outs[0];
    let g = geo(win, x.shape, y.shape)?;
    let xs = x.as_slice::<f32>();
    let plane_in = g.h * g.w;
    let plane_out = g.oh * g.ow;
    y.as_mut_slice::<f32>().par_chunks_mut(plane_out).enumerate().for_each(|(p, yp)| {
        let xp = &xs[p * plane_in..(p + 1) * plane_in];
        pool_windows(&g, |o, taps| {
            yp[o] = match kind {
                PoolKind::Max => taps.flatten().map(|i| xp[i]).fold(f32::NEG_INFINITY, f32::max),
                PoolKind::Average { count_include_pad } => {
                    let s: f32 = taps.flatten().map(|i| xp[i]).sum();
                    s / average_count(&g, o / g.ow, o % g.ow, count_include_pad).max(1) as f32
                }
            };
        });
    });
    Ok(())
}

/// Pooling over any number of spatial dims and any element type (computed in f64), with the
/// Indices output: the general path behind [`pool`]'s f32 1-D/2-D one.
fn pool_nd(kind: PoolKind, win: &Window, x: &TensorView, outs: &mut [TensorViewMut]) -> KResult {
    let nd = x.shape.len() - 2;
    let (y, rest) = outs.split_first_mut().ok_or_else(|| BackendError::refused("pooling needs an output"))?;
    let (size_in, size_out) = (&x.shape[2..], y.shape[2..].to_vec());
    let (plane_in, plane_out): (usize, usize) = (size_in.iter().product(), size_out.iter().product());
    let planes = x.shape[0] * x.shape[1];
    let xs = x.to_f64_vec();
    let mut vals = vec![0f64; planes * plane_out];
    let mut argmax = vec![0i64; planes * plane_out];
    let (mut at, mut taps) = (vec![0usize; nd], Vec::new());
    for o in 0..plane_out {
        unflatten(o, &size_out, &mut at);
        window_taps(win, &win.kernel, &at, size_in, &mut taps);
        let count = match kind {
            PoolKind::Average { count_include_pad: true } => (0..nd)
                .map(|d| {
                    let pads = (win.pads[d], win.pads[d + nd]);
                    padded_taps(at[d], win.strides[d], win.kernel[d], win.dilations[d], pads, size_in[d])
                })
                .product(),
            _ => taps.len(),
        };
        for p in 0..planes {
            let xp = &xs[p * plane_in..(p + 1) * plane_in];
            let out = p * plane_out + o;
            match kind {
                PoolKind::Max => {
                    // The first maximum wins, as ONNX's reference picks it.
                    let (mut best, mut best_at) = (f64::NEG_INFINITY, None);
                    for &(_, i) in &taps {
                        if best_at.is_none() || xp[i] > best {
                            (best, best_at) = (xp[i], Some(i));
                        }
                    }
                    vals[out] = best;
                    argmax[out] = (p * plane_in + best_at.unwrap_or(0)) as i64;
                }
                PoolKind::Average { .. } => {
                    vals[out] = taps.iter().map(|&(_, i)| xp[i]).sum::<f64>() / count.max(1) as f64;
                }
            }
        }
    }
    super::write_f64(&vals, y);
    if let Some(indices) = rest.first_mut() {
        indices.as_mut_slice::<i64>().copy_from_slice(&argmax);
    }
    Ok(())
}

/// dY, X → dX: max pooling routes each gradient to its window's (first) maximum; average
/// pooling spreads it over the window.
pub fn pool_grad(kind: PoolKind, win: &Window, dy: &TensorView, x: &TensorView, dx: &mut TensorViewMut) -> KResult {
    let g = geo(win, x.shape, dy.shape)?;
    let (xs, dys) = (x.as_slice::<f32>(), dy.as_slice::<f32>());
    let plane_in = g.h * g.w;
    let plane_out = g.oh * g.ow;
    dx.as_mut_slice::<f32>().par_chunks_mut(plane_in).enumerate().for_each(|(p, dxp)| {
        dxp.fill(0.0);
        let xp = &xs[p * plane_in..(p + 1) * plane_in];
        let dyp = &dys[p * plane_out..(p + 1) * plane_out];
        pool_windows(&g, |o, taps| match kind {
            PoolKind::Max => {
                let mut best: Option<usize> = None;
                for i in taps.flatten() {
                    if best.is_none_or(|b| xp[i] > xp[b]) {
                        best = Some(i);
                    }
                }
                if let Some(b) = best {
                    dxp[b] += dyp[o];
                }
            }
            PoolKind::Average { count_include_pad } => {
                let share = dyp[o] / average_count(&g, o / g.ow, o % g.ow, count_include_pad).max(1) as f32;
                for i in taps.flatten() {
                    dxp[i] += share;
                }
            }
        });
    });
    Ok(())
}

pub fn global_average_pool(x: &TensorView, y: &mut TensorViewMut) -> KResult {
    let plane: usize = x.shape[2..].iter().product();
    match x.dtype {
        DType::F32 => {
            let xs = x.as_slice::<f32>();
            for (o, v) in y.as_mut_slice::<f32>().iter_mut().enumerate() {
                *v = xs[o * plane..(o + 1) * plane].iter().sum::<f32>() / plane as f32;
            }
        }
        DType::F64 => {
            let xs = x.as_slice::<f64>();
            for (o, v) in y.as_mut_slice::<f64>().iter_mut().enumerate() {
                *v = xs[o * plane..(o + 1) * plane].iter().sum::<f64>() / plane as f64;
            }
        }
        d => return refused!("GlobalAveragePool is not implemented for {d}"),
    }
    Ok(())
}

/// Per-channel mean and biased variance over N and the spatial dims.
fn channel_stats(x: &[f32], n: usize, c: usize, plane: usize) -> (Vec<f32>, Vec<f32>) {
    let count = (n * plane) as f64;
    let mut mean = vec![0f32; c];
    let mut var = vec![0f32; c];
    for ch in 0..c {
        let vals = (0..n).flat_map(|i| x[(i * c + ch) * plane..(i * c + ch + 1) * plane].iter());
        let m: f64 = vals.clone().map(|&v| v as f64).sum::<f64>() / count;
        let v: f64 = vals.map(|&v| (v as f64 - m).powi(2)).sum::<f64>() / count;
        mean[ch] = m as f32;
        var[ch] = v as f32;
    }
    (mean, var)
}

/// Inference: normalizes with the running statistics. Training: with the batch's, and writes
/// the updated running statistics to outputs 1 and 2 (ONNX's momentum convention).
#[allow(clippy::too_many_arguments)]
pub fn batch_norm(
    eps: f32,
    momentum: f32,
    training: bool,
    x: &TensorView,
    scale: &TensorView,
    bias: &TensorView,
    running_mean: &TensorView,
    running_var: &TensorView,
    outs: &mut [TensorViewMut],
) -> KResult {
    if x.dtype != DType::F32 {
        return batch_norm_reference(eps, momentum, training, [x, scale, bias, running_mean, running_var], outs);
    }
    let (n, c) = (x.shape[0], x.shape[1]);
    let plane: usize = x.shape[2..].iter().product();
    let xs = x.as_slice::<f32>();
    let (s, b) = (scale.as_slice::<f32>(), bias.as_slice::<f32>());
    let (rm, rv) = (running_mean.as_slice::<f32>(), running_var.as_slice::<f32>());
    let (mean, var) = if training { channel_stats(xs, n, c, plane) } else { (rm.to_vec(), rv.to_vec()) };
    let y = outs[0].as_mut_slice::<f32>();
    for i in 0..n {
        for ch in 0..c {
            let inv = 1.0 / (var[ch] + eps).sqrt();
            let at = (i * c + ch) * plane;
            for k in 0..plane {
                y[at + k] = (xs[at + k] - mean[ch]) * inv * s[ch] + b[ch];
            }
        }
    }
    if training && outs.len() >= 3 {
        let new_mean: Vec<f32> = (0..c).map(|ch| rm[ch] * momentum + mean[ch] * (1.0 - momentum)).collect();
        let new_var: Vec<f32> = (0..c).map(|ch| rv[ch] * momentum + var[ch] * (1.0 - momentum)).collect();
        outs[1].as_mut_slice::<f32>().copy_from_slice(&new_mean);
        outs[2].as_mut_slice::<f32>().copy_from_slice(&new_var);
    }
    Ok(())
}

/// BatchNormalization of the element types off the f32 path, computed in f64.
fn batch_norm_reference(
    eps: f32,
    momentum: f32,
    training: bool,
    inputs: [&TensorView; 5],
    outs: &mut [TensorViewMut],
) -> KResult {
    let x = inputs[0];
    let (n, c) = (x.shape[0], x.shape[1]);
    let plane: usize = x.shape[2..].iter().product();
    let [xs, s, b, rm, rv] = inputs.map(|t| t.to_f64_vec());
    let (mut mean, mut var) = (rm.clone(), rv.clone());
    if training {
        let count = (n * plane) as f64;
        for ch in 0..c {
            let vals = || (0..n).flat_map(|i| xs[(i * c + ch) * plane..(i * c + ch + 1) * plane].iter());
            mean[ch] = vals().sum::<f64>() / count;
            var[ch] = vals().map(|v| (v - mean[ch]).powi(2)).sum::<f64>() / count;
        }
    }
    let mut y = vec![0f64; xs.len()];
    for (k, v) in y.iter_mut().enumerate() {
        let ch = k / plane % c;
        *v = (xs[k] - mean[ch]) / (var[ch] + eps as f64).sqrt() * s[ch] + b[ch];
    }
    super::write_f64(&y, &mut outs[0]);
    if training && outs.len() >= 3 {
        let m = momentum as f64;
        let running =
            |old: &[f64], new: &[f64]| -> Vec<f64> { (0..c).map(|k| old[k] * m + new[k] * (1.0 - m)).collect() };
        super::write_f64(&running(&rm, &mean), &mut outs[1]);
        super::write_f64(&running(&rv, &var), &mut outs[2]);
    }
    Ok(())
}

/// Training-mode backward: dY, X, scale → dX, dScale, dBias, with the batch statistics
/// recomputed from X. dX = s·σ⁻¹ (dY − mean(dY) − x̂ mean(dY·x̂)).
pub fn batch_norm_grad(
    eps: f32,
    dy: &TensorView,
    x: &TensorView,
    scale: &TensorView,
    outs: &mut [TensorViewMut],
) -> KResult {
    let (n, c) = (x.shape[0], x.shape[1]);
    let plane: usize = x.shape[2..].iter().product();
    let (dys, xs, s) = (dy.as_slice::<f32>(), x.as_slice::<f32>(), scale.as_slice::<f32>());
    let (mean, var) = channel_stats(xs, n, c, plane);
    let count = (n * plane) as f32;
    let mut dscale = vec![0f32; c];
    let mut dbias = vec![0f32; c];
    // Summed in f64 like the statistics: an f32 running sum of a large channel (ResNet's
    // 100,000s of values) keeps only about 1e-5 of it. An empty batch's sums stay 0 (its σ⁻¹
    // is NaN, which would make 0·σ⁻¹ NaN).
    let summed = if n * plane > 0 { c } else { 0 };
    for ch in 0..summed {
        let inv = 1.0 / (var[ch] + eps).sqrt();
        let (mut db, mut ds) = (0f64, 0f64);
        for i in 0..n {
            let at = (i * c + ch) * plane;
            for k in 0..plane {
                let g = dys[at + k] as f64;
                db += g;
                ds += g * (xs[at + k] as f64 - mean[ch] as f64);
            }
        }
        (dbias[ch], dscale[ch]) = (db as f32, (ds * inv as f64) as f32);
    }
    let dx = outs[0].as_mut_slice::<f32>();
    for ch in 0..c {
        let inv = 1.0 / (var[ch] + eps).sqrt();
        for i in 0..n {
            let at = (i * c + ch) * plane;
            for k in 0..plane {
                let xh = (xs[at + k] - mean[ch]) * inv;
                dx[at + k] = s[ch] * inv * (dys[at + k] - dbias[ch] / count - xh * dscale[ch] / count);
            }
        }
    }
    outs[1].as_mut_slice::<f32>().copy_from_slice(&dscale);
    outs[2].as_mut_slice::<f32>().copy_from_slice(&dbias);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;

    fn random(shape: &[usize], seed: u64) -> Tensor {
        let n = shape.iter().product::<usize>();
        Tensor::from_vec(shape, (0..n).map(|i| crate::rng::uniform(seed, i as u64) as f32 * 2.0 - 1.0).collect())
    }

    fn assert_close(a: &Tensor, b: &Tensor, what: &str) {
        for (i, (x, y)) in a.to_f64_vec().iter().zip(b.to_f64_vec()).enumerate() {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{what}: element {i}: {x} vs {y}");
        }
    }

    /// The general N-D paths agree with the f32 2-D ones on asymmetric pads, strides,
    /// dilations and ceil_mode.
    #[test]
    fn nd_paths_match_the_2d_ones() {
        let x = random(&[2, 4, 9, 8], 1);
        let win = Window::explicit(&[3, 2], &[2, 3], &[1, 2], &[1, 0, 2, 1], true);
        let out = crate::graph::infer::window_output(&win, &[9, 8]).unwrap();
        let shape = [2, 4, out[0], out[1]];
        for kind in [
            PoolKind::Max,
            PoolKind::Average { count_include_pad: false },
            PoolKind::Average { count_include_pad: true },
        ] {
            let (mut fast, mut general) = (Tensor::zeros(DType::F32, &shape), Tensor::zeros(DType::F32, &shape));
            pool(kind, &win, &x.view(), &mut [fast.view_mut()]).unwrap();
            pool_nd(kind, &win, &x.view(), &mut [general.view_mut()]).unwrap();
            assert_close(&general, &fast, &format!("{kind:?}"));
        }
        let (w, b) = (random(&[6, 2, 3, 2], 2), random(&[6], 3));
        let win = Window::explicit(&[3, 2], &[2, 1], &[2, 1], &[2, 1, 1, 0], false);
        let out = crate::graph::infer::window_output(&win, &[9, 8]).unwrap();
        let shape = [2, 6, out[0], out[1]];
        let (mut fast, mut general) = (Tensor::zeros(DType::F32, &shape), Tensor::zeros(DType::F32, &shape));
        conv(&win, 2, &x.view(), &w.view(), Some(b.view()), &mut fast.view_mut()).unwrap();
        conv_nd(&win, 2, &x.view(), &w.view(), Some(b.view()), &mut general.view_mut()).unwrap();
        assert_close(&general, &fast, "Conv");
    }

    #[test]
    fn max_pool_indices_are_flat_offsets_into_x() {
        // Two planes of 2×3; a 2×2 window with stride 1 gives two outputs per plane.
        let x = Tensor::from_vec(&[1, 2, 2, 3], vec![1.0f32, 5.0, 2.0, 4.0, 3.0, 6.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0]);
        let win = Window::explicit(&[2, 2], &[1, 1], &[1, 1], &[0, 0, 0, 0], false);
        let (mut y, mut idx) = (Tensor::zeros(DType::F32, &[1, 2, 1, 2]), Tensor::zeros(DType::I64, &[1, 2, 1, 2]));
        pool(PoolKind::Max, &win, &x.view(), &mut [y.view_mut(), idx.view_mut()]).unwrap();
        assert_eq!(y.as_slice::<f32>(), &[5.0, 6.0, 0.0, 9.0]);
        // The first maximum wins: plane 1's first window is all zeros.
        assert_eq!(idx.as_slice::<i64>(), &[1, 5, 6, 8]);
    }
}
