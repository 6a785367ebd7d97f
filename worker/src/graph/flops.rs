//! Model FLOPs of a bound graph: what model FLOPs utilization (MFU) is measured with.
//!
//! Only the dense products count (MatMul, Gemm, Conv, ConvTranspose: 2 FLOPs per multiply-add),
//! and a training step costs three forward passes (the backward pass computes two products per
//! forward one). For GPT-2 this is PaLM's and nanoGPT's estimate, 6N + 12·L·C·T per token:
//! attention is counted in full, not halved for the causal mask.

use super::ir::{Graph, Node};
use crate::op::Op;

/// FLOPs of one forward pass of `g`, whose shapes are bound.
pub fn forward(g: &Graph) -> f64 {
    g.nodes.iter().map(|n| node(g, n)).sum()
}

/// FLOPs of one node's forward computation (0 for everything but the dense products).
pub fn node(g: &Graph, n: &Node) -> f64 {
    let shape = |v: Option<super::ir::ValueId>| v.and_then(|v| g.meta(v)).map(|m| m.shape.clone());
    let numel = |s: &[usize]| s.iter().product::<usize>() as f64;
    let (Some(out), Some(a)) = (shape(n.output(0)), shape(n.input(0))) else { return 0.0 };
    match &n.op {
        Op::MatMul => 2.0 * numel(&out) * a.last().copied().unwrap_or(1) as f64,
        Op::Gemm { trans_a, .. } => {
            let k = if *trans_a { a.first() } else { a.get(1) };
            2.0 * numel(&out) * k.copied().unwrap_or(1) as f64
        }
        // Every output element sums over (input channels / group) × the kernel window.
        Op::Conv { .. } => shape(n.input(1)).map_or(0.0, |w| 2.0 * numel(&out) * numel(&w[1..])),
        // Every input element spreads over (output channels / group) × the kernel window.
        Op::ConvTranspose { .. } => shape(n.input(1)).map_or(0.0, |w| 2.0 * numel(&a) * numel(&w[1..])),
        _ => 0.0,
    }
}

/// FLOPs of one training pass (forward and backward) of `g`.
pub fn training(g: &Graph) -> f64 {
    3.0 * forward(g)
}
