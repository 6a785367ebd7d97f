//! Fused attention on the CUDA backend (kernels/attention.cu), with the CPU backend's
//! semantics (cpu/kernels/attention.rs): the forward kernel keeps each query row's
//! log-sum-exp; the backward pass is three sweeps over rows (the softmax's row term, dq per
//! query row, dk and dv per key row), none of which races.

use super::{elementwise, typed, Dev, NULL, V};
use crate::tensor::DType;

/// The kernels' largest head (a warp's 32 lanes hold 8 elements each).
const MAX_HEAD: usize = 256;

/// (groups, tq, tk, d) of q and k, checked against what the kernels take.
fn dims(q: &V, k: &V, v: &V) -> Result<(usize, usize, usize, usize), String> {
    let (qs, ks) = (q.shape(), k.shape());
    let r = qs.len();
    if r < 2 || ks.len() != r || v.shape() != ks || k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        return Err(format!("attention over q {qs:?}, k {ks:?}, v {:?} of mixed types or shapes", v.shape()));
    }
    let d = qs[r - 1];
    if d > MAX_HEAD {
        return Err(format!("attention heads of {d} elements; the CUDA kernels take up to {MAX_HEAD}"));
    }
    Ok((qs[..r - 2].iter().product(), qs[r - 2], ks[r - 2], d))
}

/// One warp per row.
fn per_warp(rows: usize) -> cudarc::driver::LaunchConfig {
    elementwise(rows * 32)
}

pub fn forward(dev: Dev, scale: f32, causal: bool, [q, k, v]: [V; 3], y: V, lse: Option<V>) -> Result<(), String> {
    let (groups, tq, tk, d) = dims(&q, &k, &v)?;
    if lse.is_some_and(|l| l.dtype() != DType::F32) {
        return Err("attention's log-sum-exp must be f32".into());
    }
    let rows = groups * tq;
    let lse = lse.map_or(NULL, |l| l.at);
    dev.kernel(
        &typed("attention_fwd", q.dtype())?,
        per_warp(rows),
        &mut params![rows as i64, tq as i64, tk as i64, d as i64, scale, causal as i32, q.at, k.at, v.at, y.at, lse],
    )
}

pub fn backward(
    dev: Dev,
    scale: f32,
    causal: bool,
    [dy, q, k, v, y, lse]: [V; 6],
    [dq, dk, dv]: [V; 3],
) -> Result<(), String> {
    let (groups, tq, tk, d) = dims(&q, &k, &v)?;
    if dy.dtype() != q.dtype() || y.dtype() != q.dtype() || lse.dtype() != DType::F32 {
        return Err(format!("attention's gradient of {} for q of {}, lse of {}", dy.dtype(), q.dtype(), lse.dtype()));
    }
    let t = q.dtype();
    let (qrows, krows) = (groups * tq, groups * tk);
    let delta = dev.scratch(qrows * 4)?;
    dev.kernel(
        &typed("attention_bwd_delta", t)?,
        per_warp(qrows),
        &mut params![qrows as i64, d as i64, dy.at, y.at, delta],
    )?;
    let (tq, tk, d, causal) = (tq as i64, tk as i64, d as i64, causal as i32);
    dev.kernel(
        &typed("attention_bwd_dq", t)?,
        per_warp(qrows),
        &mut params![qrows as i64, tq, tk, d, scale, causal, q.at, k.at, v.at, dy.at, lse.at, delta, dq.at],
    )?;
    dev.kernel(
        &typed("attention_bwd_dkv", t)?,
        per_warp(krows),
        &mut params![krows as i64, tq, tk, d, scale, causal, q.at, k.at, v.at, dy.at, lse.at, delta, dk.at, dv.at],
    )
}
