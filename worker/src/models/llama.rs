//! Llama: token embedding, pre-norm transformer blocks (RMSNorm; causal self-attention with
//! rotary position embedding and grouped-query attention; SwiGLU MLP), a final RMSNorm and an
//! untied LM head, as Hugging Face's LlamaForCausalLM computes them.
//!
//! Weights are named as Hugging Face names them, with x·W layouts (W is [in, out], the
//! transpose of nn.Linear's). Shapes in comments: B batch, T sequence, C width, H heads,
//! K kv-heads, D = C/H, F the MLP width, V vocabulary.

use super::{constant, ints, Init};
use crate::config::LlamaConfig;
use crate::error::Result;
use crate::graph::ir::{Dim, Graph, ValueId};
use crate::graph::onnx_io::EXPORT_OPSET;
use crate::op::{Binary, Op, Reduce, Unary};
use crate::tensor::{DType, Tensor};

/// x / √(mean(x²) + ε) · w over the last axis (written out, so that it exports at any opset).
fn rms_norm(g: &mut Graph, name: &str, x: ValueId, c: usize, eps: ValueId) -> ValueId {
    let w = g.add_initializer(&format!("{name}.weight"), Init::constant(&[c], 1.0));
    let sq = g.op1(&format!("{name}.square"), Op::Binary(Binary::Mul), &[x, x]);
    let mean = Op::ReduceOp { kind: Reduce::Mean, axes: Some(vec![-1]), keepdims: true, noop_with_empty_axes: false };
    let ms = g.op1(&format!("{name}.mean_square"), mean, &[sq]);
    let ms = g.op1(&format!("{name}.plus_eps"), Op::Binary(Binary::Add), &[ms, eps]);
    let rms = g.op1(&format!("{name}.rms"), Op::Unary(Unary::Sqrt), &[ms]);
    let y = g.op1(&format!("{name}.normalized"), Op::Binary(Binary::Div), &[x, rms]);
    g.op1(name, Op::Binary(Binary::Mul), &[y, w])
}

/// x·W with W [n_in, n_out] drawn from N(0, 0.02²) (Hugging Face's initializer_range), no bias.
fn linear(g: &mut Graph, init: &mut Init, name: &str, x: ValueId, n_in: usize, n_out: usize) -> ValueId {
    let w = g.add_initializer(&format!("{name}.weight"), init.normal(&[n_in, n_out], 0.02));
    g.op1(name, Op::MatMul, &[x, w])
}

/// The rotary embedding's cos and sin tables [T, D] for positions 0..T: Hugging Face's
/// default rope, angle t·θ^(−2i/D) for i < D/2, repeated over both halves of the head.
fn rope_tables(t: usize, d: usize, theta: f64) -> (Tensor, Tensor) {
    let half = d / 2;
    let angle = |pos: usize, j: usize| pos as f64 * theta.powf(-2.0 * (j % half) as f64 / d as f64);
    let table = |f: fn(f64) -> f64| {
        let v: Vec<f32> = (0..t * d).map(|k| f(angle(k / d, k % d)) as f32).collect();
        Tensor::from_vec(&[t, d], v)
    };
    (table(f64::cos), table(f64::sin))
}

/// The constants every block reads.
struct Shared {
    eps: ValueId,
    cos: ValueId,
    sin: ValueId,
    mask: ValueId,
    scale: ValueId,
    /// Each kv-head repeated for the H/K query heads that share it.
    repeat: ValueId,
    /// [B, T, heads, D] and [B, heads, T, D] with the head count left to Reshape (-1), so that
    /// tensor parallelism's local head count needs no rewrite; and [B, T, heads·D].
    split_heads: ValueId,
    grouped_heads: ValueId,
    merged: ValueId,
}

/// x·cos + rotate_half(x)·sin for x [B, heads, T, D], rotate_half(x) = [−x₂, x₁] of its halves.
fn rotary(g: &mut Graph, name: &str, x: ValueId, d: usize, s: &Shared) -> ValueId {
    let halves = Op::Split { axis: -1, sizes: vec![(d / 2) as i64; 2], num_outputs: None };
    let parts = g.add_node(&format!("{name}.halves"), halves, &[x], 2);
    let neg = g.op1(&format!("{name}.neg"), Op::Unary(Unary::Neg), &[parts[1]]);
    let rotated = g.op1(&format!("{name}.rotated"), Op::Concat { axis: -1 }, &[neg, parts[0]]);
    let a = g.op1(&format!("{name}.cos"), Op::Binary(Binary::Mul), &[x, s.cos]);
    let b = g.op1(&format!("{name}.sin"), Op::Binary(Binary::Mul), &[rotated, s.sin]);
    g.op1(name, Op::Binary(Binary::Add), &[a, b])
}

