//! Convolution and pooling on the CUDA backend (kernels/window.cu): convolution as im2col and
//! cuBLASLt products per group, strided-batched over the images where a plane fills a product's
//! columns and with the images folded into the columns where it does not; its data gradient
//! as the transposed products and col2im, chosen the same way, its weight gradient as one
//! product per chunk of images over all of their positions; transposed convolution as that
//! data gradient, and its own gradient as a convolution and the weight gradient with X and dY
//! exchanged; pooling one thread per output (and per input element for the gradient, gathered
//! so that no atomics make the sums' order vary; for max pooling, each window's first maximum
//! is found once first).
//! Convolutions over 1-D and 2-D windows in f32, f16 or bf16 (mixed precision's convolutions:
//! half products with f32 accumulation), transposed ones also over 3 (forward only, a direct
//! kernel); pooling over up to 3 spatial dims in any element type (its gradient 1-D and 2-D);
//! with the CPU backend's geometry (`crate::kernels::conv`), whose results these are checked
//! against.

use super::{
    at, at_f32, cast, elementwise, numeric, one_float_type, per_row, reduce_strided, scratch_parts, strided_move,
    through_f64, typed, Dev, Epilogue, Product, Ptr, Strided, NULL, V,
};
use crate::backend::BackendError;
use crate::kernels::conv::{self as cpu, is_pointwise};
use crate::op::{PoolKind, Reduce, Window};
use crate::refused;
use crate::tensor::DType;

/// `Geo` of kernels/window.cu, by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Geo {
    c: i64,
    h: i64,
    w: i64,
    oh: i64,
    ow: i64,
    kh: i64,
    kw: i64,
    sh: i64,
    sw: i64,
    dh: i64,
    dw: i64,
    ph: i64,
    pw: i64,
    ph_end: i64,
    pw_end: i64,
}

impl From<&cpu::Geo> for Geo {
    fn from(g: &cpu::Geo) -> Geo {
        let i = |v: usize| v as i64;
        Geo {
            c: i(g.c),
            h: i(g.h),
            w: i(g.w),
            oh: i(g.oh),
            ow: i(g.ow),
            kh: i(g.kh),
            kw: i(g.kw),
            sh: i(g.sh),
            sw: i(g.sw),
            dh: i(g.dh),
            dw: i(g.dw),
            ph: i(g.ph),
            pw: i(g.pw),
            ph_end: i(g.ph_end),
            pw_end: i(g.pw_end),
        }
    }
}

/// A convolution's element type and sizes: images, output channels, channels and output
/// channels per group, one group's im2col rows (cg·kh·kw), and the output plane.
struct Shape {
    t: DType,
    images: usize,
    m: usize,
    cg: usize,
    mg: usize,
    kdim: usize,
    plane: usize,
}

fn shape(t: DType, g: &cpu::Geo, group: usize, images: usize, m: usize) -> Result<Shape, BackendError> {
    if group == 0 || !g.c.is_multiple_of(group) || !m.is_multiple_of(group) {
        return refused!("Conv: group {group} does not divide {} input and {m} output channels", g.c);
    }
    let (cg, mg) = (g.c / group, m / group);
    Ok(Shape { t, images, m, cg, mg, kdim: cg * g.kh * g.kw, plane: g.oh * g.ow })
}

/// How many images a convolution takes per chunk: as many as fit the target's scratch budget
/// at `bytes_per_image` of temporaries each, at least one. Chunks bound the im2col columns
/// (about 0.9 GB for 64 images of a 3×3 layer at 56×56 at once), which live outside the plan's
/// memory accounting.
fn images_per_chunk(dev: Dev, images: usize, bytes_per_image: usize) -> usize {
    (dev.scratch_budget() / bytes_per_image.max(1)).clamp(1, images.max(1))
}

/// Planes of fewer positions than this run the forward and data-gradient products with the
/// images folded into their columns (n = images · plane, one product per group and chunk):
/// one per image would have n = plane, and at ResNet's 14 × 14 and 7 × 7 stages (196 and 49
/// positions) a product's tiles of 128 or 256 columns would be a fifth to four fifths empty.
/// Folding costs moves: forward, Y's rows into Y (and for a pointwise window X's channels
/// gathered); backward, dY's rows gathered (and for a pointwise window dX's rows moved into
/// dX). Larger planes, whose own products fill their tiles, need not pay them.
const FOLD_BELOW: usize = 512;

