//! One gradient rule per op: given a forward node and the gradients of its outputs, emit the
//! nodes that compute the gradients of its inputs.

use super::Builder;
use crate::error::{Error, Result};
use crate::graph::ir::{Meta, Node, ValueId};
use crate::op::{AttentionShape, Binary, Op, Reduce, ScatterReduction, Unary};
use crate::tensor::DType;

/// Ops through which gradients flow.
pub fn differentiable(op: &Op) -> bool {
    match op {
        Op::Unary(u) => u.is_differentiable(),
        Op::Binary(b) => !b.is_predicate(),
        Op::Cast { to } => to.is_float(),
        Op::Constant { .. }
        | Op::Shape { .. }
        | Op::ConstantOfShape { .. }
        | Op::Range
        | Op::Size
        | Op::ArgExtreme { .. }
        | Op::TopKIndices { .. } => false,
        _ => true,
    }
}

fn no_rule(node: &Node, what: &str) -> Error {
    Error::Config(format!("{}: no gradient rule {what}; freeze the weights that feed it", node.describe()))
}

/// Returns one optional gradient per input of `node` (node index `n` in the graph).
pub fn backward(
    b: &mut Builder,
    n: usize,
    node: &Node,
    dys: &[Option<ValueId>],
    wanted: &[bool],
) -> Result<Vec<Option<ValueId>>> {
    let name = format!("{}_grad", node.name);
    let x = |i: usize| node.input(i).expect("inputs with wanted gradients exist");
    let want = |i: usize| wanted.get(i).copied().unwrap_or(false);
    let Some(dy) = dys.first().copied().flatten() else {
        // Only secondary outputs carry gradient (e.g. Split's later parts); handled per op.
        return match &node.op {
            Op::Split { .. } => split_grad(b, node, dys, &name),
            _ => Ok(vec![None; node.inputs.len()]),
        };
    };
    let shape_of = |b: &Builder, v: ValueId| b.meta(v).shape;
    Ok(match &node.op {
        Op::Unary(u) => vec![Some(match u {
            Unary::Neg => b.emit1(&name, Op::Unary(Unary::Neg), &[dy])?,
            _ => b.emit1(&name, Op::UnaryGrad(*u), &[dy, x(0)])?,
        })],
        Op::Binary(op) => {
            let (a, c) = (x(0), x(1));
            let (sa, sc) = (shape_of(b, a), shape_of(b, c));
            let mul = Op::Binary(Binary::Mul);
            let (da, dc) = match op {
                Binary::Add => (Some(dy), Some(dy)),
                Binary::Sub => (
                    Some(dy),
                    if want(1) { Some(b.emit1(&format!("{name}_neg"), Op::Unary(Unary::Neg), &[dy])?) } else { None },
                ),
                Binary::Mul => (
                    if want(0) { Some(b.emit1(&format!("{name}_a"), mul.clone(), &[dy, c])?) } else { None },
                    if want(1) { Some(b.emit1(&format!("{name}_b"), mul, &[dy, a])?) } else { None },
                ),
                Binary::Div => {
                    let da = if want(0) {
                        Some(b.emit1(&format!("{name}_a"), Op::Binary(Binary::Div), &[dy, c])?)
                    } else {
                        None
                    };
                    let dc = if want(1) {
                        // d(a/c)/dc = −(a/c)/c
                        let y = node.output(0).expect("Div has an output");
                        let t = b.emit1(&format!("{name}_b0"), Op::Binary(Binary::Mul), &[dy, y])?;
                        let t = b.emit1(&format!("{name}_b1"), Op::Binary(Binary::Div), &[t, c])?;
                        Some(b.emit1(&format!("{name}_b"), Op::Unary(Unary::Neg), &[t])?)
                    } else {
                        None
                    };
                    (da, dc)
                }
                Binary::Pow => {
                    let y = node.output(0).expect("Pow has an output");
                    let da = if want(0) {
                        // c · a^(c−1) = c · y / a
                        let c_f = if b.meta(c).dtype == b.meta(a).dtype {
                            c
                        } else {
                            b.emit1(&format!("{name}_cast"), Op::Cast { to: b.meta(a).dtype }, &[c])?
                        };
                        let t = b.emit1(&format!("{name}_a0"), Op::Binary(Binary::Mul), &[dy, c_f])?;
                        let one = b.scalar_like(&format!("{name}_one"), c_f, 1.0);
                        let cm1 = b.emit1(&format!("{name}_a1"), Op::Binary(Binary::Sub), &[c_f, one])?;
                        let p = b.emit1(&format!("{name}_a2"), Op::Binary(Binary::Pow), &[a, cm1])?;
                        Some(b.emit1(&format!("{name}_a"), Op::Binary(Binary::Mul), &[t, p])?)
                    } else {
                        None
                    };
                    let dc = if want(1) {
                        let l = b.emit1(&format!("{name}_b0"), Op::Unary(Unary::Log), &[a])?;
                        let t = b.emit1(&format!("{name}_b1"), Op::Binary(Binary::Mul), &[dy, y])?;
                        Some(b.emit1(&format!("{name}_b"), Op::Binary(Binary::Mul), &[t, l])?)
                    } else {
                        None
                    };
                    (da, dc)
                }
                Binary::Max | Binary::Min => {
                    // The gradient goes to the input that was chosen (ties to the first).
                    let pick = if *op == Binary::Max { Binary::GreaterOrEqual } else { Binary::LessOrEqual };
                    let cond = b.emit1(&format!("{name}_pick"), Op::Binary(pick), &[a, c])?;
                    let zero = b.scalar_like(&format!("{name}_zero"), dy, 0.0);
                    let da = b.emit1(&format!("{name}_a"), Op::Where, &[cond, dy, zero])?;
                    let dc = b.emit1(&format!("{name}_b"), Op::Where, &[cond, zero, dy])?;
                    (Some(da), Some(dc))
                }
                Binary::Mod | Binary::Fmod => {
                    // a = q·c + y with q = floor(a/c) (Mod) or trunc(a/c) (Fmod), constant
                    // almost everywhere: dA = dY, dC = −dY·q, q = (a − y)/c exactly.
                    let dc = if want(1) {
                        let y = node.output(0).expect("Mod has an output");
                        let t = b.emit1(&format!("{name}_b0"), Op::Binary(Binary::Sub), &[a, y])?;
                        let q = b.emit1(&format!("{name}_b1"), Op::Binary(Binary::Div), &[t, c])?;
                        let t = b.emit1(&format!("{name}_b2"), Op::Binary(Binary::Mul), &[dy, q])?;
                        Some(b.emit1(&format!("{name}_b"), Op::Unary(Unary::Neg), &[t])?)
                    } else {
                        None
                    };
                    (Some(dy), dc)
                }
                Binary::PRelu => {
                    // dX = dY·(x < 0 ? slope : 1), dSlope = dY·(x < 0 ? x : 0).
                    let zero = b.scalar_like(&format!("{name}_zero"), a, 0.0);
                    let neg = b.emit1(&format!("{name}_neg"), Op::Binary(Binary::Less), &[a, zero])?;
                    let da = if want(0) {
                        let t = b.emit1(&format!("{name}_a0"), Op::Binary(Binary::Mul), &[dy, c])?;
                        Some(b.emit1(&format!("{name}_a"), Op::Where, &[neg, t, dy])?)
                    } else {
                        None
                    };
                    let dc = if want(1) {
                        let t = b.emit1(&format!("{name}_b0"), Op::Binary(Binary::Mul), &[dy, a])?;
                        let zero = b.scalar_like(&format!("{name}_dzero"), dy, 0.0);
                        Some(b.emit1(&format!("{name}_b"), Op::Where, &[neg, t, zero])?)
                    } else {
                        None
                    };
                    (da, dc)
                }
                _ => return Err(no_rule(node, "for comparisons")),
            };
            let da = match da {
                Some(v) if want(0) => Some(b.sum_to(&format!("{name}_a_sum"), v, &sa)?),
                _ => None,
            };
            let dc = match dc {
                Some(v) if want(1) => Some(b.sum_to(&format!("{name}_b_sum"), v, &sc)?),
                _ => None,
            };
            vec![da, dc]
        }
        Op::Where => {
            let zero = b.scalar_like(&format!("{name}_zero"), dy, 0.0);
            let cnd = x(0);
            let mut out = vec![None];
            for (k, (t, f)) in [(dy, zero), (zero, dy)].into_iter().enumerate() {
                if want(k + 1) {
                    let v = b.emit1(&format!("{name}_{k}"), Op::Where, &[cnd, t, f])?;
                    let s = shape_of(b, x(k + 1));
                    out.push(Some(b.sum_to(&format!("{name}_{k}_sum"), v, &s)?));
                } else {
                    out.push(None);
                }
            }
            out
        }
        Op::Cast { .. } => {
            let to = b.meta(x(0)).dtype;
            vec![Some(b.emit1(&name, Op::Cast { to }, &[dy])?)]
        }
        Op::Identity | Op::Reshape => {
            let s = shape_of(b, x(0));
            vec![Some(b.reshape(&name, dy, &s))]
        }
        Op::Dropout { ratio, training, .. } => {
            if !*training || *ratio == 0.0 {
                vec![Some(dy)]
            } else {
                let shape = shape_of(b, x(0));
                let mask = b.ensure_output(n, 1, Meta::new(DType::Bool, &shape));
                vec![Some(b.emit1(&name, Op::DropoutGrad { ratio: *ratio }, &[dy, mask])?)]
            }
        }
        Op::MatMul => matmul_grad(b, node, dy, want(0), want(1), &name)?,
        Op::Gemm { alpha, beta, trans_a, trans_b } => {
            let (a, w) = (x(0), x(1));
            let mm = |ta, tb| Op::FusedMatMul { trans_a: ta, trans_b: tb, activation: None };
            // Y = A'·B': dA' = dY·B'ᵀ and dB' = A'ᵀ·dY, then undo the transposes.
            let da = if want(0) {
                let v = match trans_a {
                    false => b.emit1(&format!("{name}_a"), mm(false, !trans_b), &[dy, w])?,
                    true => b.emit1(&format!("{name}_a"), mm(*trans_b, true), &[w, dy])?,
                };
                Some(scale(b, v, *alpha, &format!("{name}_a_scale"))?)
            } else {
                None
            };
            let dw = if want(1) {
                let v = match trans_b {
                    false => b.emit1(&format!("{name}_b"), mm(!trans_a, false), &[a, dy])?,
                    true => b.emit1(&format!("{name}_b"), mm(true, *trans_a), &[dy, a])?,
                };
                Some(scale(b, v, *alpha, &format!("{name}_b_scale"))?)
            } else {
                None
            };
            let dc = if node.inputs.len() > 2 && want(2) {
                let v = scale(b, dy, *beta, &format!("{name}_c_scale"))?;
                let s = shape_of(b, x(2));
                Some(b.sum_to(&format!("{name}_c"), v, &s)?)
            } else {
                None
            };
            vec![da, dw, dc]
        }
        Op::Softmax { axis } => {
            let y = node.output(0).expect("Softmax has an output");
            vec![Some(b.emit1(&name, Op::SoftmaxGrad { axis: *axis }, &[dy, y])?)]
        }
        Op::LogSoftmax { axis } => {
            let y = node.output(0).expect("LogSoftmax has an output");
            vec![Some(b.emit1(&name, Op::LogSoftmaxGrad { axis: *axis }, &[dy, y])?)]
        }
        Op::LayerNorm { axis, rms, .. } => {
            let xm = b.meta(x(0));
            let a = crate::shape::norm_axis(*axis, xm.shape.len()).unwrap_or(0);
            let stat: Vec<usize> = xm.shape.iter().enumerate().map(|(i, &d)| if i < a { d } else { 1 }).collect();
            let mean = b.ensure_output(n, 1, Meta::new(DType::F32, &stat));
            let inv = b.ensure_output(n, 2, Meta::new(DType::F32, &stat));
            let outs = b.emit(&name, Op::LayerNormGrad { axis: *axis, rms: *rms }, &[dy, x(0), x(1), mean, inv], 3)?;
            // The kernel's dScale/dBias are shaped like the scale; a bias may be shaped otherwise.
            let mut v = vec![Some(outs[0]), Some(outs[1])];
            if node.inputs.len() > 2 {
                v.push(Some(outs[2]));
            }
            v
        }
        Op::Transpose { perm } => {
            let perm = perm.clone().unwrap_or_default();
            let mut inv = vec![0i64; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p as usize] = i as i64;
            }
            vec![Some(b.emit1(&name, Op::Transpose { perm: Some(inv) }, &[dy])?)]
        }
        Op::Concat { axis } => {
            let a = *axis as usize;
            let sizes: Vec<i64> =
                node.inputs.iter().map(|i| b.meta(i.expect("Concat inputs exist")).shape[a] as i64).collect();
            let parts = b.emit(&name, Op::Split { axis: *axis, sizes, num_outputs: None }, &[dy], node.inputs.len())?;
            parts.into_iter().map(Some).collect()
        }
        Op::Split { .. } => split_grad(b, node, dys, &name)?,
        Op::Slice { starts, ends, axes, steps } => {
            let input_shape = shape_of(b, x(0));
            vec![Some(b.emit1(
                &name,
                Op::SliceGrad {
                    input_shape,
                    starts: starts.clone(),
                    ends: ends.clone(),
                    axes: axes.clone(),
                    steps: steps.clone(),
                },
                &[dy],
            )?)]
        }
        Op::Gather { axis, padding_row } => {
            let data_shape = shape_of(b, x(0));
            let dy = match padding_row {
                Some(row) => without_padding_row(b, &name, dy, x(1), *row)?,
                None => dy,
            };
            vec![Some(b.emit1(&name, Op::GatherGrad { axis: *axis, data_shape }, &[dy, x(1)])?), None]
        }
        // Each input element reaches the sums after it (before it, reversed): the gradient is
        // dY's running sum the other way.
        Op::CumSum { axis, exclusive, reverse } => {
            let op = Op::CumSum { axis: *axis, exclusive: *exclusive, reverse: !reverse };
            vec![Some(b.emit1(&name, op, &[dy])?)]
        }
        Op::Pad { mode, pads, .. } => {
            let op = Op::PadGrad { mode: *mode, pads: pads.clone(), input_shape: shape_of(b, x(0)) };
            vec![Some(b.emit1(&name, op, &[dy])?)]
        }
        Op::GatherND { batch_dims } => {
            let op = Op::GatherNDGrad { batch_dims: *batch_dims, data_shape: shape_of(b, x(0)) };
            vec![Some(b.emit1(&name, op, &[dy, x(1)])?), None]
        }
        // An update replaces (or adds to) its slice: the data's gradient is dY with the replaced
        // slices zeroed (all of dY for add), the updates' the slices of dY they landed on (for
        // tuples that repeat, every update's: PyTorch's index_put).
        Op::ScatterND { reduction } => {
            let data = match reduction {
                ScatterReduction::None => {
                    let zero = b.scalar_like(&format!("{name}_zero"), dy, 0.0);
                    let zeros = b.expand(&format!("{name}_zeros"), zero, &shape_of(b, x(2)));
                    b.emit1(&format!("{name}_data"), Op::ScatterND { reduction: *reduction }, &[dy, x(1), zeros])?
                }
                ScatterReduction::Add => dy,
                _ => return Err(no_rule(node, "for ScatterND with reduction mul, max or min")),
            };
            let updates = b.emit1(&format!("{name}_updates"), Op::GatherND { batch_dims: 0 }, &[dy, x(1)])?;
            vec![Some(data), None, Some(updates)]
        }
        // As ScatterND's, element by element.
        Op::ScatterElements { axis, reduction } => {
            let data = match reduction {
                ScatterReduction::None => {
                    let zero = b.scalar_like(&format!("{name}_zero"), dy, 0.0);
                    let zeros = b.expand(&format!("{name}_zeros"), zero, &shape_of(b, x(2)));
                    let op = Op::ScatterElements { axis: *axis, reduction: *reduction };
                    b.emit1(&format!("{name}_data"), op, &[dy, x(1), zeros])?
                }
                ScatterReduction::Add => dy,
                _ => return Err(no_rule(node, "for ScatterElements with reduction mul, max or min")),
            };
            let updates = b.emit1(&format!("{name}_updates"), Op::GatherElements { axis: *axis }, &[dy, x(1)])?;
            vec![Some(data), None, Some(updates)]
        }
        Op::GatherElements { axis } => {
            let data_shape = shape_of(b, x(0));
            let op = Op::GatherElementsGrad { axis: *axis, data_shape };
            vec![Some(b.emit1(&name, op, &[dy, x(1)])?), None]
        }
        Op::Expand => {
            let s = shape_of(b, x(0));
            vec![Some(b.sum_to(&name, dy, &s)?)]
        }
        Op::Trilu { .. } => vec![Some(b.emit1(&name, node.op.clone(), &[dy])?)],
        Op::ReduceOp { kind, axes, keepdims, .. } => {
            let xs = shape_of(b, x(0));
            let axes = axes.clone().unwrap_or_default();
            let kept: Vec<usize> =
                xs.iter().enumerate().map(|(i, &d)| if axes.contains(&(i as i64)) { 1 } else { d }).collect();
            let _ = keepdims;
            let g = b.reshape(&format!("{name}_keep"), dy, &kept);
            let g = b.expand(&format!("{name}_expand"), g, &xs);
            // The output broadcast back over the input, for the rules that read it.
            let y = |b: &mut Builder| {
                let y = node.output(0).expect("a Reduce op has an output");
                let r = b.reshape(&format!("{name}_y_keep"), y, &kept);
                b.expand(&format!("{name}_y_expand"), r, &xs)
            };
            let mul = |b: &mut Builder, p: ValueId, q: ValueId, n: &str| {
                b.emit1(&format!("{name}_{n}"), Op::Binary(Binary::Mul), &[p, q])
            };
            let g = match kind {
                Reduce::Sum => g,
                Reduce::Mean => {
                    let count: usize = axes.iter().map(|&a| xs[a as usize]).product();
                    scale(b, g, 1.0 / count.max(1) as f32, &format!("{name}_mean"))?
                }
                Reduce::SumSquare => {
                    let two = b.scalar_like(&format!("{name}_two"), x(0), 2.0);
                    let t = mul(b, x(0), two, "2x")?;
                    mul(b, g, t, "sq")?
                }
                Reduce::L1 => {
                    let sign = b.emit1(&format!("{name}_sign"), Op::Unary(Unary::Sign), &[x(0)])?;
                    mul(b, g, sign, "l1")?
                }
                // d√Σx²/dx = x/y; d ln Σx/dx = 1/Σx = e^−y; d ln Σeˣ/dx = e^(x − y).
                Reduce::L2 => {
                    let y = y(b);
                    let t = b.emit1(&format!("{name}_x_over_y"), Op::Binary(Binary::Div), &[x(0), y])?;
                    mul(b, g, t, "l2")?
                }
                Reduce::LogSum => {
                    let y = y(b);
                    let e = b.emit1(&format!("{name}_exp_y"), Op::Unary(Unary::Exp), &[y])?;
                    b.emit1(&format!("{name}_logsum"), Op::Binary(Binary::Div), &[g, e])?
                }
                Reduce::LogSumExp => {
                    let y = y(b);
                    let d = b.emit1(&format!("{name}_x_minus_y"), Op::Binary(Binary::Sub), &[x(0), y])?;
                    let e = b.emit1(&format!("{name}_softmax"), Op::Unary(Unary::Exp), &[d])?;
                    mul(b, g, e, "logsumexp")?
                }
                // Πx/x: right where no element of the product is 0.
                Reduce::Prod => {
                    let y = y(b);
                    let t = b.emit1(&format!("{name}_y_over_x"), Op::Binary(Binary::Div), &[y, x(0)])?;
                    mul(b, g, t, "prod")?
                }
                // The gradient is shared evenly by the elements equal to the extreme (PyTorch's
                // amax/amin).
                Reduce::Max | Reduce::Min => {
                    let y = y(b);
                    let hit = b.emit1(&format!("{name}_hit"), Op::Binary(Binary::Equal), &[x(0), y])?;
                    let dtype = b.meta(x(0)).dtype;
                    let mask = b.emit1(&format!("{name}_mask"), Op::Cast { to: dtype }, &[hit])?;
                    let count = b.emit1(
                        &format!("{name}_count"),
                        Op::ReduceOp {
                            kind: Reduce::Sum,
                            axes: Some(axes.clone()),
                            keepdims: true,
                            noop_with_empty_axes: false,
                        },
                        &[mask],
                    )?;
                    let share = b.emit1(&format!("{name}_share"), Op::Binary(Binary::Div), &[mask, count])?;
                    mul(b, g, share, "extreme")?
                }
            };
            vec![Some(g)]
        }
        Op::Conv { window, group } => {
            let outs = b.emit(&name, Op::ConvGrad { window: window.clone(), group: *group }, &[dy, x(0), x(1)], 3)?;
            outs.into_iter().take(node.inputs.len()).map(Some).collect()
        }
        Op::ConvTranspose { window, group, .. } => {
            let op = Op::ConvTransposeGrad { window: window.clone(), group: *group };
            let outs = b.emit(&name, op, &[dy, x(0), x(1)], 3)?;
            outs.into_iter().take(node.inputs.len()).map(Some).collect()
        }
        Op::Resize(r) => {
            let op = Op::ResizeGrad { resize: r.clone(), input_shape: shape_of(b, x(0)) };
            vec![Some(b.emit1(&name, op, &[dy])?)]
        }
        Op::Pool { kind, window } => {
            vec![Some(b.emit1(&name, Op::PoolGrad { kind: *kind, window: window.clone() }, &[dy, x(0)])?)]
        }
        Op::GlobalAveragePool => {
            let xs = shape_of(b, x(0));
            let plane: usize = xs[2..].iter().product();
            let g = b.expand(&format!("{name}_expand"), dy, &xs);
            vec![Some(scale(b, g, 1.0 / plane.max(1) as f32, &name)?)]
        }
        Op::BatchNorm { epsilon, training, .. } => {
            if !*training {
                return Err(no_rule(node, "for BatchNormalization in inference mode"));
            }
            let outs = b.emit(&name, Op::BatchNormGrad { epsilon: *epsilon }, &[dy, x(0), x(1)], 3)?;
            vec![Some(outs[0]), Some(outs[1]), Some(outs[2]), None, None]
        }
        Op::SoftmaxCrossEntropyLoss { reduction, ignore_index } => {
            let scores = b.meta(x(0));
            let log_prob = b.ensure_output(n, 1, scores.clone());
            let mut ins = vec![dy, log_prob, x(1)];
            if let Some(w) = node.input(2) {
                ins.push(w);
            }
            let op = Op::SoftmaxCrossEntropyLossGrad { reduction: *reduction, ignore_index: *ignore_index };
            vec![Some(b.emit1(&name, op, &ins)?), None, None]
        }
        Op::NegativeLogLikelihoodLoss { reduction, ignore_index } => {
            let mut ins = vec![dy, x(1)];
            if let Some(w) = node.input(2) {
                ins.push(w);
            }
            let input_shape = shape_of(b, x(0));
            let op =
                Op::NegativeLogLikelihoodLossGrad { reduction: *reduction, ignore_index: *ignore_index, input_shape };
            vec![Some(b.emit1(&name, op, &ins)?), None, None]
        }
        Op::FusedMatMul { .. } => return Err(no_rule(node, "(fusion runs after autodiff)")),
        Op::Attention { scale, causal, layout } => {
            // The backward pass reads the output and the rows' log-sum-exp, and recomputes the
            // probabilities from them.
            let y = node.output(0).expect("Attention has an output");
            let lse_shape = AttentionShape::lse_shape(&b.meta(x(0)).shape, *layout);
            let lse = b.ensure_output(n, 1, Meta::new(DType::F32, &lse_shape));
            let op = Op::AttentionGrad { scale: *scale, causal: *causal, layout: *layout };
            let operands = (0..layout.operands()).map(x);
            let ins: Vec<ValueId> = [dy].into_iter().chain(operands).chain([y, lse]).collect();
            let outs = b.emit(&name, op, &ins, layout.operands())?;
            outs.into_iter().map(Some).collect()
        }
        Op::Swiglu => {
            let outs = b.emit(&name, Op::SwigluGrad, &[dy, x(0), x(1)], 2)?;
            vec![Some(outs[0]), Some(outs[1])]
        }
        Op::Rotary => {
            let (v, cos, sin) = (x(0), x(1), x(2));
            let dx = if want(0) { Some(b.emit1(&name, Op::RotaryGrad, &[dy, cos, sin])?) } else { None };
            // The tables' gradients, wanted only where they are computed from weights: dY·x and
            // dY·rotate_half(x), summed over the dims they broadcast along.
            let mul = Op::Binary(Binary::Mul);
            let dcos = if want(1) {
                let t = b.emit1(&format!("{name}_cos"), mul.clone(), &[dy, v])?;
                Some(b.sum_to(&format!("{name}_cos_sum"), t, &shape_of(b, cos))?)
            } else {
                None
            };
            let dsin = if want(2) {
                // Emitted ops carry normalized axes (inference's form, which the kernels read).
                let shape = shape_of(b, v);
                let (last, h) = (shape.len() as i64 - 1, (*shape.last().unwrap_or(&0) / 2) as i64);
                let split = Op::Split { axis: last, sizes: vec![h, h], num_outputs: None };
                let halves = b.emit(&format!("{name}_halves"), split, &[v], 2)?;
                let neg = b.emit1(&format!("{name}_neg"), Op::Unary(Unary::Neg), &[halves[1]])?;
                let rotated = b.emit1(&format!("{name}_rotated"), Op::Concat { axis: last }, &[neg, halves[0]])?;
                let t = b.emit1(&format!("{name}_sin"), mul, &[dy, rotated])?;
                Some(b.sum_to(&format!("{name}_sin_sum"), t, &shape_of(b, sin))?)
            } else {
                None
            };
            vec![dx, dcos, dsin]
        }
        // Megatron's conjugate pair: a sum over the group passes its (replicated) gradient
        // through; a copy into the group sums its ranks' partial gradients.
        Op::AllReduce { op: crate::comm::ReduceOp::Sum } => vec![Some(dy)],
        Op::AllReduce { .. } => vec![None],
        Op::TensorParallelCopy => {
            vec![Some(b.emit1(&name, Op::AllReduce { op: crate::comm::ReduceOp::Sum }, &[dy])?)]
        }
        Op::ShardGather { start } => {
            let rows = shape_of(b, x(0))[0];
            vec![Some(b.emit1(&name, Op::ShardGatherGrad { start: *start, rows }, &[dy, x(1)])?), None]
        }
        // The row maxima get no gradient: the loss does not depend on the shift they make.
        Op::VocabShardCrossEntropy { start, ignore_index, .. } => {
            let dt = match dys.get(1).copied().flatten() {
                Some(dt) => dt,
                None => {
                    let zero = b.scalar_like(&format!("{name}_zero"), dy, 0.0);
                    b.expand(&format!("{name}_zeros"), zero, &shape_of(b, dy))
                }
            };
            let op = Op::VocabShardCrossEntropyGrad { start: *start, ignore_index: *ignore_index };
            vec![Some(b.emit1(&name, op, &[dy, dt, x(0), x(1), x(2)])?), None, None]
        }
        Op::VocabParallelLoss { reduction, ignore_index } => {
            let op = Op::VocabParallelLossGrad { reduction: *reduction, ignore_index: *ignore_index };
            let d = b.emit(&name, op, &[dy, x(0), x(2)], 2)?;
            vec![Some(d[0]), Some(d[1]), None]
        }
        _ => return Err(no_rule(node, "exists for this op")),
    })
}

