//! Softmax, LogSoftmax and LayerNormalization, forward and backward side by side.

use super::{fastmath, KResult, SharedSlice, PAR_MIN};
use crate::error::BackendError;
use crate::op::Binary;
use crate::refused;
use crate::shape::norm_axis;
use crate::tensor::{DType, TensorView, TensorViewMut};
use rayon::prelude::*;

/// Splits a shape around `axis` into (outer, axis length, inner).
fn around(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (shape[..axis].iter().product(), shape[axis], shape[axis + 1..].iter().product())
}

/// Runs `f(outer_index, inner_index, lane)` for every lane along the axis, where `lane`
/// is (offset, stride) of the axis' elements. Lanes are independent, so they run in parallel.
fn for_each_lane(total: usize, outer: usize, inner: usize, f: impl Fn(usize, usize) + Sync) {
    let lanes = outer * inner;
    if total >= PAR_MIN {
        (0..lanes).into_par_iter().for_each(|l| f(l / inner, l % inner));
    } else {
        (0..lanes).for_each(|l| f(l / inner, l % inner));
    }
}

pub fn softmax(axis: i64, log: bool, x: &TensorView, y: &mut TensorViewMut) -> KResult {
    let a = norm_axis(axis, x.shape.len()).ok_or_else(|| BackendError::refused("axis out of range"))?;
    let (outer, n, inner) = around(x.shape, a);
    match x.dtype {
        DType::F32 if inner == 1 => {
            // The last axis (attention scores): contiguous rows, vectorized exp.
            let xs = x.as_slice::<f32>();
            let row = |(r, yr): (usize, &mut [f32])| {
                let xr = &xs[r * n..(r + 1) * n];
                let max = fastmath::max(xr);
                if log {
                    let lse = max + fastmath::sum_exp(xr, max).ln();
                    yr.iter_mut().zip(xr).for_each(|(o, &v)| *o = v - lse);
                } else {
                    let mut sum = 0.0;
                    for (o, &v) in yr.iter_mut().zip(xr) {
                        *o = fastmath::exp(v - max);
                        sum += *o;
                    }
                    let inv = 1.0 / sum;
                    yr.iter_mut().for_each(|o| *o *= inv);
                }
            };
            let ys = y.as_mut_slice::<f32>();
            if xs.len() >= PAR_MIN {
                ys.par_chunks_mut(n.max(1)).enumerate().for_each(row);
            } else {
                ys.chunks_mut(n.max(1)).enumerate().for_each(row);
            }
        }
        DType::F32 => {
            let xs = x.as_slice::<f32>();
            let yp = SharedSlice::new(y.as_mut_slice::<f32>());
            for_each_lane(xs.len(), outer, inner, |o, i| {
                let at = |j: usize| o * n * inner + j * inner + i;
                let max = (0..n).map(|j| xs[at(j)]).fold(f32::NEG_INFINITY, f32::max);
                let sum: f32 = (0..n).map(|j| (xs[at(j)] - max).exp()).sum();
                let lse = max + sum.ln();
                for j in 0..n {
                    let v = if log { xs[at(j)] - lse } else { (xs[at(j)] - max).exp() / sum };
                    unsafe { yp.write(at(j), v) };
                }
            });
        }
        DType::F64 => {
            let xs = x.as_slice::<f64>();
            let ys = y.as_mut_slice::<f64>();
            for o in 0..outer {
                for i in 0..inner {
                    let at = |j: usize| o * n * inner + j * inner + i;
                    let max = (0..n).map(|j| xs[at(j)]).fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = (0..n).map(|j| (xs[at(j)] - max).exp()).sum();
                    for j in 0..n {
                        ys[at(j)] = if log { xs[at(j)] - max - sum.ln() } else { (xs[at(j)] - max).exp() / sum };
                    }
                }
            }
        }
        d => return refused!("Softmax is not implemented for {d}"),
    }
    Ok(())
}

/// Softmax: dX = Y ⊙ (dY − Σ dY⊙Y). LogSoftmax: dX = dY − exp(Y) Σ dY.
pub fn softmax_grad(axis: i64, log: bool, dy: &TensorView, y: &TensorView, dx: &mut TensorViewMut) -> KResult {
    let a = norm_axis(axis, y.shape.len()).ok_or_else(|| BackendError::refused("axis out of range"))?;
    let (outer, n, inner) = around(y.shape, a);
    let (dys, ys) = (dy.as_slice::<f32>(), y.as_slice::<f32>());
    if inner == 1 {
        // The last axis: contiguous rows.
        dx.as_mut_slice::<f32>().par_chunks_mut(n.max(1)).enumerate().for_each(|(r, dxr)| {
            let (dyr, yr) = (&dys[r * n..(r + 1) * n], &ys[r * n..(r + 1) * n]);
            if log {
                let s: f32 = dyr.iter().sum();
                dxr.iter_mut().zip(dyr.iter().zip(yr)).for_each(|(o, (&g, &y))| *o = g - fastmath::exp(y) * s);
            } else {
                let s: f32 = dyr.iter().zip(yr).map(|(g, y)| g * y).sum();
                dxr.iter_mut().zip(dyr.iter().zip(yr)).for_each(|(o, (&g, &y))| *o = y * (g - s));
            }
        });
        return Ok(());
    }
    let dxp = SharedSlice::new(dx.as_mut_slice::<f32>());
    for_each_lane(ys.len(), outer, inner, |o, i| {
        let at = |j: usize| o * n * inner + j * inner + i;
        if log {
            let s: f32 = (0..n).map(|j| dys[at(j)]).sum();
            for j in 0..n {
                unsafe { dxp.write(at(j), dys[at(j)] - ys[at(j)].exp() * s) };
            }
        } else {
            let s: f32 = (0..n).map(|j| dys[at(j)] * ys[at(j)]).sum();
            for j in 0..n {
                unsafe { dxp.write(at(j), ys[at(j)] * (dys[at(j)] - s)) };
            }
        }
    });
    Ok(())
}

