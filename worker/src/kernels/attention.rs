//! Attention without the T×T scores, forward and backward side by side (FlashAttention's
//! scheme): the forward pass keeps each query row's log-sum-exp, and the backward pass
//! recomputes the probabilities from it instead of reading them back.
//!
//! q [.., Tq, D], k and v [.., Tk, D], token-major [.., T, H, D], or packed into one qkv
//! [.., T, 3, H, D]; the groups (batch × heads) are independent, and k and v may have fewer heads
//! than q, each serving several query heads (`AttentionShape`). With `causal`, query i sees keys
//! 0..=i (Tq = Tk).

use super::fastmath::{dot, max};
use super::{KResult, SharedSlice};
use crate::error::BackendError;
use crate::op::{AttentionLayout, AttentionShape};
use crate::refused;
use crate::tensor::{TensorView, TensorViewMut};
use rayon::prelude::*;

/// The attention's shape, and q's, k's and v's elements (each from its part of a packed qkv).
fn operands<'a>(
    layout: AttentionLayout,
    ins: &'a [TensorView],
) -> Result<(AttentionShape, [&'a [f32]; 3]), BackendError> {
    let refuse =
        || BackendError::refused(format!("attention over {:?}", ins.iter().map(|x| x.shape).collect::<Vec<_>>()));
    let (q, k) = match ins {
        [qkv] => (qkv, qkv),
        [q, k, _] => (q, k),
        _ => return Err(refuse()),
    };
    let a = AttentionShape::of(q.shape, k.shape, layout).ok_or_else(refuse)?;
    let parts = match ins {
        [qkv] => a.parts().map(|at| &qkv.as_slice::<f32>()[at..]),
        _ => [0, 1, 2].map(|i| ins[i].as_slice::<f32>()),
    };
    Ok((a, parts))
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

/// q, k, v (or qkv) -> y, and (when the graph keeps it) the rows' log-sum-exp.
pub fn forward(
    scale: f32,
    causal: bool,
    layout: AttentionLayout,
    ins: &[TensorView],
    outputs: &mut [TensorViewMut],
) -> KResult {
    let (a, [qs, ks, vs]) = operands(layout, ins)?;
    let (h, tq, tk, d) = (a.interleaved, a.tq, a.tk, a.d);
    let (y, rest) = outputs.split_first_mut().ok_or_else(|| BackendError::refused("Attention has no output"))?;
    let lse = rest.first_mut().map(|l| SharedSlice::new(l.as_mut_slice::<f32>()));
    // Each worker's row of scores, reused from row to row. Rows of y in memory order: group
    // g's row i is y's row (g / h · tq + i) · h + g % h.
    let rows = y.as_mut_slice::<f32>().par_chunks_mut(d.max(1)).enumerate();
    rows.for_each_init(Vec::new, |scores: &mut Vec<f32>, (row, yr)| {
        let (g, i) = (row / (tq * h) * h + row % h, row / h % tq);
        let qr = &qs[a.q_row(g, i)..a.q_row(g, i) + d];
        let key = |j: usize| a.kv_row(g, j);
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
            unsafe { lse.write(g * tq + i, top + sum.ln()) };
        }
    });
    Ok(())
}

/// dY, q, k, v, y, lse -> dq, dk, dv (packed: dY, qkv, y, lse -> dqkv). With
/// P = exp(q·kᵀ·scale − lse) and D_i = dY_i·y_i: dS = P ⊙ (dY·vᵀ − D), dq = scale·dS·k,
/// dk = scale·dSᵀ·q, dv = Pᵀ·dY. Each query group runs on one worker into rows of its own, its
/// queries in order, so the sums over queries into dk and dv never depend on scheduling; the
/// rows then go to their places (interleaved with the other heads' when token-major), the query
/// groups that share a key head added in order.
pub fn backward(
    scale: f32,
    causal: bool,
    layout: AttentionLayout,
    ins: &[TensorView],
    outputs: &mut [TensorViewMut],
) -> KResult {
    let Some(([dy], rest)) = ins.split_first_chunk::<1>() else { return refused!("AttentionGrad without dY") };
    let Some((operand_views, [y, lse])) = rest.split_last_chunk::<2>() else {
        return refused!("AttentionGrad without y and the log-sum-exp");
    };
    let (a, [qs, ks, vs]) = operands(layout, operand_views)?;
    let (tq, tk, d) = (a.tq, a.tk, a.d);
    let (dys, ys, lses) = (dy.as_slice::<f32>(), y.as_slice::<f32>(), lse.as_slice::<f32>());
    if outputs.len() != layout.operands() {
        return refused!("AttentionGrad has {} outputs", layout.operands());
    }
    let at = |t: usize| t * d..(t + 1) * d;
    let grads: Vec<[Vec<f32>; 3]> = (0..a.groups)
        .into_par_iter()
        .map(|g| {
            let (mut dqg, mut dkg, mut dvg) = (vec![0f32; tq * d], vec![0f32; tk * d], vec![0f32; tk * d]);
            let q_row = |i: usize| a.q_row(g, i)..a.q_row(g, i) + d;
            let y_row = |i: usize| a.y_row(g, i)..a.y_row(g, i) + d;
            let k_row = |j: usize| a.kv_row(g, j)..a.kv_row(g, j) + d;
            for i in 0..tq {
                let (qi, dyi) = (&qs[q_row(i)], &dys[y_row(i)]);
                let di = dot(dyi, &ys[y_row(i)]);
                let lse = lses[g * tq + i];
                for j in 0..visible(causal, i, tk) {
                    let (kj, vj) = (&ks[k_row(j)], &vs[k_row(j)]);
                    let p = (scale * dot(qi, kj) - lse).exp();
                    let ds = p * (dot(dyi, vj) - di);
                    axpy(&mut dqg[at(i)], scale * ds, kj);
                    axpy(&mut dkg[at(j)], scale * ds, qi);
                    axpy(&mut dvg[at(j)], p, dyi);
                }
            }
            [dqg, dkg, dvg]
        })
        .collect();
    // dq, dk and dv: each an output, or a part of the one packed.
    for (which, part) in a.parts().into_iter().enumerate() {
        let out = &mut outputs[if a.packed { 0 } else { which }].as_mut_slice::<f32>()[part..];
        for (g, rows) in grads.iter().enumerate() {
            if which == 0 {
                (0..tq).for_each(|i| out[a.q_row(g, i)..a.q_row(g, i) + d].copy_from_slice(&rows[0][at(i)]));
                continue;
            }
            for j in 0..tk {
                let (to, from) = (&mut out[a.kv_row(g, j)..a.kv_row(g, j) + d], &rows[which][at(j)]);
                match g % a.rep {
                    0 => to.copy_from_slice(from),
                    _ => to.iter_mut().zip(from).for_each(|(t, f)| *t += f),
                }
            }
        }
    }
    Ok(())
}
