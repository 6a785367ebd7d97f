//! Kernels of tensor parallelism's vocab-parallel ops (`parallel::tensor`): an embedding lookup
//! in a slice of the table's rows, and the per-row pieces of a cross-entropy over a slice of the
//! classes. The all-reduces between them are the executor's.

use super::{fastmath, KResult};
use crate::error::BackendError;
use crate::op::LossReduction;
use crate::refused;
use crate::tensor::{DType, TensorView, TensorViewMut};
use rayon::prelude::*;

fn f32_only(x: &TensorView, what: &str) -> KResult {
    if x.dtype != DType::F32 {
        return refused!("{what} is implemented for f32, not {}", x.dtype);
    }
    Ok(())
}

/// Indices relative to the slice `start..start + len`: `None` outside it.
fn local_ids(ids: &TensorView, start: i64, len: usize) -> Result<Vec<Option<usize>>, BackendError> {
    let raw = ids.to_i64_vec().ok_or_else(|| BackendError::refused("indices must be integers"))?;
    raw.iter()
        .map(|&i| {
            if i < 0 {
                // Bad data, as the GPU's fault word reports it: exit 3 on both backends.
                return Err(BackendError::BadData(format!(
                    "index {i}: negative indices are not supported under tensor parallelism"
                )));
            }
            let j = i - start;
            Ok((0..len as i64).contains(&j).then_some(j as usize))
        })
        .collect()
}

/// table [R, C], ids -> [ids.., C]: rows of the ids in `start..start + R`, zeros elsewhere.
pub fn gather(start: i64, table: &TensorView, ids: &TensorView, y: &mut TensorViewMut) -> KResult {
    f32_only(table, "ShardGather")?;
    let (rows, c) = (table.shape[0], table.shape[1]);
    let local = local_ids(ids, start, rows)?;
    let t = table.as_slice::<f32>();
    y.as_mut_slice::<f32>().par_chunks_mut(c.max(1)).zip(local.par_iter()).for_each(|(out, id)| match id {
        Some(r) => out.copy_from_slice(&t[r * c..(r + 1) * c]),
        None => out.fill(0.0),
    });
    Ok(())
}

/// dY [ids.., C], ids -> dTable [R, C]: each id's row of dY added to its row, for ids in range.
pub fn gather_grad(start: i64, dy: &TensorView, ids: &TensorView, dx: &mut TensorViewMut) -> KResult {
    f32_only(dy, "ShardGatherGrad")?;
    let (rows, c) = (dx.shape[0], dx.shape[1]);
    let local = local_ids(ids, start, rows)?;
    let g = dy.as_slice::<f32>();
    let out = dx.as_mut_slice::<f32>();
    out.fill(0.0);
    // Rows of the table are independent: each thread takes a block of rows and scans the ids.
    let rows_per = rows.div_ceil(rayon::current_num_threads().max(1)).max(1);
    out.par_chunks_mut(rows_per * c.max(1)).enumerate().for_each(|(b, block)| {
        let lo = b * rows_per;
        for (k, id) in local.iter().enumerate() {
            if let Some(r) = id.filter(|&r| (lo..lo + rows_per).contains(&r)) {
                let dst = &mut block[(r - lo) * c..(r - lo + 1) * c];
                dst.iter_mut().zip(&g[k * c..(k + 1) * c]).for_each(|(d, s)| *d += s);
            }
        }
    });
    Ok(())
}

/// Labels relative to the class slice `start..start + len` (`None` outside it or ignored).
fn local_labels(
    labels: &TensorView,
    start: i64,
    len: usize,
    ignore: Option<i64>,
) -> Result<Vec<Option<usize>>, BackendError> {
    let raw = labels.to_i64_vec().ok_or_else(|| BackendError::refused("labels must be integers"))?;
    Ok(raw
        .iter()
        .map(|&l| {
            if Some(l) == ignore {
                None
            } else {
                (0..len as i64).contains(&(l - start)).then(|| (l - start) as usize)
            }
        })
        .collect())
}

/// scores [N, Vr], labels [N], max [N] -> Σ_j exp(x_j − max) [N], x[label] − max [N] (0 where
/// the label is elsewhere or ignored).
pub fn cross_entropy(
    start: i64,
    ignore: Option<i64>,
    scores: &TensorView,
    labels: &TensorView,
    max: &TensorView,
    outs: &mut [TensorViewMut],
) -> KResult {
    f32_only(scores, "VocabShardCrossEntropy")?;
    let (n, v) = (scores.shape[0], scores.shape[1]);
    let x = scores.as_slice::<f32>();
    let m = max.as_slice::<f32>();
    let lab = local_labels(labels, start, v, ignore)?;
    let (sums, targets) = outs.split_at_mut(1);
    let sums = sums[0].as_mut_slice::<f32>();
    sums.par_iter_mut().enumerate().for_each(|(p, s)| *s = fastmath::sum_exp(&x[p * v..(p + 1) * v], m[p]));
    for (p, t) in targets[0].as_mut_slice::<f32>().iter_mut().enumerate().take(n) {
        *t = lab[p].map_or(0.0, |l| x[p * v + l] - m[p]);
    }
    Ok(())
}

