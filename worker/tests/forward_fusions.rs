//! The forward fusions (`graph::fuse`'s passes before autodiff). `attention`: GPT-2's causal
//! attention becomes one Attention node whose backward recomputes the probabilities, and
//! training with it follows training without it (`disabled_passes: ["attention"]`) while
//! planning less memory; `attention_token_major` then runs it on the heads as the projections
//! lay them out, without the heads' transposes, to the same bits, and `attention_packed` on
//! q, k and v where one projection writes them, without its Split, to the same bits again.
//! `rms_norm`, `silu`, `swiglu`
//! and `rotary`: the Llama's written-out RMSNorms, SwiGLU MLPs and rotary embeddings become
//! LayerNorm { rms }, Swiglu and Rotary nodes, and train as the ops they replace.

mod common;
use std::sync::Arc;
use tensorfleet_worker::backend::cpu::CpuBackend;
use tensorfleet_worker::config::{Gpt2Config, LlamaConfig, ModelSpec};
use tensorfleet_worker::models;
use tensorfleet_worker::op::{AttentionLayout, Op, Unary};
use tensorfleet_worker::optim::Update;
use tensorfleet_worker::session::{Session, SessionOptions};
use tensorfleet_worker::tensor::DType;

use common::token_batch as batch;

fn session(fused: bool, half: Option<DType>) -> Session<CpuBackend> {
    session_without(if fused { &[] } else { &["attention"] }, half)
}

fn session_without(disabled: &[&str], half: Option<DType>) -> Session<CpuBackend> {
    let spec = ModelSpec {
        gpt2: Some(Gpt2Config {
            layers: 2,
            heads: 2,
            embed: 32,
            seq_len: 32,
            vocab: 64,
            dropout: 0.1,
            ..Default::default()
        }),
        ..Default::default()
    };
    let model = models::load(&spec, 3).unwrap();
    let adamw = Update::Adam { beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1, decoupled: true };
    let disabled = disabled.iter().map(|p| p.to_string()).collect();
    let opts = SessionOptions { disabled_passes: disabled, half, ..SessionOptions::new(adamw) };
    Session::new(Arc::new(CpuBackend::new()), &model, &batch(2, 32, 64, 0), 2, &opts).unwrap()
}

fn count(s: &Session<CpuBackend>, pick: impl Fn(&Op) -> bool) -> usize {
    s.train.graph.nodes.iter().filter(|n| pick(&n.op)).count()
}

#[test]
fn gpt2_trains_alike_with_fused_attention_and_plans_less_memory() {
    let (mut fused, mut plain) = (session(true, None), session(false, None));
    assert_eq!(count(&fused, |op| matches!(op, Op::Attention { causal: true, .. })), 2);
    assert_eq!(count(&fused, |op| matches!(op, Op::AttentionGrad { .. })), 2);
    assert_eq!(count(&fused, |op| matches!(op, Op::Softmax { .. })), 0, "the scores' softmax is gone");
    assert_eq!(count(&plain, |op| matches!(op, Op::Attention { .. })), 0);
    let (a, b) = (fused.memory().0, plain.memory().0);
    assert!(a < b, "fused attention plans {a} bytes of activations, the unfused {b}");
    let batches = [batch(2, 32, 64, 1), batch(2, 32, 64, 2)];
    for k in 0..4 {
        let (x, y) = (fused.step(&batches, 3e-3, 1.0, k).unwrap(), plain.step(&batches, 3e-3, 1.0, k).unwrap());
        assert!((x.loss - y.loss).abs() <= 1e-5 * y.loss, "step {k}: fused {} vs unfused {}", x.loss, y.loss);
        assert!((x.grad_norm - y.grad_norm).abs() <= 1e-4 * y.grad_norm, "step {k}: gradient norms");
    }
    let (e1, e2) = (fused.evaluate(&batches[..1]).unwrap(), plain.evaluate(&batches[..1]).unwrap());
    assert!((e1 - e2).abs() <= 1e-5 * e2, "evaluation: {e1} vs {e2}");
    let (w1, w2) = (fused.weights().unwrap(), plain.weights().unwrap());
    for (name, t) in &w1 {
        let worst =
            t.as_slice::<f32>().iter().zip(w2[name].as_slice::<f32>()).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-4, "{name} differs by {worst}");
    }
    println!("activations planned: fused {a} bytes, unfused {b}");
}

