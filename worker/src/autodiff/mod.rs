//! Reverse-mode autodiff over a bound graph: the backward graph is appended to the forward one,
//! one gradient rule per op ([`rules`]), as ONNX Runtime's gradient builders do.
//!
//! Only values on a path from a parameter to the loss get gradients; contributions to the same
//! value from several consumers are summed.

#[cfg(test)]
mod gradcheck;
pub mod recompute;
pub mod rules;

use crate::error::{Error, Result};
use crate::graph::infer::infer_node;
use crate::graph::ir::{Graph, Meta, Node, ValueId};
use crate::op::Op;
use crate::tensor::Tensor;

/// Appends nodes to a bound graph, inferring each new node's output metas at once.
pub struct Builder<'g> {
    pub g: &'g mut Graph,
}

impl Builder<'_> {
    pub fn meta(&self, v: ValueId) -> Meta {
        self.g.meta(v).cloned().expect("bound graphs give every value a meta")
    }

    /// Adds `op` over `inputs` with `n_out` outputs, named after `name`.
    pub fn emit(&mut self, name: &str, op: Op, inputs: &[ValueId], n_out: usize) -> Result<Vec<ValueId>> {
        let outs = self.g.add_node(name, op, inputs, n_out);
        let node = self.g.nodes.last().expect("just added").clone();
        let metas: Vec<Option<Meta>> = inputs.iter().map(|&v| self.g.meta(v).cloned()).collect();
        let consts: Vec<Option<&Tensor>> = vec![None; inputs.len()];
        let (_, out_metas) = infer_node(&node, &metas, &consts, true)?;
        for (o, m) in outs.iter().zip(out_metas) {
            self.g.values[*o].meta = Some(m);
        }
        Ok(outs)
    }

    pub fn emit1(&mut self, name: &str, op: Op, inputs: &[ValueId]) -> Result<ValueId> {
        Ok(self.emit(name, op, inputs, 1)?[0])
    }

    /// A reshape of `x` to `shape` (no inference needed: the shape is the answer).
    pub fn reshape(&mut self, name: &str, x: ValueId, shape: &[usize]) -> ValueId {
        let dtype = self.meta(x).dtype;
        if self.meta(x).shape == shape {
            return x;
        }
        let y = self.g.op1(name, Op::Reshape, &[x]);
        self.g.values[y].meta = Some(Meta::new(dtype, shape));
        y
    }

    /// `x` broadcast to `shape`.
    pub fn expand(&mut self, name: &str, x: ValueId, shape: &[usize]) -> ValueId {
        let dtype = self.meta(x).dtype;
        if self.meta(x).shape == shape {
            return x;
        }
        let y = self.g.op1(name, Op::Expand, &[x]);
        self.g.values[y].meta = Some(Meta::new(dtype, shape));
        y
    }

    /// Sums a broadcast gradient down to `shape` (identity when the shapes already agree).
    pub fn sum_to(&mut self, name: &str, dy: ValueId, shape: &[usize]) -> Result<ValueId> {
        if self.meta(dy).shape == shape {
            return Ok(dy);
        }
        self.emit1(name, Op::ReduceSumTo { shape: shape.to_vec() }, &[dy])
    }

    /// A constant scalar of `x`'s element type.
    pub fn scalar_like(&mut self, name: &str, x: ValueId, v: f64) -> ValueId {
        let dtype = self.meta(x).dtype;
        let t = Tensor::from_vec(&[], vec![v]).cast(dtype);
        let id = self.g.fresh(name);
        let name = self.g.name_of(id).to_string();
        self.g.add_initializer(&name, t)
    }

    /// Makes sure output `k` of node `n` exists (optional outputs the backward pass reads, such
    /// as LayerNormalization's saved statistics), returning it.
    pub fn ensure_output(&mut self, n: usize, k: usize, meta: Meta) -> ValueId {
        if let Some(v) = self.g.nodes[n].output(k) {
            return v;
        }
        let hint = format!("{}:saved{k}", self.g.nodes[n].name);
        let v = self.g.fresh(&hint);
        self.g.values[v].meta = Some(meta);
        let node = &mut self.g.nodes[n];
        while node.outputs.len() <= k {
            node.outputs.push(None);
        }
        node.outputs[k] = Some(v);
        v
    }
}

