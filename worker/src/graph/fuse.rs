//! Fusion passes, named so they can be listed and switched off. They run on bound graphs,
//! after autodiff, and only rewrite patterns whose intermediate values nobody else reads.

use super::ir::{Graph, Meta, Node, ValueId};
use crate::op::{AttentionLayout, AttentionShape, Binary, Op, Reduce, Unary};
use crate::shape::{norm_axis, slice_range};
use crate::tensor::{DType, Tensor};

/// The passes over the training graph, after autodiff, in the order they run.
pub const PASSES: &[&str] = &[
    "matmul_bias",
    "matmul_bias_gelu",
    "matmul_transpose",
    "matmul_gelu_grad",
    "loss_casts",
    "loss_lse",
    "layer_norm_casts",
    "layer_norm_grad_add",
    "layer_norm_grad_half",
    "residual_layer_norm",
    "batch_norm_relu",
];

/// The passes over the forward graph, before autodiff: the backward pass then differentiates
/// the fused op with its own rule (FlashAttention's backward instead of the chain's).
pub const FORWARD_PASSES: &[&str] = &[
    "rms_norm",
    "silu",
    "swiglu",
    "rotary",
    "attention",
    "attention_shared_heads",
    "attention_token_major",
    "attention_packed",
];

/// Runs every forward pass not listed in `disabled`, leaving the values in `keep` (the loss, a
/// pipeline stage's sends) as they are; returns how many nodes each rewrote.
pub fn run_forward(g: &mut Graph, disabled: &[String], keep: &[ValueId]) -> Vec<(&'static str, usize)> {
    let mut report = Vec::new();
    for &p in FORWARD_PASSES {
        if disabled.iter().any(|d| d == p) {
            continue;
        }
        let n = match p {
            "rms_norm" => rms_norm(g, keep),
            "silu" => silu(g, keep),
            "swiglu" => swiglu(g, keep),
            "rotary" => rotary(g, keep),
            "attention" => attention(g, keep),
            "attention_shared_heads" => attention_shared_heads(g, keep),
            "attention_token_major" => attention_token_major(g, keep),
            "attention_packed" => attention_packed(g, keep),
            _ => 0,
        };
        report.push((p, n));
    }
    report
}

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
            "matmul_gelu_grad" => matmul_gelu_grad(g),
            "loss_casts" => loss_casts(g),
            "loss_lse" => loss_lse(g),
            "layer_norm_casts" => layer_norm_casts(g),
            "layer_norm_grad_add" => layer_norm_grad_add(g),
            "layer_norm_grad_half" => layer_norm_grad_half(g),
            "residual_layer_norm" => residual_layer_norm(g),
            "batch_norm_relu" => batch_norm_relu(g),
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
            // The fused kernel is the float GEMM's epilogue; other element types stay unfused.
            let gemm_out = g.meta(mm_out).is_some_and(|m| gemm_type(m.dtype));
            if g.nodes[p].op != Op::MatMul || uses[mm_out] != 1 || !bias_ok || !out_same || !gemm_out {
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

/// FusedMatMul(…) → Gelu(tanh)  ⇒  FusedMatMul(…, gelu): the GELU in the GEMM's epilogue. When
/// nothing else reads the pre-activation (inference) it goes; when something does (in training,
/// the GELU's gradient, and a recomputed GELU) the fused node keeps it as a second output
/// (cuBLASLt's GELU_AUX), and takes the product's place so that it precedes every reader.
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
        let Some(y) = g.nodes[i].output(0) else { continue };
        let op = Op::FusedMatMul { trans_a, trans_b, activation: Some(Unary::GeluTanh) };
        if uses[x] == 1 && !g.outputs.contains(&x) {
            let inputs = g.nodes[p].inputs.clone();
            let node = &mut g.nodes[i];
            node.op = op;
            node.inputs = inputs;
        } else {
            let product = &mut g.nodes[p];
            product.op = op;
            product.outputs = vec![Some(y), Some(x)];
            // The GELU's node now writes nothing anyone reads; prune removes it.
            g.nodes[i].outputs.clear();
        }
        fused += 1;
    }
    fused
}

/// FusedMatMul(A, B) → UnaryGrad(gelu)(·, X)  ⇒  MatMulUnaryGrad(A, B, X): the product that is
/// the gradient of a GELU's output (dY·W₂ᵀ in an MLP's backward pass) becomes the gradient of
/// its input in the GEMM's epilogue (cuBLASLt's DGELU), when nothing else reads the product.
fn matmul_gelu_grad(g: &mut Graph) -> usize {
    let uses = g.use_counts();
    let producers = g.producers();
    let mut fused = 0;
    for i in 0..g.nodes.len() {
        if g.nodes[i].op != Op::UnaryGrad(Unary::GeluTanh) {
            continue;
        }
        let (Some(d), Some(x)) = (g.nodes[i].input(0), g.nodes[i].input(1)) else { continue };
        let Some(p) = producers[d] else { continue };
        let Op::FusedMatMul { trans_a, trans_b, activation: None } = g.nodes[p].op else { continue };
        let no_bias = g.nodes[p].inputs.len() == 2;
        let alike = g.meta(d).is_some_and(|m| gemm_type(m.dtype)) && g.meta(d) == g.meta(x);
        if uses[d] != 1 || g.outputs.contains(&d) || !no_bias || !alike {
            continue;
        }
        let (a, b) = (g.nodes[p].inputs[0], g.nodes[p].inputs[1]);
        let node = &mut g.nodes[i];
        node.op = Op::MatMulUnaryGrad { trans_a, trans_b, activation: Unary::GeluTanh };
        node.inputs = vec![a, b, Some(x)];
        // The product is now unread; prune removes it.
        fused += 1;
    }
    fused
}

/// Cast(scores: half → f32) → SoftmaxCrossEntropyLoss  ⇒  the loss reads the half scores, and
/// SoftmaxCrossEntropyLossGrad → Cast(f32 → half)  ⇒  the gradient is written in half: mixed
/// precision's logits ([B·T, V], the largest activation of a language model) are then neither
/// copied to f32 nor their gradient copied back, two sweeps each way over V columns per token.
/// The kernels widen on loading and round once on storing, so the results are the same bits.
/// The fused nodes' types (half scores, f32 loss; an f32 log-probability, a half gradient) are
/// not what `infer` gives the ONNX ops; nothing infers them again, fusion being the last pass.
fn loss_casts(g: &mut Graph) -> usize {
    let uses = g.use_counts();
    let producers = g.producers();
    let dtype = |g: &Graph, v: ValueId| g.meta(v).map(|m| m.dtype);
    let is_half = |g: &Graph, v: ValueId| matches!(dtype(g, v), Some(DType::F16 | DType::BF16));
    let mut fused = 0;
    for i in 0..g.nodes.len() {
        match g.nodes[i].op {
            // The loss reading a widened value: it reads the half one.
            Op::SoftmaxCrossEntropyLoss { .. } => {
                let Some(s) = g.nodes[i].input(0) else { continue };
                let Some(p) = producers[s] else { continue };
                let Some(h) = g.nodes[p].input(0).filter(|&h| is_half(g, h)) else { continue };
                if g.nodes[p].op != (Op::Cast { to: DType::F32 }) || uses[s] != 1 || g.outputs.contains(&s) {
                    continue;
                }
                g.nodes[i].inputs[0] = Some(h);
                // The cast is now unread; prune removes it.
                fused += 1;
            }
            // A cast down of the loss's f32 gradient: the gradient writes the half value.
            Op::Cast { .. } => {
                let (Some(dx), Some(h)) = (g.nodes[i].input(0), g.nodes[i].output(0)) else { continue };
                let Some(p) = producers[dx] else { continue };
                let from_loss = matches!(g.nodes[p].op, Op::SoftmaxCrossEntropyLossGrad { .. });
                let alone = uses[dx] == 1 && !g.outputs.contains(&dx);
                if !from_loss || !alone || dtype(g, dx) != Some(DType::F32) || !is_half(g, h) {
                    continue;
                }
                g.nodes[p].outputs[0] = Some(h);
                g.nodes[i].outputs.clear();
                fused += 1;
            }
            _ => {}
        }
    }
    fused
}