/// Whether the products fold a chunk's images into their columns: small planes, where a chunk
/// holds more than one image at `bytes_per_image` of the folded layout's temporaries (one
/// image a chunk would pay the moves for no wider product).
fn folds_images(dev: Dev, s: &Shape, bytes_per_image: usize) -> bool {
    s.plane < FOLD_BELOW && images_per_chunk(dev, s.images, bytes_per_image) > 1
}

/// D [m, n] = op(A) · op(B), one product of the convolution's element type with D of it too;
/// callers change what differs by struct update.
fn product(s: &Shape, [m, n, k]: [usize; 3], (a, trans_a): (Ptr, bool), (b, trans_b): (Ptr, bool), d: Ptr) -> Product {
    Product {
        m: m as u64,
        n: n as u64,
        k: k as u64,
        batch: 1,
        trans_a,
        trans_b,
        a: a.0,
        a_stride: 0,
        b: b.0,
        b_stride: 0,
        d: d.0,
        d_stride: 0,
        alpha: 1.0,
        beta: 0.0,
        dtype: s.t,
        d_dtype: s.t,
        bias: 0,
        epilogue: Epilogue::Plain,
    }
}

/// Moves `channels` channels of `images` images between an NCHW tensor of `total` channels per
/// image (`nchw`: the first image's first moved channel) and rows laid out [channels, images,
/// plane] (`rows`): read from the tensor with `Strided::Source`, written into it with
/// `Strided::Destination`. The folded products' operands and results are such rows.
fn channel_rows(
    dev: Dev,
    side: Strided,
    s: &Shape,
    (channels, total, plane): (usize, usize, usize),
    images: usize,
    nchw: Ptr,
    rows: Ptr,
) -> Result<(), BackendError> {
    let (shape, strides) = ([channels, images, plane], [plane as i64, (total * plane) as i64, 1]);
    let (from, to) = match side {
        Strided::Source => (nchw, rows),
        Strided::Destination => (rows, nchw),
    };
    strided_move(dev, side, &shape, &strides, s.t.size(), from, to)
}

/// Y = W ⊛ X (+ bias), per group and chunk of images: with the images folded into the
/// product's columns where the plane is small ([`FOLD_BELOW`]), else one product per image,
/// batched over the chunk's images with W_g shared.
pub fn conv(dev: Dev, win: &Window, group: usize, x: V, w: V, bias: Option<V>, y: V) -> Result<(), BackendError> {
    let mut operands = vec![(&x, "X"), (&w, "W"), (&y, "Y")];
    if let Some(b) = &bias {
        operands.push((b, "B"));
    }
    let t = one_float_type(&operands)?;
    let g = cpu::geo(win, x.shape(), y.shape())?;
    let s = shape(t, &g, group, x.shape()[0], y.shape()[1])?;
    if folds_images(dev, &s, folded_conv_bytes(&s)) {
        conv_folded(dev, &g, &s, group, x.at, w.at, y.at)?;
    } else {
        conv_per_image(dev, &g, &s, group, x.at, w.at, y.at)?;
    }
    if let Some(bias) = bias {
        let n = y.n();
        dev.kernel(
            &typed("channel_bias", t)?,
            elementwise(n),
            &mut params![n as i64, s.m as i64, s.plane as i64, bias.at, y.at],
        )?;
    }
    Ok(())
}

/// Y_g[img] = W_g · col_g[img], batched over a chunk's images; a pointwise (1×1, stride 1,
/// unpadded) window reads X itself as col.
fn conv_per_image(dev: Dev, g: &cpu::Geo, s: &Shape, group: usize, x: Ptr, w: Ptr, y: Ptr) -> Result<(), BackendError> {
    let t = s.t;
    // A pointwise window's columns are X itself: no scratch.
    let col_bytes = if is_pointwise(g) { 0 } else { s.kdim * s.plane * t.size() };
    let chunk = images_per_chunk(dev, s.images, col_bytes);
    let col = if col_bytes == 0 { NULL } else { dev.scratch(chunk * col_bytes)? };
    for first in (0..s.images).step_by(chunk) {
        let images = chunk.min(s.images - first);
        for gr in 0..group {
            let (b, b_stride) = group_columns(dev, g, s, gr, (first, images), x, col, Columns::ByImage)?;
            let d = at(y, (first * s.m + gr * s.mg) * s.plane, t);
            dev.gemm(&Product {
                batch: images as u64,
                b_stride: b_stride as i64,
                d_stride: (s.m * s.plane) as i64,
                ..product(s, [s.mg, s.plane, s.kdim], (at(w, gr * s.mg * s.kdim, t), false), (b, false), d)
            })?;
        }
    }
    Ok(())
}

