//! Finite-difference checks of every gradient rule: for a small graph around one op,
//! the gradients autodiff emits must match central differences of the loss
//! L = Σ f(params) ⊙ R (R fixed and random, so every output element matters differently).

use super::gradients;
use crate::backend::cpu::CpuBackend;
use crate::backend::Group;
use crate::comm::{HostGroup, ReduceOp, SoloGroup};
use crate::exec::Executor;
use crate::graph::infer::{bind, Bindings};
use crate::graph::ir::{Graph, Node, ValueId};
use crate::op::{
    Activation, AttentionLayout, Binary, Direction, LossReduction, NormKind, Op, PadMode, PoolKind, Recurrent,
    RecurrentKind, Reduce, ScatterReduction, Unary, Window,
};
use crate::rng::Rng;
use crate::tensor::{DType, Tensor};
use std::sync::Arc;

/// A graph under test: its parameters (trained initializers) and the output to check.
struct Case {
    g: Graph,
    params: Vec<ValueId>,
    out: ValueId,
}

fn random(rng: &mut Rng, shape: &[usize], lo: f64, hi: f64) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(shape, (0..n).map(|_| (lo + (hi - lo) * rng.next_f64()) as f32).collect())
}

/// Starts a case; `param` adds a trainable input with values in [lo, hi).
struct CaseBuilder {
    g: Graph,
    params: Vec<ValueId>,
    rng: Rng,
}

impl CaseBuilder {
    fn new(seed: u64) -> CaseBuilder {
        CaseBuilder { g: Graph::new("gradcheck", 20), params: vec![], rng: Rng::new(seed) }
    }
    fn param(&mut self, name: &str, shape: &[usize], lo: f64, hi: f64) -> ValueId {
        let t = random(&mut self.rng, shape, lo, hi);
        let v = self.g.add_initializer(name, t);
        self.params.push(v);
        v
    }
    fn constant(&mut self, name: &str, t: Tensor) -> ValueId {
        self.g.op1(name, Op::Constant { value: t }, &[])
    }
    fn done(self, out: ValueId) -> Case {
        Case { g: self.g, params: self.params, out }
    }
}

/// Attaches L = Σ out ⊙ R and returns the loss value.
fn attach_loss(c: &mut Case, rng: &mut Rng, out_shape: &[usize]) -> ValueId {
    let r = random(rng, out_shape, -1.0, 1.0);
    let r = c.g.op1("weights_r", Op::Constant { value: r }, &[]);
    let p = c.g.op1("weighted", Op::Binary(Binary::Mul), &[c.out, r]);
    c.g.op1("loss", Op::ReduceOp { kind: Reduce::Sum, axes: None, keepdims: false, noop_with_empty_axes: false }, &[p])
}

/// Checks `c`'s gradients; returns what the fusion passes rewrote in its training graph.
fn check(name: &str, mut c: Case) -> Vec<(&'static str, usize)> {
    let mut rng = Rng::new(99);
    let backend = Arc::new(CpuBackend::new());
    let vars = c.params.iter().copied().collect();
    let bindings = Bindings { variables: vars, ..Default::default() };
    // Bind once to learn the output's shape, then attach the loss.
    let probe = bind(&c.g, &bindings, true).unwrap_or_else(|e| panic!("{name}: {e}"));
    let out_shape = probe.meta(c.out).expect("bound").shape.clone();
    let loss = attach_loss(&mut c, &mut rng, &out_shape);
    c.g.outputs = vec![loss];

    let mut train = bind(&c.g, &bindings, true).unwrap_or_else(|e| panic!("{name}: {e}"));
    let grads = gradients(&mut train, loss, &c.params).unwrap_or_else(|e| panic!("{name}: {e}"));
    train.outputs = std::iter::once(loss).chain(grads.iter().copied()).collect();
    let fused = crate::graph::fuse::run(&mut train, &[]);
    // Tensor parallelism's collectives run over a group of one: the rules and kernels around them
    // are what is checked here (mpi_train.rs checks them across ranks).
    let solo = || Some(std::rc::Rc::new(Group::host(HostGroup::Solo(SoloGroup::new("tensor", 0)))));
    let mut ex = Executor::new(backend.clone(), train, &[]).unwrap();
    ex.tensor_group = solo();
    ex.run(1).unwrap();
    let analytic: Vec<Tensor> = grads.iter().map(|&g| ex.fetch(g).unwrap()).collect();

    let fwd = bind(&c.g, &bindings, true).unwrap();
    let mut fx = Executor::new(backend, fwd, &[]).unwrap();
    fx.tensor_group = solo();
    let eps = 1e-2f32;
    for (pi, &p) in c.params.iter().enumerate() {
        let base = c.g.initializers[&p].clone();
        let n = base.numel();
        // Up to 12 elements per parameter, spread over it.
        let picks: Vec<usize> = (0..n.min(12)).map(|k| k * n / n.min(12)).collect();
        for &i in &picks {
            let mut loss_at = |delta: f32| {
                let mut t = base.clone();
                t.as_mut_slice::<f32>()[i] += delta;
                fx.feed(p, &t).unwrap();
                fx.run(1).unwrap();
                fx.fetch(loss).unwrap().to_f64_vec()[0]
            };
            let numeric = (loss_at(eps) - loss_at(-eps)) / (2.0 * eps as f64);
            let got = analytic[pi].to_f64_vec()[i];
            let tol = 2e-2 * numeric.abs().max(got.abs()) + 3e-3;
            assert!(
                (numeric - got).abs() <= tol,
                "{name}: d loss / d {}[{i}]: autodiff {got:.6}, finite differences {numeric:.6}",
                c.g.name_of(p)
            );
        }
        fx.feed(p, &base).unwrap();
    }
    fused
}

