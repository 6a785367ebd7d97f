//! Mixed precision as a graph pass (precision: bf16 | fp16), with PyTorch autocast's rules.
//!
//! The weights stay f32 (the master copy the optimizer updates); the pass inserts `Cast` nodes so
//! that each op computes in the type its kind calls for:
//! - **low precision** — the products (MatMul, Gemm, Conv, ConvTranspose, fused attention): their
//!   float inputs are cast to the half type, so the GEMMs read bf16/fp16 and accumulate in f32
//!   (cuBLASLt's compute type; attention's softmax is f32 inside the kernel);
//! - **full precision** — what loses accuracy in half (LayerNorm, softmax, losses, reductions,
//!   exp/log/pow) and the tensor-parallel collectives (which reduce f32): their half inputs are
//!   cast up to f32;
//! - **BatchNormalization** runs in its input's type, as autocast leaves batch_norm (cuDNN's
//!   kernels read half X with f32 scale, bias and running statistics, and write half Y): X and Y
//!   half where X is, the parameters and the statistics f32, the arithmetic f32 inside;
//! - **the rest follows its inputs** — elementwise ops, reshapes and the like run in half when
//!   every float input computed from the batch is half (a weight or constant beside them is
//!   cast down, as a bias is), and in f32 as soon as one of them is f32 (autocast's "widest
//!   type" rule: the residual stream of a transformer stays f32).
//!
//! The pass runs on the forward graph before autodiff, so the backward pass follows: the
//! gradient of a Cast is the Cast back, which makes each weight's gradient f32 again. Values
//! listed in `keep` (the loss, a pipeline stage's sends) keep their element type.

use super::ir::{Graph, Meta, Node, ValueId};
use crate::error::{Error, Result};
use crate::op::{Binary, Op, Unary};
use crate::tensor::DType;
use std::collections::{HashMap, HashSet};

/// How an op's float inputs are typed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    Low,
    Full,
    Follow,
    /// Input 0 and output 0 follow as `Follow` does; the other inputs and outputs (parameters,
    /// statistics) are f32.
    FollowX,
    /// Casts: the type is the op's own business.
    Untouched,
}

fn rule(op: &Op) -> Rule {
    match op {
        Op::MatMul
        | Op::Gemm { .. }
        | Op::Conv { .. }
        | Op::ConvTranspose { .. }
        | Op::FusedMatMul { .. }
        | Op::Attention { .. } => Rule::Low,
        Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::LayerNorm { .. }
        | Op::SoftmaxCrossEntropyLoss { .. }
        | Op::ReduceOp { .. }
        | Op::Unary(Unary::Exp | Unary::Log | Unary::Sqrt | Unary::Reciprocal)
        | Op::Binary(Binary::Pow)
        | Op::AllReduce { .. }
        | Op::TensorParallelCopy
        | Op::VocabShardCrossEntropy { .. }
        | Op::VocabParallelLoss { .. } => Rule::Full,
        Op::BatchNorm { .. } => Rule::FollowX,
        Op::Cast { .. } => Rule::Untouched,
        _ => Rule::Follow,
    }
}

