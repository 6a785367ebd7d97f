//! Fused attention on the CUDA backend, with the CPU backend's semantics
//! (`crate::kernels::attention`): the forward kernel keeps each query row's log-sum-exp; the
//! backward pass first takes the softmax gradient's row term (delta) per query row, then the
//! warp kernels sweep dq per query row and dk and dv per key row, none of which races, where the
//! tensor-core kernels sweep once per tile of key rows and add dq's part of each into f32 sums
//! (atomically, as FlashAttention-2 does), which a last pass scales and rounds into dq.
//!
//! Two kernel families compute it: f16 and bf16 heads of a multiple of 16 elements up to 128
//! run on the tensor cores in tiles (kernels/attention_mma.cu); everything else (f32, other
//! head sizes) runs one warp per row (kernels/attention.cu). Both take every layout
//! (`AttentionShape`): a group's rows one row apart, token-major, or packed (q, k and v parts of
//! one operand, rows `qld` and `kld` elements apart, y and dY token-major).

use super::{elementwise, scratch_parts, typed, Dev, Ptr, NULL, V};
use crate::backend::BackendError;
use crate::op::{AttentionLayout, AttentionShape};
use crate::refused;
use crate::tensor::DType;
use cudarc::driver::LaunchConfig;

/// The kernels' largest head (a warp's 32 lanes hold 8 elements each).
const MAX_HEAD: usize = 256;

/// The attributes of the Attention op (and its gradient) that the kernels take.
#[derive(Clone, Copy)]
pub struct Spec {
    pub scale: f32,
    pub causal: bool,
    pub layout: AttentionLayout,
}

/// q's, k's and v's (or qkv's) groups, rows and head, checked against what the kernels take,
/// their type and where each starts (a packed qkv's parts).
fn operands(spec: Spec, ins: &[V]) -> Result<(AttentionShape, DType, [Ptr; 3]), BackendError> {
    let shapes = || ins.iter().map(|x| x.shape().to_vec()).collect::<Vec<_>>();
    let (q, k) = match ins {
        [qkv] => (qkv, qkv),
        [q, k, v] if v.shape() == k.shape() && k.dtype() == q.dtype() && v.dtype() == q.dtype() => (q, k),
        _ => return refused!("attention over {:?} of mixed types or shapes", shapes()),
    };
    let Some(a) = AttentionShape::of(q.shape(), k.shape(), spec.layout) else {
        return refused!("attention over {:?}", shapes());
    };
    if a.d > MAX_HEAD {
        return refused!("attention heads of {} elements; the CUDA kernels take up to {MAX_HEAD}", a.d);
    }
    let at = match ins {
        [qkv] => a.parts().map(|part| Ptr(qkv.at.0 + (part * q.dtype().size()) as u64)),
        _ => [ins[0].at, ins[1].at, ins[2].at],
    };
    Ok((a, q.dtype(), at))
}

/// One warp per row (striding past the target's grid limit).
fn per_warp(dev: Dev, rows: usize) -> LaunchConfig {
    let mut cfg = elementwise(rows * 32);
    cfg.grid_dim.0 = cfg.grid_dim.0.min(dev.attention_grid_limit() as u32);
    cfg
}

/// The tensor-core kernels' register tier (64 or 128, the largest head they hold) for heads of
/// `d` elements of type `t`, or None where the warp kernels run: a GPU before sm_80 (or the warp
/// kernels asked for, `ATTENTION_ENV`), f32, a head
/// that is not a multiple of 16 or is over 128, or an operand not 16-byte aligned (the kernels
/// move eight halves per access; the executor's values are 64-byte aligned).
fn mma_tier(dev: Dev, t: DType, d: usize, operands: &[Ptr]) -> Option<usize> {
    let half = dev.tensor_core_attention() && matches!(t, DType::F16 | DType::BF16);
    let aligned = operands.iter().all(|p| p.0.is_multiple_of(16));
    match d {
        _ if !half || !aligned || !d.is_multiple_of(16) => None,
        16..=64 => Some(64),
        65..=128 => Some(128),
        _ => None,
    }
}

/// A tensor-core kernel's blocks of 4 warps, each block taking `block_rows` rows (of queries
/// forward, of keys backward) of each group; the blocks stride over the tiles past CUDA's grid.
fn per_tile(dev: Dev, groups: usize, rows: usize, block_rows: usize) -> LaunchConfig {
    let tiles = groups * rows.div_ceil(block_rows);
    let blocks = tiles.min(dev.attention_grid_limit());
    LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 }
}

/// The rows a tensor-core block takes: `MMA_ROWS` of attention_mma.cu (16 a warp).
const MMA_ROWS: usize = 64;

/// The query rows a forward block takes: `FWD_TILES` times `MMA_ROWS`, 128 for heads up to 64.
fn forward_block_rows(tier: usize) -> usize {
    if tier <= 64 {
        2 * MMA_ROWS
    } else {
        MMA_ROWS
    }
}