#[test]
fn mixed_precision_runs_the_fused_attention_in_half_with_f32_statistics() {
    let s = session(true, Some(DType::BF16));
    let g = &s.train.graph;
    let node = g.nodes.iter().find(|n| matches!(n.op, Op::Attention { .. })).expect("fused");
    let dtype = |v: Option<usize>| g.meta(v.unwrap()).unwrap().dtype;
    assert_eq!(
        (dtype(node.input(0)), dtype(node.output(0)), dtype(node.output(1))),
        (DType::BF16, DType::BF16, DType::F32)
    );
}

/// The heads' transposes (q, k, v and the output's, forward and backward) go: one value fewer
/// copied each, and training on the token-major attention gives the heads-first one's losses,
/// gradient norms and weights bit for bit (the kernels take each row in the same order).
#[test]
fn token_major_attention_drops_the_heads_transposes_and_trains_to_the_same_bits() {
    let (mut tm, mut hf) = (
        session_without(&["attention_packed"], None),
        session_without(&["attention_token_major", "attention_packed"], None),
    );
    let attention = |s: &Session<CpuBackend>, tm: bool| {
        let want = if tm { AttentionLayout::TokenMajor } else { AttentionLayout::HeadsFirst };
        count(s, |op| matches!(op, Op::Attention { layout, .. } | Op::AttentionGrad { layout, .. } if *layout == want))
    };
    assert_eq!((attention(&tm, true), attention(&tm, false)), (4, 0));
    assert_eq!((attention(&hf, true), attention(&hf, false)), (0, 4));
    let transposes = |s: &Session<CpuBackend>| count(s, |op| matches!(op, Op::Transpose { .. }));
    // Per layer: q's, k's, v's and the output's, forward and backward.
    assert_eq!(transposes(&hf) - transposes(&tm), 2 * 8, "transposes left: {}", transposes(&tm));
    let batches = [batch(2, 32, 64, 1), batch(2, 32, 64, 2)];
    for k in 0..3 {
        let (x, y) = (tm.step(&batches, 3e-3, 1.0, k).unwrap(), hf.step(&batches, 3e-3, 1.0, k).unwrap());
        assert_eq!((x.loss.to_bits(), x.grad_norm.to_bits()), (y.loss.to_bits(), y.grad_norm.to_bits()), "step {k}");
    }
    let (w1, w2) = (tm.weights().unwrap(), hf.weights().unwrap());
    for (name, t) in &w1 {
        assert!(t.bytes() == w2[name].bytes(), "{name} differs");
    }
}

