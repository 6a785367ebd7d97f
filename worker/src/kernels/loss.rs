//! SoftmaxCrossEntropyLoss, fused: one pass computes log-softmax, the loss and the saved
//! log-probabilities; the gradient reads them back (softmax − one-hot, weighted, scaled). The
//! log-sum-exp form (`fuse::loss_lse`) saves each row's log-sum-exp instead, and its gradient
//! recomputes the softmax from the scores.

use super::{fastmath, KResult, SharedSlice};
use crate::error::BackendError;
use crate::op::LossReduction;
use crate::refused;
use crate::tensor::{DType, TensorView, TensorViewMut};
use rayon::prelude::*;

/// Scores [N, C, D...] → per-sample (n, d) positions; the class axis has stride D.
fn layout(scores: &[usize]) -> (usize, usize, usize) {
    (scores[0], scores[1], scores[2..].iter().product())
}

/// Labels as indices; `None` where ignored. Out-of-range labels are an error naming the label.
fn labels_of(labels: &TensorView, classes: usize, ignore: Option<i64>) -> Result<Vec<Option<usize>>, BackendError> {
    let raw = labels.to_i64_vec().ok_or_else(|| BackendError::refused("labels must be integers"))?;
    raw.iter()
        .map(|&l| {
            if Some(l) == ignore {
                Ok(None)
            } else if (0..classes as i64).contains(&l) {
                Ok(Some(l as usize))
            } else {
                Err(BackendError::BadData(format!("label {l} is out of range for {classes} classes")))
            }
        })
        .collect()
}

/// The divisor of a mean reduction: the summed weights of the positions that count.
fn denominator(reduction: LossReduction, labels: &[Option<usize>], weights: Option<&[f32]>) -> f32 {
    match reduction {
        LossReduction::Mean => labels.iter().flatten().map(|&l| weights.map_or(1.0, |w| w[l])).sum(),
        _ => 1.0,
    }
}

pub fn softmax_cross_entropy(
    reduction: LossReduction,
    ignore: Option<i64>,
    scores: &TensorView,
    labels: &TensorView,
    weights: Option<TensorView>,
    outs: &mut [TensorViewMut],
) -> KResult {
    if scores.dtype != DType::F32 {
        return softmax_cross_entropy_reference(reduction, ignore, scores, labels, weights, outs);
    }
    let (n, c, d) = layout(scores.shape);
    let x = scores.as_slice::<f32>();
    let lab = labels_of(labels, c, ignore)?;
    let w = weights.map(|w| w.as_slice::<f32>());
    let nll: Vec<f32> = if d == 1 {
        // Classes contiguous (scores [N, C], the language-model case): one row per position.
        rows_nll(x, c, &lab, w, outs.get_mut(1).map(|lp| lp.as_mut_slice::<f32>())).0
    } else {
        // Per position (n, k): log-softmax over the strided class lane.
        let mut logp = vec![0f32; x.len()];
        let positions = n * d;
        let mut per = vec![0f32; positions];
        let lp = SharedSlice::new(&mut logp);
        per.par_iter_mut().enumerate().for_each(|(p, out)| {
            let (i, k) = (p / d, p % d);
            let at = |j: usize| i * c * d + j * d + k;
            let max = (0..c).map(|j| x[at(j)]).fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = (0..c).map(|j| ((x[at(j)] - max) as f64).exp()).sum();
            let lse = max + sum.ln() as f32;
            for j in 0..c {
                // Each position writes its own class lane: disjoint across threads.
                unsafe { lp.write(at(j), x[at(j)] - lse) };
            }
            *out = match lab[p] {
                Some(l) => -(x[at(l)] - lse) * w.map_or(1.0, |w| w[l]),
                None => 0.0,
            };
        });
        if let Some(out) = outs.get_mut(1) {
            out.as_mut_slice::<f32>().copy_from_slice(&logp);
        }
        per
    };
    write_loss(reduction, &nll, &lab, w, &mut outs[0]);
    Ok(())
}