/// LayerNormalization → Cast(f32 → half)  ⇒  the LayerNorm writes the half value, and
/// Cast(half → f32) → LayerNormGrad's dY  ⇒  the gradient reads the half value: under mixed
/// precision the residual stream is f32 and the products after each LayerNorm (and their input
/// gradients, before it) are half, so each LayerNorm had a cast sweep on each side, forward and
/// backward. The kernels compute in f32 and round (or widen) as the casts did: the same bits.
/// The statistics stay f32.
fn layer_norm_casts(g: &mut Graph) -> usize {
    let uses = g.use_counts();
    let producers = g.producers();
    let dtype = |g: &Graph, v: ValueId| g.meta(v).map(|m| m.dtype);
    let is_half = |g: &Graph, v: ValueId| matches!(dtype(g, v), Some(DType::F16 | DType::BF16));
    let alone = |v: ValueId| uses[v] == 1 && !g.outputs.contains(&v);
    let mut fused = 0;
    for i in 0..g.nodes.len() {
        match g.nodes[i].op {
            // A cast down of the LayerNorm's f32 output: the LayerNorm writes the half value.
            Op::Cast { .. } => {
                let (Some(y), Some(h)) = (g.nodes[i].input(0), g.nodes[i].output(0)) else { continue };
                let Some(p) = producers[y] else { continue };
                let from_norm = matches!(g.nodes[p].op, Op::LayerNorm { .. }) && g.nodes[p].output(0) == Some(y);
                if !from_norm || !alone(y) || dtype(g, y) != Some(DType::F32) || !is_half(g, h) {
                    continue;
                }
                g.nodes[p].outputs[0] = Some(h);
                g.nodes[i].outputs.clear();
                fused += 1;
            }
            // The gradient reading a widened dY: it reads the half one.
            Op::LayerNormGrad { .. } => {
                let Some(dy) = g.nodes[i].input(0) else { continue };
                let Some(p) = producers[dy] else { continue };
                let Some(h) = g.nodes[p].input(0).filter(|&h| is_half(g, h)) else { continue };
                if g.nodes[p].op != (Op::Cast { to: DType::F32 }) || !alone(dy) {
                    continue;
                }
                g.nodes[i].inputs[0] = Some(h);
                // The cast is now unread; prune removes it.
                fused += 1;
            }
            _ => {}
        }
    }
    fused
}

/// Add(G, LayerNormGrad's dX)  ⇒  LayerNormGrad(…, G) writing the sum: a pre-norm block's
/// residual stream feeds its LayerNorm and the residual add, so autodiff sums the two gradients
/// of every block's input, an f32 sweep that reads both and writes the sum. The LayerNorm's
/// gradient adds G as it writes dX instead (one more read, no sweep). G must be computed before
/// the LayerNormGrad runs, f32 and shaped like dX (no broadcast), and dX read by the Add alone.
fn layer_norm_grad_add(g: &mut Graph) -> usize {
    let uses = g.use_counts();
    let producers = g.producers();
    let mut fused = 0;
    for i in 0..g.nodes.len() {
        if g.nodes[i].op != Op::Binary(Binary::Add) || g.nodes[i].inputs.len() != 2 {
            continue;
        }
        let (Some(l), Some(r), Some(sum)) = (g.nodes[i].input(0), g.nodes[i].input(1), g.nodes[i].output(0)) else {
            continue;
        };
        for (dx, other) in [(l, r), (r, l)] {
            let Some(p) = producers[dx] else { continue };
            let node = &g.nodes[p];
            let is_dx = matches!(node.op, Op::LayerNormGrad { .. }) && node.output(0) == Some(dx);
            let f32_alike = g.meta(dx).is_some_and(|m| m.dtype == DType::F32)
                && g.meta(other) == g.meta(dx)
                && g.meta(sum) == g.meta(dx);
            let ready = producers[other].is_none_or(|q| q < p);
            if !is_dx || node.inputs.len() != 5 || uses[dx] != 1 || g.outputs.contains(&dx) || !f32_alike || !ready {
                continue;
            }
            g.nodes[p].inputs.push(Some(other));
            g.nodes[p].outputs[0] = Some(sum);
            // The Add now writes nothing anyone reads; prune removes it.
            g.nodes[i].outputs.clear();
            fused += 1;
            break;
        }
    }
    fused
}

/// LayerNormGrad's dX → Cast(f32 → half)  ⇒  LayerNormGrad writing the half copy as well: under
/// mixed precision a block's input gradient (f32, the residual stream's, after
/// `layer_norm_grad_add`) is also read in half by the products before it, through a cast that
/// read the f32 dX back. The kernel rounds as it writes dX (the same bits as the cast); dX
/// stays f32 for the residual stream. The half type must be dY's (what the kernel writes).
fn layer_norm_grad_half(g: &mut Graph) -> usize {
    let producers = g.producers();
    let dtype = |g: &Graph, v: ValueId| g.meta(v).map(|m| m.dtype);
    let mut fused = 0;
    for i in 0..g.nodes.len() {
        let Op::Cast { to } = g.nodes[i].op else { continue };
        let (Some(dx), Some(h)) = (g.nodes[i].input(0), g.nodes[i].output(0)) else { continue };
        let Some(p) = producers[dx] else { continue };
        let grad = &g.nodes[p];
        let is_dx =
            matches!(grad.op, Op::LayerNormGrad { .. }) && grad.output(0) == Some(dx) && grad.outputs.len() == 3;
        let dy_type = grad.input(0).and_then(|dy| dtype(g, dy));
        let half = matches!(to, DType::F16 | DType::BF16) && dy_type == Some(to);
        if !is_dx || !half || dtype(g, dx) != Some(DType::F32) || grad.outputs.iter().any(Option::is_none) {
            continue;
        }
        g.nodes[p].outputs.push(Some(h));
        g.nodes[i].outputs.clear();
        fused += 1;
    }
    fused
}

/// Add(X, B) → LayerNorm  ⇒  ResidualLayerNorm(X, B, …): a pre-norm block's residual add and
/// the next block's LayerNorm, one kernel that writes the sum S (the residual stream, which the
/// next add and the LayerNorm's gradient read) and the normalized Y, instead of an add that
/// writes S and a LayerNorm that reads it back. Under mixed precision the branch arrives as a
/// Cast of the half product to f32, read by the add alone: the fused node reads the half value
/// (the cast goes). X and S are f32 of one shape, B of Y's type. The fused node takes the
/// LayerNorm's place, so nothing between the two may read S (the add's inputs are ready there).
fn residual_layer_norm(g: &mut Graph) -> usize {
    let uses = g.use_counts();
    let producers = g.producers();
    let dtype = |v: ValueId| g.meta(v).map(|m| m.dtype);
    // (the LayerNorm, the add, X, B)
    let mut rewrites: Vec<(usize, usize, ValueId, ValueId)> = Vec::new();
    for l in 0..g.nodes.len() {
        let norm = &g.nodes[l];
        let (Some(s), Some(y)) = (norm.input(0), norm.output(0)) else { continue };
        let Some(a) = producers[s].filter(|&a| g.nodes[a].op == Op::Binary(Binary::Add)) else { continue };
        let (add, Some(sum)) = (&g.nodes[a], g.meta(s)) else { continue };
        let (Some(p), Some(q)) = (add.input(0), add.input(1)) else { continue };
        let read_between = g.nodes[a + 1..l].iter().any(|n| n.inputs.contains(&Some(s)));
        let first = rewrites.iter().all(|&(_, earlier, ..)| earlier != a);
        let plain = matches!(norm.op, Op::LayerNorm { .. }) && norm.outputs.iter().all(Option::is_some);
        if !plain || add.inputs.len() != 2 || sum.dtype != DType::F32 || read_between || !first {
            continue;
        }
        let found = [(p, q), (q, p)].into_iter().find_map(|(x, b)| {
            // The branch, or the half value it was widened from when the add alone reads that.
            let widened = producers[b].filter(|&c| g.nodes[c].op == (Op::Cast { to: DType::F32 }));
            let alone = uses[b] == 1 && !g.outputs.contains(&b);
            let half = widened.and_then(|c| g.nodes[c].input(0)).filter(|&h| alone && dtype(h) == dtype(y));
            let branch = half.unwrap_or(b);
            let fits = g.meta(x) == Some(sum) && g.meta(branch).is_some_and(|m| m.shape == sum.shape);
            (fits && dtype(branch) == dtype(y)).then_some((x, branch))
        });
        if let Some((x, branch)) = found {
            rewrites.push((l, a, x, branch));
        }
    }
    for &(l, a, x, branch) in &rewrites {
        let s = g.nodes[a].outputs[0];
        let norm = &mut g.nodes[l];
        let Op::LayerNorm { axis, epsilon, rms } = norm.op else { unreachable!("checked above") };
        norm.op = Op::ResidualLayerNorm { axis, epsilon, rms };
        norm.inputs.splice(0..1, [Some(x), Some(branch)]);
        norm.outputs.insert(1, s);
        // The add now writes nothing anyone reads; prune removes it (and a folded cast).
        g.nodes[a].outputs.clear();
    }
    rewrites.len()
}