/// Gather's `dy` with zeros where the indices pick `row`: nn.Embedding(padding_idx)'s
/// backward, which never writes the padding row's gradient.
fn without_padding_row(b: &mut Builder, name: &str, dy: ValueId, indices: ValueId, row: i64) -> Result<ValueId> {
    let (dy_shape, idx_shape) = (b.meta(dy).shape, b.meta(indices).shape);
    let row = b.scalar_like(&format!("{name}_padding_row"), indices, row as f64);
    let is_padding = b.emit1(&format!("{name}_is_padding"), Op::Binary(Binary::Equal), &[indices, row])?;
    // Gather's output is data[..axis] ++ indices ++ data[axis + 1..]: lay the mask along the
    // indices' dims. Padding is configured on axis-0 gathers (embeddings), so the mask leads.
    let mut mask_shape = idx_shape.clone();
    mask_shape.resize(dy_shape.len(), 1);
    let mask = b.reshape(&format!("{name}_padding_mask"), is_padding, &mask_shape);
    let zero = b.scalar_like(&format!("{name}_zero"), dy, 0.0);
    b.emit1(&format!("{name}_unpadded"), Op::Where, &[mask, zero, dy])
}

/// `v · k` (returns `v` when k is 1).
fn scale(b: &mut Builder, v: ValueId, k: f32, name: &str) -> Result<ValueId> {
    if k == 1.0 {
        return Ok(v);
    }
    let c = b.scalar_like(&format!("{name}_k"), v, k as f64);
    b.emit1(name, Op::Binary(Binary::Mul), &[v, c])
}

