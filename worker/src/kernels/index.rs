//! Ops that address elements by index tensors: GatherElements (indices of the data's rank) and
//! its gradient (the scatter-add that ScatterElements with reduction "add" is); GatherND and
//! ScatterND (k-tuples of indices naming slices) and GatherND's gradient; ArgMax/ArgMin and
//! TopK's indices, which produce indices.

use super::KResult;
use crate::error::BackendError;
use crate::op::ScatterReduction;
use crate::tensor::{strides, DType, TensorView, TensorViewMut};
use std::cmp::Ordering;

/// For each position of `idx` (row-major), the element offset in `data_shape` that it addresses:
/// the position's own coordinates, the one along `axis` replaced by the index there (negative
/// indices count from the end).
fn element_offsets(axis: usize, data_shape: &[usize], idx: &TensorView) -> Result<Vec<usize>, BackendError> {
    let ids = idx.to_i64_vec().ok_or_else(|| BackendError::refused("indices must be integers"))?;
    let (ds, dim) = (strides(data_shape), data_shape[axis]);
    let mut coord = vec![0usize; idx.shape.len()];
    let mut out = Vec::with_capacity(ids.len());
    for &raw in &ids {
        let id = if raw < 0 { raw + dim as i64 } else { raw };
        if !(0..dim as i64).contains(&id) {
            return Err(BackendError::BadData(format!("index {raw} is out of range for axis {axis} of size {dim}")));
        }
        let at: usize =
            coord.iter().zip(&ds).enumerate().map(|(k, (&c, &s))| if k == axis { id as usize } else { c } * s).sum();
        out.push(at);
        for k in (0..coord.len()).rev() {
            coord[k] += 1;
            if coord[k] < idx.shape[k] {
                break;
            }
            coord[k] = 0;
        }
    }
    Ok(out)
}

/// out[i] = data[offset(i)], for elements of any type.
pub fn gather_elements(axis: usize, data: &TensorView, idx: &TensorView, y: &mut TensorViewMut) -> KResult {
    let size = data.dtype.size();
    for (o, at) in y.bytes.chunks_mut(size).zip(element_offsets(axis, data.shape, idx)?) {
        o.copy_from_slice(&data.bytes[at * size..(at + 1) * size]);
    }
    Ok(())
}

/// dData = zeros; dData[offset(i)] += dY[i] (indices that repeat accumulate, in index order).
pub fn gather_elements_grad(axis: usize, dy: &TensorView, idx: &TensorView, dx: &mut TensorViewMut) -> KResult {
    let shape = dx.shape.to_vec();
    let offsets = element_offsets(axis, &shape, idx)?;
    super::scatter_add(dy, offsets.into_iter().map(Some), dx);
    Ok(())
}

/// ScatterElements: y = data, then each update combined into the element at its offset
/// (`element_offsets`), in index order (with `None`, of indices that repeat the last wins).
pub fn scatter_elements(
    reduction: ScatterReduction,
    axis: usize,
    data: &TensorView,
    idx: &TensorView,
    updates: &TensorView,
    y: &mut TensorViewMut,
) -> KResult {
    let offsets = element_offsets(axis, data.shape, idx)?;
    combine_into(reduction, &offsets, 1, data, updates, y);
    Ok(())
}

/// y = data, then update block t (of `inner` elements) combined into y's elements from
/// offsets[t] on, in order: ScatterND's and ScatterElements' common step.
fn combine_into(
    reduction: ScatterReduction,
    offsets: &[usize],
    inner: usize,
    data: &TensorView,
    updates: &TensorView,
    y: &mut TensorViewMut,
) {
    y.bytes.copy_from_slice(data.bytes);
    if reduction == ScatterReduction::None {
        let size = data.dtype.size();
        for (t, &at) in offsets.iter().enumerate() {
            let src = &updates.bytes[t * inner * size..(t + 1) * inner * size];
            y.bytes[at * size..(at + inner) * size].copy_from_slice(src);
        }
        return;
    }
    // The arithmetic reductions in f64, as the CPU's other element-type-generic ops.
    let (mut acc, upd) = (data.to_f64_vec(), updates.to_f64_vec());
    for (t, &at) in offsets.iter().enumerate() {
        for (o, &u) in acc[at..at + inner].iter_mut().zip(&upd[t * inner..(t + 1) * inner]) {
            *o = match reduction {
                ScatterReduction::Add => *o + u,
                ScatterReduction::Mul => *o * u,
                ScatterReduction::Max => o.max(u),
                ScatterReduction::Min => o.min(u),
                ScatterReduction::None => u,
            };
        }
    }
    super::write_f64(&acc, y);
}