/// BatchNormalization (training) → ReLU, with ReLU's gradient feeding the norm's  ⇒
/// BatchNormRelu writing the ReLU's output Z, and BatchNormReluGrad reading dZ and Z: the
/// norm's output Y is neither written nor kept for the ReLU's gradient (ResNet's norms before
/// a ReLU, two in each bottleneck), and neither ReLU pass runs. The same bits: Z > 0 exactly
/// where Y > 0, and dY = dZ · (Z > 0) is taken as the norm's gradient reads dZ.
fn batch_norm_relu(g: &mut Graph) -> usize {
    let (producers, uses) = (g.producers(), g.use_counts());
    let readers = g.readers();
    let inner = |v: ValueId, n: usize| uses[v] == n && !g.outputs.contains(&v);
    let mut rewrites = Vec::new();
    for (i, grad) in g.nodes.iter().enumerate() {
        let Op::BatchNormGrad { epsilon: grad_epsilon } = grad.op else { continue };
        let Some(dy) = grad.input(0).filter(|&dy| inner(dy, 1)) else { continue };
        let Some(relu_grad) = producers[dy].filter(|&p| g.nodes[p].op == Op::UnaryGrad(Unary::Relu)) else { continue };
        let (Some(dz), Some(y)) = (g.nodes[relu_grad].input(0), g.nodes[relu_grad].input(1)) else { continue };
        let Some(norm) = producers[y].filter(|_| inner(y, 2)) else { continue };
        let Op::BatchNorm { epsilon, momentum, training: true } = g.nodes[norm].op else { continue };
        let relu = readers[y].iter().copied().find(|&r| r != relu_grad && g.nodes[r].op == Op::Unary(Unary::Relu));
        let Some((relu, z)) = relu.and_then(|r| Some((r, g.nodes[r].output(0)?))) else { continue };
        let same_norm = grad.input(1) == g.nodes[norm].input(0) && grad.input(2) == g.nodes[norm].input(1);
        if same_norm && g.nodes[norm].output(0) == Some(y) {
            rewrites.push((norm, relu, relu_grad, i, z, dz, (epsilon, momentum, grad_epsilon)));
        }
    }
    for &(norm, relu, relu_grad, grad, z, dz, (epsilon, momentum, grad_epsilon)) in &rewrites {
        g.nodes[norm].op = Op::BatchNormRelu { epsilon, momentum };
        g.nodes[norm].outputs[0] = Some(z);
        // The ReLU and its gradient now write nothing anyone reads; prune removes them.
        g.nodes[relu].outputs.clear();
        g.nodes[relu_grad].outputs.clear();
        let node = &mut g.nodes[grad];
        node.op = Op::BatchNormReluGrad { epsilon: grad_epsilon };
        node.inputs[0] = Some(dz);
        node.inputs.truncate(3);
        node.inputs.push(Some(z));
    }
    rewrites.len()
}

/// SoftmaxCrossEntropyLoss → log-probabilities → SoftmaxCrossEntropyLossGrad  ⇒
/// SoftmaxCrossEntropyLse → each row's log-sum-exp → SoftmaxCrossEntropyLseGrad: the loss keeps
/// one f32 per row instead of the [N, C] f32 log-probabilities, and the gradient recomputes the
/// softmax from the scores. For a language model's logits that is the largest tensor of the
/// step (GPT-2 at micro-batch 64: 13 GB) neither written nor read back; the scores (half under
/// mixed precision, after `loss_casts`) live until the backward pass instead. Same bits: both
/// forms compute exp(x − lse) in f32 from the same lse. Rows of classes ([N, C]) only.
fn loss_lse(g: &mut Graph) -> usize {
    let uses = g.use_counts();
    let producers = g.producers();
    let mut fused = 0;
    for i in 0..g.nodes.len() {
        let Op::SoftmaxCrossEntropyLossGrad { reduction, ignore_index } = g.nodes[i].op else { continue };
        let (Some(log_prob), Some(dx)) = (g.nodes[i].input(1), g.nodes[i].output(0)) else { continue };
        let Some(p) = producers[log_prob] else { continue };
        let loss = &g.nodes[p];
        let Some(scores) = loss.input(0).filter(|_| matches!(loss.op, Op::SoftmaxCrossEntropyLoss { .. })) else {
            continue;
        };
        let (Some(s), Some(d)) = (g.meta(scores), g.meta(dx)) else { continue };
        let alone = uses[log_prob] == 1 && !g.outputs.contains(&log_prob);
        if !alone || s.shape.len() != 2 || s.dtype != d.dtype || loss.output(1) != Some(log_prob) {
            continue;
        }
        let (rows, name) = (s.shape[0], format!("{}_lse", loss.name));
        let lse = g.fresh(&name);
        g.values[lse].meta = Some(Meta::new(DType::F32, &[rows]));
        g.nodes[p].op = Op::SoftmaxCrossEntropyLse { reduction, ignore_index };
        g.nodes[p].outputs[1] = Some(lse);
        let grad = &mut g.nodes[i];
        grad.op = Op::SoftmaxCrossEntropyLseGrad { reduction, ignore_index };
        // dLoss, log_prob, labels (, weights) → dLoss, scores, lse, labels (, weights).
        grad.inputs.splice(1..2, [Some(scores), Some(lse)]);
        fused += 1;
    }
    fused
}