/// Causal self-attention with RoPE and grouped-query attention: [B, T, C] → [B, T, C].
fn attention(g: &mut Graph, init: &mut Init, p: &str, x: ValueId, c: &LlamaConfig, s: &Shared) -> ValueId {
    let (e, d) = (c.embed, c.embed / c.heads);
    let kv = c.kv_heads * d;
    let heads = |g: &mut Graph, x: ValueId, name: &str| {
        let r = g.op1(&format!("{p}.self_attn.{name}.heads"), Op::Reshape, &[x, s.split_heads]); // [B,T,·,D]
        g.op1(&format!("{p}.self_attn.{name}.t"), Op::Transpose { perm: Some(vec![0, 2, 1, 3]) }, &[r])
    };
    let q = linear(g, init, &format!("{p}.self_attn.q_proj"), x, e, e);
    let k = linear(g, init, &format!("{p}.self_attn.k_proj"), x, e, kv);
    let v = linear(g, init, &format!("{p}.self_attn.v_proj"), x, e, kv);
    let (q, k, v) = (heads(g, q, "q"), heads(g, k, "k"), heads(g, v, "v")); // [B,H,T,D], [B,K,T,D]
    let q = rotary(g, &format!("{p}.self_attn.q_rope"), q, d, s);
    let k = rotary(g, &format!("{p}.self_attn.k_rope"), k, d, s);
    // Each kv-head serves H/K query heads: [B,K,T,D] → [B,K,1,T,D] → [B,K,H/K,T,D] → [B,H,T,D].
    let group = |g: &mut Graph, x: ValueId, name: &str| {
        if c.kv_heads == c.heads {
            return x;
        }
        let u = g.op1(&format!("{p}.self_attn.{name}.grouped"), Op::Unsqueeze { axes: Some(vec![2]) }, &[x]);
        let r = g.op1(&format!("{p}.self_attn.{name}.repeated"), Op::Expand, &[u, s.repeat]);
        g.op1(&format!("{p}.self_attn.{name}.shared"), Op::Reshape, &[r, s.grouped_heads])
    };
    let (k, v) = (group(g, k, "k"), group(g, v, "v"));
    let k = g.op1(&format!("{p}.self_attn.k_t"), Op::Transpose { perm: Some(vec![0, 1, 3, 2]) }, &[k]); // [B,H,D,T]
    let scores = g.op1(&format!("{p}.self_attn.scores"), Op::MatMul, &[q, k]); // [B,H,T,T]
    let scores = g.op1(&format!("{p}.self_attn.scaled"), Op::Binary(Binary::Mul), &[scores, s.scale]);
    let scores = g.op1(&format!("{p}.self_attn.masked"), Op::Binary(Binary::Add), &[scores, s.mask]);
    let probs = g.op1(&format!("{p}.self_attn.probs"), Op::Softmax { axis: -1 }, &[scores]);
    let y = g.op1(&format!("{p}.self_attn.context"), Op::MatMul, &[probs, v]); // [B,H,T,D]
    let y = g.op1(&format!("{p}.self_attn.merge"), Op::Transpose { perm: Some(vec![0, 2, 1, 3]) }, &[y]);
    let y = g.op1(&format!("{p}.self_attn.merged"), Op::Reshape, &[y, s.merged]); // [B,T,C]
    linear(g, init, &format!("{p}.self_attn.o_proj"), y, e, e)
}

/// SwiGLU: down(silu(gate(x)) · up(x)), [B, T, C] → [B, T, C].
fn mlp(g: &mut Graph, init: &mut Init, p: &str, x: ValueId, c: &LlamaConfig) -> ValueId {
    let gate = linear(g, init, &format!("{p}.mlp.gate_proj"), x, c.embed, c.ffn); // [B,T,F]
    let up = linear(g, init, &format!("{p}.mlp.up_proj"), x, c.embed, c.ffn);
    let sig = g.op1(&format!("{p}.mlp.gate_sigmoid"), Op::Unary(Unary::Sigmoid), &[gate]);
    let silu = g.op1(&format!("{p}.mlp.gate_silu"), Op::Binary(Binary::Mul), &[gate, sig]);
    let h = g.op1(&format!("{p}.mlp.gated"), Op::Binary(Binary::Mul), &[silu, up]);
    linear(g, init, &format!("{p}.mlp.down_proj"), h, c.ffn, c.embed)
}