/// Rewrites the forward graph `g` (bound) to compute in `half` (F16 or BF16) where autocast
/// would. `params` are the trained weights (cast by a node each step; other initializers are
/// constants, converted once here).
pub fn autocast(g: &mut Graph, half: DType, params: &HashSet<ValueId>, keep: &[ValueId]) -> Result<()> {
    if !matches!(half, DType::F16 | DType::BF16) {
        return Err(Error::Config(format!("precision: {half} is not a half-precision type")));
    }
    // The values computed from the batch (as opposed to from weights and constants alone).
    let mut from_batch: HashSet<ValueId> =
        g.inputs.iter().map(|d| d.value).filter(|v| !g.initializers.contains_key(v)).collect();
    let mut casts: HashMap<(ValueId, DType), ValueId> = HashMap::new();
    let dtype_of = |g: &Graph, v: ValueId| g.meta(v).expect("bound graphs give every value a meta").dtype;
    for mut node in std::mem::take(&mut g.nodes) {
        let floats: Vec<usize> =
            (0..node.inputs.len()).filter(|&k| node.input(k).is_some_and(|v| dtype_of(g, v).is_float())).collect();
        // f64 and the like are not autocast's business: a node reading one stays as it is.
        let autocast_types = floats.iter().filter_map(|&k| node.input(k)).all(|v| {
            let d = dtype_of(g, v);
            d == half || d == DType::F32
        });
        let rule = rule(&node.op);
        // The inputs whose type is the compute type; the rest (FollowX's parameters) are f32.
        let follows = |k: usize| rule != Rule::FollowX || k == 0;
        let compute = match rule {
            _ if !autocast_types => None,
            Rule::Untouched => None,
            Rule::Low => Some(half),
            Rule::Full => Some(DType::F32),
            Rule::Follow | Rule::FollowX => {
                let batch: Vec<DType> = floats
                    .iter()
                    .filter(|&&k| follows(k))
                    .filter_map(|&k| node.input(k))
                    .filter(|v| from_batch.contains(v))
                    .map(|v| dtype_of(g, v))
                    .collect();
                if batch.is_empty() {
                    None
                } else if batch.iter().all(|&d| d == half) {
                    Some(half)
                } else {
                    Some(DType::F32)
                }
            }
        };
        let batch_in = node.inputs.iter().flatten().any(|v| from_batch.contains(v));
        // The node's float outputs that keep their type: the node writes a fresh value, which a
        // Cast after it turns back into the one the rest of the graph reads.
        let mut restore: Vec<(ValueId, ValueId, DType)> = Vec::new();
        if let Some(to) = compute {
            for &k in &floats {
                let v = node.input(k).expect("a float input");
                let want = if follows(k) { to } else { DType::F32 };
                if dtype_of(g, v) != want {
                    node.inputs[k] = Some(cast(g, &mut casts, &mut from_batch, params, v, want));
                }
            }
            // Float outputs take the compute type (every op here computes in its inputs' type),
            // but for statistics kept in f32: attention's log-sum-exp (left as inferred), and
            // BatchNormalization's running mean and variance (f32, as its parameters).
            let typed = if matches!(node.op, Op::Attention { .. }) { 1 } else { node.outputs.len() };
            for k in 0..typed {
                let Some(out) = node.output(k) else { continue };
                let (old, to) = (dtype_of(g, out), if follows(k) { to } else { DType::F32 });
                if !old.is_float() || old == to {
                    continue;
                }
                let shape = g.meta(out).expect("bound").shape.clone();
                if keep.contains(&out) {
                    let fresh = g.fresh(&format!("{}_{}", g.name_of(out), to.name()));
                    g.values[fresh].meta = Some(Meta::new(to, &shape));
                    node.outputs[k] = Some(fresh);
                    restore.push((fresh, out, old));
                } else {
                    g.values[out].meta = Some(Meta::new(to, &shape));
                }
            }
        }
        if batch_in {
            from_batch.extend(node.outputs.iter().flatten().copied());
            from_batch.extend(restore.iter().map(|&(_, out, _)| out));
        }
        let name = node.name.clone();
        g.nodes.push(node);
        for (fresh, out, old) in restore {
            g.nodes.push(Node {
                name: format!("{name}_to_{}", old.name()),
                op: Op::Cast { to: old },
                inputs: vec![Some(fresh)],
                outputs: vec![Some(out)],
            });
        }
    }
    narrow_before_moving(g, keep);
    Ok(())
}

/// Cast(Transpose(x)) ⇒ Transpose(Cast(x)) where the cast narrows (f32 to half) and nothing
/// else reads the transposed value: the transpose then moves half the bytes and sits next to
/// what reads it, so a product's transposed weight (a tied embedding's LM head, [V, C] read as
/// [C, V]) becomes a GEMM flag in the `matmul_transpose` fusion instead of a copy, and so does
/// its gradient's transpose. The two commute exactly.
fn narrow_before_moving(g: &mut Graph, keep: &[ValueId]) {
    let uses = g.use_counts();
    let producers = g.producers();
    for j in 0..g.nodes.len() {
        let Op::Cast { to } = g.nodes[j].op else { continue };
        let Some(moved) = g.nodes[j].input(0) else { continue };
        let Some(i) = producers[moved] else { continue };
        let Some(x) = g.nodes[i].input(0).filter(|_| matches!(g.nodes[i].op, Op::Transpose { .. })) else { continue };
        let from = g.meta(x).expect("bound").clone();
        if to.size() >= from.dtype.size() || uses[moved] != 1 || g.outputs.contains(&moved) || keep.contains(&moved) {
            continue;
        }
        // The Transpose's node casts x into its value (now x's shape, of the narrow type), and
        // the Cast's node transposes that into the value the readers know.
        let transpose = std::mem::replace(&mut g.nodes[i].op, Op::Cast { to });
        g.nodes[j].op = transpose;
        let (a, b) = (g.nodes[i].name.clone(), g.nodes[j].name.clone());
        (g.nodes[i].name, g.nodes[j].name) = (b, a);
        g.values[moved].meta = Some(Meta::new(to, &from.shape));
    }
}