/// The element types the GEMMs behind FusedMatMul take (f32, and mixed precision's halves).
fn gemm_type(t: DType) -> bool {
    matches!(t, DType::F32 | DType::F16 | DType::BF16)
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
        let gemm_out = g.nodes[i].output(0).and_then(|o| g.meta(o)).is_some_and(|m| gemm_type(m.dtype));
        let (ta, tb) = match &g.nodes[i].op {
            Op::MatMul if gemm_out => (false, false),
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

/// One attention found in the forward graph, by node index.
struct AttentionChain {
    /// The nodes from the scores' product to the softmax, which go.
    gone: Vec<usize>,
    /// The product with v, which becomes the fused node.
    context: usize,
    q: ValueId,
    /// kᵀ [.., D, T] as the scores' product reads it.
    k_t: ValueId,
    v: ValueId,
    scale: f32,
    causal: bool,
}

/// x / Sqrt(ReduceMean(x²) + ε) · scale  ⇒  LayerNorm { rms } (x, scale): RMSNorm in the forms
/// the builtin Llama and binding (ONNX's RMSNormalization) write out, and Hugging Face's
/// LlamaRMSNorm as both PyTorch exporters write it (x² as Pow(x, 2), and x · Reciprocal(√…) or
/// x · (1 / √…) for the division, a cast to f32 before the scale): the mean over trailing dims,
/// a scale of those dims. One kernel each way instead of six element-wise ops forward and about
/// twice as many backward. f32 only: the kernels read an f32 x, and the forward passes run
/// before mixed precision's casts.
fn rms_norm(g: &mut Graph, keep: &[ValueId]) -> usize {
    rewrite_chains(g, keep, rms_norm_chain)
}

/// The RMSNorm whose scaling (the last Mul) is node `i`, if it is one.
fn rms_norm_chain(m: &ChainMatcher, i: usize) -> Option<Fused> {
    let (g, node) = (m.g, &m.g.nodes[i]);
    if node.op != Op::Binary(Binary::Mul) {
        return None;
    }
    let (a, b) = (node.input(0)?, node.input(1)?);
    [(a, b), (b, a)].into_iter().find_map(|(normalized, scale)| {
        let mut gone = Vec::new();
        let mut n = m.inner(normalized)?;
        // A cast that changes nothing (f32 to f32) before the scale.
        if g.nodes[n].op == (Op::Cast { to: DType::F32 }) && g.meta(g.nodes[n].input(0)?)?.dtype == DType::F32 {
            gone.push(n);
            n = m.inner(g.nodes[n].input(0)?)?;
        }
        gone.push(n);
        let (l, r) = (g.nodes[n].input(0)?, g.nodes[n].input(1)?);
        let (x, shifted) = match g.nodes[n].op {
            Op::Binary(Binary::Div) => (l, m.sqrt_of(r, &mut gone)?),
            // Either factor may be the inverse root.
            Op::Binary(Binary::Mul) => {
                let mut via_r = gone.clone();
                if let Some(shifted) = m.inverse_sqrt_of(r, &mut via_r) {
                    gone = via_r;
                    (l, shifted)
                } else {
                    (r, m.inverse_sqrt_of(l, &mut gone)?)
                }
            }
            _ => return None,
        };
        let (epsilon, axis) = m.mean_square_plus_eps(shifted, x, &mut gone)?;
        let (xm, sm) = (g.meta(x)?, g.meta(scale)?);
        let fits = xm.dtype == DType::F32 && sm.dtype == DType::F32 && sm.shape == xm.shape[axis..];
        (fits && g.meta(node.output(0)?) == Some(xm)).then_some(())?;
        let op = Op::LayerNorm { axis: axis as i64, epsilon, rms: true };
        Some(Fused { op, inputs: vec![x, scale], gone })
    })
}

/// x · Sigmoid(x)  ⇒  Silu(x): SwiGLU's gate as the builtin Llama and PyTorch's exporters write
/// SiLU. One kernel each way instead of two forward and four backward (the product's two
/// gradients, the sigmoid's and their sum), and no sigmoid kept for the backward pass.
fn silu(g: &mut Graph, keep: &[ValueId]) -> usize {
    let (producers, uses) = (g.producers(), g.use_counts());
    let m = ChainMatcher { g, producers: &producers, uses: &uses, keep };
    let mut gone = vec![false; g.nodes.len()];
    let mut rewrites = Vec::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let (Some(a), Some(b)) = (node.input(0), node.input(1)) else { continue };
        if node.op != Op::Binary(Binary::Mul) {
            continue;
        }
        let sigmoid_of = |s: ValueId, x: ValueId| {
            let p = m.inner(s)?;
            (g.nodes[p].op == Op::Unary(Unary::Sigmoid) && g.nodes[p].input(0) == Some(x) && !gone[p]).then_some(p)
        };
        let Some((x, p)) = sigmoid_of(b, a).map(|p| (a, p)).or_else(|| sigmoid_of(a, b).map(|p| (b, p))) else {
            continue;
        };
        gone[p] = true;
        rewrites.push((i, x));
    }
    for &(i, x) in &rewrites {
        let node = &mut g.nodes[i];
        node.op = Op::Unary(Unary::Silu);
        node.inputs = vec![Some(x)];
    }
    drop_nodes(g, &gone);
    rewrites.len()
}

/// Silu(a) · b  ⇒  Swiglu(a, b): Llama's MLP gate times its up projection (after `silu` made the
/// gate one op), a and b of one shape. One kernel each way instead of two forward and three
/// backward (the product's two gradients and the SiLU's), and no SiLU(a) kept for the backward.
fn swiglu(g: &mut Graph, keep: &[ValueId]) -> usize {
    let (producers, uses) = (g.producers(), g.use_counts());
    let m = ChainMatcher { g, producers: &producers, uses: &uses, keep };
    let mut gone = vec![false; g.nodes.len()];
    let mut rewrites = Vec::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let (Some(l), Some(r)) = (node.input(0), node.input(1)) else { continue };
        if node.op != Op::Binary(Binary::Mul) || g.meta(l) != g.meta(r) {
            continue;
        }
        // The gate may be either factor.
        let gate_of = |s: ValueId| {
            let p = m.inner(s)?;
            let a = g.nodes[p].input(0)?;
            (g.nodes[p].op == Op::Unary(Unary::Silu) && !gone[p] && g.meta(a) == g.meta(s)).then_some((p, a))
        };
        let Some(((p, a), up)) = gate_of(l).map(|v| (v, r)).or_else(|| gate_of(r).map(|v| (v, l))) else { continue };
        if !g.meta(a).is_some_and(|t| t.dtype.is_float()) {
            continue;
        }
        gone[p] = true;
        rewrites.push((i, a, up));
    }
    for &(i, a, up) in &rewrites {
        let node = &mut g.nodes[i];
        node.op = Op::Swiglu;
        node.inputs = vec![Some(a), Some(up)];
    }
    drop_nodes(g, &gone);
    rewrites.len()
}

/// x · cos + Concat(−x₂, x₁) · sin  ⇒  Rotary(x, cos, sin): the rotary position embedding as the
/// builtin Llama and Hugging Face's `apply_rotary_pos_emb` (both PyTorch exporters) write it,
/// x's halves taken along the last dim by a Split or two Slices. One kernel each way instead of
/// six forward (Split, Neg, Concat, two products and their sum) and about as many backward.
fn rotary(g: &mut Graph, keep: &[ValueId]) -> usize {
    rewrite_chains(g, keep, rotary_chain)
}

/// The rotary embedding whose sum (an Add) is node `i`, if it is one.
fn rotary_chain(m: &ChainMatcher, i: usize) -> Option<Fused> {
    let (g, node) = (m.g, &m.g.nodes[i]);
    if node.op != Op::Binary(Binary::Add) {
        return None;
    }
    let (a, b) = (node.input(0)?, node.input(1)?);
    let factors = |p: usize| Some((g.nodes[p].input(0)?, g.nodes[p].input(1)?));
    // The sum's terms in either order: x · cos (straight), the rotated halves' product (turned).
    [(a, b), (b, a)].into_iter().find_map(|(straight, turned)| {
        let (p, q) = (m.inner(straight)?, m.inner(turned)?);
        let mul = Op::Binary(Binary::Mul);
        (g.nodes[p].op == mul && g.nodes[q].op == mul).then_some(())?;
        let (l, r) = factors(q)?;
        let mut gone = vec![p, q];
        let (x, sin) = match m.rotated_half(l, &mut gone) {
            Some(x) => (x, r),
            None => (m.rotated_half(r, &mut gone)?, l),
        };
        let cos = match factors(p)? {
            (v, cos) if v == x => cos,
            (cos, v) if v == x => cos,
            _ => return None,
        };
        let xm = g.meta(x)?;
        // Float only: the kernels rotate floats (an integer chain stays as it is).
        let tables = [cos, sin].iter().all(|&t| g.meta(t).is_some_and(|t| t.dtype == xm.dtype));
        (xm.dtype.is_float() && tables && g.meta(node.output(0)?) == Some(xm)).then_some(())?;
        Some(Fused { op: Op::Rotary, inputs: vec![x, cos, sin], gone })
    })
}

/// A chain a forward pass found: the op and inputs its last node takes, and the nodes before it
/// that the fused node replaces.
struct Fused {
    op: Op,
    inputs: Vec<ValueId>,
    gone: Vec<usize>,
}

/// Makes each node for which `find` finds a chain the fused op, dropping the nodes it replaces;
/// returns how many.
fn rewrite_chains(g: &mut Graph, keep: &[ValueId], find: fn(&ChainMatcher, usize) -> Option<Fused>) -> usize {
    let (producers, uses) = (g.producers(), g.use_counts());
    let m = ChainMatcher { g, producers: &producers, uses: &uses, keep };
    let chains: Vec<(usize, Fused)> = (0..g.nodes.len()).filter_map(|i| Some((i, find(&m, i)?))).collect();
    let mut gone = vec![false; g.nodes.len()];
    for (i, c) in chains.iter() {
        c.gone.iter().for_each(|&n| gone[n] = true);
        let node = &mut g.nodes[*i];
        node.op = c.op.clone();
        node.inputs = c.inputs.iter().map(|&v| Some(v)).collect();
    }
    drop_nodes(g, &gone);
    chains.len()
}

