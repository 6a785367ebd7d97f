//! BatchNormalization and its training-mode gradient on the CUDA backend (kernels/channels.cu),
//! over N × C × … tensors: each channel's values cut into shares that a block each sums, the
//! shares added per channel in a fixed order, then one element-wise pass writing Y or dX. X, Y,
//! dY and dX share one type, f32, f16 or bf16 (mixed precision leaves BatchNormalization in its
//! input's type); scale, bias and the statistics are f32. The statistics are the CPU backend's
//! (`crate::kernels::conv`): mean and biased variance summed in f64, which the results are
//! checked against. Fused with the ReLU after it, the forward pass writes Z = max(Y, 0) and the
//! backward pass takes dY = dZ · (Z > 0) as it reads dZ (`Op::BatchNormRelu`).

use super::{channels, elementwise, need_f32, one_float_type, scratch_parts, typed, Dev, Ptr, NULL, V};
use crate::backend::BackendError;
use crate::refused;
use cudarc::driver::LaunchConfig;

/// About how many of a channel's values one block sums: enough for its 256 threads to stream,
/// few enough that ResNet-50's first stage (64 channels of 128 × 56 × 56) spreads over about
/// 1,600 blocks rather than 64.
const SHARE: i64 = 16 * 1024;

/// An N × C × plane tensor's dims, and how its channels are cut for the sums: `share` values a
/// block, `parts` blocks a channel (none where the batch's statistics are not wanted).
struct Layout {
    n: i64,
    c: i64,
    plane: i64,
    share: i64,
    parts: i64,
}

impl Layout {
    /// Shares of at least [`SHARE`] values, at most 65,535 of them (a grid's y dimension), a
    /// channel a grid column (at most 2^31 − 1 of them); `summed` false cuts no shares.
    fn of(x: &V, summed: bool) -> Result<Layout, BackendError> {
        let (n, c, plane) = channels(x.shape())?;
        if c > i32::MAX as usize {
            return refused!("BatchNormalization over {c} channels (the kernels take at most 2^31 - 1)");
        }
        let count = if summed { n * plane } else { 0 };
        let share = SHARE.max((count + 65_534) / 65_535);
        Ok(Layout { n, c: c as i64, plane, share, parts: (count + share - 1) / share })
    }

    /// The scratch of one normalization: the shares' sums ([C, parts, 4] f64), each channel's
    /// shift (f64) and the per-channel statistics the element-wise pass reads (4 f32 a channel).
    fn scratch(&self, dev: Dev) -> Result<Scratch, BackendError> {
        let (c, parts) = (self.c as usize, self.parts as usize);
        let bytes = [(c * parts * 4 * 8).max(8), (c * 8).max(8), (c * 4 * 4).max(4)];
        let [partial, shifts, stats] = scratch_parts(dev, &bytes)?[..] else { unreachable!("three parts") };
        Ok(Scratch { partial, shifts, stats })
    }

    /// Each channel's four f64 sums (`batch_norm_partial`), share by share: of X around its
    /// first value (the shift) and, with `dy`, of dY and dY·X (dY through the fused ReLU of
    /// output `z` where not null). No shares launch nothing.
    fn partial_sums(&self, dev: Dev, x: &V, [dy, z]: [Ptr; 2], at: &Scratch) -> Result<(), BackendError> {
        if self.parts == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (self.c as u32, self.parts as u32, 1),
            block_dim: (super::super::BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let kernel = typed("batch_norm_partial", x.dtype())?;
        let (n, c, plane, share) = (self.n, self.c, self.plane, self.share);
        dev.kernel(&kernel, cfg, &mut params![n, c, plane, share, x.at, dy, z, at.partial, at.shifts])
    }
}

/// Outputs 1 and 2 (the running statistics, or dScale and dBias), f32, where the node has them;
/// null pointers where not.
fn f32_extras(outs: &[V], what: &str) -> Result<[Ptr; 2], BackendError> {
    outs.iter().skip(1).try_for_each(|o| need_f32(o, what))?;
    Ok([1, 2].map(|k| outs.get(k).map_or(NULL, |o| o.at)))
}

/// Where one normalization's temporaries are ([`Layout::scratch`]).
struct Scratch {
    partial: Ptr,
    shifts: Ptr,
    stats: Ptr,
}

/// X, scale, B, input_mean, input_var → Y (max(Y, 0) with `relu`), and in training the
/// running statistics' update where the node has those outputs.
pub fn batch_norm(
    dev: Dev,
    (epsilon, momentum, training, relu): (f32, f32, bool, bool),
    [x, scale, bias, mean, var]: [V; 5],
    outs: &[V],
) -> Result<(), BackendError> {
    let (y, [new_mean, new_var]) = (outs[0], f32_extras(outs, "a running statistic")?);
    let t = one_float_type(&[(&x, "X"), (&y, "Y")])?;
    for (v, what) in [(&scale, "scale"), (&bias, "B"), (&mean, "input_mean"), (&var, "input_var")] {
        need_f32(v, what)?;
    }
    let l = Layout::of(&x, training)?;
    let at = l.scratch(dev)?;
    l.partial_sums(dev, &x, [NULL, NULL], &at)?;
    dev.kernel(
        "batch_norm_finish",
        elementwise(l.c as usize),
        &mut params![
            training as i32,
            l.n,
            l.c,
            l.plane,
            l.parts,
            epsilon,
            momentum,
            at.partial,
            at.shifts,
            mean.at,
            var.at,
            at.stats,
            new_mean,
            new_var
        ],
    )?;
    let total = x.n() as i64;
    dev.kernel(
        &typed("batch_norm_apply", t)?,
        elementwise(x.n()),
        &mut params![total, l.c, l.plane, relu as i32, x.at, at.stats, scale.at, bias.at, y.at],
    )
}

/// dY, X, scale → dX, and dScale, dBias where the node has those outputs; the batch's
/// statistics are recomputed from X in the same read as dY's sums. With `z`, the output of a
/// fused ReLU, dY is dZ · (Z > 0).
pub fn batch_norm_grad(
    dev: Dev,
    epsilon: f32,
    [dy, x, scale]: [V; 3],
    z: Option<V>,
    outs: &[V],
) -> Result<(), BackendError> {
    let (dx, [dscale, dbias]) = (outs[0], f32_extras(outs, "dScale or dBias")?);
    let t = one_float_type(&[(&x, "X"), (&dy, "dY"), (&dx, "dX")])?;
    if let Some(z) = z {
        one_float_type(&[(&x, "X"), (&z, "Z")])?;
    }
    need_f32(&scale, "scale")?;
    let l = Layout::of(&x, true)?;
    let at = l.scratch(dev)?;
    let z = z.map_or(NULL, |z| z.at);
    l.partial_sums(dev, &x, [dy.at, z], &at)?;
    dev.kernel(
        "batch_norm_grad_finish",
        elementwise(l.c as usize),
        &mut params![l.n, l.c, l.plane, l.parts, epsilon, at.partial, at.shifts, at.stats, dscale, dbias],
    )?;
    let total = x.n() as i64;
    dev.kernel(
        &typed("batch_norm_grad_apply", t)?,
        elementwise(x.n()),
        &mut params![total, l.c, l.plane, dy.at, z, x.at, at.stats, scale.at, dx.at],
    )
}