/// Rows of classes [N, C]: each row's weighted negative log-likelihood and log-sum-exp, the
/// log-probabilities written into `logp` when it is given.
fn rows_nll(
    x: &[f32],
    c: usize,
    lab: &[Option<usize>],
    w: Option<&[f32]>,
    logp: Option<&mut [f32]>,
) -> (Vec<f32>, Vec<f32>) {
    let row_lse = |row: &[f32]| {
        let max = fastmath::max(row);
        max + fastmath::sum_exp(row, max).ln()
    };
    let lse: Vec<f32> = match logp {
        Some(logp) => logp
            .par_chunks_mut(c)
            .zip(x.par_chunks(c))
            .map(|(lrow, row)| {
                let lse = row_lse(row);
                for (l, &v) in lrow.iter_mut().zip(row) {
                    *l = v - lse;
                }
                lse
            })
            .collect(),
        None => x.par_chunks(c).map(row_lse).collect(),
    };
    let nll = lab
        .iter()
        .enumerate()
        .map(|(p, l)| l.map_or(0.0, |l| -(x[p * c + l] - lse[p]) * w.map_or(1.0, |w| w[l])))
        .collect();
    (nll, lse)
}

/// The loss from the positions' negative log-likelihoods: as they are, summed, or averaged
/// over the summed weights of the positions that count.
fn write_loss(
    reduction: LossReduction,
    nll: &[f32],
    lab: &[Option<usize>],
    w: Option<&[f32]>,
    loss: &mut TensorViewMut,
) {
    match reduction {
        LossReduction::None => loss.as_mut_slice::<f32>().copy_from_slice(nll),
        _ => {
            let total: f64 = nll.iter().map(|&v| v as f64).sum();
            // A mean over no counted position is 0/0: NaN, as in ONNX's reference and PyTorch.
            let den = denominator(reduction, lab, w) as f64;
            loss.as_mut_slice::<f32>()[0] = (total / den) as f32;
        }
    }
}

/// The fused loss (`fuse::loss_lse`) computes in f32; half scores arrive widened (`run`).
fn f32_scores(scores: &TensorView) -> KResult {
    match scores.dtype {
        DType::F32 => Ok(()),
        t => refused!("the fused loss takes f32, f16 or bf16 scores, not {t}"),
    }
}

/// SoftmaxCrossEntropyLse: the loss of scores [N, C] as SoftmaxCrossEntropyLoss's, and each
/// row's log-sum-exp (outs[1], f32 [N]) for the gradient to recompute the softmax from.
pub fn softmax_cross_entropy_lse(
    reduction: LossReduction,
    ignore: Option<i64>,
    scores: &TensorView,
    labels: &TensorView,
    weights: Option<TensorView>,
    outs: &mut [TensorViewMut],
) -> KResult {
    f32_scores(scores)?;
    let c = scores.shape[1];
    let lab = labels_of(labels, c, ignore)?;
    let w = weights.as_ref().map(|w| w.as_slice::<f32>());
    let (nll, lse) = rows_nll(scores.as_slice::<f32>(), c, &lab, w, None);
    outs[1].as_mut_slice::<f32>().copy_from_slice(&lse);
    write_loss(reduction, &nll, &lab, w, &mut outs[0]);
    Ok(())
}

/// dLoss, scores [N, C], lse [N], labels (, weights) → dScores = (exp(x − lse) − onehot) ·
/// w[label] · dLoss / den: SoftmaxCrossEntropyLossGrad with the softmax recomputed.
#[allow(clippy::too_many_arguments)]
pub fn softmax_cross_entropy_lse_grad(
    reduction: LossReduction,
    ignore: Option<i64>,
    dloss: &TensorView,
    scores: &TensorView,
    lse: &TensorView,
    labels: &TensorView,
    weights: Option<TensorView>,
    dx: &mut TensorViewMut,
) -> KResult {
    f32_scores(scores)?;
    let (x, c) = (scores.as_slice::<f32>(), scores.shape[1]);
    let lab = labels_of(labels, c, ignore)?;
    let scales = row_scales(reduction, &lab, weights.as_ref().map(|w| w.as_slice::<f32>()), dloss.as_slice::<f32>());
    let lse = lse.as_slice::<f32>();
    dx.as_mut_slice::<f32>().par_chunks_mut(c).enumerate().for_each(|(p, row)| {
        let (scale, m) = (scales[p], lse[p]);
        for (o, &v) in row.iter_mut().zip(&x[p * c..(p + 1) * c]) {
            *o = fastmath::exp(v - m) * scale;
        }
        if let Some(l) = lab[p] {
            row[l] -= scale;
        }
    });
    Ok(())
}