/// Removes the nodes marked in `gone` (indexed as `g.nodes` is).
fn drop_nodes(g: &mut Graph, gone: &[bool]) {
    let mut index = 0;
    g.nodes.retain(|_| {
        index += 1;
        !gone[index - 1]
    });
}

/// Steps over a chain of ops that a forward pass replaces: each checks that a value is made by
/// the op it expects and read only by the chain, and (the RMSNorm's) notes that op's node as
/// replaced.
struct ChainMatcher<'a> {
    g: &'a Graph,
    producers: &'a [Option<usize>],
    uses: &'a [usize],
    keep: &'a [ValueId],
}

impl ChainMatcher<'_> {
    /// The node making `v`, if `v` is read once (by the chain) and kept by no one.
    fn inner(&self, v: ValueId) -> Option<usize> {
        (self.uses[v] == 1 && !self.keep.contains(&v) && !self.g.outputs.contains(&v)).then_some(())?;
        self.producers[v]
    }

    /// `v` = Concat(−x₂, x₁) along the last dim, x₁ and x₂ x's halves there (a Split's two
    /// outputs or two Slices): x.
    fn rotated_half(&self, v: ValueId, gone: &mut Vec<usize>) -> Option<ValueId> {
        let g = self.g;
        let cat = self.inner(v)?;
        let (neg, x1) = (g.nodes[cat].input(0)?, g.nodes[cat].input(1)?);
        let rank = g.meta(v)?.shape.len();
        let last = Some(rank.checked_sub(1)?);
        let Op::Concat { axis } = g.nodes[cat].op else { return None };
        (g.nodes[cat].inputs.len() == 2 && norm_axis(axis, rank) == last).then_some(())?;
        let n = self.inner(neg)?;
        (g.nodes[n].op == Op::Unary(Unary::Neg)).then_some(())?;
        let x2 = g.nodes[n].input(0)?;
        let (s1, s2) = (self.inner(x1)?, self.inner(x2)?);
        let x = g.nodes[s1].input(0)?;
        let d = *g.meta(x)?.shape.last()?;
        let halves = match (&g.nodes[s1].op, &g.nodes[s2].op) {
            (Op::Split { axis, .. }, _) if s1 == s2 => {
                let outs = &g.nodes[s1].outputs;
                let halved = [x1, x2].iter().all(|&h| g.meta(h).and_then(|m| m.shape.last()) == Some(&(d / 2)));
                halved && norm_axis(*axis, rank) == last && outs[..] == [Some(x1), Some(x2)]
            }
            (Op::Slice { .. }, Op::Slice { .. }) => {
                g.nodes[s2].input(0) == Some(x) && self.half_of(s1, d) == Some(0) && self.half_of(s2, d) == Some(1)
            }
            _ => false,
        };
        (halves && d % 2 == 0).then_some(())?;
        gone.extend(if s1 == s2 { vec![cat, n, s1] } else { vec![cat, n, s1, s2] });
        Some(x)
    }

    /// Which half (0 or 1) of the last dim, of size `d`, Slice node `s` takes, if it takes one.
    fn half_of(&self, s: usize, d: usize) -> Option<usize> {
        let Op::Slice { starts, ends, axes, steps } = &self.g.nodes[s].op else { return None };
        let rank = self.g.meta(self.g.nodes[s].input(0)?)?.shape.len();
        let one_axis =
            axes.len() == 1 && norm_axis(axes[0], rank) == Some(rank.checked_sub(1)?) && steps.first() == Some(&1);
        let (start, _, count) = slice_range(*starts.first()?, *ends.first()?, 1, d);
        let h = d / 2;
        (one_axis && count == h).then_some(())?;
        [0, h as i64].iter().position(|&s| s == start)
    }

    /// The value of a constant scalar.
    fn scalar(&self, v: ValueId) -> Option<f64> {
        let t = self.g.initializers.get(&v).filter(|_| self.producers[v].is_none())?;
        (t.numel() == 1).then(|| t.to_f64_vec()[0])
    }

    /// `v` = Sqrt(s): s.
    fn sqrt_of(&self, v: ValueId, gone: &mut Vec<usize>) -> Option<ValueId> {
        let n = self.inner(v)?;
        (self.g.nodes[n].op == Op::Unary(Unary::Sqrt)).then_some(())?;
        gone.push(n);
        self.g.nodes[n].input(0)
    }

    /// `v` = Reciprocal(Sqrt(s)) or 1 / Sqrt(s): s.
    fn inverse_sqrt_of(&self, v: ValueId, gone: &mut Vec<usize>) -> Option<ValueId> {
        let n = self.inner(v)?;
        let node = &self.g.nodes[n];
        let root = match node.op {
            Op::Unary(Unary::Reciprocal) => node.input(0)?,
            Op::Binary(Binary::Div) if self.scalar(node.input(0)?) == Some(1.0) => node.input(1)?,
            _ => return None,
        };
        let s = self.sqrt_of(root, gone)?;
        gone.push(n);
        Some(s)
    }

    /// `v` = ReduceMean(x², trailing axes, keepdims) + ε, x² as x · x or Pow(x, 2): ε and the
    /// first normalized axis.
    fn mean_square_plus_eps(&self, v: ValueId, x: ValueId, gone: &mut Vec<usize>) -> Option<(f32, usize)> {
        let g = self.g;
        let add = self.inner(v)?;
        (g.nodes[add].op == Op::Binary(Binary::Add)).then_some(())?;
        let (l, r) = (g.nodes[add].input(0)?, g.nodes[add].input(1)?);
        let (mean_square, epsilon) = match self.scalar(r) {
            Some(e) => (l, e),
            None => (r, self.scalar(l)?),
        };
        let mean = self.inner(mean_square)?;
        let Op::ReduceOp { kind: Reduce::Mean, axes: Some(axes), keepdims: true, .. } = &g.nodes[mean].op else {
            return None;
        };
        let square = self.inner(g.nodes[mean].input(0)?)?;
        let sq = &g.nodes[square];
        let squares_x = match sq.op {
            Op::Binary(Binary::Mul) => sq.input(0)? == x && sq.input(1)? == x,
            Op::Binary(Binary::Pow) => sq.input(0)? == x && self.scalar(sq.input(1)?) == Some(2.0),
            _ => false,
        };
        // The mean over the trailing dims from `first` on.
        let rank = g.meta(x)?.shape.len();
        let mut dims: Vec<usize> = axes.iter().map(|&a| norm_axis(a, rank)).collect::<Option<_>>()?;
        dims.sort_unstable();
        dims.dedup();
        let first = *dims.first()?;
        (squares_x && dims == (first..rank).collect::<Vec<_>>()).then_some(())?;
        gone.extend([add, mean, square]);
        Some((epsilon as f32, first))
    }
}

