//! A multilayer perceptron: `fc{i}` layers (x·W + b, W [in, out]) with ReLU between them.

use super::Init;
use crate::config::MlpConfig;
use crate::error::Result;
use crate::graph::ir::{Dim, Graph};
use crate::graph::onnx_io::EXPORT_OPSET;
use crate::op::{Binary, Op, Unary};
use crate::tensor::DType;

pub fn build(c: &MlpConfig, seed: u64) -> Result<Graph> {
    let mut g = Graph::new("mlp", EXPORT_OPSET);
    let mut init = Init::new(seed);
    let mut x = g.add_input("x", DType::F32, vec![Dim::Named("batch".into()), Dim::Fixed(c.inputs)]);
    let widths: Vec<usize> = std::iter::once(c.inputs).chain(c.hidden.iter().copied()).chain([c.classes]).collect();
    let layers = widths.len() - 1;
    for i in 0..layers {
        let (n_in, n_out) = (widths[i], widths[i + 1]);
        // PyTorch's nn.Linear default: U(−1/√in, 1/√in) for weight and bias.
        let bound = 1.0 / (n_in as f64).sqrt();
        let w = g.add_initializer(&format!("fc{i}.weight"), init.uniform(&[n_in, n_out], bound));
        let b = g.add_initializer(&format!("fc{i}.bias"), init.uniform(&[n_out], bound));
        let y = g.op1(&format!("fc{i}.matmul"), Op::MatMul, &[x, w]);
        let name = if i + 1 == layers { "logits".to_string() } else { format!("fc{i}") };
        x = g.op1(&name, Op::Binary(Binary::Add), &[y, b]);
        if i + 1 < layers {
            x = g.op1(&format!("fc{i}.relu"), Op::Unary(Unary::Relu), &[x]);
        }
    }
    g.outputs.push(x);
    Ok(g)
}
