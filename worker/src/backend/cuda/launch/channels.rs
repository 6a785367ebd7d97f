//! BatchNormalization and its training-mode gradient on the CUDA backend (kernels/channels.cu),
//! over f32 N × C × … tensors: each channel's values cut into shares that a block each sums,
//! the shares added per channel in a fixed order, then one element-wise pass writing Y or dX.
//! The statistics are the CPU backend's (`crate::kernels::conv`): mean and biased variance
//! summed in f64, which the results are checked against.

use super::{channels, elementwise, need_f32, scratch_parts, Dev, Ptr, NULL, V};
use crate::backend::BackendError;
use cudarc::driver::LaunchConfig;

/// About how many of a channel's values one block sums: enough for its 256 threads to stream,
/// few enough that ResNet-50's first stage (64 channels of 128 × 56 × 56) spreads over about
/// 1,600 blocks rather than 64.
const SHARE: i64 = 16 * 1024;

/// An N × C × plane tensor's dims, and how its channels are cut: `share` values a block,
/// `parts` blocks a channel.
struct Layout {
    n: i64,
    c: i64,
    plane: i64,
    share: i64,
    parts: i64,
}

impl Layout {
    /// Shares of at least [`SHARE`] values, at most 65,535 of them (a grid's y dimension).
    fn of(x: &V) -> Result<Layout, BackendError> {
        let (n, c, plane) = channels(x.shape())?;
        let count = n * plane;
        let share = SHARE.max((count + 65_534) / 65_535);
        Ok(Layout { n, c: c as i64, plane, share, parts: (count + share - 1) / share })
    }

    /// The scratch of one normalization: the shares' sums ([C, parts, 4] f64) and the
    /// per-channel statistics the element-wise pass reads (4 f32 a channel).
    fn scratch(&self, dev: Dev) -> Result<[Ptr; 2], BackendError> {
        let (c, parts) = (self.c as usize, self.parts as usize);
        let bytes = [(c * parts * 4 * 8).max(8), (c * 4 * 4).max(4)];
        let [partial, stats] = scratch_parts(dev, &bytes)?[..] else { unreachable!("two parts") };
        Ok([partial, stats])
    }

    /// Each channel's four f64 sums (`batch_norm_partial`), share by share into `partial`: of X
    /// around its first value and, with `dy`, of dY and dY·X. An empty batch launches nothing.
    fn partial_sums(&self, dev: Dev, x: Ptr, dy: Ptr, partial: Ptr) -> Result<(), BackendError> {
        if self.parts == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (self.c.min(u32::MAX as i64) as u32, self.parts as u32, 1),
            block_dim: (super::super::BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        dev.kernel("batch_norm_partial", cfg, &mut params![self.n, self.c, self.plane, self.share, x, dy, partial])
    }
}

/// X, scale, B, input_mean, input_var → Y; in training, the running statistics' update into
/// `new_stats` where the node has those outputs (null pointers where not).
pub fn batch_norm(
    dev: Dev,
    (epsilon, momentum, training): (f32, f32, bool),
    [x, scale, bias, mean, var]: [V; 5],
    y: V,
    new_stats: [Ptr; 2],
) -> Result<(), BackendError> {
    for (v, what) in [(&x, "X"), (&scale, "scale"), (&bias, "B"), (&mean, "input_mean"), (&var, "input_var")] {
        need_f32(v, what)?;
    }
    let l = Layout::of(&x)?;
    let [partial, stats] = l.scratch(dev)?;
    let parts = if training {
        l.partial_sums(dev, x.at, NULL, partial)?;
        l.parts
    } else {
        0
    };
    let [new_mean, new_var] = new_stats;
    dev.kernel(
        "batch_norm_finish",
        elementwise(l.c as usize),
        &mut params![
            training as i32,
            l.n,
            l.c,
            l.plane,
            parts,
            epsilon,
            momentum,
            partial,
            x.at,
            mean.at,
            var.at,
            stats,
            new_mean,
            new_var
        ],
    )?;
    let total = x.n() as i64;
    dev.kernel(
        "batch_norm_apply",
        elementwise(x.n()),
        &mut params![total, l.c, l.plane, x.at, stats, scale.at, bias.at, y.at],
    )
}

/// dY, X, scale → dX, and dScale, dBias where the node has those outputs (null pointers where
/// not); the batch's statistics are recomputed from X in the same read as dY's sums.
pub fn batch_norm_grad(
    dev: Dev,
    epsilon: f32,
    [dy, x, scale]: [V; 3],
    dx: V,
    sums: [Ptr; 2],
) -> Result<(), BackendError> {
    for (v, what) in [(&dy, "dY"), (&x, "X"), (&scale, "scale")] {
        need_f32(v, what)?;
    }
    let l = Layout::of(&x)?;
    let [partial, stats] = l.scratch(dev)?;
    l.partial_sums(dev, x.at, dy.at, partial)?;
    let [dscale, dbias] = sums;
    dev.kernel(
        "batch_norm_grad_finish",
        elementwise(l.c as usize),
        &mut params![l.n, l.c, l.plane, l.parts, epsilon, partial, x.at, stats, dscale, dbias],
    )?;
    let total = x.n() as i64;
    dev.kernel(
        "batch_norm_grad_apply",
        elementwise(x.n()),
        &mut params![total, l.c, l.plane, dy.at, x.at, stats, scale.at, dx.at],
    )
}