/// What each position's gradient is scaled by: dLoss (its own, for reduction none) times its
/// label's weight, over the mean's denominator; 0 where the label is ignored.
fn row_scales(reduction: LossReduction, lab: &[Option<usize>], w: Option<&[f32]>, g: &[f32]) -> Vec<f32> {
    let den = denominator(reduction, lab, w);
    let den = if den == 0.0 { 1.0 } else { den };
    lab.iter()
        .enumerate()
        .map(|(p, l)| match (l, reduction) {
            (None, _) => 0.0,
            (Some(l), LossReduction::None) => g[p] * w.map_or(1.0, |w| w[*l]),
            (Some(l), _) => g[0] * w.map_or(1.0, |w| w[*l]) / den,
        })
        .collect()
}

/// SoftmaxCrossEntropyLoss of the element types off the f32 path (f64, f16, bf16), computed
/// in f64.
fn softmax_cross_entropy_reference(
    reduction: LossReduction,
    ignore: Option<i64>,
    scores: &TensorView,
    labels: &TensorView,
    weights: Option<TensorView>,
    outs: &mut [TensorViewMut],
) -> KResult {
    let (n, c, d) = layout(scores.shape);
    let x = scores.to_f64_vec();
    let lab = labels_of(labels, c, ignore)?;
    let w = weights.map(|w| w.to_f64_vec());
    let weight = |l: usize| w.as_ref().map_or(1.0, |w| w[l]);
    let mut logp = vec![0f64; x.len()];
    let mut nll = vec![0f64; n * d];
    for (p, out) in nll.iter_mut().enumerate() {
        let (i, k) = (p / d, p % d);
        let at = |j: usize| i * c * d + j * d + k;
        let max = (0..c).map(|j| x[at(j)]).fold(f64::NEG_INFINITY, f64::max);
        let lse = max + (0..c).map(|j| (x[at(j)] - max).exp()).sum::<f64>().ln();
        for j in 0..c {
            logp[at(j)] = x[at(j)] - lse;
        }
        *out = lab[p].map_or(0.0, |l| -logp[at(l)] * weight(l));
    }
    let loss = match reduction {
        LossReduction::None => nll,
        LossReduction::Sum => vec![nll.iter().sum()],
        LossReduction::Mean => vec![nll.iter().sum::<f64>() / lab.iter().flatten().map(|&l| weight(l)).sum::<f64>()],
    };
    super::write_f64(&loss, &mut outs[0]);
    if let Some(lp) = outs.get_mut(1) {
        super::write_f64(&logp, lp);
    }
    Ok(())
}

