//! Data movement (Transpose, Concat, Split, Slice, Gather, Expand, Trilu) and reductions, with
//! the gradients that are themselves data movement (SliceGrad, GatherGrad, ReduceSumTo).
//!
//! Movement kernels copy bytes, so they serve every element type.

use super::{KResult, PAR_MIN};
use crate::error::BackendError;
use crate::op::{PadMode, Reduce};
use crate::refused;
use crate::shape::{reduced_axes, slice_range};
use crate::tensor::{strides, DType, Tensor, TensorView, TensorViewMut};
use rayon::prelude::*;

/// Calls `f(out_linear_index, in_element_offset)` for every output element, where the input
/// offset is `Σ idx[d]·in_strides[d] + base` (strides may be 0 or negative).
fn for_each_index(out_shape: &[usize], in_strides: &[isize], base: isize, mut f: impl FnMut(usize, usize)) {
    let n: usize = out_shape.iter().product();
    if n == 0 {
        return;
    }
    let r = out_shape.len();
    let mut idx = vec![0usize; r];
    let mut off = base;
    for lin in 0..n {
        f(lin, off as usize);
        for d in (0..r).rev() {
            idx[d] += 1;
            off += in_strides[d];
            if idx[d] < out_shape[d] {
                break;
            }
            off -= in_strides[d] * out_shape[d] as isize;
            idx[d] = 0;
        }
    }
}

/// Copies elements of size `size` from `src` into `dst` along the index map; when the last
/// dimension is contiguous in the source the copy goes row by row.
fn gather_copy(dst: &mut [u8], src: &[u8], size: usize, out_shape: &[usize], in_strides: &[isize], base: isize) {
    let r = out_shape.len();
    if r > 0 && in_strides[r - 1] == 1 && out_shape[r - 1] > 1 {
        let row = out_shape[r - 1];
        let outer = &out_shape[..r - 1];
        let rows: usize = outer.iter().product();
        let bytes = row * size;
        let mut offs = Vec::with_capacity(rows);
        for_each_index(outer, &in_strides[..r - 1], base, |_, o| offs.push(o));
        let copy = |(k, d): (usize, &mut [u8])| d.copy_from_slice(&src[offs[k] * size..offs[k] * size + bytes]);
        if dst.len() >= PAR_MIN * 4 {
            dst.par_chunks_mut(bytes).enumerate().for_each(copy);
        } else {
            dst.chunks_mut(bytes).enumerate().for_each(copy);
        }
        return;
    }
    for_each_index(out_shape, in_strides, base, |lin, o| {
        dst[lin * size..(lin + 1) * size].copy_from_slice(&src[o * size..(o + 1) * size]);
    });
}

pub fn transpose(perm: &[i64], x: &TensorView, y: &mut TensorViewMut) -> KResult {
    let st = strides(x.shape);
    let in_strides: Vec<isize> = perm.iter().map(|&p| st[p as usize] as isize).collect();
    let out_shape = y.shape.to_vec();
    gather_copy(y.bytes, x.bytes, x.dtype.size(), &out_shape, &in_strides, 0);
    Ok(())
}

pub fn concat(axis: usize, ins: &[TensorView], y: &mut TensorViewMut) -> KResult {
    let size = y.dtype.size();
    let outer: usize = y.shape[..axis].iter().product();
    let out_row: usize = y.shape[axis..].iter().product::<usize>() * size;
    let mut at = 0;
    for x in ins {
        let row: usize = x.shape[axis..].iter().product::<usize>() * size;
        for o in 0..outer {
            y.bytes[o * out_row + at..o * out_row + at + row].copy_from_slice(&x.bytes[o * row..(o + 1) * row]);
        }
        at += row;
    }
    Ok(())
}

pub fn split(axis: usize, x: &TensorView, outs: &mut [TensorViewMut]) -> KResult {
    let size = x.dtype.size();
    let outer: usize = x.shape[..axis].iter().product();
    let in_row: usize = x.shape[axis..].iter().product::<usize>() * size;
    let mut at = 0;
    for y in outs.iter_mut() {
        let row: usize = y.shape[axis..].iter().product::<usize>() * size;
        for o in 0..outer {
            y.bytes[o * row..(o + 1) * row].copy_from_slice(&x.bytes[o * in_row + at..o * in_row + at + row]);
        }
        at += row;
    }
    Ok(())
}

/// Per-dim (start, step) of a slice over `shape`.
pub(crate) fn slice_plan(
    starts: &[i64],
    ends: &[i64],
    axes: &[i64],
    steps: &[i64],
    shape: &[usize],
) -> Vec<(i64, i64)> {
    let mut plan: Vec<(i64, i64)> = vec![(0, 1); shape.len()];
    for i in 0..starts.len() {
        let a = axes[i] as usize;
        let (s, st, _) = slice_range(starts[i], ends[i], steps[i], shape[a]);
        plan[a] = (s, st);
    }
    plan
}

