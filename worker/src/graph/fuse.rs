//! Fusion passes, named so they can be listed and switched off. They run on bound graphs,
//! after autodiff, and only rewrite patterns whose intermediate values nobody else reads.

use super::ir::Graph;
use super::op::{Binary, Op, Unary};
use crate::tensor::DType;

/// The passes, in the order they run.
pub const PASSES: &[&str] = &["matmul_bias", "matmul_bias_gelu", "matmul_transpose"];

/// Runs every pass not listed in `disabled`; returns how many nodes each rewrote.
pub fn run(g: &mut Graph, disabled: &[String]) -> Vec<(&'static str, usize)> {
    let mut report = Vec::new();
    for &p in PASSES {
        if disabled.iter().any(|d| d == p) {
            continue;
        }
        let n = match p {
            "matmul_bias" => matmul_bias(g),
            "matmul_bias_gelu" => matmul_bias_gelu(g),
            "matmul_transpose" => matmul_transpose(g),
            _ => 0,
        };
        report.push((p, n));
    }
    g.prune();
    report
}

/// MatMul(A, W) → Add(·, bias[N])  ⇒  FusedMatMul(A, W, bias): the bias is added in the GEMM's
/// output pass instead of a second sweep over the activations.
fn matmul_bias(g: &mut Graph) -> usize {
    let uses = g.use_counts();
    let producers = g.producers();
    let mut fused = 0;
    for i in 0..g.nodes.len() {
        if g.nodes[i].op != Op::Binary(Binary::Add) {
            continue;
        }
        let (Some(l), Some(r)) = (g.nodes[i].input(0), g.nodes[i].input(1)) else { continue };
        for (mm_out, bias) in [(l, r), (r, l)] {
            let Some(p) = producers[mm_out] else { continue };
            let n_cols = match g.meta(mm_out) {
                Some(m) if !m.shape.is_empty() => m.shape[m.shape.len() - 1],
                _ => continue,
            };
            let bias_ok = g.meta(bias).is_some_and(|m| m.shape == [n_cols]);
            let out_same = g.meta(mm_out) == g.nodes[i].output(0).and_then(|o| g.meta(o));
            // The fused kernel is the f32 GEMM's epilogue; other element types stay unfused.
            let f32_out = g.meta(mm_out).is_some_and(|m| m.dtype == DType::F32);
            if g.nodes[p].op != Op::MatMul || uses[mm_out] != 1 || !bias_ok || !out_same || !f32_out {
                continue;
            }
            let (a, w) = (g.nodes[p].inputs[0], g.nodes[p].inputs[1]);
            let out = g.nodes[i].outputs[0];
            let fused_node = &mut g.nodes[i];
            fused_node.op = Op::FusedMatMul { trans_a: false, trans_b: false, activation: None };
            fused_node.inputs = vec![a, w, Some(bias)];
            fused_node.outputs = vec![out];
            // The MatMul's output is now unread; prune removes it.
            fused += 1;
            break;
        }
    }
    fused
}

/// FusedMatMul(…) → Gelu(tanh)  ⇒  FusedMatMul(…, gelu), when the pre-activation is not read
/// by anything else (in training the GELU gradient reads it, so this fuses in inference).
fn matmul_bias_gelu(g: &mut Graph) -> usize {
    let uses = g.use_counts();
    let producers = g.producers();
    let mut fused = 0;
    for i in 0..g.nodes.len() {
        if g.nodes[i].op != Op::Unary(Unary::GeluTanh) {
            continue;
        }
        let Some(x) = g.nodes[i].input(0) else { continue };
        let Some(p) = producers[x] else { continue };
        let Op::FusedMatMul { trans_a, trans_b, activation: None } = g.nodes[p].op else { continue };
        if uses[x] != 1 || g.outputs.contains(&x) {
            continue;
        }
        let inputs = g.nodes[p].inputs.clone();
        let node = &mut g.nodes[i];
        node.op = Op::FusedMatMul { trans_a, trans_b, activation: Some(Unary::GeluTanh) };
        node.inputs = inputs;
        fused += 1;
    }
    fused
}

/// Whether `op` is a Transpose that swaps the last two axes and keeps the others.
fn swaps_last_two(op: &Op) -> bool {
    let Op::Transpose { perm: Some(p) } = op else { return false };
    let r = p.len();
    r >= 2
        && p[r - 1] == r as i64 - 2
        && p[r - 2] == r as i64 - 1
        && p[..r - 2].iter().enumerate().all(|(i, &d)| d == i as i64)
}

/// Transposes around matrix products become GEMM flags (the GEMM reads either layout at the
/// same speed, a transpose is a full copy):
/// - MatMul(A, Bᵀ) ⇒ FusedMatMul(A, B, trans_b), and likewise for A — tied embeddings' logits
///   and their input gradient;
/// - (A·B)ᵀ ⇒ Bᵀ·Aᵀ, when the product is read only by the transpose — the tied embedding's
///   weight gradient.
fn matmul_transpose(g: &mut Graph) -> usize {
    let mut fused = 0;
    let producers = g.producers();
    for i in 0..g.nodes.len() {
        let f32_out = g.nodes[i].output(0).and_then(|o| g.meta(o)).is_some_and(|m| m.dtype == DType::F32);
        let (ta, tb) = match &g.nodes[i].op {
            Op::MatMul if f32_out => (false, false),
            Op::FusedMatMul { trans_a, trans_b, activation: None } => (*trans_a, *trans_b),
            _ => continue,
        };
        let mut flags = [ta, tb];
        let mut changed = false;
        for (k, flag) in flags.iter_mut().enumerate() {
            let Some(x) = g.nodes[i].input(k) else { continue };
            let Some(p) = producers[x] else { continue };
            let rank_ok = g.meta(x).is_some_and(|m| m.shape.len() >= 2);
            if swaps_last_two(&g.nodes[p].op) && rank_ok {
                g.nodes[i].inputs[k] = g.nodes[p].inputs[0];
                *flag = !*flag;
                changed = true;
            }
        }
        if changed {
            let bias = g.nodes[i].inputs.get(2).copied().flatten();
            if matches!(g.nodes[i].op, Op::MatMul) || bias.is_none() {
                g.nodes[i].op = Op::FusedMatMul { trans_a: flags[0], trans_b: flags[1], activation: None };
            } else if let Op::FusedMatMul { trans_a, trans_b, .. } = &mut g.nodes[i].op {
                (*trans_a, *trans_b) = (flags[0], flags[1]);
            }
            fused += 1;
        }
    }
    let uses = g.use_counts();
    let producers = g.producers();
    for i in 0..g.nodes.len() {
        if !swaps_last_two(&g.nodes[i].op) {
            continue;
        }
        let Some(x) = g.nodes[i].input(0) else { continue };
        let Some(p) = producers[x] else { continue };
        let Op::FusedMatMul { trans_a, trans_b, activation: None } = g.nodes[p].op else { continue };
        let two_inputs = g.nodes[p].inputs.len() == 2;
        let plain_2d = g.meta(x).is_some_and(|m| m.shape.len() == 2);
        if uses[x] != 1 || g.outputs.contains(&x) || !two_inputs || !plain_2d {
            continue;
        }
        let (a, b) = (g.nodes[p].inputs[0], g.nodes[p].inputs[1]);
        let node = &mut g.nodes[i];
        node.op = Op::FusedMatMul { trans_a: !trans_b, trans_b: !trans_a, activation: None };
        node.inputs = vec![b, a];
        fused += 1;
    }
    fused
}