/// An image's temporaries of [`conv_folded`]: its columns and a group's rows of Y.
fn folded_conv_bytes(s: &Shape) -> usize {
    (s.kdim + s.mg) * s.plane * s.t.size()
}

/// Y_g's rows [mg, images · plane] = W_g · col_g [kdim, images · plane], one product per group
/// and chunk, moved into Y's [images, m, plane] after it.
fn conv_folded(dev: Dev, g: &cpu::Geo, s: &Shape, group: usize, x: Ptr, w: Ptr, y: Ptr) -> Result<(), BackendError> {
    let (t, esize) = (s.t, s.t.size());
    let chunk = images_per_chunk(dev, s.images, folded_conv_bytes(s));
    let bytes = [chunk * s.kdim * s.plane * esize, chunk * s.mg * s.plane * esize];
    let [col, y_rows] = scratch_parts(dev, &bytes)?[..] else { unreachable!("two parts") };
    for first in (0..s.images).step_by(chunk) {
        let images = chunk.min(s.images - first);
        for gr in 0..group {
            group_columns(dev, g, s, gr, (first, images), x, col, Columns::ByRow)?;
            let w_g = at(w, gr * s.mg * s.kdim, t);
            dev.gemm(&product(s, [s.mg, images * s.plane, s.kdim], (w_g, false), (col, false), y_rows))?;
            let y_g = at(y, (first * s.m + gr * s.mg) * s.plane, t);
            channel_rows(dev, Strided::Destination, s, (s.mg, s.m, s.plane), images, y_g, y_rows)?;
        }
    }
    Ok(())
}

/// How a group's columns of a chunk of images lie: image by image ([images, kdim, plane], the
/// per-image products' operand; a pointwise window's are X's own channels, read in place), or
/// row by row ([kdim, images · plane], the folded products' and the weight gradient's; a
/// pointwise window's channels of X gathered into `col`).
#[derive(Clone, Copy, PartialEq)]
enum Columns {
    ByImage,
    ByRow,
}

/// Group `gr`'s columns of the images `first..first + images`, laid out as `layout` says, at
/// `col` (or in X). Returns where they start and the stride from one image's to the next.
#[allow(clippy::too_many_arguments)]
fn group_columns(
    dev: Dev,
    g: &cpu::Geo,
    s: &Shape,
    gr: usize,
    (first, images): (usize, usize),
    x: Ptr,
    col: Ptr,
    layout: Columns,
) -> Result<(Ptr, usize), BackendError> {
    let x = at(x, first * g.c * g.h * g.w, s.t);
    let channels = at(x, gr * s.cg * s.plane, s.t);
    let (img_stride, row_stride) = match layout {
        Columns::ByImage => (s.kdim * s.plane, s.plane),
        Columns::ByRow => (s.plane, images * s.plane),
    };
    match (layout, is_pointwise(g)) {
        (Columns::ByImage, true) => return Ok((channels, g.c * s.plane)),
        (Columns::ByRow, true) => channel_rows(dev, Strided::Source, s, (s.cg, g.c, s.plane), images, channels, col)?,
        (_, false) => im2col(dev, g, s, gr, images, x, (col, img_stride, row_stride))?,
    }
    Ok((col, img_stride))
}

/// im2col of group `gr`'s channels of `images` images from `x` into `col`, an image's rows
/// `img_stride` elements apart and a row's `row_stride`.
fn im2col(
    dev: Dev,
    g: &cpu::Geo,
    s: &Shape,
    gr: usize,
    images: usize,
    x: Ptr,
    (col, img_stride, row_stride): (Ptr, usize, usize),
) -> Result<(), BackendError> {
    let (c0, cg) = ((gr * s.cg) as i64, s.cg as i64);
    dev.kernel(
        &typed("im2col", s.t)?,
        elementwise(images * s.kdim * s.plane),
        &mut params![images as i64, Geo::from(g), c0, cg, img_stride as i64, row_stride as i64, x, col],
    )
}