pub fn slice(
    starts: &[i64],
    ends: &[i64],
    axes: &[i64],
    steps: &[i64],
    x: &TensorView,
    y: &mut TensorViewMut,
) -> KResult {
    let plan = slice_plan(starts, ends, axes, steps, x.shape);
    let st = strides(x.shape);
    let base: isize = plan.iter().zip(&st).map(|((s, _), &d)| *s as isize * d as isize).sum();
    let in_strides: Vec<isize> = plan.iter().zip(&st).map(|((_, step), &d)| *step as isize * d as isize).collect();
    let out_shape = y.shape.to_vec();
    gather_copy(y.bytes, x.bytes, x.dtype.size(), &out_shape, &in_strides, base);
    Ok(())
}

/// dX = zeros with dY written at the slice.
pub fn slice_grad(
    starts: &[i64],
    ends: &[i64],
    axes: &[i64],
    steps: &[i64],
    dy: &TensorView,
    dx: &mut TensorViewMut,
) -> KResult {
    let shape = dx.shape.to_vec();
    let plan = slice_plan(starts, ends, axes, steps, &shape);
    let st = strides(&shape);
    let base: isize = plan.iter().zip(&st).map(|((s, _), &d)| *s as isize * d as isize).sum();
    let out_strides: Vec<isize> = plan.iter().zip(&st).map(|((_, step), &d)| *step as isize * d as isize).collect();
    let size = dy.dtype.size();
    dx.bytes.fill(0);
    for_each_index(dy.shape, &out_strides, base, |lin, o| {
        dx.bytes[o * size..(o + 1) * size].copy_from_slice(&dy.bytes[lin * size..(lin + 1) * size]);
    });
    Ok(())
}

fn indices_of(idx: &TensorView, dim: usize) -> Result<Vec<usize>, BackendError> {
    let raw = idx.to_i64_vec().ok_or_else(|| BackendError::refused("indices must be integers"))?;
    raw.iter()
        .map(|&i| {
            let j = if i < 0 { i + dim as i64 } else { i };
            if (0..dim as i64).contains(&j) {
                Ok(j as usize)
            } else {
                Err(BackendError::BadData(format!("index {i} is out of range for a dimension of size {dim}")))
            }
        })
        .collect()
}

pub fn gather(axis: usize, data: &TensorView, idx: &TensorView, y: &mut TensorViewMut) -> KResult {
    let size = data.dtype.size();
    let dim = data.shape[axis];
    let outer: usize = data.shape[..axis].iter().product();
    let inner: usize = data.shape[axis + 1..].iter().product::<usize>() * size;
    let ids = indices_of(idx, dim)?;
    let n = ids.len();
    let copy = |(r, row): (usize, &mut [u8])| {
        let (o, k) = (r / n.max(1), r % n.max(1));
        let src = (o * dim + ids[k]) * inner;
        row.copy_from_slice(&data.bytes[src..src + inner]);
    };
    if inner == 0 {
        return Ok(());
    }
    if y.bytes.len() >= PAR_MIN * 4 {
        y.bytes.par_chunks_mut(inner).enumerate().for_each(copy);
    } else {
        y.bytes.chunks_mut(inner).enumerate().for_each(copy);
    }
    let _ = outer;
    Ok(())
}

/// dData = zeros; dData[.., idx[k], ..] += dY[.., k, ..] (repeated indices accumulate).
pub fn gather_grad(axis: usize, dy: &TensorView, idx: &TensorView, dx: &mut TensorViewMut) -> KResult {
    if dy.dtype != DType::F32 {
        return refused!("GatherGrad is not implemented for {}", dy.dtype);
    }
    let shape = dx.shape.to_vec();
    let dim = shape[axis];
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let ids = indices_of(idx, dim)?;
    let n = ids.len();
    let g = dy.as_slice::<f32>();
    let out = dx.as_mut_slice::<f32>();
    out.fill(0.0);
    if outer == 1 && inner >= 64 {
        // Embedding gradient: rows of the table are independent, so split the table's rows
        // across threads and let each scan the indices for its own rows.
        let threads = rayon::current_num_threads().max(1);
        let rows_per = dim.div_ceil(threads).max(1);
        out.par_chunks_mut(rows_per * inner).enumerate().for_each(|(c, block)| {
            let lo = c * rows_per;
            for (k, &i) in ids.iter().enumerate() {
                if i >= lo && i < lo + rows_per {
                    let dst = &mut block[(i - lo) * inner..(i - lo + 1) * inner];
                    dst.iter_mut().zip(&g[k * inner..(k + 1) * inner]).for_each(|(d, s)| *d += s);
                }
            }
        });
        return Ok(());
    }
    for o in 0..outer {
        for (k, &i) in ids.iter().enumerate() {
            let src = &g[(o * n + k) * inner..(o * n + k + 1) * inner];
            let dst = &mut out[(o * dim + i) * inner..(o * dim + i + 1) * inner];
            dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
        }
    }
    Ok(())
}