/// softmax(q·kᵀ·c (+ causal mask))·v ⇒ Attention(q, k, v): the scores' product (MatMul of q
/// and a kᵀ), an optional scale (Mul or Div by a constant scalar), an optional causal mask (a
/// constant added — 0 on and below the diagonal, −10⁴ or less above, which exp takes to 0 — or
/// Where with a constant lower-triangular condition and a fill of −10⁴ or less), Softmax over
/// the last axis, and the product with v. The builtin GPT-2 and nanoGPT's (exported by
/// PyTorch with masked_fill) both read this way. Every value inside the chain must be read only
/// by the chain.
fn attention(g: &mut Graph, keep: &[ValueId]) -> usize {
    let (producers, uses) = (g.producers(), g.use_counts());
    let chains: Vec<AttentionChain> =
        (0..g.nodes.len()).filter_map(|i| attention_chain(g, &producers, &uses, i, keep)).collect();
    if chains.is_empty() {
        return 0;
    }
    let mut gone = vec![false; g.nodes.len()];
    let mut before: Vec<Vec<Node>> = vec![Vec::new(); g.nodes.len()];
    for c in &chains {
        c.gone.iter().for_each(|&n| gone[n] = true);
        // k [.., T, D]: the transpose that made kᵀ, changed to make k, or a new one.
        let kt_meta = g.meta(c.k_t).cloned().expect("bound");
        let r = kt_meta.shape.len();
        let mut k_shape = kt_meta.shape.clone();
        k_shape.swap(r - 1, r - 2);
        let k = match producers[c.k_t] {
            Some(p) if matches!(g.nodes[p].op, Op::Transpose { perm: Some(_) }) && uses[c.k_t] == 1 => {
                if let Op::Transpose { perm: Some(perm) } = &mut g.nodes[p].op {
                    perm.swap(r - 1, r - 2);
                }
                g.values[c.k_t].meta = Some(Meta::new(kt_meta.dtype, &k_shape));
                c.k_t
            }
            _ => {
                let name = format!("{}_k", g.nodes[c.context].name);
                let k = g.fresh(&name);
                g.values[k].meta = Some(Meta::new(kt_meta.dtype, &k_shape));
                let mut perm: Vec<i64> = (0..r as i64).collect();
                perm.swap(r - 1, r - 2);
                before[c.context].push(Node {
                    name,
                    op: Op::Transpose { perm: Some(perm) },
                    inputs: vec![Some(c.k_t)],
                    outputs: vec![Some(k)],
                });
                k
            }
        };
        let q_shape = g.meta(c.q).expect("bound").shape.clone();
        let lse = g.fresh(&format!("{}_lse", g.nodes[c.context].name));
        g.values[lse].meta = Some(Meta::new(DType::F32, &q_shape[..q_shape.len() - 1]));
        let node = &mut g.nodes[c.context];
        node.op = Op::Attention { scale: c.scale, causal: c.causal, layout: AttentionLayout::HeadsFirst };
        node.inputs = vec![Some(c.q), Some(k), Some(c.v)];
        node.outputs.push(Some(lse));
    }
    let nodes = std::mem::take(&mut g.nodes);
    for (i, node) in nodes.into_iter().enumerate() {
        g.nodes.append(&mut before[i]);
        if !gone[i] {
            g.nodes.push(node);
        }
    }
    chains.len()
}

/// The attention whose product with v is node `context`, if it is one.
fn attention_chain(
    g: &Graph,
    producers: &[Option<usize>],
    uses: &[usize],
    context: usize,
    keep: &[ValueId],
) -> Option<AttentionChain> {
    let node = &g.nodes[context];
    if node.op != Op::MatMul {
        return None;
    }
    let (probs, v) = (node.input(0)?, node.input(1)?);
    // A value inside the chain: produced by a node, read once (by the chain), kept by no one.
    let inner = |x: ValueId| -> Option<usize> {
        (uses[x] == 1 && !keep.contains(&x) && !g.outputs.contains(&x)).then_some(())?;
        producers[x]
    };
    let softmax = inner(probs)?;
    let rank = g.meta(probs)?.shape.len();
    match g.nodes[softmax].op {
        Op::Softmax { axis } if axis == -1 || axis == rank as i64 - 1 => {}
        _ => return None,
    }
    let mut gone = vec![softmax];
    let mut x = g.nodes[softmax].input(0)?;
    let tq = g.meta(x)?.shape[rank - 2];
    let constant = |v: ValueId| g.initializers.get(&v).filter(|_| producers[v].is_none());
    // The mask.
    let mut causal = false;
    let p = inner(x)?;
    match &g.nodes[p].op {
        Op::Binary(Binary::Add) => {
            let (a, b) = (g.nodes[p].input(0)?, g.nodes[p].input(1)?);
            let (scores, mask) = if constant(b).is_some() { (a, b) } else { (b, a) };
            if is_additive_causal_mask(constant(mask)?, tq) {
                causal = true;
                gone.push(p);
                x = scores;
            }
        }
        Op::Where => {
            let (cond, a, b) = (g.nodes[p].input(0)?, g.nodes[p].input(1)?, g.nodes[p].input(2)?);
            let cond = constant(cond)?;
            let masked_fill =
                |fill: ValueId| constant(fill).is_some_and(|t| t.numel() == 1 && t.to_f64_vec()[0] <= -1e4);
            let scores = if masked_fill(b) && is_triangular(cond, tq, true) {
                a
            } else if masked_fill(a) && is_triangular(cond, tq, false) {
                b
            } else {
                return None;
            };
            causal = true;
            gone.push(p);
            x = scores;
        }
        _ => {}
    }
    // The scale.
    let mut scale = 1.0f32;
    let p = inner(x)?;
    if let Op::Binary(op @ (Binary::Mul | Binary::Div)) = g.nodes[p].op {
        let (a, b) = (g.nodes[p].input(0)?, g.nodes[p].input(1)?);
        let c = constant(b).filter(|t| t.numel() == 1)?.to_f64_vec()[0] as f32;
        scale = if op == Binary::Mul { c } else { 1.0 / c };
        gone.push(p);
        x = a;
    }
    // The scores' product.
    let p = inner(x)?;
    if g.nodes[p].op != Op::MatMul {
        return None;
    }
    gone.push(p);
    let (q, k_t) = (g.nodes[p].input(0)?, g.nodes[p].input(1)?);
    let (qm, km, vm) = (g.meta(q)?, g.meta(k_t)?, g.meta(v)?);
    let r = qm.shape.len();
    let lead = |s: &[usize]| s[..s.len() - 2].to_vec();
    let alike = r >= 2
        && km.shape.len() == r
        && vm.shape.len() == r
        && lead(&qm.shape) == lead(&km.shape)
        && lead(&qm.shape) == lead(&vm.shape)
        && km.shape[r - 2] == qm.shape[r - 1]
        && km.shape[r - 1] == vm.shape[r - 2]
        && vm.shape[r - 1] == qm.shape[r - 1]
        && qm.dtype == km.dtype
        && qm.dtype == vm.dtype
        && (!causal || km.shape[r - 1] == qm.shape[r - 2]);
    alike.then_some(AttentionChain { gone, context, q, k_t, v, scale, causal })
}

/// Attention(q, k, v) whose k and v repeat each key head side by side to q's heads, as
/// grouped-query attention is written out (the builtin Llama, Hugging Face's `repeat_kv`: a
/// Reshape adding an axis after the heads', an Expand of it, a Reshape merging it into the
/// heads; the identity Transpose `attention` leaves of kᵀ may follow)  ⇒  Attention of the key
/// heads themselves (`AttentionShape::rep`): the kernels read key head h / rep for query head
/// h, and the copies, and the gradient's sums over them, go.
fn attention_shared_heads(g: &mut Graph, keep: &[ValueId]) -> usize {
    let (producers, uses) = (g.producers(), g.use_counts());
    let inner = |x: ValueId| uses[x] == 1 && !keep.contains(&x) && !g.outputs.contains(&x);
    let mut gone = vec![false; g.nodes.len()];
    let mut rewrites = Vec::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let Op::Attention { layout: AttentionLayout::HeadsFirst, .. } = node.op else { continue };
        let heads = |x: Option<ValueId>| repeated_heads(g, &producers, &inner, x?);
        let (Some((k, k_chain)), Some((v, v_chain))) = (heads(node.input(1)), heads(node.input(2))) else {
            continue;
        };
        if g.meta(k).map(|m| &m.shape) != g.meta(v).map(|m| &m.shape) {
            continue;
        }
        k_chain.iter().chain(&v_chain).for_each(|&n| gone[n] = true);
        rewrites.push((i, k, v));
    }
    for &(i, k, v) in &rewrites {
        g.nodes[i].inputs[1] = Some(k);
        g.nodes[i].inputs[2] = Some(v);
    }
    drop_nodes(g, &gone);
    rewrites.len()
}