/// The adjoint of [`im2col`]: group `gr`'s channels of `images` images of `dx` gathered from
/// `dcol`, laid out as im2col lays out `col`.
fn col2im(
    dev: Dev,
    g: &cpu::Geo,
    s: &Shape,
    gr: usize,
    images: usize,
    (dcol, img_stride, row_stride): (Ptr, usize, usize),
    dx: Ptr,
) -> Result<(), BackendError> {
    let (c0, cg) = ((gr * s.cg) as i64, s.cg as i64);
    dev.kernel(
        &typed("col2im", s.t)?,
        elementwise(images * s.cg * g.h * g.w),
        &mut params![images as i64, Geo::from(g), c0, cg, img_stride as i64, row_stride as i64, dcol, dx],
    )
}

/// dY, X, W → dX, dW, dB: [`data_grad`], [`weight_grad`], and dB summing dY over images and
/// the plane.
pub fn conv_grad(dev: Dev, win: &Window, group: usize, dy: V, x: V, w: V, outs: [V; 3]) -> Result<(), BackendError> {
    let [dx, dw, db] = outs;
    let t = one_float_type(&[(&dy, "dY"), (&x, "X"), (&w, "W"), (&dx, "dX"), (&dw, "dW"), (&db, "dB")])?;
    let g = cpu::geo(win, x.shape(), dy.shape())?;
    let s = shape(t, &g, group, x.shape()[0], dy.shape()[1])?;
    data_grad(dev, &g, &s, group, dy.at, w.at, dx.at)?;
    weight_grad(dev, &g, &s, group, dy.at, x.at, dw)?;
    channel_sums(dev, dy, db)
}

/// ConvTranspose: Y = the data gradient of the convolution of `win` whose input is Y, taken
/// at X (X in dY's place), plus the bias per channel. Over 3 spatial dims, where the products'
/// im2col geometry does not reach, a direct kernel sums each output's taps.
pub fn conv_transpose(
    dev: Dev,
    win: &Window,
    group: usize,
    x: V,
    w: V,
    bias: Option<V>,
    y: V,
) -> Result<(), BackendError> {
    let mut operands = vec![(&x, "X"), (&w, "W"), (&y, "Y")];
    if let Some(b) = &bias {
        operands.push((b, "B"));
    }
    let t = one_float_type(&operands)?;
    let bias_at = bias.map_or(NULL, |b| b.at);
    if x.shape().len() == 5 {
        let (cg, mg) = (x.shape()[1] / group.max(1), w.shape()[1]);
        let geometry = Pool::of(win, y.shape(), x.shape())?;
        return dev.kernel(
            &typed("conv_transpose_direct", t)?,
            elementwise(y.n()),
            &mut params![x.shape()[0] as i64, group as i64, cg as i64, mg as i64, geometry, x.at, w.at, bias_at, y.at],
        );
    }
    let g = cpu::geo(win, y.shape(), x.shape())?;
    let s = shape(t, &g, group, x.shape()[0], x.shape()[1])?;
    data_grad(dev, &g, &s, group, x.at, w.at, y.at)?;
    if bias.is_some() {
        let n = y.n();
        let (channels, plane) = (g.c as i64, (g.h * g.w) as i64);
        dev.kernel(&typed("channel_bias", t)?, elementwise(n), &mut params![n as i64, channels, plane, bias_at, y.at])?;
    }
    Ok(())
}

/// dY, X, W → dX, dW, dB of ConvTranspose: dX = dY ⊛ W (the convolution), dW the convolution's
/// weight gradient with X as its output's gradient and dY as its input, dB dY's sums.
pub fn conv_transpose_grad(
    dev: Dev,
    win: &Window,
    group: usize,
    dy: V,
    x: V,
    w: V,
    outs: [V; 3],
) -> Result<(), BackendError> {
    let [dx, dw, db] = outs;
    let t = one_float_type(&[(&dy, "dY"), (&x, "X"), (&w, "W"), (&dx, "dX"), (&dw, "dW"), (&db, "dB")])?;
    conv(dev, win, group, dy, w, None, dx)?;
    let g = cpu::geo(win, dy.shape(), x.shape())?;
    let s = shape(t, &g, group, x.shape()[0], x.shape()[1])?;
    weight_grad(dev, &g, &s, group, x.at, dy.at, dw)?;
    channel_sums(dev, dy, db)
}