/// dLoss, log_prob, labels (, weights) → dScores = (softmax − onehot) · w[label] · dLoss / den.
pub fn softmax_cross_entropy_grad(
    reduction: LossReduction,
    ignore: Option<i64>,
    dloss: &TensorView,
    log_prob: &TensorView,
    labels: &TensorView,
    weights: Option<TensorView>,
    dx: &mut TensorViewMut,
) -> KResult {
    let (n, c, d) = layout(log_prob.shape);
    let lp = log_prob.as_slice::<f32>();
    let lab = labels_of(labels, c, ignore)?;
    let w = weights.map(|w| w.as_slice::<f32>());
    let scales = row_scales(reduction, &lab, w, dloss.as_slice::<f32>());
    if d == 1 {
        // Contiguous rows: softmax − one-hot, vectorized, then the label's element fixed up.
        dx.as_mut_slice::<f32>().par_chunks_mut(c).enumerate().for_each(|(p, row)| {
            let scale = scales[p];
            for (o, &l) in row.iter_mut().zip(&lp[p * c..(p + 1) * c]) {
                *o = fastmath::exp(l) * scale;
            }
            if let Some(l) = lab[p] {
                row[l] -= scale;
            }
        });
        return Ok(());
    }
    let out = SharedSlice::new(dx.as_mut_slice::<f32>());
    (0..n * d).into_par_iter().for_each(|p| {
        let (i, k) = (p / d, p % d);
        let at = |j: usize| i * c * d + j * d + k;
        let scale = scales[p];
        for j in 0..c {
            let onehot = (lab[p] == Some(j)) as u8 as f32;
            unsafe { out.write(at(j), (lp[at(j)].exp() - onehot) * scale) };
        }
    });
    Ok(())
}

/// NegativeLogLikelihoodLoss's positions: each one's label (None where ignored) and weight (0
/// where ignored), and the divisor of a mean (the summed weights; 1 otherwise).
struct NllPositions {
    labels: Vec<Option<usize>>,
    counted: Vec<f64>,
    den: f64,
}

impl NllPositions {
    fn of(
        reduction: LossReduction,
        ignore: Option<i64>,
        classes: usize,
        labels: &TensorView,
        weights: Option<&TensorView>,
    ) -> Result<NllPositions, BackendError> {
        let labels = labels_of(labels, classes, ignore)?;
        let w = weights.map(|w| w.to_f64_vec());
        let counted: Vec<f64> = labels.iter().map(|l| l.map_or(0.0, |l| w.as_ref().map_or(1.0, |w| w[l]))).collect();
        let den = match reduction {
            LossReduction::Mean => counted.iter().sum(),
            _ => 1.0,
        };
        Ok(NllPositions { labels, counted, den })
    }
}

/// NegativeLogLikelihoodLoss over log-probabilities [N, C, D...]: −x[n, label, d]·w[label] per
/// position, summed or averaged over the summed weights (a mean over none is NaN, as SCE's), in
/// f64.
pub fn negative_log_likelihood(
    reduction: LossReduction,
    ignore: Option<i64>,
    input: &TensorView,
    labels: &TensorView,
    weights: Option<TensorView>,
    loss: &mut TensorViewMut,
) -> KResult {
    let (_, c, d) = layout(input.shape);
    let NllPositions { labels, counted, den } = NllPositions::of(reduction, ignore, c, labels, weights.as_ref())?;
    let x = input.to_f64_vec();
    let per: Vec<f64> = labels
        .iter()
        .zip(&counted)
        .enumerate()
        .map(|(p, (l, w))| l.map_or(0.0, |l| -x[(p / d * c + l) * d + p % d] * w))
        .collect();
    match reduction {
        LossReduction::None => super::write_f64(&per, loss),
        _ => super::write_f64(&[per.iter().sum::<f64>() / den], loss),
    }
    Ok(())
}

/// NegativeLogLikelihoodLoss's gradient: −w[label]·dLoss (÷ the summed weights for a mean) at
/// each counted position's label, zeros elsewhere.
pub fn negative_log_likelihood_grad(
    reduction: LossReduction,
    ignore: Option<i64>,
    dloss: &TensorView,
    labels: &TensorView,
    weights: Option<TensorView>,
    dx: &mut TensorViewMut,
) -> KResult {
    let (_, c, d) = layout(dx.shape);
    let NllPositions { labels, counted, den } = NllPositions::of(reduction, ignore, c, labels, weights.as_ref())?;
    let g = dloss.to_f64_vec();
    let mut out = vec![0f64; dx.numel()];
    for (p, (l, w)) in labels.iter().zip(&counted).enumerate() {
        if let Some(l) = l {
            let dl = if reduction == LossReduction::None { g[p] } else { g[0] };
            out[(p / d * c + l) * d + p % d] = -w * dl / den;
        }
    }
    super::write_f64(&out, dx);
    Ok(())
}