/// The value [.., K, T, D] whose heads the nodes before `x` (each value read only by the next)
/// repeat side by side into x [.., K·rep, T, D], with those nodes; None where they do not.
fn repeated_heads(
    g: &Graph,
    producers: &[Option<usize>],
    inner: &impl Fn(ValueId) -> bool,
    x: ValueId,
) -> Option<(ValueId, Vec<usize>)> {
    let shape = |v: ValueId| g.meta(v).map(|m| m.shape.clone());
    let mut chain = Vec::new();
    let mut step = |v: ValueId, want: fn(&Op) -> bool| -> Option<ValueId> {
        let p = producers[v].filter(|&p| inner(v) && want(&g.nodes[p].op))?;
        chain.push(p);
        g.nodes[p].input(0)
    };
    let mut at = x;
    while let Some(before) = step(at, |op| matches!(op, Op::Transpose { perm: Some(p) } if is_identity(p))) {
        at = before;
    }
    let expanded = step(at, |op| *op == Op::Reshape)?;
    let spread = step(expanded, |op| *op == Op::Expand)?;
    let source = step(spread, |op| *op == Op::Reshape)?;
    let (s, u, e, y) = (shape(source)?, shape(spread)?, shape(expanded)?, shape(x)?);
    let r = s.len();
    if r < 3 || u.len() != r + 1 || e.len() != r + 1 {
        return None;
    }
    // The heads' axis a: source [.., K, T, D], spread [.., K, 1, T, D], expanded [.., K, rep,
    // T, D], x [.., K·rep, T, D].
    let a = r - 3;
    let rep = e[a + 1];
    let with = |at: usize, n: usize| [&s[..at], &[n], &s[at..]].concat();
    let merged = [&s[..a], &[s[a] * rep], &s[a + 1..]].concat();
    let repeats = u == with(a + 1, 1) && e == with(a + 1, rep) && y == merged && rep > 0;
    repeats.then_some((source, chain))
}

fn is_identity(perm: &[i64]) -> bool {
    perm.iter().enumerate().all(|(i, &p)| p == i as i64)
}

/// Attention(q, k, v) whose q, k and v are [.., T, H, D] values made [.., H, T, D] by transposes
/// (one, or a chain, as nanoGPT's kᵀ), and whose output only a transpose back to [.., T, H, D]
/// reads  ⇒  the token-major Attention of those values, writing that transpose's output. The
/// heads' copies go, forward and backward (the gradient keeps the layout): eight per layer of
/// GPT-2. A rotary embedding between the transposes and the attention (the Llama's q and k)
/// moves before them, onto the token-major value, its tables laid out to match.
fn attention_token_major(g: &mut Graph, keep: &[ValueId]) -> usize {
    let (producers, uses) = (g.producers(), g.use_counts());
    let readers = g.readers();
    // A value only its one reader sees.
    let inner = |x: ValueId| uses[x] == 1 && !keep.contains(&x) && !g.outputs.contains(&x);
    let mut gone = vec![false; g.nodes.len()];
    let mut rewrites = Vec::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let Op::Attention { layout: AttentionLayout::HeadsFirst, .. } = node.op else { continue };
        let Some(rank) = node.input(0).and_then(|q| g.meta(q)).map(|m| m.shape.len()).filter(|&r| r >= 3) else {
            continue;
        };
        let mut swap: Vec<usize> = (0..rank).collect();
        swap.swap(rank - 3, rank - 2);
        let sources: Option<Vec<HeadsSource>> =
            node.inputs.iter().map(|x| heads_source(g, &producers, &inner, (*x)?, &swap)).collect();
        let Some(sources) = sources else { continue };
        let Some(y) = node.output(0).filter(|&y| inner(y)) else { continue };
        let merge = readers[y][0];
        let merges = matches!(&g.nodes[merge].op, Op::Transpose { perm: Some(p) } if same_perm(p, &swap));
        let shape = |x: ValueId| g.meta(x).map(|m| m.shape.clone()).unwrap_or_default();
        let (q, k, v) = (sources[0].value, sources[1].value, sources[2].value);
        let token_major =
            AttentionShape::of(&shape(q), &shape(k), AttentionLayout::TokenMajor).is_some() && shape(k) == shape(v);
        let Some(merged) = g.nodes[merge].output(0).filter(|_| merges && token_major) else { continue };
        sources.iter().flat_map(|s| &s.transposes).for_each(|&n| gone[n] = true);
        gone[merge] = true;
        rewrites.push((i, sources, merged));
    }
    let mut tables = TokenMajorTables::default();
    for (i, sources, merged) in &rewrites {
        let inputs = sources.iter().map(|s| Some(s.rotary.map_or(s.value, |r| tables.rotate_first(g, r, s.value))));
        let inputs = inputs.collect();
        let node = &mut g.nodes[*i];
        if let Op::Attention { layout, .. } = &mut node.op {
            *layout = AttentionLayout::TokenMajor;
        }
        node.inputs = inputs;
        node.outputs[0] = Some(*merged);
    }
    drop_nodes(g, &gone);
    let count = rewrites.len();
    tables.insert(g);
    count
}

/// A token-major Attention whose q, k and v are one projection's output split in three along
/// its last axis, each part reshaped to [.., T, H, D] (GPT-2's c_attn, as nanoGPT and Hugging
/// Face write it)  ⇒  the packed Attention of that output viewed as [.., T, 3, H, D]: the kernels
/// read q, k and v in place, a token's rows 3·H·D elements apart, and the gradient writes dqkv
/// the same way, so the Split's three copies and its gradient's Concat go.
fn attention_packed(g: &mut Graph, keep: &[ValueId]) -> usize {
    let (producers, uses) = (g.producers(), g.use_counts());
    let inner = |x: ValueId| uses[x] == 1 && !keep.contains(&x) && !g.outputs.contains(&x);
    let mut gone = vec![false; g.nodes.len()];
    let mut rewrites = Vec::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let Op::Attention { layout: AttentionLayout::TokenMajor, .. } = node.op else { continue };
        let made = |x: Option<ValueId>| x.filter(|&x| inner(x)).and_then(|x| producers[x]);
        let Some(reshapes) = node.inputs.iter().map(|&x| made(x)).collect::<Option<Vec<_>>>() else { continue };
        // Each operand a Reshape of the Split's part of its place, read by that Reshape alone.
        let parts: Option<Vec<(usize, usize)>> = reshapes
            .iter()
            .map(|&r| {
                let part = g.nodes[r].input(0).filter(|&p| inner(p) && g.nodes[r].op == Op::Reshape)?;
                let split = producers[part].filter(|&s| matches!(g.nodes[s].op, Op::Split { .. }))?;
                Some((split, g.nodes[split].outputs.iter().position(|&o| o == Some(part))?))
            })
            .collect();
        let Some(parts) = parts else { continue };
        // k and v as q (token-major attention also takes fewer key heads over more rows).
        let shape = |x: Option<ValueId>| x.and_then(|x| g.meta(x)).map(|m| &m.shape);
        if (1..3).any(|k| shape(node.input(k)) != shape(node.input(0))) {
            continue;
        }
        let split = parts[0].0;
        let in_order = parts.iter().enumerate().all(|(k, &(s, at))| s == split && at == k);
        let Some(packed) = packed_shape(g, &g.nodes[split], node.input(0)).filter(|_| in_order) else { continue };
        reshapes.iter().for_each(|&r| gone[r] = true);
        rewrites.push((i, split, packed));
    }
    for (i, split, shape) in &rewrites {
        let qkv = g.nodes[*split].input(0).expect("the Split's input");
        let meta = Meta::new(g.meta(qkv).expect("bound").dtype, shape);
        let name = format!("{}.packed", g.name_of(qkv));
        let dims = Tensor::from_vec(&[shape.len()], shape.iter().map(|&n| n as i64).collect());
        let dims = g.add_initializer(&format!("{name}_shape"), dims);
        let packed = g.fresh(&name);
        g.values[packed].meta = Some(meta);
        // The view takes the Split's place, before every reader of its parts.
        g.nodes[*split] =
            Node { name, op: Op::Reshape, inputs: vec![Some(qkv), Some(dims)], outputs: vec![Some(packed)] };
        let node = &mut g.nodes[*i];
        if let Op::Attention { layout, .. } = &mut node.op {
            *layout = AttentionLayout::Packed;
        }
        node.inputs = vec![Some(packed)];
    }
    drop_nodes(g, &gone);
    rewrites.len()
}

