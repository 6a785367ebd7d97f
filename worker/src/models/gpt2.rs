//! GPT-2: token and position embeddings, pre-norm transformer blocks (causal self-attention,
//! tanh-GELU MLP), a final LayerNorm and logits tied to the token embedding.
//!
//! With `make_vocab_size_divisible_by` the embedding holds the padded vocabulary's rows (zeros
//! past V, which no token reads) and the logits are masked to −∞ past V: exp(−∞) is 0, so the
//! loss, every gradient and every trained value are the unpadded model's, while the LM head's
//! products run on rows of whole 16-byte words (50257 logits a row are not; 50304 are).
//!
//! Weights are named as Hugging Face's GPT-2 names them, with x·W layouts (W is [in, out]).
//! Shapes in comments: B batch, T sequence, C width, H heads, D = C/H, V vocabulary.

use super::{constant, ints, Init};
use crate::config::Gpt2Config;
use crate::error::Result;
use crate::graph::ir::{Dim, Graph, ValueId};
use crate::graph::onnx_io::EXPORT_OPSET;
use crate::op::{Binary, Op, Unary};
use crate::tensor::{DType, Tensor};

fn layer_norm(g: &mut Graph, name: &str, x: ValueId, c: usize) -> ValueId {
    let w = g.add_initializer(&format!("{name}.weight"), Init::constant(&[c], 1.0));
    let b = g.add_initializer(&format!("{name}.bias"), Init::constant(&[c], 0.0));
    g.op1(name, Op::LayerNorm { axis: -1, epsilon: 1e-5, rms: false }, &[x, w, b])
}

/// x·W + b with W [n_in, n_out] drawn from N(0, std²) and b = 0.
fn linear(g: &mut Graph, init: &mut Init, name: &str, x: ValueId, n_in: usize, n_out: usize, std: f64) -> ValueId {
    let w = g.add_initializer(&format!("{name}.weight"), init.normal(&[n_in, n_out], std));
    let b = g.add_initializer(&format!("{name}.bias"), Init::constant(&[n_out], 0.0));
    let y = g.op1(&format!("{name}.matmul"), Op::MatMul, &[x, w]);
    g.op1(name, Op::Binary(Binary::Add), &[y, b])
}

fn dropout(g: &mut Graph, name: &str, x: ValueId, p: f32, seed: u64) -> ValueId {
    if p == 0.0 {
        return x;
    }
    g.add_node(name, Op::Dropout { ratio: p, training: false, seed }, &[x], 1)[0]
}