fn split_grad(b: &mut Builder, node: &Node, dys: &[Option<ValueId>], name: &str) -> Result<Vec<Option<ValueId>>> {
    let Op::Split { axis, .. } = &node.op else { unreachable!("split_grad on a Split") };
    let mut parts = Vec::new();
    for (k, o) in node.outputs.iter().enumerate() {
        let o = o.expect("bound Split outputs exist");
        parts.push(match dys.get(k).copied().flatten() {
            Some(g) => g,
            None => {
                // A part that does not reach the loss contributes zeros.
                let z = b.scalar_like(&format!("{name}_zero{k}"), o, 0.0);
                let s = b.meta(o).shape;
                b.expand(&format!("{name}_zeros{k}"), z, &s)
            }
        });
    }
    Ok(vec![Some(b.emit1(name, Op::Concat { axis: *axis }, &parts)?)])
}

/// MatMul: dA = dY·Bᵀ, dB = Aᵀ·dY, each summed back over broadcast batch dims. A weight
/// multiplied from the right (A [.., K], B [K, N]) gets its gradient as one big product over
/// the flattened batch, not a batch of small ones.
fn matmul_grad(
    b: &mut Builder,
    node: &Node,
    dy: ValueId,
    want_a: bool,
    want_b: bool,
    name: &str,
) -> Result<Vec<Option<ValueId>>> {
    let (a, w) = (node.input(0).expect("MatMul input"), node.input(1).expect("MatMul input"));
    let (sa, sw, sy) = (b.meta(a).shape, b.meta(w).shape, b.meta(dy).shape);
    if sa.len() < 2 || sw.len() < 2 {
        return Err(no_rule(node, "for 1-D MatMul operands"));
    }
    let mm = |ta, tb| Op::FusedMatMul { trans_a: ta, trans_b: tb, activation: None };
    let da = if want_a {
        let v = b.emit1(&format!("{name}_a"), mm(false, true), &[dy, w])?;
        Some(b.sum_to(&format!("{name}_a_sum"), v, &sa)?)
    } else {
        None
    };
    let dw = if want_b {
        if sw.len() == 2 {
            let k = sa[sa.len() - 1];
            let nn = sy[sy.len() - 1];
            let rows: usize = sa[..sa.len() - 1].iter().product();
            let a2 = b.reshape(&format!("{name}_a2d"), a, &[rows, k]);
            let dy2 = b.reshape(&format!("{name}_dy2d"), dy, &[rows, nn]);
            Some(b.emit1(&format!("{name}_b"), mm(true, false), &[a2, dy2])?)
        } else {
            let v = b.emit1(&format!("{name}_b"), mm(true, false), &[a, dy])?;
            Some(b.sum_to(&format!("{name}_b_sum"), v, &sw)?)
        }
    } else {
        None
    };
    Ok(vec![da, dw])
}