fn unary_case(u: Unary, lo: f64, hi: f64) -> Case {
    let mut b = CaseBuilder::new(1);
    let x = b.param("x", &[3, 4], lo, hi);
    let y = b.g.op1("y", Op::Unary(u), &[x]);
    b.done(y)
}

#[test]
fn unary_rules() {
    use Unary::*;
    for (u, lo, hi) in [
        (Neg, -2.0, 2.0),
        (Exp, -1.0, 1.0),
        (Log, 0.5, 2.0),
        (Sqrt, 0.5, 2.0),
        (Tanh, -2.0, 2.0),
        (Erf, -1.5, 1.5),
        (Relu, 0.1, 1.0),
        (Sigmoid, -3.0, 3.0),
        (Abs, 0.2, 1.0),
        (Reciprocal, 0.5, 2.0),
        (Gelu, -2.0, 2.0),
        (GeluTanh, -2.0, 2.0),
        (Sin, -2.0, 2.0),
        (Cos, -2.0, 2.0),
        (Tan, -1.0, 1.0),
        (Asin, -0.8, 0.8),
        (Acos, -0.8, 0.8),
        (Atan, -2.0, 2.0),
        (Sinh, -2.0, 2.0),
        (Cosh, -2.0, 2.0),
        (Asinh, -2.0, 2.0),
        (Acosh, 1.2, 3.0),
        (Atanh, -0.8, 0.8),
        (Softplus, -3.0, 3.0),
        (Softsign, -3.0, 3.0),
        (Mish, -3.0, 3.0),
        (Silu, -3.0, 3.0),
        // HardSwish's three pieces, away from their joins at ±3.
        (HardSwish, -2.9, 2.9),
        (HardSwish, 3.1, 4.0),
        (HardSigmoid { alpha: 0.2, beta: 0.5 }, -2.0, 2.0),
        (LeakyRelu { alpha: 0.1 }, -2.0, -0.1),
        (LeakyRelu { alpha: 0.1 }, 0.1, 2.0),
        (Elu { alpha: 1.5 }, -2.0, -0.1),
        (Elu { alpha: 1.5 }, 0.1, 2.0),
        (Selu { alpha: 1.673_263_2, gamma: 1.050_701 }, -2.0, -0.1),
        (Selu { alpha: 1.673_263_2, gamma: 1.050_701 }, 0.1, 2.0),
        (Celu { alpha: 0.7 }, -2.0, -0.1),
        (Celu { alpha: 0.7 }, 0.1, 2.0),
        (ThresholdedRelu { alpha: 0.5 }, 0.6, 2.0),
        // Clip's three regions: below, inside and above the bounds.
        (Clip { min: -0.5, max: 0.5 }, -2.0, -0.6),
        (Clip { min: -0.5, max: 0.5 }, -0.45, 0.45),
        (Clip { min: -0.5, max: 0.5 }, 0.6, 2.0),
    ] {
        check(&format!("{u:?}"), unary_case(u, lo, hi));
    }
    // Relu on both sides of zero (away from the kink).
    let mut b = CaseBuilder::new(2);
    let x = b.constant("x0", Tensor::from_vec(&[4], vec![-1.0f32, -0.5, 0.5, 1.0]));
    let s = b.param("s", &[4], 0.5, 1.5);
    let m = b.g.op1("m", Op::Binary(Binary::Mul), &[x, s]);
    let y = b.g.op1("y", Op::Unary(Relu), &[m]);
    check("Relu both sides", b.done(y));
}

#[test]
fn binary_rules_with_broadcasting() {
    use Binary::*;
    for op in [Add, Sub, Mul, Div, Pow, Max, Min, PRelu] {
        let mut b = CaseBuilder::new(3);
        let (lo, hi) = if op == Pow || op == Div { (0.5, 2.0) } else { (-2.0, 2.0) };
        let a = b.param("a", &[2, 3], lo, hi);
        let c = b.param("c", &[3], lo, hi);
        let y = b.g.op1("y", Op::Binary(op), &[a, c]);
        check(&format!("{op:?}"), b.done(y));
    }
}

#[test]
fn reduce_rules() {
    use Reduce::*;
    for kind in [Sum, Mean, SumSquare, L1, L2, LogSum, LogSumExp, Prod, Max, Min] {
        for (axes, keepdims) in [(vec![1i64], false), (vec![0, 2], true)] {
            let mut b = CaseBuilder::new(40);
            // Positive, so that L1 and LogSum are smooth; distinct, so that Max/Min have no ties.
            let x = b.param("x", &[2, 3, 4], 0.5, 1.5);
            let op = Op::ReduceOp { kind, axes: Some(axes.clone()), keepdims, noop_with_empty_axes: false };
            let y = b.g.op1("y", op, &[x]);
            check(&format!("{kind:?} over {axes:?}"), b.done(y));
        }
    }
}

#[test]
fn mod_rules_away_from_their_jumps() {
    // a/c stays within (2, 3) for Mod (floor 2) and within (−3, −2) for Fmod (trunc −2).
    for (op, lo, hi) in [(Binary::Mod, 2.3, 2.5), (Binary::Fmod, -2.5, -2.3)] {
        let mut b = CaseBuilder::new(11);
        let a = b.param("a", &[2, 3], lo, hi);
        let c = b.param("c", &[3], 1.0, 1.1);
        let y = b.g.op1("y", Op::Binary(op), &[a, c]);
        check(&format!("{op:?}"), b.done(y));
    }
}