pub fn build(c: &LlamaConfig, seed: u64) -> Result<Graph> {
    let (h, t, d) = (c.heads, c.seq_len, c.embed / c.heads);
    let mut g = Graph::new("llama", EXPORT_OPSET);
    let mut init = Init::new(seed);
    let ids = g.add_input("input_ids", DType::I64, vec![Dim::Named("batch".into()), Dim::Fixed(t)]);
    let table = g.add_initializer("model.embed_tokens.weight", init.normal(&[c.vocab, c.embed], 0.02));
    let mut x = g.op1("model.embed_tokens", Op::Gather { axis: 0, padding_row: None }, &[table, ids]); // [B,T,C]

    let (cos, sin) = rope_tables(t, d, c.rope_theta);
    // Causal mask, added to the scores: 0 on and below the diagonal, a large negative above.
    let mask: Vec<f32> = (0..t * t).map(|k| if k % t > k / t { -1e9 } else { 0.0 }).collect();
    let shared = Shared {
        eps: constant(&mut g, "model.rms_eps", Tensor::scalar(c.norm_eps as f32)),
        cos: constant(&mut g, "model.rotary.cos", cos),
        sin: constant(&mut g, "model.rotary.sin", sin),
        mask: constant(&mut g, "model.causal_mask", Tensor::from_vec(&[t, t], mask)),
        scale: constant(&mut g, "model.attn_scale", Tensor::scalar(1.0 / (d as f32).sqrt())),
        repeat: ints(&mut g, "model.kv_repeat", &[1, 1, (h / c.kv_heads) as i64, 1, 1]),
        split_heads: ints(&mut g, "model.split_heads", &[0, 0, -1, d as i64]),
        grouped_heads: ints(&mut g, "model.grouped_heads", &[0, -1, t as i64, d as i64]),
        merged: ints(&mut g, "model.merged_heads", &[0, 0, -1]),
    };
    for i in 0..c.layers {
        let p = format!("model.layers.{i}");
        let a = rms_norm(&mut g, &format!("{p}.input_layernorm"), x, c.embed, shared.eps);
        let y = attention(&mut g, &mut init, &p, a, c, &shared);
        x = g.op1(&format!("{p}.attn_residual"), Op::Binary(Binary::Add), &[x, y]);
        let m = rms_norm(&mut g, &format!("{p}.post_attention_layernorm"), x, c.embed, shared.eps);
        let y = mlp(&mut g, &mut init, &p, m, c);
        x = g.op1(&format!("{p}.mlp_residual"), Op::Binary(Binary::Add), &[x, y]);
    }
    let x = rms_norm(&mut g, "model.norm", x, c.embed, shared.eps);
    let head = g.add_initializer("lm_head.weight", init.normal(&[c.embed, c.vocab], 0.02));
    let logits = g.op1("logits", Op::MatMul, &[x, head]); // [B,T,V]
    g.outputs.push(logits);
    Ok(g)
}

/// Parameters of a Llama of this shape, counted in u128 so that no configuration overflows it.
pub fn parameter_count(c: &LlamaConfig) -> u128 {
    let (e, f, v) = (c.embed as u128, c.ffn as u128, c.vocab as u128);
    let kv = c.kv_heads as u128 * (e / (c.heads as u128).max(1));
    let block = 2 * e + e * e + 2 * e * kv + e * e + 3 * e * f;
    2 * v * e + c.layers as u128 * block + e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_7b_shape_has_the_published_parameter_count() {
        let c = LlamaConfig {
            layers: 32,
            heads: 32,
            kv_heads: 32,
            embed: 4096,
            ffn: 11008,
            seq_len: 16,
            vocab: 32000,
            rope_theta: 10000.0,
            norm_eps: 1e-6,
        };
        assert_eq!(parameter_count(&c), 6_738_415_616);
        let small = LlamaConfig { layers: 2, heads: 4, kv_heads: 2, embed: 16, ffn: 32, vocab: 64, ..c };
        let g = build(&small, 1).unwrap();
        let n: usize = g.float_initializers().iter().map(|&v| g.initializers[&v].numel()).sum();
        assert_eq!(n as u128, parameter_count(&small));
    }
}