/// GPT-2's attention reads q, k and v where c_attn writes them, one [B, T, 3, H, D] value
/// (`attention_packed`), and its gradient writes dq, dk and dv there for c_attn's gradient: the
/// Split and its gradient's Concat go (one of each a layer), and training gives the token-major
/// attention's losses, gradient norms and weights bit for bit.
#[test]
fn packed_attention_drops_the_qkv_split_and_trains_to_the_same_bits() {
    let (mut packed, mut parts) = (session_without(&[], None), session_without(&["attention_packed"], None));
    let layouts = |s: &Session<CpuBackend>, want: AttentionLayout| {
        count(s, |op| matches!(op, Op::Attention { layout, .. } | Op::AttentionGrad { layout, .. } if *layout == want))
    };
    assert_eq!((layouts(&packed, AttentionLayout::Packed), layouts(&parts, AttentionLayout::Packed)), (4, 0));
    assert_eq!(layouts(&parts, AttentionLayout::TokenMajor), 4);
    let splits = |s: &Session<CpuBackend>| count(s, |op| matches!(op, Op::Split { .. }));
    let concats = |s: &Session<CpuBackend>| count(s, |op| matches!(op, Op::Concat { .. }));
    assert_eq!((splits(&parts) - splits(&packed), concats(&parts) - concats(&packed)), (2, 2));
    let batches = [batch(2, 32, 64, 1), batch(2, 32, 64, 2)];
    for k in 0..3 {
        let (x, y) = (packed.step(&batches, 3e-3, 1.0, k).unwrap(), parts.step(&batches, 3e-3, 1.0, k).unwrap());
        assert_eq!((x.loss.to_bits(), x.grad_norm.to_bits()), (y.loss.to_bits(), y.grad_norm.to_bits()), "step {k}");
    }
    let (e1, e2) = (packed.evaluate(&batches[..1]).unwrap(), parts.evaluate(&batches[..1]).unwrap());
    assert_eq!(e1.to_bits(), e2.to_bits(), "evaluation");
    let (w1, w2) = (packed.weights().unwrap(), parts.weights().unwrap());
    for (name, t) in &w1 {
        assert!(t.bytes() == w2[name].bytes(), "{name} differs");
    }
}

fn llama(disabled: &[&str]) -> Session<CpuBackend> {
    let config = LlamaConfig {
        layers: 2,
        heads: 4,
        kv_heads: 2,
        embed: 32,
        ffn: 64,
        seq_len: 16,
        vocab: 64,
        rope_theta: 1e4,
        norm_eps: 1e-5,
    };
    let model = models::load(&ModelSpec { llama: Some(config), ..Default::default() }, 5).unwrap();
    let adamw = Update::Adam { beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1, decoupled: true };
    let disabled_passes = disabled.iter().map(|p| p.to_string()).collect();
    let opts = SessionOptions { disabled_passes, ..SessionOptions::new(adamw) };
    Session::new(Arc::new(CpuBackend::new()), &model, &batch(2, 16, 64, 0), 2, &opts).unwrap()
}

/// Each block's two RMSNorms and the final one become one node forward (with the residual add
/// before it, `residual_layer_norm`) and one backward, each
/// block's SwiGLU and its two rotary embeddings (q's and k's) one node each way, and training
/// follows the written-out ops' losses, gradient norms and weights.
#[test]
fn the_llamas_rms_norms_swiglus_and_rotaries_fuse_and_train_as_the_written_out_ops() {
    let (mut fused, mut plain) = (llama(&[]), llama(&["rms_norm", "silu", "swiglu", "rotary"]));
    let rms = |s: &Session<CpuBackend>| {
        count(s, |op| matches!(op, Op::LayerNorm { rms: true, .. } | Op::ResidualLayerNorm { rms: true, .. }))
    };
    let rms_grad = |s: &Session<CpuBackend>| count(s, |op| matches!(op, Op::LayerNormGrad { rms: true, .. }));
    assert_eq!((rms(&fused), rms_grad(&fused)), (5, 5));
    // All but the first block's (which reads the embedding) with the residual add before it.
    assert_eq!(count(&fused, |op| matches!(op, Op::ResidualLayerNorm { rms: true, .. })), 4);
    assert_eq!((rms(&plain), rms_grad(&plain)), (0, 0));
    let sqrt = |s: &Session<CpuBackend>| count(s, |op| matches!(op, Op::Unary(Unary::Sqrt)));
    assert_eq!(sqrt(&fused), 0, "every RMSNorm's square root is gone");
    // SwiGLU forward and backward, and the SiLUs and sigmoids left (SwiGLU took the SiLUs).
    let swiglu = |s: &Session<CpuBackend>| {
        [Op::Swiglu, Op::SwigluGrad, Op::Unary(Unary::Silu), Op::Unary(Unary::Sigmoid)].map(|w| count(s, |op| *op == w))
    };
    assert_eq!((swiglu(&fused), swiglu(&plain)[0]), ([2, 2, 0, 0], 0));
    // The rotary embeddings forward and backward, and the halves' Concat, Split and Neg left.
    let rotary = |s: &Session<CpuBackend>| {
        let halves = |op: &Op| matches!(op, Op::Concat { .. } | Op::Split { .. } | Op::Unary(Unary::Neg));
        [count(s, |op| *op == Op::Rotary), count(s, |op| *op == Op::RotaryGrad), count(s, halves)]
    };
    assert_eq!((rotary(&fused), rotary(&plain)[0]), ([4, 4, 0], 0));
    let batches = [batch(2, 16, 64, 1), batch(2, 16, 64, 2)];
    for k in 0..4 {
        let (x, y) = (fused.step(&batches, 3e-3, 1.0, k).unwrap(), plain.step(&batches, 3e-3, 1.0, k).unwrap());
        assert!((x.loss - y.loss).abs() <= 1e-5 * y.loss, "step {k}: fused {} vs written out {}", x.loss, y.loss);
        assert!((x.grad_norm - y.grad_norm).abs() <= 1e-4 * y.grad_norm, "step {k}: gradient norms");
    }
    let (w1, w2) = (fused.weights().unwrap(), plain.weights().unwrap());
    for (name, t) in &w1 {
        let worst =
            t.as_slice::<f32>().iter().zip(w2[name].as_slice::<f32>()).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-4, "{name} differs by {worst}");
    }
}