#[test]
fn where_cast_identity_reshape_transpose() {
    let mut b = CaseBuilder::new(4);
    let cond = b.constant("cond", Tensor::from_vec(&[2, 3], vec![1u8, 0, 1, 0, 0, 1]).cast(DType::Bool));
    let x = b.param("x", &[2, 3], -1.0, 1.0);
    let z = b.param("z", &[3], -1.0, 1.0);
    let y = b.g.op1("y", Op::Where, &[cond, x, z]);
    check("Where", b.done(y));

    let mut b = CaseBuilder::new(5);
    let x = b.param("x", &[2, 3], -1.0, 1.0);
    let d = b.g.op1("d", Op::Cast { to: DType::F64 }, &[x]);
    let y = b.g.op1("y", Op::Cast { to: DType::F32 }, &[d]);
    let y = b.g.op1("id", Op::Identity, &[y]);
    let shape = b.constant("shape", Tensor::from_vec(&[2], vec![3i64, 2]));
    let y = b.g.op1("r", Op::Reshape, &[y, shape]);
    let y = b.g.op1("t", Op::Transpose { perm: Some(vec![1, 0]) }, &[y]);
    check("Cast, Identity, Reshape, Transpose", b.done(y));

    let mut b = CaseBuilder::new(6);
    let x = b.param("x", &[2, 1, 3], -1.0, 1.0);
    let y = b.g.op1("sq", Op::Squeeze { axes: Some(vec![1]) }, &[x]);
    let y = b.g.op1("un", Op::Unsqueeze { axes: Some(vec![0]) }, &[y]);
    let y = b.g.op1("fl", Op::Flatten { axis: 2 }, &[y]);
    check("Squeeze, Unsqueeze, Flatten", b.done(y));
}

#[test]
fn matmul_and_gemm() {
    let mut b = CaseBuilder::new(7);
    let a = b.param("a", &[2, 3, 4], -1.0, 1.0);
    let w = b.param("w", &[4, 5], -1.0, 1.0);
    let y = b.g.op1("y", Op::MatMul, &[a, w]);
    check("MatMul 3-D × 2-D", b.done(y));

    let mut b = CaseBuilder::new(8);
    let a = b.param("a", &[2, 2, 3, 4], -1.0, 1.0);
    let w = b.param("w", &[2, 1, 4, 3], -1.0, 1.0);
    let y = b.g.op1("y", Op::MatMul, &[a, w]);
    check("MatMul batch-broadcast", b.done(y));

    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let mut b = CaseBuilder::new(9);
        let a = b.param("a", if ta { &[4, 3] } else { &[3, 4] }, -1.0, 1.0);
        let w = b.param("w", if tb { &[5, 4] } else { &[4, 5] }, -1.0, 1.0);
        let c = b.param("c", &[5], -1.0, 1.0);
        let y = b.g.op1("y", Op::Gemm { alpha: 0.7, beta: 1.3, trans_a: ta, trans_b: tb }, &[a, w, c]);
        check(&format!("Gemm transA={ta} transB={tb}"), b.done(y));
    }

    // MatMul + bias the fusion pass turns into FusedMatMul, then GELU.
    let mut b = CaseBuilder::new(10);
    let a = b.param("a", &[2, 3, 4], -1.0, 1.0);
    let w = b.param("w", &[4, 6], -1.0, 1.0);
    let bias = b.param("bias", &[6], -1.0, 1.0);
    let y = b.g.op1("mm", Op::MatMul, &[a, w]);
    let y = b.g.op1("add", Op::Binary(Binary::Add), &[y, bias]);
    let y = b.g.op1("gelu", Op::Unary(Unary::GeluTanh), &[y]);
    check("MatMul + bias + GELU (fused)", b.done(y));

    // An MLP: the GELU joins the first product's epilogue (keeping its input for the
    // gradient), and its gradient joins the epilogue of the product that feeds it.
    let mut b = CaseBuilder::new(12);
    let a = b.param("a", &[2, 3, 4], -1.0, 1.0);
    let w = b.param("w", &[4, 6], -1.0, 1.0);
    let bias = b.param("bias", &[6], -1.0, 1.0);
    let w2 = b.param("w2", &[6, 5], -1.0, 1.0);
    let y = b.g.op1("mm", Op::MatMul, &[a, w]);
    let y = b.g.op1("add", Op::Binary(Binary::Add), &[y, bias]);
    let y = b.g.op1("gelu", Op::Unary(Unary::GeluTanh), &[y]);
    let y = b.g.op1("mm2", Op::MatMul, &[y, w2]);
    let fused = check("MatMul + bias + GELU, MatMul (GELU and its gradient fused)", b.done(y));
    for pass in ["matmul_bias_gelu", "matmul_gelu_grad"] {
        assert!(fused.contains(&(pass, 1)), "{pass} did not fuse the MLP once: {fused:?}");
    }
}

/// Einsum through the Transposes, Reshapes, Slices, ReduceSums, Muls and MatMuls it is written
/// out as.
#[test]
fn einsum_written_out() {
    let cases: [(&str, &[&[usize]]); 7] = [
        ("bij,bjk->bik", &[&[2, 3, 4], &[2, 4, 2]]),
        // k is summed in its operand alone, before the product.
        ("ij,jk->i", &[&[2, 3], &[3, 4]]),
        ("i,j->ij", &[&[3], &[4]]),
        ("ij->ji", &[&[3, 4]]),
        ("ii->i", &[&[3, 3]]),
        ("ii", &[&[3, 3]]),
        ("...ii,...i->...", &[&[2, 3, 3], &[1, 3]]),
    ];
    for (equation, shapes) in cases {
        let mut b = CaseBuilder::new(50);
        let ins: Vec<ValueId> =
            shapes.iter().enumerate().map(|(k, s)| b.param(&format!("x{k}"), s, -1.0, 1.0)).collect();
        let y = b.g.op1("y", Op::Einsum { equation: equation.into() }, &ins);
        check(&format!("Einsum {equation}"), b.done(y));
    }
}