pub fn expand(x: &TensorView, y: &mut TensorViewMut) -> KResult {
    let out_shape = y.shape.to_vec();
    let r = out_shape.len();
    let mut padded = vec![1; r - x.shape.len()];
    padded.extend_from_slice(x.shape);
    let st = strides(&padded);
    let in_strides: Vec<isize> = (0..r).map(|d| if padded[d] == 1 { 0 } else { st[d] as isize }).collect();
    gather_copy(y.bytes, x.bytes, x.dtype.size(), &out_shape, &in_strides, 0);
    Ok(())
}

pub fn trilu(upper: bool, k: i64, x: &TensorView, y: &mut TensorViewMut) -> KResult {
    let r = x.shape.len();
    let (rows, cols) = (x.shape[r - 2], x.shape[r - 1]);
    let size = x.dtype.size();
    y.bytes.copy_from_slice(x.bytes);
    for (e, chunk) in y.bytes.chunks_mut(size).enumerate() {
        let i = (e / cols) % rows;
        let j = e % cols;
        let d = j as i64 - i as i64;
        let keep = if upper { d >= k } else { d <= k };
        if !keep {
            chunk.fill(0);
        }
    }
    Ok(())
}

/// Reduces `x` over `axes` into `y` (whose shape has the reduced dims kept or dropped: the
/// element order is the same either way).
pub fn reduce(kind: Reduce, axes: &[i64], x: &TensorView, y: &mut TensorViewMut) -> KResult {
    let mut keep_shape = x.shape.to_vec();
    for &a in axes {
        keep_shape[a as usize] = 1;
    }
    if axes.is_empty() {
        // noop_with_empty_axes: the input unchanged (SumSquare still squares).
        keep_shape = x.shape.to_vec();
    }
    let count = (x.numel() / keep_shape.iter().product::<usize>().max(1)).max(1) as f64;
    let vals = x.to_f64_vec();
    let n_out: usize = keep_shape.iter().product();
    let init = match kind {
        Reduce::Max => f64::NEG_INFINITY,
        Reduce::Min => f64::INFINITY,
        Reduce::Prod => 1.0,
        _ => 0.0,
    };
    let mut acc = vec![init; n_out];
    let ost = strides(&keep_shape);
    let in_strides: Vec<isize> =
        (0..x.shape.len()).map(|d| if keep_shape[d] == 1 { 0 } else { ost[d] as isize }).collect();
    // LogSumExp shifts each sum by its maximum, found in a first pass.
    let shift = match kind {
        Reduce::LogSumExp => {
            let mut max = vec![f64::NEG_INFINITY; n_out];
            for_each_index(x.shape, &in_strides, 0, |lin, o| max[o] = max[o].max(vals[lin]));
            // An infinite maximum is the result; shifting by it would give NaN.
            max.iter().map(|&m| if m.is_finite() { m } else { 0.0 }).collect()
        }
        _ => vec![],
    };
    for_each_index(x.shape, &in_strides, 0, |lin, o| {
        let v = vals[lin];
        acc[o] = match kind {
            Reduce::Sum | Reduce::Mean | Reduce::LogSum => acc[o] + v,
            Reduce::SumSquare | Reduce::L2 => acc[o] + v * v,
            Reduce::L1 => acc[o] + v.abs(),
            Reduce::LogSumExp => acc[o] + (v - shift[o]).exp(),
            Reduce::Prod => acc[o] * v,
            Reduce::Max => acc[o].max(v),
            Reduce::Min => acc[o].min(v),
        };
    });
    match kind {
        Reduce::Mean => acc.iter_mut().for_each(|v| *v /= count),
        Reduce::L2 => acc.iter_mut().for_each(|v| *v = v.sqrt()),
        Reduce::LogSum => acc.iter_mut().for_each(|v| *v = v.ln()),
        Reduce::LogSumExp => acc.iter_mut().zip(&shift).for_each(|(v, m)| *v = v.ln() + m),
        _ => {}
    }
    super::write_f64(&acc, y);
    Ok(())
}

