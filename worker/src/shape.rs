//! Shape arithmetic shared by binding (graph::infer), the host kernels and the backends: numpy
//! broadcasting, axes in `-rank..rank`, ONNX Slice ranges, the axes a reduction sums over. A
//! leaf: it imports nothing from the crate.

/// Numpy-style broadcast of two shapes.
pub fn broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
        let db = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

/// An axis in `-rank..rank` as an index; a scalar has none.
pub fn norm_axis(axis: i64, rank: usize) -> Option<usize> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    (0..r).contains(&a).then_some(a as usize)
}

/// Slice parameters clamped to a dimension: (start, step, count).
pub fn slice_range(start: i64, end: i64, step: i64, dim: usize) -> (i64, i64, usize) {
    let d = dim as i64;
    let clamp = |v: i64, lo: i64, hi: i64| v.max(lo).min(hi);
    let (s, e) = if step > 0 {
        let s = if start < 0 { start + d } else { start };
        let e = if end < 0 { end + d } else { end };
        (clamp(s, 0, d), clamp(e, 0, d))
    } else {
        let s = if start < 0 { start + d } else { start };
        let e = if end < 0 { end + d } else { end };
        (clamp(s, -1, d - 1), clamp(e, -1, d - 1))
    };
    // Counted without overflow for any step (i64::MAX's and i64::MIN's too).
    let count = if step > 0 {
        if e > s {
            (e - s - 1) / step + 1
        } else {
            0
        }
    } else if s > e {
        ((s - e - 1) as u64 / step.unsigned_abs() + 1) as i64
    } else {
        0
    };
    (s, step, count as usize)
}

/// The reduction a `ReduceSumTo` needs: which axes of `from` sum into `to`.
pub fn reduced_axes(from: &[usize], to: &[usize]) -> Vec<usize> {
    let off = from.len() - to.len();
    (0..from.len()).filter(|&i| i < off || (to[i - off] == 1 && from[i] != 1)).collect()
}
