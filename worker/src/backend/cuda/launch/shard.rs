//! Tensor parallelism's vocab-parallel ops on the CUDA backend (kernels/shard.cu), with the
//! CPU backend's semantics (`crate::kernels::shard`): the sharded embedding lookup and its
//! gradient, and the per-row pieces of the vocab-parallel cross-entropy and its loss.

use super::{elementwise, ids_i64, need_f32, per_row, Dev, V};
use crate::backend::BackendError;
use crate::op::LossReduction;
use crate::refused;

/// (has_ignore, ignore) as the kernels take them.
fn ignore_flags(ignore: Option<i64>) -> (i32, i64) {
    (ignore.is_some() as i32, ignore.unwrap_or(0))
}

fn reduction_code(r: LossReduction) -> i32 {
    match r {
        LossReduction::None => 0,
        LossReduction::Mean => 1,
        LossReduction::Sum => 2,
    }
}

fn two_d(x: &V, what: &str) -> Result<(usize, usize), BackendError> {
    match x.shape() {
        [rows, cols] => Ok((*rows, *cols)),
        s => refused!("{what} of shape {s:?} (2-D expected)"),
    }
}

/// table [rows, cols], ids → [ids.., cols].
pub fn gather(dev: Dev, start: i64, table: V, ids: V, y: V) -> Result<(), BackendError> {
    need_f32(&table, "ShardGather's table")?;
    let (rows, cols) = two_d(&table, "ShardGather's table")?;
    let wide = ids_i64(&ids, "ShardGather's indices")?;
    let count = ids.n();
    let fault = dev.fault(|| "ShardGather: a negative index (not supported under tensor parallelism)".into());
    dev.kernel(
        "shard_gather_f32",
        elementwise(count * cols),
        &mut params![count as i64, rows as i64, cols as i64, start, table.at, ids.at, wide, y.at, fault],
    )
}

/// dY, ids → dTable [rows, cols].
pub fn gather_grad(dev: Dev, start: i64, dy: V, ids: V, dtable: V) -> Result<(), BackendError> {
    need_f32(&dy, "ShardGatherGrad's gradient")?;
    let (rows, cols) = two_d(&dtable, "ShardGatherGrad's output")?;
    let wide = ids_i64(&ids, "ShardGatherGrad's indices")?;
    let count = ids.n();
    dev.fill(dtable.at, 0, dtable.meta.bytes())?;
    dev.kernel(
        "shard_gather_grad_f32",
        elementwise(count * cols),
        &mut params![count as i64, rows as i64, cols as i64, start, dy.at, ids.at, wide, dtable.at],
    )
}

/// scores [N, V], labels, max → Σexp [N], target [N].
pub fn cross_entropy(dev: Dev, start: i64, ignore: Option<i64>, ins: [V; 3], outs: [V; 2]) -> Result<(), BackendError> {
    let [scores, labels, max] = ins;
    need_f32(&scores, "VocabShardCrossEntropy's scores")?;
    let (rows, cols) = two_d(&scores, "VocabShardCrossEntropy's scores")?;
    let wide = ids_i64(&labels, "the labels")?;
    let (has_ignore, ignore) = ignore_flags(ignore);
    dev.kernel(
        "vocab_shard_ce_rows",
        per_row(rows),
        &mut params![
            cols as i64,
            start,
            has_ignore,
            ignore,
            scores.at,
            labels.at,
            wide,
            max.at,
            outs[0].at,
            outs[1].at
        ],
    )
}

/// dΣexp, dTarget, scores, labels, max → dScores.
pub fn cross_entropy_grad(dev: Dev, start: i64, ignore: Option<i64>, ins: [V; 5], dx: V) -> Result<(), BackendError> {
    let [dsums, dtargets, scores, labels, max] = ins;
    need_f32(&scores, "VocabShardCrossEntropyGrad's scores")?;
    let (_, cols) = two_d(&scores, "VocabShardCrossEntropyGrad's scores")?;
    let wide = ids_i64(&labels, "the labels")?;
    let (has_ignore, ignore) = ignore_flags(ignore);
    let n = dx.n();
    dev.kernel(
        "vocab_shard_ce_grad",
        elementwise(n),
        &mut params![
            n as i64,
            cols as i64,
            start,
            has_ignore,
            ignore,
            dsums.at,
            dtargets.at,
            scores.at,
            labels.at,
            wide,
            max.at,
            dx.at
        ],
    )
}

/// Σexp, target, labels → the loss.
pub fn loss(dev: Dev, reduction: LossReduction, ignore: Option<i64>, ins: [V; 3], y: V) -> Result<(), BackendError> {
    let [sums, targets, labels] = ins;
    need_f32(&sums, "VocabParallelLoss's sums")?;
    let wide = ids_i64(&labels, "the labels")?;
    let (has_ignore, ignore) = ignore_flags(ignore);
    dev.kernel(
        "vocab_parallel_loss",
        per_row(1),
        &mut params![
            reduction_code(reduction),
            has_ignore,
            ignore,
            sums.n() as i64,
            sums.at,
            targets.at,
            labels.at,
            wide,
            y.at
        ],
    )
}

/// dLoss, Σexp, labels → dΣexp, dTarget.
pub fn loss_grad(
    dev: Dev,
    reduction: LossReduction,
    ignore: Option<i64>,
    ins: [V; 3],
    outs: [V; 2],
) -> Result<(), BackendError> {
    let [dloss, sums, labels] = ins;
    need_f32(&sums, "VocabParallelLossGrad's sums")?;
    let wide = ids_i64(&labels, "the labels")?;
    let (has_ignore, ignore) = ignore_flags(ignore);
    dev.kernel(
        "vocab_parallel_loss_grad",
        per_row(1),
        &mut params![
            reduction_code(reduction),
            has_ignore,
            ignore,
            sums.n() as i64,
            dloss.at,
            sums.at,
            labels.at,
            wide,
            outs[0].at,
            outs[1].at
        ],
    )
}