/// [dΣexp, dTarget, scores, labels, max] -> dScores = dΣexp·exp(x − max) + dTarget·onehot.
pub fn cross_entropy_grad(start: i64, ignore: Option<i64>, ins: [&TensorView; 5], dx: &mut TensorViewMut) -> KResult {
    let [ds, dt, scores, labels, max] = ins;
    f32_only(scores, "VocabShardCrossEntropyGrad")?;
    let v = scores.shape[1];
    let x = scores.as_slice::<f32>();
    let (ds, dt, m) = (ds.as_slice::<f32>(), dt.as_slice::<f32>(), max.as_slice::<f32>());
    let lab = local_labels(labels, start, v, ignore)?;
    dx.as_mut_slice::<f32>().par_chunks_mut(v.max(1)).enumerate().for_each(|(p, row)| {
        for (o, &xi) in row.iter_mut().zip(&x[p * v..(p + 1) * v]) {
            *o = ds[p] * fastmath::exp(xi - m[p]);
        }
        if let Some(l) = lab[p] {
            row[l] += dt[p];
        }
    });
    Ok(())
}

/// The rows that count, and the divisor of a mean over them.
fn counted(
    labels: &TensorView,
    ignore: Option<i64>,
    reduction: LossReduction,
) -> Result<(Vec<bool>, f64), BackendError> {
    let raw = labels.to_i64_vec().ok_or_else(|| BackendError::refused("labels must be integers"))?;
    let keep: Vec<bool> = raw.iter().map(|&l| Some(l) != ignore).collect();
    let den = match reduction {
        LossReduction::Mean => keep.iter().filter(|&&k| k).count() as f64,
        _ => 1.0,
    };
    Ok((keep, den))
}

/// Σexp [N], target [N], labels [N] -> (ln Σexp − target) over the counted rows, reduced.
pub fn loss(
    reduction: LossReduction,
    ignore: Option<i64>,
    sums: &TensorView,
    targets: &TensorView,
    labels: &TensorView,
    y: &mut TensorViewMut,
) -> KResult {
    f32_only(sums, "VocabParallelLoss")?;
    let (s, t) = (sums.as_slice::<f32>(), targets.as_slice::<f32>());
    let (keep, den) = counted(labels, ignore, reduction)?;
    let per: Vec<f32> = (0..s.len()).map(|p| if keep[p] { s[p].ln() - t[p] } else { 0.0 }).collect();
    match reduction {
        LossReduction::None => y.as_mut_slice::<f32>().copy_from_slice(&per),
        // A mean over no counted row is 0/0: NaN, as SoftmaxCrossEntropyLoss gives.
        _ => y.as_mut_slice::<f32>()[0] = (per.iter().map(|&v| v as f64).sum::<f64>() / den) as f32,
    }
    Ok(())
}

/// dLoss, Σexp, labels -> dΣexp = w/Σexp, dTarget = −w, with w the row's share of dLoss.
pub fn loss_grad(
    reduction: LossReduction,
    ignore: Option<i64>,
    dloss: &TensorView,
    sums: &TensorView,
    labels: &TensorView,
    outs: &mut [TensorViewMut],
) -> KResult {
    f32_only(sums, "VocabParallelLossGrad")?;
    let (g, s) = (dloss.as_slice::<f32>(), sums.as_slice::<f32>());
    let (keep, den) = counted(labels, ignore, reduction)?;
    let w = |p: usize| -> f32 {
        match (keep[p], reduction) {
            (false, _) => 0.0,
            (true, LossReduction::None) => g[p],
            (true, _) => g[0] / if den == 0.0 { 1.0 } else { den as f32 },
        }
    };
    let (d_sums, d_targets) = outs.split_at_mut(1);
    for (p, d) in d_sums[0].as_mut_slice::<f32>().iter_mut().enumerate() {
        *d = w(p) / s[p];
    }
    for (p, d) in d_targets[0].as_mut_slice::<f32>().iter_mut().enumerate() {
        *d = -w(p);
    }
    Ok(())
}