/// dB[k] = Σ over images and the plane of dY[img, k, ·].
fn channel_sums(dev: Dev, dy: V, db: V) -> Result<(), BackendError> {
    if dy.n() == 0 {
        return dev.fill(db.at, 0, db.meta.bytes());
    }
    let mut summed = vec![true; dy.shape().len()];
    summed[1] = false;
    reduce_strided(dev, Reduce::Sum, dy, &summed, db)
}

/// dX of the convolution `g` from dY and W, per group and chunk of images: with the images
/// folded into the product's columns where the plane is small ([`FOLD_BELOW`]), else one
/// product per image.
fn data_grad(dev: Dev, g: &cpu::Geo, s: &Shape, group: usize, dy: Ptr, w: Ptr, dx: Ptr) -> Result<(), BackendError> {
    if folds_images(dev, s, folded_data_grad_bytes(s)) {
        data_grad_folded(dev, g, s, group, dy, w, dx)
    } else {
        data_grad_per_image(dev, g, s, group, dy, w, dx)
    }
}

/// dcol[img] = W_gᵀ · dY_g[img] (batched over a chunk's images), dX_g = col2im(dcol); a
/// pointwise window's product writes dX's rows.
fn data_grad_per_image(
    dev: Dev,
    g: &cpu::Geo,
    s: &Shape,
    group: usize,
    dy: Ptr,
    w: Ptr,
    dx: Ptr,
) -> Result<(), BackendError> {
    let (t, pointwise, per_image) = (s.t, is_pointwise(g), s.kdim * s.plane);
    let col_bytes = if pointwise { 0 } else { per_image * t.size() };
    let chunk = images_per_chunk(dev, s.images, col_bytes);
    let dcol = if pointwise { NULL } else { dev.scratch(chunk * col_bytes)? };
    for gr in 0..group {
        for first in (0..s.images).step_by(chunk) {
            let images = chunk.min(s.images - first);
            let dy_g = at(dy, (first * s.m + gr * s.mg) * s.plane, t);
            let dx_first = at(dx, first * g.c * g.h * g.w, t);
            let (d, d_stride) =
                if pointwise { (at(dx_first, gr * s.cg * s.plane, t), g.c * s.plane) } else { (dcol, per_image) };
            dev.gemm(&Product {
                batch: images as u64,
                b_stride: (s.m * s.plane) as i64,
                d_stride: d_stride as i64,
                ..product(s, [s.kdim, s.plane, s.mg], (at(w, gr * s.mg * s.kdim, t), true), (dy_g, false), d)
            })?;
            if !pointwise {
                col2im(dev, g, s, gr, images, (dcol, per_image, s.plane), dx_first)?;
            }
        }
    }
    Ok(())
}

/// An image's temporaries of [`data_grad_folded`]: dY's rows and a group's dcol (or dX's rows).
fn folded_data_grad_bytes(s: &Shape) -> usize {
    (s.m + s.kdim) * s.plane * s.t.size()
}

/// Per chunk: dY's rows [m, images · plane], then per group dcol [kdim, images · plane] =
/// W_gᵀ · dY_g's rows, one product, and dX_g = col2im(dcol); a pointwise window's product
/// gives dX_g's rows, moved into dX.
fn data_grad_folded(
    dev: Dev,
    g: &cpu::Geo,
    s: &Shape,
    group: usize,
    dy: Ptr,
    w: Ptr,
    dx: Ptr,
) -> Result<(), BackendError> {
    let (t, esize) = (s.t, s.t.size());
    let chunk = images_per_chunk(dev, s.images, folded_data_grad_bytes(s));
    let bytes = [chunk * s.m * s.plane * esize, chunk * s.kdim * s.plane * esize];
    let [dy_rows, dcol] = scratch_parts(dev, &bytes)?[..] else { unreachable!("two parts") };
    for first in (0..s.images).step_by(chunk) {
        let images = chunk.min(s.images - first);
        let n = images * s.plane;
        let dy_first = at(dy, first * s.m * s.plane, t);
        channel_rows(dev, Strided::Source, s, (s.m, s.m, s.plane), images, dy_first, dy_rows)?;
        let dx_first = at(dx, first * g.c * g.h * g.w, t);
        for gr in 0..group {
            let (w_g, dy_g) = (at(w, gr * s.mg * s.kdim, t), at(dy_rows, gr * s.mg * n, t));
            dev.gemm(&product(s, [s.kdim, n, s.mg], (w_g, true), (dy_g, false), dcol))?;
            if is_pointwise(g) {
                let dx_g = at(dx_first, gr * s.cg * s.plane, t);
                channel_rows(dev, Strided::Destination, s, (s.cg, g.c, s.plane), images, dx_g, dcol)?;
            } else {
                col2im(dev, g, s, gr, images, (dcol, s.plane, n), dx_first)?;
            }
        }
    }
    Ok(())
}