/// TopK's values, through the GatherElements of X at TopKIndices' indices they bind as.
#[test]
fn top_k_values() {
    for largest in [true, false] {
        let mut b = CaseBuilder::new(51);
        let x = b.param("x", &[3, 5], -1.0, 1.0);
        // Values 0.1 apart, so that the finite differences' steps (0.01) keep their order.
        let spread: Vec<f32> = (0..15).map(|i| ((i * 7) % 15) as f32 / 10.0 - 0.7).collect();
        b.g.initializers.insert(x, Tensor::from_vec(&[3, 5], spread));
        let k = b.constant("k", Tensor::from_vec(&[1], vec![2i64]));
        let outs = b.g.add_node("topk", Op::TopK { axis: -1, largest, sorted: true }, &[x, k], 2);
        check(&format!("TopK values, largest {largest}"), b.done(outs[0]));
    }
}

/// A recurrent layer with every optional input but sequence_lens (each a parameter, so that
/// its gradient is checked), reading its output `k` (Y, Y_h or Y_c).
fn recurrent_case(seed: u64, layer: Recurrent, x_shape: &[usize], k: usize) -> Case {
    let mut b = CaseBuilder::new(seed);
    let (dirs, gates, h) = (layer.direction.count(), layer.kind.gates(), 2);
    let input = x_shape[2];
    let states: &[usize] = if layer.batch_first { &[x_shape[0], dirs, h] } else { &[dirs, x_shape[1], h] };
    let mut inputs = vec![
        Some(b.param("x", x_shape, -1.0, 1.0)),
        Some(b.param("w", &[dirs, gates * h, input], -0.8, 0.8)),
        Some(b.param("r", &[dirs, gates * h, h], -0.8, 0.8)),
        Some(b.param("b", &[dirs, 2 * gates * h], -0.5, 0.5)),
        None,
        Some(b.param("initial_h", states, -0.8, 0.8)),
    ];
    if layer.kind == RecurrentKind::Lstm {
        inputs.push(Some(b.param("initial_c", states, -0.8, 0.8)));
        inputs.push(Some(b.param("p", &[dirs, 3 * h], -0.5, 0.5)));
    }
    let outputs: Vec<ValueId> = (0..3).map(|o| b.g.fresh(&format!("y{o}"))).collect();
    let outputs = if layer.kind == RecurrentKind::Lstm { outputs } else { outputs[..2].to_vec() };
    let out = outputs[k];
    let name = layer.kind.onnx_name().to_string();
    b.g.nodes.push(Node { name, op: Op::Recurrent(layer), inputs, outputs: outputs.into_iter().map(Some).collect() });
    b.done(out)
}

/// LSTM, GRU and RNN through the Gemm, Split, pointwise and Concat ops binding unrolls them into.
#[test]
fn recurrent_layers() {
    use Unary::{Sigmoid, Tanh};
    let layer = |kind, direction: Direction, batch_first, linear_before_reset| {
        let per: &[Unary] = match kind {
            RecurrentKind::Lstm => &[Sigmoid, Tanh, Tanh],
            RecurrentKind::Gru => &[Sigmoid, Tanh],
            RecurrentKind::Rnn => &[Tanh],
        };
        let activations = per.iter().cycle().take(per.len() * direction.count()).map(|&u| Activation::Unary(u));
        Recurrent {
            kind,
            direction,
            hidden_size: Some(2),
            activations: activations.collect(),
            clip: None,
            input_forget: false,
            linear_before_reset,
            batch_first,
        }
    };
    // 3 steps of a batch of 2, 3 features; hidden size 2.
    let (time_major, batch_major) = ([3, 2, 3], [2, 3, 3]);
    let lstm = layer(RecurrentKind::Lstm, Direction::Bidirectional, false, false);
    for (k, output) in ["Y", "Y_h", "Y_c"].iter().enumerate() {
        check(&format!("LSTM bidirectional, {output}"), recurrent_case(44, lstm.clone(), &time_major, k));
    }
    for (lbr, direction) in [(false, Direction::Forward), (true, Direction::Reverse)] {
        let gru = layer(RecurrentKind::Gru, direction, true, lbr);
        for (k, output) in ["Y", "Y_h"].iter().enumerate() {
            let name = format!("GRU {direction:?} batch-first, linear_before_reset {lbr}, {output}");
            check(&name, recurrent_case(45, gru.clone(), &batch_major, k));
        }
    }
    let rnn = layer(RecurrentKind::Rnn, Direction::Bidirectional, true, false);
    check("RNN bidirectional batch-first, Y", recurrent_case(46, rnn, &batch_major, 0));
}

#[test]
fn fused_attention() {
    // q, k, v [2 groups, T 5, D 3], token-major [B 2, T 5, H 2, D 3], or packed into one qkv
    // [B 2, T 5, 3, H 2, D 3]: causal and full, scaled.
    for (seed, layout) in
        [AttentionLayout::HeadsFirst, AttentionLayout::TokenMajor, AttentionLayout::Packed].into_iter().enumerate()
    {
        let shape: &[usize] = match layout {
            AttentionLayout::HeadsFirst => &[2, 5, 3],
            AttentionLayout::TokenMajor => &[2, 5, 2, 3],
            AttentionLayout::Packed => &[2, 5, 3, 2, 3],
        };
        for causal in [true, false] {
            let mut b = CaseBuilder::new(31 + causal as u64 + 2 * seed as u64);
            let operands = match layout {
                AttentionLayout::Packed => vec![b.param("qkv", shape, -1.5, 1.5)],
                _ => {
                    vec![b.param("q", shape, -1.5, 1.5), b.param("k", shape, -1.5, 1.5), b.param("v", shape, -1.0, 1.0)]
                }
            };
            let op = Op::Attention { scale: 0.6, causal, layout };
            let y = b.g.add_node("attn", op, &operands, 2)[0];
            check(&format!("Attention, causal {causal}, {layout:?}"), b.done(y));
        }
    }
}

#[test]
fn fused_swiglu() {
    let mut b = CaseBuilder::new(48);
    let gate = b.param("gate", &[3, 8], -3.0, 3.0);
    let up = b.param("up", &[3, 8], -1.5, 1.5);
    let y = b.g.op1("y", Op::Swiglu, &[gate, up]);
    check("Swiglu", b.done(y));
}