/// Appends the backward pass of `loss` to `g` (bound). Returns each parameter's gradient
/// value, in the order of `params`. A parameter the loss does not depend on is an error
/// naming it (it would never train).
pub fn gradients(g: &mut Graph, loss: ValueId, params: &[ValueId]) -> Result<Vec<ValueId>> {
    let grads = gradients_of(g, loss, params, None)?;
    params
        .iter()
        .zip(grads)
        .map(|(&p, dp)| {
            dp.ok_or_else(|| {
                Error::Config(format!("weight '{}' does not affect the loss; freeze it or remove it", g.name_of(p)))
            })
        })
        .collect()
}

/// Like [`gradients`], for any values `wrt` (a pipeline stage's received activations too);
/// `None` for a value the loss does not depend on. `seed` is the loss's own gradient, a scalar
/// (fp16's loss scale, a graph input); None: 1.
pub fn gradients_of(
    g: &mut Graph,
    loss: ValueId,
    wrt: &[ValueId],
    seed: Option<ValueId>,
) -> Result<Vec<Option<ValueId>>> {
    let params = wrt;
    let n_forward = g.nodes.len();
    // Which values depend on a parameter (only those need gradients).
    let mut requires = vec![false; g.values.len()];
    for &p in params {
        requires[p] = true;
    }
    for node in &g.nodes {
        if rules::differentiable(&node.op) && node.inputs.iter().flatten().any(|i| requires[*i]) {
            for o in node.outputs.iter().flatten() {
                requires[*o] = true;
            }
        }
    }
    if !requires[loss] {
        return Err(Error::Config(format!("the loss '{}' does not depend on any trainable weight", g.name_of(loss))));
    }
    let mut grad: Vec<Option<ValueId>> = vec![None; g.values.len()];
    let mut b = Builder { g };
    let seed = match seed {
        None => b.scalar_like("loss_grad_seed", loss, 1.0),
        Some(s) if b.meta(s).dtype == b.meta(loss).dtype => s,
        Some(s) => b.emit1("loss_grad_seed", Op::Cast { to: b.meta(loss).dtype }, &[s])?,
    };
    let seed = b.expand("loss_grad", seed, &b.meta(loss).shape.clone());
    grad[loss] = Some(seed);

    for n in (0..n_forward).rev() {
        let node: Node = b.g.nodes[n].clone();
        let out_grads: Vec<Option<ValueId>> = node.outputs.iter().map(|o| o.and_then(|v| grad[v])).collect();
        if out_grads.iter().all(Option::is_none) {
            continue;
        }
        let wanted: Vec<bool> = node.inputs.iter().map(|i| i.is_some_and(|v| requires[v])).collect();
        if !wanted.iter().any(|&w| w) {
            continue;
        }
        let in_grads = rules::backward(&mut b, n, &node, &out_grads, &wanted)?;
        for (k, dx) in in_grads.into_iter().enumerate() {
            let (Some(dx), Some(x)) = (dx, node.input(k)) else { continue };
            if !wanted[k] {
                continue;
            }
            grad[x] = Some(match grad[x] {
                None => dx,
                Some(prev) => {
                    let name = format!("{}_grad_sum", b.g.name_of(x));
                    b.emit1(&name, Op::Binary(crate::op::Binary::Add), &[prev, dx])?
                }
            });
            if grad.len() < b.g.values.len() {
                grad.resize(b.g.values.len(), None);
            }
        }
        if grad.len() < b.g.values.len() {
            grad.resize(b.g.values.len(), None);
            requires.resize(b.g.values.len(), false);
        }
    }
    Ok(params.iter().map(|&p| grad[p]).collect())
}