/// LayerNormalization over the dims from `axis` on (RMSNorm where `rms`: no mean is taken
/// out, and the mean written is 0). Outputs: Y, then optionally the mean and inverse standard
/// deviation (root mean square) per row, kept for the backward pass.
pub fn layer_norm(
    axis: i64,
    eps: f32,
    rms: bool,
    x: &TensorView,
    scale: &TensorView,
    bias: Option<TensorView>,
    outs: &mut [TensorViewMut],
) -> KResult {
    let a = norm_axis(axis, x.shape.len()).ok_or_else(|| BackendError::refused("axis out of range"))?;
    let rows: usize = x.shape[..a].iter().product();
    let cols: usize = x.shape[a..].iter().product();
    if x.dtype != DType::F32 {
        return layer_norm_reference(rows, cols, eps, rms, x, scale, bias, outs);
    }
    let xs = x.as_slice::<f32>();
    let g = scale.as_slice::<f32>();
    let b = bias.map(|b| b.as_slice::<f32>());
    if g.len() != cols || b.is_some_and(|b| b.len() != cols) {
        return refused!("scale/bias must have {cols} elements (the normalized dims)");
    }
    let mut stats = vec![(0f32, 0f32); rows];
    let (y, rest) = outs.split_first_mut().ok_or_else(|| BackendError::refused("no output"))?;
    y.as_mut_slice::<f32>().par_chunks_mut(cols.max(1)).zip(stats.par_iter_mut()).enumerate().for_each(
        |(r, (yr, st))| {
            let xr = &xs[r * cols..(r + 1) * cols];
            let mean = if rms { 0.0 } else { xr.iter().sum::<f32>() / cols as f32 };
            let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / cols as f32;
            let inv = 1.0 / (var + eps).sqrt();
            for j in 0..cols {
                yr[j] = (xr[j] - mean) * inv * g[j] + b.map_or(0.0, |b| b[j]);
            }
            *st = (mean, inv);
        },
    );
    if let Some(m) = rest.get_mut(0) {
        m.as_mut_slice::<f32>().iter_mut().zip(&stats).for_each(|(o, s)| *o = s.0);
    }
    if let Some(s) = rest.get_mut(1) {
        s.as_mut_slice::<f32>().iter_mut().zip(&stats).for_each(|(o, s)| *o = s.1);
    }
    Ok(())
}

/// X, B, scale (, bias) → Y, S (, mean, inv_std): S = X + B written (by the Add's own kernel),
/// then S's LayerNorm (f32; a half B arrives widened, as `kernels::run` widens half inputs).
#[allow(clippy::too_many_arguments)]
pub fn residual_layer_norm(
    axis: i64,
    eps: f32,
    rms: bool,
    x: &TensorView,
    branch: &TensorView,
    scale: &TensorView,
    bias: Option<TensorView>,
    outs: &mut [TensorViewMut],
) -> KResult {
    let [y, sum, stats @ ..] = outs else { return refused!("ResidualLayerNorm writes Y and S") };
    if x.dtype != DType::F32 || branch.dtype != DType::F32 || branch.shape != x.shape {
        return refused!("ResidualLayerNorm takes f32 X and B of one shape");
    }
    super::elementwise::binary(Binary::Add, x, branch, sum)?;
    let mut norm: Vec<TensorViewMut> =
        std::iter::once(y.reborrow()).chain(stats.iter_mut().map(TensorViewMut::reborrow)).collect();
    layer_norm(axis, eps, rms, &sum.as_view(), scale, bias, &mut norm)
}