/// dW of the convolution `g` from dY and X, per group: dW_g = Σ_img dY_g[img] · col_g[img]ᵀ.
/// Per chunk of images, one product over all of the chunk's images and positions (k = images ·
/// plane): dY's chunk laid out [M, images, plane] and the columns [kdim, images, plane] for it,
/// the products summed in f32 across the chunks and rounded once to dW's type. (A product per
/// image would write a dW-sized f32 slot for each: 9.4 MB an image of 49 positions at
/// ResNet-50's last stage, whose products then have k = 49.)
fn weight_grad(dev: Dev, g: &cpu::Geo, s: &Shape, group: usize, dy: Ptr, x: Ptr, dw: V) -> Result<(), BackendError> {
    let t = s.t;
    if s.images == 0 {
        // No images: dW sums nothing.
        return dev.fill(dw.at, 0, dw.meta.bytes());
    }
    let (dw_g_len, esize) = (s.mg * s.kdim, t.size());
    let chunk = images_per_chunk(dev, s.images, (s.kdim + s.m) * s.plane * esize);
    // One scratch: the chunk's columns (a group's at a time), dY's chunk, and dW's f32 sums
    // (dW itself when it is f32).
    let sums_bytes = if t == DType::F32 { 0 } else { group * dw_g_len * 4 };
    let bytes = [chunk * s.kdim * s.plane * esize, chunk * s.m * s.plane * esize, sums_bytes];
    let [col, dy_rows, summed] = scratch_parts(dev, &bytes)?[..] else { unreachable!("three parts") };
    let sums = if t == DType::F32 { dw.at } else { summed };
    for first in (0..s.images).step_by(chunk) {
        let images = chunk.min(s.images - first);
        let k = images * s.plane;
        let dy_first = at(dy, first * s.m * s.plane, t);
        channel_rows(dev, Strided::Source, s, (s.m, s.m, s.plane), images, dy_first, dy_rows)?;
        for gr in 0..group {
            group_columns(dev, g, s, gr, (first, images), x, col, Columns::ByRow)?;
            let dy_g = at(dy_rows, gr * s.mg * k, t);
            dev.gemm(&Product {
                beta: if first == 0 { 0.0 } else { 1.0 },
                d_dtype: DType::F32,
                ..product(s, [s.mg, s.kdim, k], (dy_g, false), (col, true), at_f32(sums, gr * dw_g_len))
            })?;
        }
    }
    if t != DType::F32 {
        cast(dev, DType::F32, t, summed, dw.at, group * dw_g_len)?;
    }
    Ok(())
}

/// `Pool` of kernels/window.cu, by value: a pooling window over up to 3 spatial dims.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Pool {
    input: [i64; 3],
    output: [i64; 3],
    kernel: [i64; 3],
    strides: [i64; 3],
    dilations: [i64; 3],
    pads: [i64; 3],
    pads_end: [i64; 3],
}

impl Pool {
    /// The window between input `x` and output `y` (N, C, spatial…), with fewer than 3 spatial
    /// dims padded in front by dims of size 1.
    fn of(win: &Window, x: &[usize], y: &[usize]) -> Result<Pool, BackendError> {
        let nd = x.len().saturating_sub(2);
        if !(1..=3).contains(&nd) || y.len() != x.len() {
            return refused!("pooling {x:?} into {y:?}: 1 to 3 spatial dims expected");
        }
        let per_dim = [&win.kernel, &win.strides, &win.dilations].iter().all(|v| v.len() == nd);
        if !per_dim || win.pads.len() != 2 * nd {
            return refused!("a pooling window {win:?} over {nd} spatial dims");
        }
        let lead = 3 - nd;
        let dim = |values: &[usize], fill: usize| -> [i64; 3] {
            std::array::from_fn(|d| if d < lead { fill } else { values[d - lead] } as i64)
        };
        Ok(Pool {
            input: dim(&x[2..], 1),
            output: dim(&y[2..], 1),
            kernel: dim(&win.kernel, 1),
            strides: dim(&win.strides, 1),
            dilations: dim(&win.dilations, 1),
            pads: dim(&win.pads[..nd], 0),
            pads_end: dim(&win.pads[nd..], 0),
        })
    }
}

