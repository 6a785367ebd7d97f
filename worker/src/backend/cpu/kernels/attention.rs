//! Attention without the T×T scores, forward and backward side by side (FlashAttention's
//! scheme): the forward pass keeps each query row's log-sum-exp, and the backward pass
//! recomputes the probabilities from it instead of reading them back.
//!
//! q [.., Tq, D], k and v [.., Tk, D]; the leading dims are groups (batch × heads), each
//! independent. With `causal`, query i sees keys 0..=i (Tq = Tk).

use super::fastmath::{dot, max};
use super::{KResult, SharedSlice};
use crate::tensor::{TensorView, TensorViewMut};
use rayon::prelude::*;

/// (groups, Tq, Tk, D) of q and k.
fn dims(q: &TensorView, k: &TensorView) -> (usize, usize, usize, usize) {
    let r = q.shape.len();
    let (tq, d) = (q.shape[r - 2], q.shape[r - 1]);
    let groups = q.shape[..r - 2].iter().product();
    (groups, tq, k.shape[r - 2], d)
}

/// y += a·x.
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// The keys query `i` sees.
fn visible(causal: bool, i: usize, tk: usize) -> usize {
    if causal {
        i + 1
    } else {
        tk
    }
}

/// Outputs: y, and (when the graph keeps it) the rows' log-sum-exp.
pub fn forward(
    scale: f32,
    causal: bool,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    outputs: &mut [TensorViewMut],
) -> KResult {
    let (_, tq, tk, d) = dims(q, k);
    let (qs, ks, vs) = (q.as_slice::<f32>(), k.as_slice::<f32>(), v.as_slice::<f32>());
    let (y, rest) = outputs.split_first_mut().ok_or("Attention has no output")?;
    let lse = rest.first_mut().map(|l| SharedSlice::new(l.as_mut_slice::<f32>()));
    // Each worker's row of scores, reused from row to row.
    let rows = y.as_mut_slice::<f32>().par_chunks_mut(d.max(1)).enumerate();
    rows.for_each_init(Vec::new, |scores: &mut Vec<f32>, (row, yr)| {
        let (g, i) = (row / tq, row % tq);
        let qr = &qs[row * d..(row + 1) * d];
        let key = |j: usize| (g * tk + j) * d;
        scores.clear();
        scores.extend((0..visible(causal, i, tk)).map(|j| scale * dot(qr, &ks[key(j)..key(j) + d])));
        let top = max(scores);
        yr.fill(0.0);
        let mut sum = 0f32;
        for (j, s) in scores.iter().enumerate() {
            let e = (s - top).exp();
            sum += e;
            axpy(yr, e, &vs[key(j)..key(j) + d]);
        }
        let inv = 1.0 / sum;
        yr.iter_mut().for_each(|o| *o *= inv);
        if let Some(lse) = lse {
            // SAFETY: one row per worker; the slice outlives the loop.
            unsafe { lse.write(row, top + sum.ln()) };
        }
    });
    Ok(())
}

/// dY, q, k, v, y, lse -> dq, dk, dv. With P = exp(q·kᵀ·scale − lse) and D_i = dY_i·y_i:
/// dS = P ⊙ (dY·vᵀ − D), dq = scale·dS·k, dk = scale·dSᵀ·q, dv = Pᵀ·dY. Each group runs on one
/// worker, its queries in order, so the sums over queries into dk and dv never depend on
/// scheduling.
pub fn backward(scale: f32, causal: bool, ins: [&TensorView; 6], outputs: &mut [TensorViewMut]) -> KResult {
    let [dy, q, k, v, y, lse] = ins;
    let (_, tq, tk, d) = dims(q, k);
    let (dys, qs, ks, vs, ys, lses) = (
        dy.as_slice::<f32>(),
        q.as_slice::<f32>(),
        k.as_slice::<f32>(),
        v.as_slice::<f32>(),
        y.as_slice::<f32>(),
        lse.as_slice::<f32>(),
    );
    let [dq, dk, dv] = outputs else { return Err("AttentionGrad has three outputs".into()) };
    let (qlen, klen) = ((tq * d).max(1), (tk * d).max(1));
    dq.as_mut_slice::<f32>()
        .par_chunks_mut(qlen)
        .zip(dk.as_mut_slice::<f32>().par_chunks_mut(klen))
        .zip(dv.as_mut_slice::<f32>().par_chunks_mut(klen))
        .enumerate()
        .for_each(|(g, ((dqg, dkg), dvg))| {
            dqg.fill(0.0);
            dkg.fill(0.0);
            dvg.fill(0.0);
            let at = |t: usize| t * d..(t + 1) * d;
            let (qo, ko) = (g * tq * d, g * tk * d);
            for i in 0..tq {
                let row = g * tq + i;
                let (qi, dyi) = (&qs[qo..][at(i)], &dys[qo..][at(i)]);
                let di = dot(dyi, &ys[qo..][at(i)]);
                for j in 0..visible(causal, i, tk) {
                    let (kj, vj) = (&ks[ko..][at(j)], &vs[ko..][at(j)]);
                    let p = (scale * dot(qi, kj) - lses[row]).exp();
                    let ds = p * (dot(dyi, vj) - di);
                    axpy(&mut dqg[at(i)], scale * ds, kj);
                    axpy(&mut dkg[at(j)], scale * ds, qi);
                    axpy(&mut dvg[at(j)], p, dyi);
                }
            }
        });
    Ok(())
}