/// The kernels' extents: tq, tk, d, q's and k's heads to a token, the query heads per key head,
/// and the elements from a token's row of a group to the next in q (and dq) and in k and v.
fn extents(a: &AttentionShape) -> [i64; 8] {
    [a.tq, a.tk, a.d, a.interleaved, a.kv_interleaved(), a.rep, a.q_ld(), a.kv_ld()].map(|x| x as i64)
}

fn mma_kernel(family: &str, t: DType, tier: usize) -> Result<String, BackendError> {
    Ok(format!("{}_d{tier}", typed(family, t)?))
}

/// q, k, v (or qkv) -> y, and the rows' log-sum-exp where the graph keeps it.
pub fn forward(dev: Dev, spec: Spec, ins: &[V], y: V, lse: Option<V>) -> Result<(), BackendError> {
    let (a, t, [q, k, v]) = operands(spec, ins)?;
    if lse.is_some_and(|l| l.dtype() != DType::F32) {
        return refused!("attention's log-sum-exp must be f32");
    }
    let lse = lse.map_or(NULL, |l| l.at);
    let (scale, causal) = (spec.scale, spec.causal as i32);
    let [tq, tk, d, inter, kinter, rep, qld, kld] = extents(&a);
    if let Some(tier) = mma_tier(dev, t, a.d, &[q, k, v, y.at]) {
        let g = a.groups as i64;
        return dev.kernel(
            &mma_kernel("attention_mma_fwd", t, tier)?,
            per_tile(dev, a.groups, a.tq, forward_block_rows(tier)),
            &mut params![g, tq, tk, d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, y.at, lse],
        );
    }
    let rows = a.groups * a.tq;
    dev.kernel(
        &typed("attention_fwd", t)?,
        per_warp(dev, rows),
        &mut params![rows as i64, tq, tk, d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, y.at, lse],
    )
}

/// dY, q, k, v (or qkv), y, lse -> dq, dk, dv (or dqkv, in the same parts as qkv).
pub fn backward(dev: Dev, spec: Spec, ins: &[V], grads: &[V]) -> Result<(), BackendError> {
    let (Some((dy, rest)), true) = (ins.split_first(), grads.len() == spec.layout.operands()) else {
        return refused!("attention's gradient of {} inputs into {} outputs", ins.len(), grads.len());
    };
    let Some((operand_values, &[y, lse])) = rest.split_last_chunk::<2>() else {
        return refused!("attention's gradient without y and the log-sum-exp");
    };
    let (a, t, [q, k, v]) = operands(spec, operand_values)?;
    let (_, _, [dq, dk, dv]) = operands(spec, grads)?;
    if dy.dtype() != t || y.dtype() != t || lse.dtype() != DType::F32 || grads[0].dtype() != t {
        return refused!("attention's gradient of {} for q of {t}, lse of {}", dy.dtype(), lse.dtype());
    }
    let (dy, y, lse) = (dy.at, y.at, lse.at);
    // The query rows, and the key rows of the key groups.
    let (qrows, krows) = (a.groups * a.tq, a.groups / a.rep * a.tk);
    let (scale, causal) = (spec.scale, spec.causal as i32);
    let [tq, tk, d, inter, kinter, rep, qld, kld] = extents(&a);
    let tier = mma_tier(dev, t, a.d, &[dy, q, k, v, dq, dk, dv]);
    // The softmax gradient's row term, and for the tensor-core kernels dq's f32 sums (laid out
    // as y is).
    let sums = if tier.is_some() { qrows * a.d * 4 } else { 0 };
    let [delta, dq_sums] = scratch_parts(dev, &[qrows * 4, sums])?[..] else { unreachable!("two parts") };
    dev.kernel(
        &typed("attention_bwd_delta", t)?,
        per_warp(dev, qrows),
        &mut params![qrows as i64, tq, d, inter, dy, y, delta],
    )?;
    if let Some(tier) = tier {
        let g = a.groups as i64;
        dev.fill(dq_sums, 0, sums)?;
        dev.kernel(
            &mma_kernel("attention_mma_bwd", t, tier)?,
            per_tile(dev, a.groups / a.rep, a.tk, MMA_ROWS),
            &mut params![
                g, tq, tk, d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, dy, lse, delta, dq_sums, dk, dv
            ],
        )?;
        let (n, width) = (qrows * a.d, inter * d);
        return dev.kernel(
            &typed("attention_mma_dq", t)?,
            elementwise(n / 4),
            &mut params![n as i64, width, qld, scale, dq_sums, dq],
        );
    }
    dev.kernel(
        &typed("attention_bwd_dq", t)?,
        per_warp(dev, qrows),
        &mut params![qrows as i64, tq, tk, d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, dy, lse, delta, dq],
    )?;
    dev.kernel(
        &typed("attention_bwd_dkv", t)?,
        per_warp(dev, krows),
        &mut params![
            krows as i64,
            tq,
            tk,
            d,
            inter,
            kinter,
            rep,
            qld,
            kld,
            scale,
            causal,
            q,
            k,
            v,
            dy,
            lse,
            delta,
            dk,
            dv
        ],
    )
}