#[test]
fn fused_rotary() {
    // x [B 2, H 3, T 4, D 6]; cos repeated along the leading dims ([T, D]), sin broadcast over
    // the heads ([B, 1, T, D]): both tables trained too, so that their gradients are checked.
    let mut b = CaseBuilder::new(47);
    let x = b.param("x", &[2, 3, 4, 6], -1.5, 1.5);
    let cos = b.param("cos", &[4, 6], -1.0, 1.0);
    let sin = b.param("sin", &[2, 1, 4, 6], -1.0, 1.0);
    let y = b.g.op1("y", Op::Rotary, &[x, cos, sin]);
    check("Rotary", b.done(y));
}

#[test]
fn softmax_layernorm_and_losses() {
    for (name, op) in [("Softmax", Op::Softmax { axis: -1 }), ("LogSoftmax", Op::LogSoftmax { axis: 1 })] {
        let mut b = CaseBuilder::new(11);
        let x = b.param("x", &[2, 3, 4], -2.0, 2.0);
        let y = b.g.op1("y", op, &[x]);
        check(name, b.done(y));
    }
    let mut b = CaseBuilder::new(12);
    let x = b.param("x", &[2, 3, 4], -2.0, 2.0);
    let s = b.param("scale", &[4], 0.5, 1.5);
    let bias = b.param("bias", &[4], -0.5, 0.5);
    let y = b.g.op1("y", Op::LayerNorm { axis: -1, epsilon: 1e-5, rms: false }, &[x, s, bias]);
    check("LayerNormalization", b.done(y));
    // RMSNorm fused (`fuse::rms_norm`), over the last two dims.
    let mut b = CaseBuilder::new(13);
    let x = b.param("x", &[2, 3, 4], -2.0, 2.0);
    let s = b.param("scale", &[3, 4], 0.5, 1.5);
    let y = b.g.op1("y", Op::LayerNorm { axis: -2, epsilon: 1e-5, rms: true }, &[x, s]);
    check("RMSNorm", b.done(y));

    // Instance, group (per-channel and opset 18's per-group scale) and RMS normalization,
    // through the reductions and arithmetic they bind as.
    for (what, kind, scale_len, bias) in [
        ("InstanceNormalization", NormKind::Instance, 4, true),
        ("GroupNormalization", NormKind::Group { groups: 2 }, 4, true),
        ("GroupNormalization per group", NormKind::Group { groups: 2 }, 2, true),
        ("RMSNormalization", NormKind::Rms { axis: 2 }, 6, false),
    ] {
        let mut b = CaseBuilder::new(43);
        let x = b.param("x", &[2, 4, 6], -1.0, 1.0);
        let shape: &[usize] = if scale_len == 6 { &[2, 3] } else { &[scale_len] };
        let s = b.param("scale", shape, 0.5, 1.5);
        let mut ins = vec![x, s];
        if bias {
            ins.push(b.param("bias", &[scale_len], -0.5, 0.5));
        }
        let y = b.g.op1("y", Op::Normalization { kind, epsilon: 1e-5 }, &ins);
        check(what, b.done(y));
    }

    for (name, reduction, ignore, weights) in [
        ("SoftmaxCrossEntropyLoss mean", LossReduction::Mean, None, false),
        ("SoftmaxCrossEntropyLoss ignore_index", LossReduction::Mean, Some(2), false),
        ("SoftmaxCrossEntropyLoss weighted sum", LossReduction::Sum, None, true),
        ("SoftmaxCrossEntropyLoss none NCd", LossReduction::None, None, false),
    ] {
        let nc_d = reduction == LossReduction::None;
        let labels = if nc_d {
            Tensor::from_vec(&[2, 3], vec![0i64, 3, 1, 2, 2, 0])
        } else {
            Tensor::from_vec(&[5], vec![0i64, 3, 2, 1, 2])
        };
        let w = Tensor::from_vec(&[4], vec![0.5f32, 1.0, 2.0, 1.5]);
        // The same positions through NegativeLogLikelihoodLoss, over the scores as they are (it
        // reads log-probabilities, but its gradient does not depend on that).
        for (loss, op) in [
            (name.to_string(), Op::SoftmaxCrossEntropyLoss { reduction, ignore_index: ignore }),
            (
                name.replace("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"),
                Op::NegativeLogLikelihoodLoss { reduction, ignore_index: ignore },
            ),
        ] {
            let mut b = CaseBuilder::new(13);
            let x = b.param("scores", if nc_d { &[2, 4, 3] } else { &[5, 4] }, -2.0, 2.0);
            let l = b.constant("labels", labels.clone());
            let mut ins = vec![x, l];
            if weights {
                ins.push(b.constant("w", w.clone()));
            }
            let y = b.g.op1("y", op, &ins);
            check(&loss, b.done(y));
        }
    }
}