pub fn build(c: &Gpt2Config, seed: u64) -> Result<Graph> {
    let (l, h, e, t, v, vp) = (c.layers, c.heads, c.embed, c.seq_len, c.vocab, c.padded_vocab());
    let d = e / h;
    let mut g = Graph::new("gpt2", EXPORT_OPSET);
    let mut init = Init::new(seed);
    // GPT-2's initialization: N(0, 0.02²), residual projections scaled by 1/√(2L).
    let std = 0.02;
    let proj_std = 0.02 / ((2 * l) as f64).sqrt();

    let ids = g.add_input("input_ids", DType::I64, vec![Dim::Named("batch".into()), Dim::Fixed(t)]);
    let wte = g.add_initializer("wte", padded_rows(init.normal(&[v, e], std), vp));
    let wpe = g.add_initializer("wpe", init.normal(&[t, e], std));
    let tok = g.op1("embed.tokens", Op::Gather { axis: 0, padding_row: None }, &[wte, ids]); // [B,T,C]
    let mut x = g.op1("embed", Op::Binary(Binary::Add), &[tok, wpe]);
    x = dropout(&mut g, "embed.dropout", x, c.dropout, 1);

    // Causal mask, added to the scores: 0 on and below the diagonal, a large negative above.
    let mask: Vec<f32> = (0..t * t).map(|k| if k % t > k / t { -1e9 } else { 0.0 }).collect();
    let mask = constant(&mut g, "attn.causal_mask", Tensor::from_vec(&[t, t], mask));
    let scale = constant(&mut g, "attn.scale", Tensor::scalar(1.0 / (d as f32).sqrt()));
    let heads_shape = ints(&mut g, "attn.heads_shape", &[0, 0, h as i64, d as i64]);
    let merged_shape = ints(&mut g, "attn.merged_shape", &[0, 0, e as i64]);

    for i in 0..l {
        let p = format!("h.{i}");
        // Attention: x + proj(softmax(q·kᵀ/√D + mask)·v)
        let a = layer_norm(&mut g, &format!("{p}.ln_1"), x, e);
        let qkv = linear(&mut g, &mut init, &format!("{p}.attn.c_attn"), a, e, 3 * e, std); // [B,T,3C]
        let parts = g.add_node(
            &format!("{p}.attn.split"),
            Op::Split { axis: -1, sizes: vec![e as i64; 3], num_outputs: None },
            &[qkv],
            3,
        );
        let heads = |g: &mut Graph, x: ValueId, name: &str, perm: &[i64]| {
            let r = g.op1(&format!("{p}.attn.{name}.heads"), Op::Reshape, &[x, heads_shape]); // [B,T,H,D]
            g.op1(&format!("{p}.attn.{name}"), Op::Transpose { perm: Some(perm.to_vec()) }, &[r])
        };
        let q = heads(&mut g, parts[0], "q", &[0, 2, 1, 3]); // [B,H,T,D]
        let k = heads(&mut g, parts[1], "k", &[0, 2, 3, 1]); // [B,H,D,T]
        let vv = heads(&mut g, parts[2], "v", &[0, 2, 1, 3]); // [B,H,T,D]
        let s = g.op1(&format!("{p}.attn.scores"), Op::MatMul, &[q, k]); // [B,H,T,T]
        let s = g.op1(&format!("{p}.attn.scaled"), Op::Binary(Binary::Mul), &[s, scale]);
        let s = g.op1(&format!("{p}.attn.masked"), Op::Binary(Binary::Add), &[s, mask]);
        let pr = g.op1(&format!("{p}.attn.probs"), Op::Softmax { axis: -1 }, &[s]);
        let y = g.op1(&format!("{p}.attn.context"), Op::MatMul, &[pr, vv]); // [B,H,T,D]
        let y = g.op1(&format!("{p}.attn.merge"), Op::Transpose { perm: Some(vec![0, 2, 1, 3]) }, &[y]); // [B,T,H,D]
        let y = g.op1(&format!("{p}.attn.merged"), Op::Reshape, &[y, merged_shape]); // [B,T,C]
        let y = linear(&mut g, &mut init, &format!("{p}.attn.c_proj"), y, e, e, proj_std);
        let y = dropout(&mut g, &format!("{p}.attn.dropout"), y, c.dropout, 2 + 2 * i as u64);
        x = g.op1(&format!("{p}.attn.residual"), Op::Binary(Binary::Add), &[x, y]);
        // MLP: x + proj(gelu(fc(ln(x))))
        let m = layer_norm(&mut g, &format!("{p}.ln_2"), x, e);
        let f = linear(&mut g, &mut init, &format!("{p}.mlp.c_fc"), m, e, 4 * e, std); // [B,T,4C]
        let f = g.op1(&format!("{p}.mlp.gelu"), Op::Unary(Unary::GeluTanh), &[f]);
        let f = linear(&mut g, &mut init, &format!("{p}.mlp.c_proj"), f, 4 * e, e, proj_std);
        let f = dropout(&mut g, &format!("{p}.mlp.dropout"), f, c.dropout, 3 + 2 * i as u64);
        x = g.op1(&format!("{p}.mlp.residual"), Op::Binary(Binary::Add), &[x, f]);
    }
    let x = layer_norm(&mut g, "ln_f", x, e);
    let wte_t = g.op1("lm_head.weight", Op::Transpose { perm: Some(vec![1, 0]) }, &[wte]); // [C,V]
    let logits = if vp > v {
        let padded = g.op1("lm_head.padded_logits", Op::MatMul, &[x, wte_t]); // [B,T,Vp]
        let mask: Vec<f32> = (0..vp).map(|k| if k < v { 0.0 } else { f32::NEG_INFINITY }).collect();
        let mask = constant(&mut g, "lm_head.vocab_mask", Tensor::from_vec(&[vp], mask));
        g.op1("logits", Op::Binary(Binary::Add), &[padded, mask])
    } else {
        g.op1("logits", Op::MatMul, &[x, wte_t]) // [B,T,V]
    };
    g.outputs.push(logits);
    Ok(g)
}

/// `w` ([V, C]) with zero rows appended up to `rows`: the padding is drawn from nothing, so the
/// weights after it are drawn as without it.
fn padded_rows(w: Tensor, rows: usize) -> Tensor {
    let (v, e) = (w.shape()[0], w.shape()[1]);
    if rows == v {
        return w;
    }
    let mut values = w.as_slice::<f32>().to_vec();
    values.resize(rows * e, 0.0);
    Tensor::from_vec(&[rows, e], values)
}

/// Parameters of a GPT-2 of this shape (tied embeddings counted once, with the padded
/// vocabulary's rows, which the model holds), counted in u128 so that no configuration
/// overflows it.
pub fn parameter_count(c: &Gpt2Config) -> u128 {
    let (l, e, t, v) = (c.layers as u128, c.embed as u128, c.seq_len as u128, c.padded_vocab() as u128);
    v * e + t * e + l * (12 * e * e + 13 * e) + 2 * e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_124m_shape_builds_with_the_published_parameter_count() {
        let c = Gpt2Config { layers: 12, heads: 12, embed: 768, seq_len: 1024, vocab: 50257, ..Default::default() };
        assert_eq!(parameter_count(&c), 124_439_808);
        let small = Gpt2Config { layers: 2, heads: 2, embed: 16, seq_len: 8, vocab: 32, ..Default::default() };
        let g = build(&small, 1).unwrap();
        let n: usize = g.float_initializers().iter().map(|&v| g.initializers[&v].numel()).sum();
        assert_eq!(n as u128, parameter_count(&small));
    }
}