/// The slices that GatherND's and ScatterND's indices [.., k] name in data of `data_shape`:
/// each k-tuple's element offset (within its batch: the first `batch` dims of data and indices
/// are shared), and the slice's length (the product of data's dims past batch + k).
fn nd_slices(batch: usize, data_shape: &[usize], idx: &TensorView) -> Result<(Vec<usize>, usize), BackendError> {
    let ids = idx.to_i64_vec().ok_or_else(|| BackendError::refused("indices must be integers"))?;
    let k = *idx.shape.last().ok_or_else(|| BackendError::refused("indices have no axes"))?;
    let st = strides(data_shape);
    let per_batch: usize = idx.shape[batch..idx.shape.len() - 1].iter().product();
    let batch_stride: usize = data_shape[batch..].iter().product();
    let inner: usize = data_shape[batch + k..].iter().product();
    let tuples: usize = idx.shape[..idx.shape.len() - 1].iter().product();
    let mut offsets = Vec::with_capacity(tuples);
    for t in 0..tuples {
        let mut at = (t / per_batch.max(1)) * batch_stride;
        for (j, &raw) in ids[t * k..(t + 1) * k].iter().enumerate() {
            let dim = data_shape[batch + j] as i64;
            let i = if raw < 0 { raw + dim } else { raw };
            if !(0..dim).contains(&i) {
                return Err(BackendError::BadData(format!(
                    "index {raw} is out of range for axis {} of size {dim}",
                    batch + j
                )));
            }
            at += i as usize * st[batch + j];
        }
        offsets.push(at);
    }
    Ok((offsets, inner))
}

/// GatherND: output block t is data's slice at tuple t's offset.
pub fn gather_nd(batch: usize, data: &TensorView, idx: &TensorView, y: &mut TensorViewMut) -> KResult {
    let size = data.dtype.size();
    let (offsets, inner) = nd_slices(batch, data.shape, idx)?;
    for (block, at) in y.bytes.chunks_mut((inner * size).max(1)).zip(offsets) {
        block.copy_from_slice(&data.bytes[at * size..(at + inner) * size]);
    }
    Ok(())
}

/// GatherND's gradient: dData = zeros, each dY block added into the slice it was read from.
pub fn gather_nd_grad(batch: usize, dy: &TensorView, idx: &TensorView, dx: &mut TensorViewMut) -> KResult {
    let shape = dx.shape.to_vec();
    let (offsets, inner) = nd_slices(batch, &shape, idx)?;
    super::scatter_add(dy, offsets.iter().flat_map(|&at| (at..at + inner).map(Some)), dx);
    Ok(())
}

/// ScatterND: y = data, then each update slice combined into the slice its tuple names, in
/// index order (with `None`, of tuples that repeat the last wins).
pub fn scatter_nd(
    reduction: ScatterReduction,
    data: &TensorView,
    idx: &TensorView,
    updates: &TensorView,
    y: &mut TensorViewMut,
) -> KResult {
    let (offsets, inner) = nd_slices(0, data.shape, idx)?;
    combine_into(reduction, &offsets, inner, data, updates, y);
    Ok(())
}

/// y[o, i] = the index along the middle axis of x viewed as [outer, len, inner] of its largest
/// (`max`) or smallest element; ties go to the first (or, with `last`, the last) of them, and a
/// NaN is the extreme (numpy's argmax).
pub fn arg_extreme(max: bool, last: bool, axis: usize, x: &TensorView, y: &mut TensorViewMut) -> KResult {
    let vals = x.to_f64_vec();
    let len = x.shape[axis];
    let inner: usize = x.shape[axis + 1..].iter().product();
    let beats = |v: f64, best: f64| {
        if best.is_nan() {
            false
        } else if v.is_nan() {
            true
        } else if last {
            if max {
                v >= best
            } else {
                v <= best
            }
        } else if max {
            v > best
        } else {
            v < best
        }
    };
    for (r, o) in y.as_mut_slice::<i64>().iter_mut().enumerate() {
        let (outer, i) = (r / inner.max(1), r % inner.max(1));
        let at = |k: usize| vals[(outer * len + k) * inner + i];
        let mut best = 0;
        for k in 1..len {
            if beats(at(k), at(best)) {
                best = k;
            }
        }
        *o = best as i64;
    }
    Ok(())
}

/// y[o, j, i] = the index along the middle axis of x viewed as [outer, len, inner] of its j-th
/// largest (`largest`) or smallest element, j < k (y's length along the axis): equal elements
/// in index order (ONNX's rule), a NaN above every number (numpy's sort and PyTorch's topk put
/// it there; ONNX Runtime's order of NaNs is not a consistent one). Integers compare as they
/// are, other types in f64 (halves arrive widened).
pub fn top_k_indices(largest: bool, axis: usize, x: &TensorView, y: &mut TensorViewMut) -> KResult {
    let k = y.shape[axis];
    let out = y.as_mut_slice::<i64>();
    match x.dtype {
        DType::I64 => top_k_lines(largest, axis, x.shape, x.as_slice::<i64>(), k, out),
        DType::I32 => top_k_lines(largest, axis, x.shape, x.as_slice::<i32>(), k, out),
        DType::F32 => top_k_lines(largest, axis, x.shape, x.as_slice::<f32>(), k, out),
        _ => top_k_lines(largest, axis, x.shape, &x.to_f64_vec(), k, out),
    }
    Ok(())
}