/// The kernels' (max, include_pad) flags for a pooling kind.
fn pool_flags(kind: PoolKind) -> (i32, i32) {
    match kind {
        PoolKind::Max => (1, 0),
        PoolKind::Average { count_include_pad } => (0, count_include_pad as i32),
    }
}

/// MaxPool or AveragePool over 1 to 3 spatial dims; `indices` is MaxPool's optional second
/// output. Other element types than the float ones pool in f64 and convert back, as the CPU
/// backend does.
pub fn pool(dev: Dev, kind: PoolKind, win: &Window, x: V, y: V, indices: Option<V>) -> Result<(), BackendError> {
    if x.dtype() != y.dtype() {
        return refused!("Y is {} where X is {}", y.dtype(), x.dtype());
    }
    let g = Pool::of(win, x.shape(), y.shape())?;
    let (max, include_pad) = pool_flags(kind);
    let planes = (x.shape()[0] * x.shape()[1]) as i64;
    let indices = indices.map_or(NULL, |i| i.at);
    let t = x.dtype();
    if matches!(t, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
        return dev.kernel(
            &numeric("pool", t),
            elementwise(y.n()),
            &mut params![max, include_pad, planes, g, x.at, y.at, indices],
        );
    }
    through_f64(dev, &[x], y, |wide, y| {
        dev.kernel("pool_f64", elementwise(y.n()), &mut params![max, include_pad, planes, g, wide[0].at, y.at, indices])
    })
}

/// dY, X → dX of 1-D or 2-D pooling (as the CPU backend's).
pub fn pool_grad(dev: Dev, kind: PoolKind, win: &Window, dy: V, x: V, dx: V) -> Result<(), BackendError> {
    let t = one_float_type(&[(&dy, "dY"), (&x, "X"), (&dx, "dX")])?;
    if x.shape().len() > 4 {
        return refused!("the gradient of {}-D pooling is not implemented (1-D and 2-D are)", x.shape().len() - 2);
    }
    let g = Pool::of(win, x.shape(), dy.shape())?;
    let (max, include_pad) = pool_flags(kind);
    let planes = x.shape()[0] * x.shape()[1];
    let (plane_in, plane_out) = (x.n() / planes.max(1), dy.n() / planes.max(1));
    let (kernel, argmax) = (typed("pool_grad", t)?, typed("pool_argmax", t)?);
    if max == 0 {
        let planes = planes as i64;
        return dev.kernel(&kernel, elementwise(dx.n()), &mut params![max, include_pad, planes, g, dy.at, NULL, dx.at]);
    }
    if plane_in > i32::MAX as usize {
        return refused!("MaxPool's gradient over planes of {plane_in} values (at most 2^31 - 1)");
    }
    // Each output's first maximum (an i32 a window) for as many planes as the scratch budget
    // holds, then the gather over those planes.
    let chunk = (dev.scratch_budget() / (4 * plane_out).max(1)).clamp(1, planes.max(1));
    let best = dev.scratch((4 * chunk * plane_out).max(4))?;
    for first in (0..planes).step_by(chunk) {
        let n = chunk.min(planes - first);
        let (x_at, dy_at) = (at(x.at, first * plane_in, t), at(dy.at, first * plane_out, t));
        let dx_at = at(dx.at, first * plane_in, t);
        dev.kernel(&argmax, elementwise(n * plane_out), &mut params![n as i64, g, x_at, best])?;
        dev.kernel(
            &kernel,
            elementwise(n * plane_in),
            &mut params![max, include_pad, n as i64, g, dy_at, best, dx_at],
        )?;
    }
    Ok(())
}

pub fn global_average_pool(dev: Dev, x: V, y: V) -> Result<(), BackendError> {
    let t = one_float_type(&[(&x, "X"), (&y, "Y")])?;
    if x.shape().len() < 3 {
        return refused!("GlobalAveragePool of a rank-{} input (N, C and spatial dims expected)", x.shape().len());
    }
    let rows = x.shape()[0] * x.shape()[1];
    dev.kernel(&typed("mean_rows", t)?, per_row(rows), &mut params![(x.n() / rows.max(1)) as i64, x.at, y.at])
}
