//! SqueezeNet 1.1 (Iandola et al.), as torchvision builds it: a strided stem, eight Fire
//! modules (squeeze 1×1 → expand 1×1 ‖ expand 3×3), dropout and a 1×1 convolution classifier
//! pooled globally. Layout NCHW.

use super::Init;
use crate::config::SqueezeNetConfig;
use crate::error::Result;
use crate::graph::ir::{Dim, Graph, ValueId};
use crate::graph::onnx_io::EXPORT_OPSET;
use crate::op::{Op, PoolKind, Unary, Window};
use crate::tensor::DType;

fn window(k: usize, stride: usize, pad: usize, ceil_mode: bool) -> Window {
    Window::explicit(&[k, k], &[stride, stride], &[1, 1], &[pad; 4], ceil_mode)
}

/// Conv + ReLU with Kaiming-uniform weights (torchvision's SqueezeNet init) and zero bias.
#[allow(clippy::too_many_arguments)]
fn conv_relu(
    g: &mut Graph,
    init: &mut Init,
    name: &str,
    x: ValueId,
    c_in: usize,
    c_out: usize,
    k: usize,
    stride: usize,
    pad: usize,
) -> ValueId {
    let fan_in = (c_in * k * k) as f64;
    let w = g.add_initializer(&format!("{name}.weight"), init.uniform(&[c_out, c_in, k, k], (6.0 / fan_in).sqrt()));
    let b = g.add_initializer(&format!("{name}.bias"), Init::constant(&[c_out], 0.0));
    let y = g.op1(name, Op::Conv { window: window(k, stride, pad, false), group: 1 }, &[x, w, b]);
    g.op1(&format!("{name}.relu"), Op::Unary(Unary::Relu), &[y])
}

fn fire(g: &mut Graph, init: &mut Init, name: &str, x: ValueId, c_in: usize, squeeze: usize, expand: usize) -> ValueId {
    let s = conv_relu(g, init, &format!("{name}.squeeze"), x, c_in, squeeze, 1, 1, 0);
    let e1 = conv_relu(g, init, &format!("{name}.expand1x1"), s, squeeze, expand, 1, 1, 0);
    let e3 = conv_relu(g, init, &format!("{name}.expand3x3"), s, squeeze, expand, 3, 1, 1);
    g.op1(name, Op::Concat { axis: 1 }, &[e1, e3])
}

fn max_pool(g: &mut Graph, name: &str, x: ValueId) -> ValueId {
    g.op1(name, Op::Pool { kind: PoolKind::Max, window: window(3, 2, 0, true) }, &[x])
}

pub fn build(c: &SqueezeNetConfig, seed: u64) -> Result<Graph> {
    let mut g = Graph::new("squeezenet1_1", EXPORT_OPSET);
    let mut init = Init::new(seed);
    let s = c.image_size;
    let x =
        g.add_input("image", DType::F32, vec![Dim::Named("batch".into()), Dim::Fixed(3), Dim::Fixed(s), Dim::Fixed(s)]);
    let mut x = conv_relu(&mut g, &mut init, "features.0", x, 3, 64, 3, 2, 0);
    x = max_pool(&mut g, "features.2", x);
    let fires: [(&str, usize, usize, usize, bool); 8] = [
        ("features.3", 64, 16, 64, false),
        ("features.4", 128, 16, 64, true),
        ("features.6", 128, 32, 128, false),
        ("features.7", 256, 32, 128, true),
        ("features.9", 256, 48, 192, false),
        ("features.10", 384, 48, 192, false),
        ("features.11", 384, 64, 256, false),
        ("features.12", 512, 64, 256, false),
    ];
    for (name, c_in, sq, ex, pool_after) in fires {
        x = fire(&mut g, &mut init, name, x, c_in, sq, ex);
        if pool_after {
            x = max_pool(&mut g, &format!("{name}.pool"), x);
        }
    }
    x = g.add_node("classifier.0", Op::Dropout { ratio: 0.5, training: false, seed: 7 }, &[x], 1)[0];
    // The final convolution starts small (N(0, 0.01²)), as torchvision's does.
    let w = g.add_initializer("classifier.1.weight", init.normal(&[c.classes, 512, 1, 1], 0.01));
    let b = g.add_initializer("classifier.1.bias", Init::constant(&[c.classes], 0.0));
    x = g.op1("classifier.1", Op::Conv { window: window(1, 1, 0, false), group: 1 }, &[x, w, b]);
    x = g.op1("classifier.2", Op::Unary(Unary::Relu), &[x]);
    x = g.op1("classifier.3", Op::GlobalAveragePool, &[x]);
    let logits = g.op1("logits", Op::Flatten { axis: 1 }, &[x]);
    g.outputs.push(logits);
    Ok(g)
}