/// The Llama's grouped-query attention reads the key heads themselves (`attention_shared_heads`:
/// no Expand copies of k and v, no sums of their gradients) and runs token-major
/// (`attention_token_major`, the rotary embeddings moved before the heads' transposes, which
/// all go), training to the written-out heads' losses, gradient norms and weights bit for bit.
#[test]
fn the_llamas_attention_reads_shared_key_heads_token_major_and_trains_to_the_same_bits() {
    let (mut fused, mut plain) = (llama(&[]), llama(&["attention_shared_heads", "attention_token_major"]));
    let token_major = |s: &Session<CpuBackend>| {
        count(s, |op| {
            matches!(
                op,
                Op::Attention { layout: AttentionLayout::TokenMajor, .. }
                    | Op::AttentionGrad { layout: AttentionLayout::TokenMajor, .. }
            )
        })
    };
    let ops = |s: &Session<CpuBackend>| {
        let of = |pick: fn(&Op) -> bool| count(s, pick);
        [
            of(|op| matches!(op, Op::Transpose { .. })),
            of(|op| *op == Op::Expand),
            of(|op| matches!(op, Op::ReduceOp { .. } | Op::ReduceSumTo { .. })),
        ]
    };
    assert_eq!((token_major(&fused), token_major(&plain)), (4, 0));
    // Per layer, q's, k's, v's and the output's transposes each way, and kᵀ's forward (an
    // identity after `attention`) and its gradient's; k's and v's Expand copies and their
    // gradients' sums. The fused graph's Expands make the rotary tables [T, H, D], once for
    // each table (cos, sin) and head count (q's 4, k's 2).
    assert_eq!((ops(&fused), ops(&plain)), ([0, 4, 0], [20, 4, 4]));
    let batches = [batch(2, 16, 64, 1), batch(2, 16, 64, 2)];
    for k in 0..3 {
        let (x, y) = (fused.step(&batches, 3e-3, 1.0, k).unwrap(), plain.step(&batches, 3e-3, 1.0, k).unwrap());
        assert_eq!((x.loss.to_bits(), x.grad_norm.to_bits()), (y.loss.to_bits(), y.grad_norm.to_bits()), "step {k}");
    }
    let (w1, w2) = (fused.weights().unwrap(), plain.weights().unwrap());
    for (name, t) in &w1 {
        assert!(t.bytes() == w2[name].bytes(), "{name} differs");
    }
}