#[test]
fn tensor_parallel_ops() {
    // Megatron's f and g around a product: the gradient flows through both.
    let mut b = CaseBuilder::new(21);
    let x = b.param("x", &[2, 3], -1.0, 1.0);
    let w = b.param("w", &[3, 4], -1.0, 1.0);
    let copy = b.g.op1("copy", Op::TensorParallelCopy, &[x]);
    let y = b.g.op1("y", Op::MatMul, &[copy, w]);
    let y = b.g.op1("sum", Op::AllReduce { op: ReduceOp::Sum }, &[y]);
    check("TensorParallelCopy, AllReduce", b.done(y));

    // Rows 2..6 of a table: ids outside them look up zeros and get no gradient.
    let mut b = CaseBuilder::new(22);
    let table = b.param("table", &[4, 3], -1.0, 1.0);
    let ids = b.constant("ids", Tensor::from_vec(&[2, 3], vec![0i64, 2, 5, 3, 7, 5]));
    let y = b.g.op1("y", Op::ShardGather { start: 2 }, &[table, ids]);
    check("ShardGather", b.done(y));

    // The vocab-parallel cross-entropy chain over one slice of 4 classes: classes 0..4, or
    // 2..6 of a larger vocabulary. (Every label lies in the slice, as on the rank that holds it;
    // the row maxima's shift cancels only between Σexp and the target, as across the ranks.)
    for (name, start, labels, reduction) in [
        ("vocab-parallel cross-entropy, mean", 0, [0i64, 3, 2, 1, 3], LossReduction::Mean),
        ("vocab-parallel cross-entropy, a slice, sum", 2, [3, 5, 2, 4, 2], LossReduction::Sum),
        ("vocab-parallel cross-entropy, none", 0, [1, 0, 2, 3, 3], LossReduction::None),
    ] {
        let mut b = CaseBuilder::new(23);
        let x = b.param("scores", &[5, 4], -2.0, 2.0);
        let l = b.constant("labels", Tensor::from_vec(&[5], labels.to_vec()));
        let reduce =
            Op::ReduceOp { kind: Reduce::Max, axes: Some(vec![1]), keepdims: false, noop_with_empty_axes: false };
        let m = b.g.op1("max", reduce, &[x]);
        let m = b.g.op1("max_all", Op::AllReduce { op: ReduceOp::Max }, &[m]);
        let ignore_index = Some(2);
        let parts = b.g.add_node(
            "shard",
            Op::VocabShardCrossEntropy { start, classes: start + 4, ignore_index },
            &[x, l, m],
            2,
        );
        let se = b.g.op1("sum_exp", Op::AllReduce { op: ReduceOp::Sum }, &[parts[0]]);
        let t = b.g.op1("target", Op::AllReduce { op: ReduceOp::Sum }, &[parts[1]]);
        let y = b.g.op1("loss_", Op::VocabParallelLoss { reduction, ignore_index }, &[se, t, l]);
        check(name, b.done(y));
    }
}

#[test]
fn data_movement() {
    let mut b = CaseBuilder::new(14);
    let x = b.param("x", &[2, 3], -1.0, 1.0);
    let z = b.param("z", &[2, 2], -1.0, 1.0);
    let y = b.g.op1("y", Op::Concat { axis: 1 }, &[x, z]);
    check("Concat", b.done(y));

    let mut b = CaseBuilder::new(15);
    let x = b.param("x", &[2, 6], -1.0, 1.0);
    let parts = b.g.add_node("s", Op::Split { axis: 1, sizes: vec![2, 4], num_outputs: None }, &[x], 2);
    // Only the second part reaches the loss: the first contributes zeros.
    check("Split", b.done(parts[1]));

    let mut b = CaseBuilder::new(16);
    let x = b.param("x", &[4, 5], -1.0, 1.0);
    let st = b.constant("starts", Tensor::from_vec(&[2], vec![1i64, 4]));
    let en = b.constant("ends", Tensor::from_vec(&[2], vec![4i64, 0]));
    let ax = b.constant("axes", Tensor::from_vec(&[2], vec![0i64, 1]));
    let sp = b.constant("steps", Tensor::from_vec(&[2], vec![2i64, -2]));
    let y = b.g.op1("y", Op::Slice { starts: vec![], ends: vec![], axes: vec![], steps: vec![] }, &[x, st, en, ax, sp]);
    check("Slice (negative step)", b.done(y));

    let mut b = CaseBuilder::new(17);
    let table = b.param("table", &[5, 3], -1.0, 1.0);
    let idx = b.constant("idx", Tensor::from_vec(&[2, 3], vec![0i64, 4, 4, -1, 2, 0]));
    let y = b.g.op1("y", Op::Gather { axis: 0, padding_row: None }, &[table, idx]);
    check("Gather (repeated and negative indices)", b.done(y));

    // Pad in every mode, with a cropping (negative) pad and borders wider than reflect's
    // period, so that input elements are read several times.
    for mode in [PadMode::Constant, PadMode::Reflect, PadMode::Edge, PadMode::Wrap] {
        let mut b = CaseBuilder::new(35);
        let x = b.param("x", &[2, 3], -1.0, 1.0);
        let pads = b.constant("pads", Tensor::from_vec(&[4], vec![1i64, 4, -1, 2]));
        let y = b.g.op1("y", Op::Pad { mode, pads: vec![], value: 0.5 }, &[x, pads]);
        check(&format!("Pad {mode:?}"), b.done(y));
    }

    // Tile (through the Reshape → Expand → Reshape it binds as): each element read 6 times.
    let mut b = CaseBuilder::new(38);
    let x = b.param("x", &[2, 3], -1.0, 1.0);
    let repeats = b.constant("repeats", Tensor::from_vec(&[2], vec![3i64, 2]));
    let y = b.g.op1("y", Op::Tile, &[x, repeats]);
    check("Tile", b.done(y));

    // Sum and Mean of three inputs, broadcast (through the Adds they bind as).
    for mean in [false, true] {
        let mut b = CaseBuilder::new(41);
        let (x, z, w) =
            (b.param("x", &[2, 3], -1.0, 1.0), b.param("z", &[3], -1.0, 1.0), b.param("w", &[2, 1], -1.0, 1.0));
        let y = b.g.op1("y", Op::Sum { mean }, &[x, z, w]);
        check(if mean { "Mean" } else { "Sum" }, b.done(y));
    }

    // CumSum each way along the middle axis of three.
    for (exclusive, reverse) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut b = CaseBuilder::new(39);
        let x = b.param("x", &[2, 4, 3], -1.0, 1.0);
        let axis = b.constant("axis", Tensor::scalar(-2i64));
        let y = b.g.op1("y", Op::CumSum { axis: 0, exclusive, reverse }, &[x, axis]);
        check(&format!("CumSum exclusive {exclusive} reverse {reverse}"), b.done(y));
    }

    // GatherND with a batch dim, and ScatterND replacing and adding slices (a tuple repeated).
    let mut b = CaseBuilder::new(36);
    let x = b.param("x", &[2, 3, 4], -1.0, 1.0);
    let idx = b.constant("idx", Tensor::from_vec(&[2, 2, 1], vec![2i64, 0, -1, 2]));
    let y = b.g.op1("y", Op::GatherND { batch_dims: 1 }, &[x, idx]);
    check("GatherND (batch_dims 1)", b.done(y));
    // Repeated tuples only with Add: ONNX leaves None's undefined (and the updates' gradient
    // then follows PyTorch's index_put: every update gets its slice's).
    for (reduction, ids) in [(ScatterReduction::None, vec![1i64, 3, -4]), (ScatterReduction::Add, vec![1, 3, 1])] {
        let mut b = CaseBuilder::new(37);
        let x = b.param("x", &[4, 3], -1.0, 1.0);
        let idx = b.constant("idx", Tensor::from_vec(&[3, 1], ids));
        let u = b.param("u", &[3, 3], -1.0, 1.0);
        let y = b.g.op1("y", Op::ScatterND { reduction }, &[x, idx, u]);
        check(&format!("ScatterND {reduction:?}"), b.done(y));
    }

    // ScatterElements replacing (distinct indices) and adding (an index repeated) along axis 1.
    for (reduction, ids) in [(ScatterReduction::None, vec![3i64, 0, -4, 1]), (ScatterReduction::Add, vec![3, 3, 0, 3])]
    {
        let mut b = CaseBuilder::new(42);
        let x = b.param("x", &[2, 4], -1.0, 1.0);
        let idx = b.constant("idx", Tensor::from_vec(&[2, 2], ids));
        let u = b.param("u", &[2, 2], -1.0, 1.0);
        let y = b.g.op1("y", Op::ScatterElements { axis: 1, reduction }, &[x, idx, u]);
        check(&format!("ScatterElements {reduction:?}"), b.done(y));
    }

    // BERT's attention-mask gather: indices of data's rank, repeated and negative, along the
    // last axis and along the first.
    for (axis, idx) in [(1, vec![0i64, 3, 3, -1, 2, 0]), (0, vec![1i64, 0, -2, 1, 1, 0])] {
        let mut b = CaseBuilder::new(30 + axis as u64);
        let x = b.param("x", &[2, 4], -1.0, 1.0);
        let idx = b.constant("idx", Tensor::from_vec(&[2, 3], idx));
        let y = b.g.op1("y", Op::GatherElements { axis }, &[x, idx]);
        check(&format!("GatherElements along axis {axis}"), b.done(y));
    }

    let mut b = CaseBuilder::new(18);
    let x = b.param("x", &[3, 1], -1.0, 1.0);
    let shape = b.constant("shape", Tensor::from_vec(&[3], vec![2i64, 3, 4]));
    let y = b.g.op1("y", Op::Expand, &[x, shape]);
    check("Expand", b.done(y));

    let mut b = CaseBuilder::new(19);
    let x = b.param("x", &[2, 4, 4], -1.0, 1.0);
    let y = b.g.op1("y", Op::Trilu { upper: false, k: 0 }, &[x]);
    check("Trilu", b.done(y));

    for kind in [Reduce::Sum, Reduce::Mean, Reduce::SumSquare] {
        let mut b = CaseBuilder::new(20);
        let x = b.param("x", &[2, 3, 4], -1.0, 1.0);
        let y = b.g.op1(
            "y",
            Op::ReduceOp { kind, axes: Some(vec![0, 2]), keepdims: false, noop_with_empty_axes: false },
            &[x],
        );
        check(&format!("Reduce{kind:?}"), b.done(y));
    }

    let mut b = CaseBuilder::new(21);
    let x = b.param("x", &[3, 4], -1.0, 1.0);
    let y = b.g.op1("y", Op::Dropout { ratio: 0.3, training: true, seed: 5 }, &[x]);
    check("Dropout (training)", b.done(y));
}