/// `v` as `to`: a Cast node (shared by every reader) for weights and computed values, a
/// converted copy for constants.
fn cast(
    g: &mut Graph,
    casts: &mut HashMap<(ValueId, DType), ValueId>,
    from_batch: &mut HashSet<ValueId>,
    params: &HashSet<ValueId>,
    v: ValueId,
    to: DType,
) -> ValueId {
    if let Some(&c) = casts.get(&(v, to)) {
        return c;
    }
    let name = format!("{}_{}", g.name_of(v), to.name());
    let c = match g.initializers.get(&v) {
        Some(t) if !params.contains(&v) => {
            let t = t.cast(to);
            let fresh = g.fresh(&name);
            let name = g.name_of(fresh).to_string();
            g.add_initializer(&name, t)
        }
        _ => {
            let shape = g.meta(v).expect("bound").shape.clone();
            let c = g.op1(&name, Op::Cast { to }, &[v]);
            g.values[c].meta = Some(Meta::new(to, &shape));
            c
        }
    };
    if from_batch.contains(&v) {
        from_batch.insert(c);
    }
    casts.insert((v, to), c);
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::infer::{bind, Bindings};
    use crate::graph::ir::Dim;
    use crate::tensor::Tensor;

    #[test]
    fn products_go_half_softmax_stays_f32_others_follow_and_f64_is_left_alone() {
        let mut g = Graph::new("autocast", 17);
        let x = g.add_input("x", DType::F32, vec![Dim::Fixed(2), Dim::Fixed(3)]);
        let w = g.add_initializer("w", Tensor::from_vec(&[3, 4], vec![0.5f32; 12]));
        let bias = g.add_initializer("bias", Tensor::from_vec(&[4], vec![0.25f32; 4]));
        let y = g.op1("mm", Op::MatMul, &[x, w]);
        let y = g.op1("bias_add", Op::Binary(Binary::Add), &[y, bias]);
        let p = g.op1("softmax", Op::Softmax { axis: -1 }, &[y]);
        let r = g.op1("residual", Op::Binary(Binary::Add), &[p, y]);
        let xd = g.add_input("xd", DType::F64, vec![Dim::Fixed(2), Dim::Fixed(3)]);
        let wd = g.add_initializer("wd", Tensor::from_vec(&[3, 3], vec![0.5f64; 9]));
        let yd = g.op1("mm64", Op::MatMul, &[xd, wd]);
        g.outputs = vec![r, yd];
        let params: HashSet<ValueId> = [w, bias].into_iter().collect();
        let mut b = bind(&g, &Bindings { variables: params.clone(), ..Default::default() }, true).unwrap();
        autocast(&mut b, DType::BF16, &params, &[r]).unwrap();
        let dtype = |name: &str| b.meta(b.find(name).unwrap()).unwrap().dtype;
        let reads = |node: &str| -> Vec<DType> {
            let n = b.nodes.iter().find(|n| n.name == node).unwrap();
            n.inputs.iter().flatten().map(|&v| b.meta(v).unwrap().dtype).collect()
        };
        assert_eq!(reads("mm"), [DType::BF16, DType::BF16], "a product reads half");
        assert_eq!(reads("bias_add"), [DType::BF16, DType::BF16], "a bias follows the product, cast down");
        assert_eq!(reads("softmax"), [DType::F32], "softmax computes in f32");
        assert_eq!(reads("residual"), [DType::F32, DType::F32], "mixed inputs promote to f32");
        assert_eq!(reads("mm64"), [DType::F64, DType::F64], "f64 is not autocast's business");
        assert_eq!((dtype("w"), dtype("bias"), dtype("mm64")), (DType::F32, DType::F32, DType::F64));
        assert_eq!(dtype("residual"), DType::F32, "a kept value keeps its type");
        // The weights are cast by nodes (they change every step); a cast is shared by its readers.
        let casts = b.nodes.iter().filter(|n| matches!(n.op, Op::Cast { .. })).count();
        assert_eq!(casts, 4, "x, w and bias down; the biased product up, once, for softmax and residual");
    }
}