fn top_k_lines<T: PartialOrd + Copy>(largest: bool, axis: usize, shape: &[usize], x: &[T], k: usize, out: &mut [i64]) {
    let (len, inner) = (shape[axis], shape[axis + 1..].iter().product::<usize>());
    if k == 0 || inner == 0 {
        return;
    }
    let mut order: Vec<usize> = Vec::with_capacity(len);
    for line in 0..x.len() / (len * inner) * inner {
        let (o, i) = (line / inner, line % inner);
        let at = |p: usize| x[(o * len + p) * inner + i];
        // A total order (ties by index), so the k first need not come from a stable sort.
        let before = |p: &usize, q: &usize| top_k_order(at(*p), at(*q), largest).then(p.cmp(q));
        order.clear();
        order.extend(0..len);
        if k < len {
            order.select_nth_unstable_by(k - 1, before);
        }
        order[..k].sort_unstable_by(before);
        for (j, &p) in order[..k].iter().enumerate() {
            out[(o * k + j) * inner + i] = p as i64;
        }
    }
}

/// Which of a and b TopK puts first: the larger (or smaller), NaN above every number.
fn top_k_order<T: PartialOrd>(a: T, b: T, largest: bool) -> Ordering {
    // NaN is the one value that does not compare with itself.
    let ascending = match (a.partial_cmp(&a).is_none(), b.partial_cmp(&b).is_none()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        (false, false) => a.partial_cmp(&b).unwrap_or(Ordering::Equal),
    };
    if largest {
        ascending.reverse()
    } else {
        ascending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{DType, Tensor};

    #[test]
    fn gathers_along_an_axis_and_scatters_back() {
        // ONNX's example: data [[1, 2], [3, 4]], indices [[0, 0], [1, 0]] along axis 1.
        let data = Tensor::from_vec(&[2, 2], vec![1.0f32, 2.0, 3.0, 4.0]);
        let idx = Tensor::from_vec(&[2, 2], vec![0i64, 0, 1, -2]);
        let mut y = Tensor::zeros(DType::F32, &[2, 2]);
        gather_elements(1, &data.view(), &idx.view(), &mut y.view_mut()).unwrap();
        assert_eq!(y.as_slice::<f32>(), &[1.0, 1.0, 4.0, 3.0]);
        let dy = Tensor::from_vec(&[2, 2], vec![1.0f32, 10.0, 100.0, 1000.0]);
        let mut dx = Tensor::zeros(DType::F32, &[2, 2]);
        gather_elements_grad(1, &dy.view(), &idx.view(), &mut dx.view_mut()).unwrap();
        assert_eq!(dx.as_slice::<f32>(), &[11.0, 0.0, 1000.0, 100.0]);
        let bad = Tensor::from_vec(&[2, 2], vec![0i64, 2, 0, 0]);
        let e = gather_elements(1, &data.view(), &bad.view(), &mut y.view_mut()).unwrap_err();
        assert!(
            matches!(&e, BackendError::BadData(m) if m.contains("index 2 is out of range for axis 1 of size 2")),
            "{e}"
        );
    }

    #[test]
    fn arg_extremes_break_ties_as_asked_and_see_nan_first() {
        let x = Tensor::from_vec(&[2, 4], vec![1.0f32, 3.0, 3.0, -1.0, 2.0, f32::NAN, 5.0, f32::NAN]);
        let run = |max, last| {
            let mut y = Tensor::zeros(DType::I64, &[2]);
            arg_extreme(max, last, 1, &x.view(), &mut y.view_mut()).unwrap();
            y.as_slice::<i64>().to_vec()
        };
        assert_eq!(run(true, false), vec![1, 1]);
        assert_eq!(run(true, true), vec![2, 1]);
        assert_eq!(run(false, false), vec![3, 1]);
    }

    #[test]
    fn top_k_orders_ties_by_index_and_puts_nan_above_every_number() {
        let x =
            Tensor::from_vec(&[2, 6], vec![1.0f32, 3.0, f32::NAN, 3.0, -1.0, f32::NAN, 2.0, 2.0, 5.0, 2.0, 0.0, 7.0]);
        let run = |largest, k, x: &Tensor| {
            let mut y = Tensor::zeros(DType::I64, &[2, k]);
            top_k_indices(largest, 1, &x.view(), &mut y.view_mut()).unwrap();
            y.as_slice::<i64>().to_vec()
        };
        assert_eq!(run(true, 4, &x), vec![2, 5, 1, 3, 5, 2, 0, 1]);
        assert_eq!(run(false, 4, &x), vec![4, 0, 1, 3, 4, 0, 1, 3]);
        assert_eq!(run(false, 6, &x), vec![4, 0, 1, 3, 2, 5, 4, 0, 1, 3, 2, 5]);
        // Along the first axis, of i64 elements (compared as integers, past f64's precision).
        let big = Tensor::from_vec(&[3, 2], vec![i64::MAX, 1, i64::MAX - 1, 1, i64::MAX, 0]);
        let mut y = Tensor::zeros(DType::I64, &[2, 2]);
        top_k_indices(true, 0, &big.view(), &mut y.view_mut()).unwrap();
        assert_eq!(y.as_slice::<i64>(), &[0, 0, 2, 1]);
    }
}