/// CumSum along `axis` (x viewed as [outer, len, inner]): floats summed in f64, integers in i64
/// (wrapping), each rounded or cast once into the output's type.
pub fn cumsum(axis: usize, exclusive: bool, reverse: bool, x: &TensorView, y: &mut TensorViewMut) -> KResult {
    let len = x.shape[axis];
    let inner: usize = x.shape[axis + 1..].iter().product();
    let lines = x.numel() / (len * inner).max(1);
    let order = |k: usize| if reverse { len - 1 - k } else { k };
    macro_rules! scan {
        ($vals:expr, $zero:expr, $add:expr) => {{
            let vals = $vals;
            let mut out = vec![$zero; vals.len()];
            for line in 0..lines {
                for i in 0..inner {
                    let mut acc = $zero;
                    for k in 0..len {
                        let at = (line * len + order(k)) * inner + i;
                        if exclusive {
                            out[at] = acc;
                            acc = $add(acc, vals[at]);
                        } else {
                            acc = $add(acc, vals[at]);
                            out[at] = acc;
                        }
                    }
                }
            }
            out
        }};
    }
    if x.dtype.is_float() {
        let out = scan!(x.to_f64_vec(), 0f64, |a: f64, v: f64| a + v);
        super::write_f64(&out, y);
    } else {
        let vals = x.to_i64_vec().ok_or_else(|| BackendError::refused(format!("CumSum of {}", x.dtype)))?;
        let out = scan!(vals, 0i64, |a: i64, v: i64| a.wrapping_add(v));
        let t = Tensor::from_vec(y.shape, out).cast(y.dtype);
        y.bytes.copy_from_slice(t.bytes());
    }
    Ok(())
}

/// For each element of Pad's output (row-major), the offset in the input it reads, or None in
/// the constant border.
fn pad_sources(mode: PadMode, pads: &[i64], input: &[usize], output: &[usize]) -> Vec<Option<usize>> {
    let (r, st) = (input.len(), strides(input));
    let n: usize = output.iter().product();
    let mut coord = vec![0usize; r];
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let mut at = Some(0usize);
        for a in 0..r {
            at = at
                .and_then(|at| mode.source(coord[a] as i64, pads[a], input[a] as i64).map(|i| at + i as usize * st[a]));
        }
        out.push(at);
        for a in (0..r).rev() {
            coord[a] += 1;
            if coord[a] < output[a] {
                break;
            }
            coord[a] = 0;
        }
    }
    out
}

/// Pad: each output element is the input element its coordinates map to (`PadMode::source`
/// along every axis), or `value` in the constant border.
pub fn pad(mode: PadMode, pads: &[i64], value: f64, x: &TensorView, y: &mut TensorViewMut) -> KResult {
    let size = x.dtype.size();
    let fill = Tensor::scalar(value).cast(x.dtype);
    let sources = pad_sources(mode, pads, x.shape, y.shape);
    for (o, src) in y.bytes.chunks_mut(size).zip(sources) {
        o.copy_from_slice(match src {
            Some(i) => &x.bytes[i * size..(i + 1) * size],
            None => fill.bytes(),
        });
    }
    Ok(())
}

/// Pad's gradient: dX = zeros; dX[source(o)] += dY[o] (the border's sources repeat in the
/// reflect, edge and wrap modes).
pub fn pad_grad(mode: PadMode, pads: &[i64], dy: &TensorView, dx: &mut TensorViewMut) -> KResult {
    let sources = pad_sources(mode, pads, dx.shape, dy.shape);
    super::scatter_add(dy, sources.into_iter(), dx);
    Ok(())
}

/// Sums a broadcast gradient `dy` down to `dx`'s shape (the adjoint of broadcasting).
pub fn reduce_sum_to(dy: &TensorView, dx: &mut TensorViewMut) -> KResult {
    let to = dx.shape.to_vec();
    let axes = reduced_axes(dy.shape, &to);
    if axes.is_empty() {
        dx.bytes.copy_from_slice(dy.bytes);
        return Ok(());
    }
    let contiguous_leading = axes.iter().enumerate().all(|(i, &a)| i == a);
    if dy.dtype == DType::F32 && contiguous_leading {
        // [R, P] → [P]: the bias-gradient shape; rows split across threads, partials merged.
        let g = dy.as_slice::<f32>();
        let p: usize = dy.shape[axes.len()..].iter().product();
        let rows = g.len() / p.max(1);
        let out = dx.as_mut_slice::<f32>();
        let chunk = rows.div_ceil(rayon::current_num_threads().max(1)).max(1);
        let partials: Vec<Vec<f32>> = g
            .par_chunks(chunk * p)
            .map(|block| {
                let mut s = vec![0f32; p];
                for row in block.chunks(p) {
                    s.iter_mut().zip(row).for_each(|(a, b)| *a += b);
                }
                s
            })
            .collect();
        out.fill(0.0);
        for s in partials {
            out.iter_mut().zip(s).for_each(|(a, b)| *a += b);
        }
        return Ok(());
    }
    let axes: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
    reduce(Reduce::Sum, &axes, dy, dx)
}