/// LayerNormalization of the element types off the f32 path, computed in f64.
#[allow(clippy::too_many_arguments)]
fn layer_norm_reference(
    rows: usize,
    cols: usize,
    eps: f32,
    rms: bool,
    x: &TensorView,
    scale: &TensorView,
    bias: Option<TensorView>,
    outs: &mut [TensorViewMut],
) -> KResult {
    let (xs, g) = (x.to_f64_vec(), scale.to_f64_vec());
    let b = bias.map(|b| b.to_f64_vec());
    if g.len() != cols || b.as_ref().is_some_and(|b| b.len() != cols) {
        return refused!("scale/bias must have {cols} elements (the normalized dims)");
    }
    let mut y = vec![0f64; xs.len()];
    let (mut means, mut invs) = (vec![0f64; rows], vec![0f64; rows]);
    for r in 0..rows {
        let xr = &xs[r * cols..(r + 1) * cols];
        let mean = if rms { 0.0 } else { xr.iter().sum::<f64>() / cols as f64 };
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / cols as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for j in 0..cols {
            y[r * cols + j] = (xr[j] - mean) * inv * g[j] + b.as_ref().map_or(0.0, |b| b[j]);
        }
        (means[r], invs[r]) = (mean, inv);
    }
    for (out, vals) in outs.iter_mut().zip([&y, &means, &invs]) {
        super::write_f64(vals, out);
    }
    Ok(())
}

/// dY, X, scale, mean, inv_std (, dX_in) → dX, dScale, dBias (, dX again: the half copy
/// `layer_norm_casts` asks for, which `kernels::run` rounds as it writes half outputs).
/// With x̂ = (x−μ)·σ⁻¹ and g = dY⊙scale: dX = σ⁻¹ (g − mean(g) − x̂ mean(g⊙x̂)); RMSNorm's
/// (`rms`, μ = 0) has no mean(g) term, as nothing was taken out of x. dX_in, where the graph
/// added a gradient to dX (fuse.rs's layer_norm_grad_add), is added to it.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_grad(
    axis: i64,
    rms: bool,
    dy: &TensorView,
    x: &TensorView,
    scale: &TensorView,
    mean: &TensorView,
    inv_std: &TensorView,
    dx_in: Option<TensorView>,
    outs: &mut [TensorViewMut],
) -> KResult {
    let a = norm_axis(axis, x.shape.len()).ok_or_else(|| BackendError::refused("axis out of range"))?;
    let rows: usize = x.shape[..a].iter().product();
    let cols: usize = x.shape[a..].iter().product();
    let (dys, xs, g) = (dy.as_slice::<f32>(), x.as_slice::<f32>(), scale.as_slice::<f32>());
    let (mu, inv) = (mean.as_slice::<f32>(), inv_std.as_slice::<f32>());
    let (outs, half) = outs.split_at_mut(3.min(outs.len()));
    let [dx, dscale, dbias] = outs else { return refused!("LayerNormGrad needs 3 outputs") };
    let dx_in = dx_in.map(|d| d.as_slice::<f32>());
    if dx_in.is_some_and(|d| d.len() != xs.len()) {
        return refused!("LayerNormGrad's added gradient must be shaped like the input");
    }
    // Per-thread partial sums of dScale and dBias, merged after: rows are split across threads.
    let chunk = rows.div_ceil(rayon::current_num_threads().max(1)).max(1);
    let partials: Vec<(Vec<f32>, Vec<f32>)> = dx
        .as_mut_slice::<f32>()
        .par_chunks_mut(chunk * cols.max(1))
        .enumerate()
        .map(|(c, dxc)| {
            let mut ds = vec![0f32; cols];
            let mut db = vec![0f32; cols];
            for (k, dxr) in dxc.chunks_mut(cols.max(1)).enumerate() {
                let r = c * chunk + k;
                let (xr, dyr) = (&xs[r * cols..(r + 1) * cols], &dys[r * cols..(r + 1) * cols]);
                let (m, s) = (mu[r], inv[r]);
                let mut mean_g = 0f32;
                let mut mean_gx = 0f32;
                for j in 0..cols {
                    let xh = (xr[j] - m) * s;
                    let gj = dyr[j] * g[j];
                    mean_g += gj;
                    mean_gx += gj * xh;
                    ds[j] += dyr[j] * xh;
                    db[j] += dyr[j];
                }
                mean_g = if rms { 0.0 } else { mean_g / cols as f32 };
                mean_gx /= cols as f32;
                let add = dx_in.map(|d| &d[r * cols..(r + 1) * cols]);
                for j in 0..cols {
                    let xh = (xr[j] - m) * s;
                    dxr[j] = add.map_or(0.0, |a| a[j]) + s * (dyr[j] * g[j] - mean_g - xh * mean_gx);
                }
            }
            (ds, db)
        })
        .collect();
    let (ds, db) = (dscale.as_mut_slice::<f32>(), dbias.as_mut_slice::<f32>());
    ds.fill(0.0);
    db.fill(0.0);
    for (ps, pb) in partials {
        ds.iter_mut().zip(ps).for_each(|(o, v)| *o += v);
        db.iter_mut().zip(pb).for_each(|(o, v)| *o += v);
    }
    if let Some(copy) = half.first_mut() {
        copy.as_mut_slice::<f32>().copy_from_slice(dx.as_mut_slice::<f32>());
    }
    Ok(())
}