/// [.., T, 3, H, D] for a Split of qkv [.., T, 3·H·D] into three parts along its last axis,
/// where `q`, the first part reshaped, is [.., T, H, D]; None for any other Split.
fn packed_shape(g: &Graph, split: &Node, q: Option<ValueId>) -> Option<Vec<usize>> {
    let Op::Split { axis, .. } = split.op else { return None };
    let (qkv, q) = (g.meta(split.input(0)?)?, g.meta(q?)?);
    let (r, heads) = (qkv.shape.len(), q.shape.len());
    let part = |k: usize| split.outputs.get(k).copied().flatten().and_then(|o| g.meta(o)).map(|m| &m.shape);
    let alike = split.outputs.len() == 3 && (1..3).all(|k| part(k).is_some() && part(k) == part(0));
    let last = norm_axis(axis, r)? + 1 == r;
    let (h, d) = (q.shape[heads.checked_sub(2)?], q.shape[heads - 1]);
    let fits = heads == r + 1 && q.shape[..r - 1] == qkv.shape[..r - 1] && qkv.shape[r - 1] == 3 * h * d;
    (alike && last && fits).then(|| [&qkv.shape[..r - 1], &[3, h, d]].concat())
}

/// Where an operand of a heads-first Attention comes from: the [.., T, H, D] value the
/// transposes (to drop) turn into it, through the rotary embedding `rotary` if one sits last.
struct HeadsSource {
    value: ValueId,
    transposes: Vec<usize>,
    rotary: Option<usize>,
}

/// The value that transposes (each read only by the next) turn into `x` by the permutation
/// `target`, perhaps through a rotary embedding last whose tables `TokenMajorTables` can lay out
/// token-major; None where there is none.
fn heads_source(
    g: &Graph,
    producers: &[Option<usize>],
    inner: &impl Fn(ValueId) -> bool,
    x: ValueId,
    target: &[usize],
) -> Option<HeadsSource> {
    let rotary = producers[x].filter(|&p| inner(x) && g.nodes[p].op == Op::Rotary);
    if let Some(r) = rotary {
        let rank = target.len();
        let movable = |t: Option<ValueId>| t.and_then(|t| g.meta(t)).is_some_and(|m| token_major_table(&m.shape, rank));
        (movable(g.nodes[r].input(1)) && movable(g.nodes[r].input(2))).then_some(())?;
    }
    // x's axis a is the current value's axis `composed[a]`.
    let mut composed: Vec<usize> = (0..target.len()).collect();
    let mut at = match rotary {
        Some(r) => g.nodes[r].input(0)?,
        None => x,
    };
    let mut transposes = Vec::new();
    while let Some(p) = producers[at].filter(|_| inner(at)) {
        let Op::Transpose { perm: Some(perm) } = &g.nodes[p].op else { return None };
        if perm.len() != composed.len() {
            return None;
        }
        composed =
            composed.iter().map(|&a| perm.get(a).and_then(|&p| usize::try_from(p).ok())).collect::<Option<_>>()?;
        transposes.push(p);
        at = g.nodes[p].input(0)?;
        if composed == target {
            return g.meta(at).is_some().then_some(HeadsSource { value: at, transposes, rotary });
        }
    }
    None
}

/// Whether a rotary table of `shape`, broadcast to heads-first values of `rank` ([.., H, T, D]),
/// is one table for every head and batch ([.., 1, T, D] with 1s before): then [T, H, D] is it
/// for the token-major values, and the kernels read it as a table repeated along their leading
/// dims.
fn token_major_table(shape: &[usize], rank: usize) -> bool {
    shape.len() <= rank && shape[..shape.len().saturating_sub(2)].iter().all(|&n| n == 1)
}

/// The rotary tables laid out for token-major values: Reshape to [T, 1, D], Expand to [T, H, D],
/// once for each table and [T, H, D], placed right after the table is made.
#[derive(Default)]
struct TokenMajorTables {
    made: std::collections::BTreeMap<(ValueId, [usize; 3]), ValueId>,
    nodes: Vec<(ValueId, [Node; 2])>,
}

impl TokenMajorTables {
    /// Moves the rotary embedding `r` onto the token-major value `x` [.., T, H, D]; returns
    /// its output, now token-major.
    fn rotate_first(&mut self, g: &mut Graph, r: usize, x: ValueId) -> ValueId {
        let xm = g.meta(x).cloned().expect("bound");
        let n = xm.shape.len();
        let (t, h, d) = (xm.shape[n - 3], xm.shape[n - 2], xm.shape[n - 1]);
        for input in [1, 2] {
            let table = g.nodes[r].input(input).expect("a rotary table");
            let laid = self.table(g, table, [t, h, d]);
            g.nodes[r].inputs[input] = Some(laid);
        }
        g.nodes[r].inputs[0] = Some(x);
        let y = g.nodes[r].output(0).expect("Rotary's output");
        g.values[y].meta = Some(xm);
        y
    }

    fn table(&mut self, g: &mut Graph, table: ValueId, [t, h, d]: [usize; 3]) -> ValueId {
        if let Some(&laid) = self.made.get(&(table, [t, h, d])) {
            return laid;
        }
        let meta = g.meta(table).cloned().expect("bound");
        // Its last two dims (positions, and the head's elements), either perhaps 1.
        let (rows, cols) = match meta.shape[..] {
            [.., rows, cols] => (rows, cols),
            [cols] => (1, cols),
            [] => (1, 1),
        };
        let name = format!("{}.token_major_{t}x{h}x{d}", g.name_of(table));
        let mut shape_of = |what: &str, dims: [usize; 3]| {
            let dims = Tensor::from_vec(&[3], dims.map(|n| n as i64).to_vec());
            g.add_initializer(&format!("{name}.{what}_shape"), dims)
        };
        let (to_rows, to_heads) = (shape_of("rows", [rows, 1, cols]), shape_of("heads", [t, h, d]));
        let (column, laid) = (g.fresh(&format!("{name}.rows")), g.fresh(&name));
        g.values[column].meta = Some(Meta::new(meta.dtype, &[rows, 1, cols]));
        g.values[laid].meta = Some(Meta::new(meta.dtype, &[t, h, d]));
        let node = |op: Op, inputs: [ValueId; 2], out: ValueId| Node {
            name: g.name_of(out).to_string(),
            op,
            inputs: inputs.map(Some).to_vec(),
            outputs: vec![Some(out)],
        };
        let pair = [node(Op::Reshape, [table, to_rows], column), node(Op::Expand, [column, to_heads], laid)];
        self.nodes.push((table, pair));
        self.made.insert((table, [t, h, d]), laid);
        laid
    }

    /// Puts the tables' nodes into the graph right after their table's producer (first, for an
    /// initializer), so that they come before every reader.
    fn insert(self, g: &mut Graph) {
        for (table, pair) in self.nodes {
            let made = g.nodes.iter().position(|n| n.outputs.contains(&Some(table)));
            let at = made.map_or(0, |i| i + 1);
            g.nodes.splice(at..at, pair);
        }
    }
}

fn same_perm(perm: &[i64], target: &[usize]) -> bool {
    perm.len() == target.len() && perm.iter().zip(target).all(|(&p, &t)| p == t as i64)
}

/// A constant added to [.., T, T] scores that is 0 on and below the diagonal and −10⁴ or less
/// above (one T × T matrix, possibly with leading 1s).
fn is_additive_causal_mask(m: &Tensor, t: usize) -> bool {
    let s = m.shape();
    if s.len() < 2 || s[s.len() - 2..] != [t, t] || m.numel() != t * t || !m.dtype().is_float() {
        return false;
    }
    let v = m.to_f64_vec();
    (0..t * t).all(|k| if k % t <= k / t { v[k] == 0.0 } else { v[k] <= -1e4 })
}

/// A constant bool [.., T, T] condition that is true exactly on and below the diagonal
/// (`lower`), or exactly above it.
fn is_triangular(c: &Tensor, t: usize, lower: bool) -> bool {
    let s = c.shape();
    if c.dtype() != DType::Bool || s.len() < 2 || s[s.len() - 2..] != [t, t] || c.numel() != t * t {
        return false;
    }
    let v = c.to_f64_vec();
    (0..t * t).all(|k| (v[k] != 0.0) == ((k % t <= k / t) == lower))
}