fn win(k: usize, s: usize, p: usize, ceil_mode: bool) -> Window {
    Window::explicit(&[k, k], &[s, s], &[1, 1], &[p; 4], ceil_mode)
}

#[test]
fn convolution_pooling_batchnorm() {
    for (name, group, k, s, p) in
        [("Conv 3×3 stride 2 pad 1", 1, 3, 2, 1), ("Conv 1×1", 1, 1, 1, 0), ("Conv grouped", 2, 3, 1, 1)]
    {
        let mut b = CaseBuilder::new(22);
        let x = b.param("x", &[2, 4, 5, 5], -1.0, 1.0);
        let w = b.param("w", &[6, 4 / group, k, k], -1.0, 1.0);
        let bias = b.param("b", &[6], -1.0, 1.0);
        let y = b.g.op1("y", Op::Conv { window: win(k, s, p, false), group }, &[x, w, bias]);
        check(name, b.done(y));
    }
    for (name, kind) in [("MaxPool", PoolKind::Max), ("AveragePool", PoolKind::Average { count_include_pad: false })] {
        let mut b = CaseBuilder::new(23);
        let x = b.param("x", &[1, 2, 7, 7], -1.0, 1.0);
        let y = b.g.op1("y", Op::Pool { kind, window: win(3, 2, 1, true) }, &[x]);
        check(name, b.done(y));
    }
    let mut b = CaseBuilder::new(24);
    let x = b.param("x", &[2, 3, 4, 4], -1.0, 1.0);
    let y = b.g.op1("y", Op::GlobalAveragePool, &[x]);
    check("GlobalAveragePool", b.done(y));

    let mut b = CaseBuilder::new(25);
    let x = b.param("x", &[3, 2, 2, 2], -1.0, 1.0);
    let s = b.param("scale", &[2], 0.5, 1.5);
    let bias = b.param("bias", &[2], -0.5, 0.5);
    let mean = b.constant("mean", Tensor::from_vec(&[2], vec![0.0f32, 0.0]));
    let var = b.constant("var", Tensor::from_vec(&[2], vec![1.0f32, 1.0]));
    let outs =
        b.g.add_node("bn", Op::BatchNorm { epsilon: 1e-5, momentum: 0.9, training: true }, &[x, s, bias, mean, var], 3);
    check("BatchNormalization (training)", b.done(outs[0]));
}

#[test]
fn transposed_convolution() {
    // (what, x shape, W shape, group, window, output_padding)
    let cases = [
        (
            "ConvTranspose 3×3 stride 2 pad 1, output padding 1",
            vec![2, 4, 3, 3],
            vec![4, 3, 3, 3],
            1,
            Window::explicit(&[3, 3], &[2, 2], &[1, 1], &[1, 1, 1, 1], false),
            vec![1, 1],
        ),
        (
            "ConvTranspose grouped, dilated, uneven pads",
            vec![1, 4, 3, 4],
            vec![4, 3, 2, 3],
            2,
            Window::explicit(&[2, 3], &[2, 1], &[2, 1], &[0, 1, 1, 0], false),
            vec![1, 0],
        ),
        (
            "ConvTranspose 1-D stride 3",
            vec![2, 2, 4],
            vec![2, 3, 3],
            1,
            Window::explicit(&[3], &[3], &[1], &[1, 0], false),
            vec![2],
        ),
        (
            "ConvTranspose 3-D",
            vec![1, 2, 2, 3, 2],
            vec![2, 2, 2, 2, 3],
            1,
            Window::explicit(&[2, 2, 3], &[2, 1, 2], &[1, 1, 1], &[0, 1, 1, 1, 0, 0], false),
            vec![0, 0, 1],
        ),
    ];
    for (name, x_shape, w_shape, group, window, output_padding) in cases {
        let mut b = CaseBuilder::new(26);
        let x = b.param("x", &x_shape, -1.0, 1.0);
        let w = b.param("w", &w_shape, -1.0, 1.0);
        let bias = b.param("b", &[w_shape[1] * group], -1.0, 1.0);
        let op = Op::ConvTranspose { window, group, output_padding, output_shape: None };
        let y = b.g.op1("y", op, &[x, w, bias]);
        check(name, b.done(y));
    }
    // The plain loops behind 3-D convolution's gradient.
    let mut b = CaseBuilder::new(27);
    let x = b.param("x", &[1, 2, 3, 4, 3], -1.0, 1.0);
    let w = b.param("w", &[4, 1, 2, 3, 2], -1.0, 1.0);
    let window = Window::explicit(&[2, 3, 2], &[1, 2, 1], &[1, 1, 2], &[1, 1, 0, 0, 1, 1], false);
    let y = b.g.op1("y", Op::Conv { window, group: 2 }, &[x, w]);
    check("Conv 3-D grouped", b.done(y));
}

#[test]
fn resize_rules() {
    use crate::op::resize::{Coordinates as C, Interpolation as I, Resize, Target};
    let cases = [
        ("Resize nearest ×2", I::Nearest, C::Asymmetric, vec![1.0, 1.0, 2.0, 2.0]),
        ("Resize nearest ×1.5, ×0.6", I::Nearest, C::HalfPixel, vec![1.0, 1.0, 1.5, 0.6]),
        ("Resize bilinear, half pixel", I::Linear, C::HalfPixel, vec![1.0, 1.0, 2.0, 1.5]),
        ("Resize bilinear, aligned corners", I::Linear, C::AlignCorners, vec![1.0, 1.0, 2.0, 2.5]),
        ("Resize linear over 3 axes, downsampling one", I::Linear, C::PytorchHalfPixel, vec![1.0, 1.5, 0.5, 2.0]),
        ("Resize bicubic", I::Cubic, C::HalfPixel, vec![1.0, 1.0, 1.5, 2.0]),
    ];
    for (name, mode, coordinates, scales) in cases {
        let mut b = CaseBuilder::new(28);
        let x = b.param("x", &[2, 2, 4, 5], -1.0, 1.0);
        let y = b.g.op1("y", Op::Resize(Resize::new(mode, coordinates, Target::Scales(scales))), &[x]);
        check(name, b.done(y));
    }
}

/// A padded lookup (nn.Embedding(padding_idx)) is not what finite differences measure on
/// purpose: the padding row gets no gradient from it, and every other row the plain gradient.
#[test]
fn padding_row_of_a_lookup_gets_no_gradient() {
    let gradient = |padding_row: Option<i64>| {
        let mut b = CaseBuilder::new(17);
        let table = b.param("table", &[5, 3], -1.0, 1.0);
        let idx = b.constant("idx", Tensor::from_vec(&[2, 3], vec![0i64, 4, 4, 1, 2, 0]));
        let y = b.g.op1("y", Op::Gather { axis: 0, padding_row }, &[table, idx]);
        let mut c = b.done(y);
        let loss = attach_loss(&mut c, &mut Rng::new(5), &[2, 3, 3]);
        c.g.outputs = vec![loss];
        let bindings = Bindings { variables: c.params.iter().copied().collect(), ..Default::default() };
        let mut train = bind(&c.g, &bindings, true).unwrap();
        let grads = gradients(&mut train, loss, &c.params).unwrap();
        train.outputs = grads.clone();
        let mut ex = Executor::new(Arc::new(CpuBackend::new()), train, &[]).unwrap();
        ex.run(1).unwrap();
        ex.fetch(grads[0]).unwrap().to_f64_vec()
    };
    let (plain, padded) = (gradient(None), gradient(Some(4)));
    assert!(plain[12..].iter().all(|&g| g != 0.0), "row 4 is looked up twice: {plain:?}");
    assert_eq!(&padded[12..], &[0.0; 3], "the padding row");
    assert_eq!(&padded[..12], &plain[..12], "the other rows");
}
