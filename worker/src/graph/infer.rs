//! Binding a graph to static shapes: type and shape inference, constant folding, and the
//! resolution of shape operands (Reshape's `shape`, Slice's `starts`, ...) into attributes.
//!
//! After [`bind`] every value has a [`Meta`], shape-computing subgraphs (Shape → Gather →
//! Concat → Reshape, as exporters emit them) are gone, and every remaining node's op is fully
//! static, so backends never read shape operands at run time.

use super::ir::{Dim, Graph, Meta, Node, ValueId};
use crate::error::{Error, Result};
use crate::kernels;
use crate::op::{AttentionLayout, AttentionShape, LossReduction, NormKind, Op, PadMode, PoolKind, Unary, Window};
use crate::shape::{broadcast, norm_axis, slice_range};
use crate::tensor::{checked_numel, DType, Tensor};
use std::collections::{HashMap, HashSet, VecDeque};

/// What the caller knows about the graph's inputs.
#[derive(Default, Clone)]
pub struct Bindings {
    /// Symbolic dimension name → size (e.g. "batch" → 8).
    pub dims: HashMap<String, usize>,
    /// Exact shapes of inputs (the batch's), taking precedence over their declared dims.
    pub shapes: HashMap<ValueId, Vec<usize>>,
    /// Inputs fed by value at plan time (their consumers may fold).
    pub constants: HashMap<ValueId, Tensor>,
    /// Initializers that must stay variable (trainable weights): never folded into consumers.
    pub variables: HashSet<ValueId>,
}

fn err(node: &Node, msg: impl std::fmt::Display) -> Error {
    Error::Corrupt(format!("{}: {msg}", node.describe()))
}

/// Resolves auto_pad against input spatial dims; returns the window with explicit pads.
pub fn resolve_window(w: &Window, spatial: &[usize]) -> Window {
    let mut w = w.clone();
    let n = spatial.len();
    if w.kernel.is_empty() {
        return w;
    }
    if w.auto_pad == "SAME_UPPER" || w.auto_pad == "SAME_LOWER" {
        let mut pads = vec![0; 2 * n];
        for i in 0..n {
            let out = spatial[i].div_ceil(w.strides[i]);
            let eff = (w.kernel[i] - 1).saturating_mul(w.dilations[i]).saturating_add(1);
            let total =
                out.saturating_sub(1).saturating_mul(w.strides[i]).saturating_add(eff).saturating_sub(spatial[i]);
            let (small, big) = (total / 2, total - total / 2);
            if w.auto_pad == "SAME_UPPER" {
                pads[i] = small;
                pads[i + n] = big;
            } else {
                pads[i] = big;
                pads[i + n] = small;
            }
        }
        w.pads = pads;
    } else if w.auto_pad == "VALID" {
        w.pads = vec![0; 2 * n];
    }
    w.auto_pad = "NOTSET".into();
    w
}

/// An output no allocation can hold (its byte count overflows, or passes what Rust can
/// allocate) is refused before anything is sized by it, naming the node.
fn addressable(node: &Node, m: &Meta) -> Result<()> {
    let bytes = m.shape.iter().try_fold(m.dtype.size(), |acc, &d| acc.checked_mul(d));
    match bytes {
        Some(b) if b <= isize::MAX as usize => Ok(()),
        _ => Err(err(node, format!("its output {}{:?} is too large to address", m.dtype, m.shape))),
    }
}

/// Folding computes a constant in this machine's memory, beside its inputs and the copies its
/// consumers make of it (an Expand's shape operand read as integers): constants larger than a
/// quarter of the memory (a constant expanded to 2^31 elements) are refused, naming the node and
/// both sizes, rather than the process being killed or aborted when memory runs out. No model
/// folds anything near that (what folds are shapes, masks and position tables). Exit 2: the
/// model asks more than the machine has, which a larger machine may give.
fn fits_in_memory(node: &Node, outs: &[Meta]) -> Result<()> {
    let bytes: usize = outs.iter().map(Meta::bytes).fold(0, usize::saturating_add);
    match crate::host::memory_bytes() {
        Some(total) if bytes > total / 4 => Err(Error::Config(format!(
            "{}: folding its constant output {} needs {bytes} bytes; a quarter of this machine's memory is {} (this machine has {total})",
            node.describe(),
            outs.iter().map(|m| format!("{}{:?}", m.dtype, m.shape)).collect::<Vec<_>>().join(", "),
            total / 4
        ))),
        _ => Ok(()),
    }
}

/// Output spatial size of a window over `spatial`.
pub fn window_output(w: &Window, spatial: &[usize]) -> Option<Vec<usize>> {
    let n = spatial.len();
    (0..n)
        .map(|i| {
            // Checked: a model's attributes can ask for sizes no machine addresses.
            let eff = (w.kernel[i] - 1).checked_mul(w.dilations[i])?.checked_add(1)?;
            let padded = spatial[i].checked_add(w.pads[i])?.checked_add(w.pads[i + n])?;
            if padded < eff {
                return None;
            }
            let span = padded - eff;
            let mut out = if w.ceil_mode { span.div_ceil(w.strides[i]) + 1 } else { span / w.strides[i] + 1 };
            // With ceil_mode the last window must start inside the input or left padding.
            if w.ceil_mode && (out - 1) * w.strides[i] >= spatial[i] + w.pads[i] {
                out -= 1;
            }
            Some(out)
        })
        .collect()
}

fn matmul_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    if a.is_empty() || b.is_empty() {
        return None;
    }
    let a2: Vec<usize> = if a.len() == 1 { vec![1, a[0]] } else { a.to_vec() };
    let b2: Vec<usize> = if b.len() == 1 { vec![b[0], 1] } else { b.to_vec() };
    let (m, k) = (a2[a2.len() - 2], a2[a2.len() - 1]);
    let (k2, n) = (b2[b2.len() - 2], b2[b2.len() - 1]);
    if k != k2 {
        return None;
    }
    let mut out = broadcast(&a2[..a2.len() - 2], &b2[..b2.len() - 2])?;
    if a.len() > 1 {
        out.push(m);
    }
    if b.len() > 1 {
        out.push(n);
    }
    Some(out)
}

/// Infers one node: returns the node's op with shape operands resolved, and output metas.
/// `metas[i]`/`consts[i]` describe input i (`None` for an omitted optional input).
pub fn infer_node(
    node: &Node,
    metas: &[Option<Meta>],
    consts: &[Option<&Tensor>],
    training: bool,
) -> Result<(Op, Vec<Meta>)> {
    let m = |i: usize| -> Result<&Meta> {
        metas.get(i).and_then(|x| x.as_ref()).ok_or_else(|| err(node, format!("input {i} is missing")))
    };
    let c = |i: usize| -> Option<&Tensor> { consts.get(i).copied().flatten() };
    let ints = |i: usize, what: &str| -> Result<Option<Vec<i64>>> {
        match (metas.get(i).and_then(|x| x.as_ref()), c(i)) {
            (None, _) => Ok(None),
            (Some(_), Some(t)) => t.to_i64_vec().map(Some).ok_or_else(|| err(node, format!("{what} must be integers"))),
            (Some(_), None) => Err(err(
                node,
                format!("{what} (input {i}) must be known when the graph is planned; shapes are static per run"),
            )),
        }
    };
    // A scalar operand folded into an attribute (Clip's bounds).
    let bound = |i: usize, what: &str| -> Result<Option<f32>> {
        match (metas.get(i).and_then(|x| x.as_ref()), c(i)) {
            (None, _) => Ok(None),
            (Some(_), Some(t)) if t.numel() == 1 => Ok(Some(t.to_f64_vec()[0] as f32)),
            (Some(x), Some(_)) => {
                Err(err(node, format!("{what} (input {i}) has shape {:?}; a scalar expected", x.shape)))
            }
            (Some(_), None) => Err(err(node, format!("{what} (input {i}) must be known when the graph is planned"))),
        }
    };
    let same = |i: usize| -> Result<Vec<Meta>> { Ok(vec![m(i)?.clone()]) };
    // Kernels view these inputs as the first input's element type: they must share it.
    let same_dtype = |inputs: &[usize]| -> Result<()> {
        let want = m(inputs[0])?.dtype;
        for &i in &inputs[1..] {
            if let Some(Some(x)) = metas.get(i) {
                if x.dtype != want {
                    return Err(err(node, format!("input {i} is {} but input {} is {want}", x.dtype, inputs[0])));
                }
            }
        }
        Ok(())
    };
    // Per-channel operands must have exactly `n` elements.
    let has_len = |i: usize, n: usize, what: &str| -> Result<()> {
        match metas.get(i) {
            Some(Some(x)) if x.numel() != n => {
                Err(err(node, format!("{what} (input {i}) has shape {:?}; {n} elements expected", x.shape)))
            }
            _ => Ok(()),
        }
    };
    let op = node.op.clone();
    let out: (Op, Vec<Meta>) = match &node.op {
        Op::Unary(u) => {
            let x = m(0)?;
            let dtype = if u.is_predicate() { DType::Bool } else { x.dtype };
            let op = match *u {
                Unary::Clip { min, max } if node.inputs.len() > 1 => Op::Unary(Unary::Clip {
                    min: bound(1, "min")?.unwrap_or(min),
                    max: bound(2, "max")?.unwrap_or(max),
                }),
                _ => op,
            };
            (op, vec![Meta::new(dtype, &x.shape)])
        }
        Op::CastLike => (Op::Cast { to: m(1)?.dtype }, vec![Meta::new(m(1)?.dtype, &m(0)?.shape)]),
        Op::Binary(b) => {
            // Max and Min are variadic (1 or more inputs); the others take exactly two.
            let variadic = matches!(b, crate::op::Binary::Max | crate::op::Binary::Min);
            let n = node.inputs.len();
            if n != 2 && !(variadic && n >= 1) {
                return Err(err(node, format!("{n} inputs given, 2 expected")));
            }
            let x = m(0)?;
            if n == 1 {
                return Ok((Op::Identity, vec![x.clone()]));
            }
            let mut shape = x.shape.clone();
            for i in 1..n {
                let y = m(i)?;
                shape = broadcast(&shape, &y.shape)
                    .ok_or_else(|| err(node, format!("shapes {:?} and {:?} do not broadcast", shape, y.shape)))?;
                if x.dtype != y.dtype && !matches!(b, crate::op::Binary::Pow) {
                    return Err(err(node, format!("element types differ: {} and {}", x.dtype, y.dtype)));
                }
            }
            if *b == crate::op::Binary::PRelu && shape != x.shape {
                return Err(err(node, format!("the slope {:?} does not broadcast to X {:?}", m(1)?.shape, x.shape)));
            }
            if b.is_logic() && x.dtype != DType::Bool {
                return Err(err(node, format!("{b:?} needs bool inputs, not {}", x.dtype)));
            }
            let dtype = if b.is_predicate() { DType::Bool } else { x.dtype };
            (op, vec![Meta::new(dtype, &shape)])
        }
        Op::Where => {
            let (cnd, x, y) = (m(0)?, m(1)?, m(2)?);
            if cnd.dtype != DType::Bool {
                return Err(err(node, format!("the condition must be bool, not {}", cnd.dtype)));
            }
            same_dtype(&[1, 2])?;
            let shape = broadcast(&cnd.shape, &x.shape)
                .and_then(|s| broadcast(&s, &y.shape))
                .ok_or_else(|| err(node, "condition, X and Y do not broadcast"))?;
            (op, vec![Meta::new(x.dtype, &shape)])
        }
        Op::Cast { to } => (op.clone(), vec![Meta::new(*to, &m(0)?.shape)]),
        Op::Identity => (op, same(0)?),
        Op::Dropout { ratio, seed, .. } => {
            let ratio = match c(1) {
                Some(t) => t.to_f64_vec().first().copied().unwrap_or(*ratio as f64) as f32,
                None => *ratio,
            };
            let training_mode = match c(2) {
                Some(t) => t.to_f64_vec().first().copied().unwrap_or(0.0) != 0.0,
                None => training,
            };
            let x = m(0)?;
            (
                Op::Dropout { ratio, training: training_mode, seed: *seed },
                vec![x.clone(), Meta::new(DType::Bool, &x.shape)],
            )
        }
        Op::MatMul => {
            let (a, b) = (m(0)?, m(1)?);
            same_dtype(&[0, 1])?;
            let shape = matmul_shape(&a.shape, &b.shape)
                .ok_or_else(|| err(node, format!("cannot multiply shapes {:?} and {:?}", a.shape, b.shape)))?;
            (op, vec![Meta::new(a.dtype, &shape)])
        }
        Op::Attention { causal, layout, .. } => {
            let packed = *layout == AttentionLayout::Packed;
            let (q, k, v) = if packed { (m(0)?, m(0)?, m(0)?) } else { (m(0)?, m(1)?, m(2)?) };
            same_dtype(&(0..layout.operands()).collect::<Vec<_>>())?;
            let shape = AttentionShape::of(&q.shape, &k.shape, *layout).filter(|_| k.shape == v.shape);
            let Some(a) = shape else {
                let (q, k, v) = (&q.shape, &k.shape, &v.shape);
                return Err(match layout {
                    AttentionLayout::Packed => err(node, format!("qkv {q:?} is not [.., T, 3, H, D]")),
                    AttentionLayout::TokenMajor => {
                        err(node, format!("q {q:?}, k {k:?}, v {v:?} are not [.., T, H, D] alike"))
                    }
                    AttentionLayout::HeadsFirst => {
                        err(node, format!("q {q:?}, k {k:?}, v {v:?} are not [.., T, D] alike"))
                    }
                });
            };
            if *causal && a.tq != a.tk {
                return Err(err(node, format!("a causal mask over q {:?} and k {:?}", q.shape, k.shape)));
            }
            let y = Meta::new(q.dtype, &AttentionShape::y_shape(&q.shape, *layout));
            (op, vec![y, Meta::new(DType::F32, &AttentionShape::lse_shape(&q.shape, *layout))])
        }
        Op::AttentionGrad { layout, .. } => {
            let operands = (1..=layout.operands()).map(|i| m(i).cloned()).collect::<Result<_, _>>()?;
            (op, operands)
        }
        Op::Swiglu | Op::SwigluGrad => {
            // The gate and up projection (and the gradient) alike in type and shape.
            let k = usize::from(matches!(op, Op::SwigluGrad));
            same_dtype(&[0, 1])?;
            same_dtype(&[k, k + 1])?;
            let (a, b) = (m(k)?, m(k + 1)?);
            if a.shape != b.shape || m(0)?.shape != a.shape {
                return Err(err(node, format!("SwiGLU of {:?} and {:?} (the same shape expected)", a.shape, b.shape)));
            }
            let outs = if k == 0 { vec![a.clone()] } else { vec![a.clone(), b.clone()] };
            (op, outs)
        }
        Op::Rotary | Op::RotaryGrad => {
            let x = m(0)?;
            same_dtype(&[0, 1, 2])?;
            let fits = |t: &Meta| broadcast(&t.shape, &x.shape).as_deref() == Some(&x.shape[..]);
            if x.shape.last().is_none_or(|d| d % 2 != 0) || !fits(m(1)?) || !fits(m(2)?) {
                let (c, s) = (&m(1)?.shape, &m(2)?.shape);
                return Err(err(node, format!("cos {c:?} and sin {s:?} against x {:?} of even last dim", x.shape)));
            }
            (op, vec![x.clone()])
        }
        Op::FusedMatMul { trans_a, trans_b, .. } | Op::MatMulUnaryGrad { trans_a, trans_b, .. } => {
            let (a, b) = (m(0)?, m(1)?);
            let t = |s: &[usize], tr: bool| {
                let mut s = s.to_vec();
                let n = s.len();
                if tr && n >= 2 {
                    s.swap(n - 1, n - 2);
                }
                s
            };
            let shape = matmul_shape(&t(&a.shape, *trans_a), &t(&b.shape, *trans_b))
                .ok_or_else(|| err(node, format!("cannot multiply shapes {:?} and {:?}", a.shape, b.shape)))?;
            let y = Meta::new(a.dtype, &shape);
            if matches!(op, Op::MatMulUnaryGrad { .. }) {
                // X, the activation's input, is shaped like the product.
                if *m(2)? != y {
                    return Err(err(node, format!("the activation's input {:?} against the product {:?}", m(2)?, y)));
                }
            }
            // A fused activation's second output is its input, the pre-activation.
            let outputs = if node.outputs.len() > 1 { vec![y.clone(), y] } else { vec![y] };
            (op, outputs)
        }
        Op::Gemm { trans_a, trans_b, .. } => {
            let (a, b) = (m(0)?, m(1)?);
            same_dtype(&[0, 1, 2])?;
            if a.shape.len() != 2 || b.shape.len() != 2 {
                return Err(err(node, "Gemm needs 2-D A and B"));
            }
            let (mm, k) = if *trans_a { (a.shape[1], a.shape[0]) } else { (a.shape[0], a.shape[1]) };
            let (k2, n) = if *trans_b { (b.shape[1], b.shape[0]) } else { (b.shape[0], b.shape[1]) };
            if k != k2 {
                return Err(err(node, format!("inner dimensions differ: {k} and {k2}")));
            }
            if let Ok(cm) = m(2) {
                if broadcast(&cm.shape, &[mm, n]).as_deref() != Some(&[mm, n][..]) {
                    return Err(err(node, format!("C of shape {:?} does not broadcast to [{mm}, {n}]", cm.shape)));
                }
            }
            (op, vec![Meta::new(a.dtype, &[mm, n])])
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            let x = m(0)?;
            norm_axis(*axis, x.shape.len()).ok_or_else(|| err(node, format!("axis {axis} is out of range")))?;
            (op.clone(), same(0)?)
        }
        Op::LayerNorm { axis, .. } | Op::ResidualLayerNorm { axis, .. } => {
            // ResidualLayerNorm: X, B, scale (, bias) -> Y, S (, mean, inv_std), S shaped as X.
            let residual = matches!(op, Op::ResidualLayerNorm { .. });
            let x = m(0)?;
            let a = norm_axis(*axis, x.shape.len()).ok_or_else(|| err(node, format!("axis {axis} is out of range")))?;
            let k = residual as usize;
            same_dtype(&[0, 1 + k, 2 + k])?;
            if residual && m(1)?.shape != x.shape {
                return Err(err(node, format!("the residual {:?} and the branch {:?} differ", x.shape, m(1)?.shape)));
            }
            let stat: Vec<usize> = x.shape.iter().enumerate().map(|(i, &d)| if i < a { d } else { 1 }).collect();
            let stat = Meta::new(DType::F32, &stat);
            let sum = residual.then(|| x.clone());
            let outs = [Some(x.clone()), sum, Some(stat.clone()), Some(stat)].into_iter().flatten().collect();
            (op.clone(), outs)
        }
        Op::Reshape | Op::ReshapeAllowZero => {
            let x = m(0)?;
            let target = match ints(1, "shape")? {
                Some(t) => t,
                // Already resolved: the output keeps the meta it was given.
                None => return Ok((op, vec![metas.get(1).cloned().flatten().unwrap_or_else(|| x.clone())])),
            };
            let allow_zero = matches!(node.op, Op::ReshapeAllowZero);
            let shape = reshape_target(&x.shape, &target, allow_zero).ok_or_else(|| {
                err(node, format!("cannot reshape {:?} ({} elements) to {:?}", x.shape, x.numel(), target))
            })?;
            (Op::Reshape, vec![Meta::new(x.dtype, &shape)])
        }
        Op::Flatten { axis } => {
            let x = m(0)?;
            // axis is in [-rank, rank]; a negative one counts from rank, not rank + 1.
            let r = x.shape.len() as i64;
            let a = if *axis < 0 { axis + r } else { *axis };
            if !(0..=r).contains(&a) {
                return Err(err(node, format!("axis {axis} is out of range for rank {r}")));
            }
            let a = a as usize;
            let outer: usize = x.shape[..a].iter().product();
            (Op::Reshape, vec![Meta::new(x.dtype, &[outer, x.numel() / outer.max(1)])])
        }
        Op::Squeeze { axes } => {
            let x = m(0)?;
            let axes = match ints(1, "axes")? {
                Some(a) => Some(a),
                None => axes.clone(),
            };
            let shape: Vec<usize> = match axes {
                None => x.shape.iter().copied().filter(|&d| d != 1).collect(),
                Some(axes) => {
                    let mut drop = vec![false; x.shape.len()];
                    for a in axes {
                        let a =
                            norm_axis(a, x.shape.len()).ok_or_else(|| err(node, format!("axis {a} out of range")))?;
                        if x.shape[a] != 1 {
                            return Err(err(node, format!("cannot squeeze axis {a} of size {}", x.shape[a])));
                        }
                        drop[a] = true;
                    }
                    x.shape.iter().zip(drop).filter(|(_, d)| !d).map(|(s, _)| *s).collect()
                }
            };
            (Op::Reshape, vec![Meta::new(x.dtype, &shape)])
        }
        Op::Unsqueeze { axes } => {
            let x = m(0)?;
            let axes = match ints(1, "axes")? {
                Some(a) => a,
                None => axes.clone().ok_or_else(|| err(node, "axes are required"))?,
            };
            let r = x.shape.len() + axes.len();
            let mut ins = vec![false; r];
            for a in axes {
                let a = norm_axis(a, r).ok_or_else(|| err(node, format!("axis {a} out of range")))?;
                if std::mem::replace(&mut ins[a], true) {
                    return Err(err(node, format!("axis {a} is given twice")));
                }
            }
            let mut it = x.shape.iter();
            let shape: Vec<usize> = ins.iter().map(|&i| if i { 1 } else { *it.next().unwrap_or(&1) }).collect();
            (Op::Reshape, vec![Meta::new(x.dtype, &shape)])
        }
        Op::Transpose { perm } => {
            let x = m(0)?;
            let r = x.shape.len();
            let perm: Vec<i64> = perm.clone().unwrap_or_else(|| (0..r as i64).rev().collect());
            let mut seen = vec![false; r];
            let mut shape = Vec::with_capacity(r);
            // Negative entries count from the end, as ONNX Runtime accepts them; the bound op
            // holds them from the front, which every kernel and gradient rule reads.
            let mut normalized = Vec::with_capacity(r);
            for &p in &perm {
                let p = norm_axis(p, r).ok_or_else(|| err(node, format!("perm {perm:?} is not a permutation")))?;
                if std::mem::replace(&mut seen[p], true) {
                    return Err(err(node, format!("perm {perm:?} is not a permutation")));
                }
                shape.push(x.shape[p]);
                normalized.push(p as i64);
            }
            if perm.len() != r {
                return Err(err(node, format!("perm {perm:?} does not match rank {r}")));
            }
            (Op::Transpose { perm: Some(normalized) }, vec![Meta::new(x.dtype, &shape)])
        }
        Op::Concat { axis } => {
            let first = m(0)?;
            let a = norm_axis(*axis, first.shape.len()).ok_or_else(|| err(node, "axis out of range"))?;
            let mut shape = first.shape.clone();
            shape[a] = 0;
            for i in 0..node.inputs.len() {
                let x = m(i)?;
                if x.shape.len() != shape.len()
                    || x.shape.iter().zip(&first.shape).enumerate().any(|(d, (p, q))| d != a && p != q)
                {
                    return Err(err(
                        node,
                        format!("input {i} of shape {:?} does not match {:?}", x.shape, first.shape),
                    ));
                }
                shape[a] += x.shape[a];
            }
            same_dtype(&(0..node.inputs.len()).collect::<Vec<_>>())?;
            (Op::Concat { axis: a as i64 }, vec![Meta::new(first.dtype, &shape)])
        }
        Op::Split { axis, sizes, num_outputs } => {
            let x = m(0)?;
            let a = norm_axis(*axis, x.shape.len()).ok_or_else(|| err(node, "axis out of range"))?;
            let n = node.outputs.len();
            let sizes: Vec<i64> = match ints(1, "split")? {
                Some(s) => s,
                None if !sizes.is_empty() => sizes.clone(),
                None => {
                    let parts = num_outputs.unwrap_or(n).max(1);
                    let chunk = x.shape[a].div_ceil(parts);
                    (0..parts).map(|i| chunk.min(x.shape[a].saturating_sub(i * chunk)) as i64).collect()
                }
            };
            // Summed without wrapping: sizes whose sum wraps around to the axis cover nothing.
            let total = sizes.iter().try_fold(0i64, |t, &s| t.checked_add(s));
            if sizes.len() != n || sizes.iter().any(|&s| s < 0) || total != Some(x.shape[a] as i64) {
                return Err(err(node, format!("split sizes {sizes:?} do not cover axis {a} of {:?}", x.shape)));
            }
            let metas = sizes
                .iter()
                .map(|&s| {
                    let mut sh = x.shape.clone();
                    sh[a] = s as usize;
                    Meta::new(x.dtype, &sh)
                })
                .collect();
            (Op::Split { axis: a as i64, sizes, num_outputs: None }, metas)
        }
        Op::Slice { starts, ends, axes, steps } => {
            let x = m(0)?;
            let r = x.shape.len();
            let (starts, ends, axes, steps) = if node.inputs.len() > 1 {
                let s = ints(1, "starts")?.unwrap_or_default();
                let e = ints(2, "ends")?.unwrap_or_default();
                let a = ints(3, "axes")?.unwrap_or_else(|| (0..s.len() as i64).collect());
                let st = ints(4, "steps")?.unwrap_or_else(|| vec![1; s.len()]);
                (s, e, a, st)
            } else {
                (starts.clone(), ends.clone(), axes.clone(), steps.clone())
            };
            if starts.len() != ends.len() || axes.len() != starts.len() || steps.len() != starts.len() {
                return Err(err(node, "starts, ends, axes and steps differ in length"));
            }
            let mut shape = x.shape.clone();
            let mut norm_axes = Vec::new();
            for i in 0..starts.len() {
                let a = norm_axis(axes[i], r).ok_or_else(|| err(node, format!("axis {} out of range", axes[i])))?;
                if steps[i] == 0 {
                    return Err(err(node, "a step of 0"));
                }
                shape[a] = slice_range(starts[i], ends[i], steps[i], x.shape[a]).2;
                norm_axes.push(a as i64);
            }
            (Op::Slice { starts, ends, axes: norm_axes, steps }, vec![Meta::new(x.dtype, &shape)])
        }
        Op::ArgExtreme { max, axis, keepdims, select_last_index } => {
            let x = m(0)?;
            let a = norm_axis(*axis, x.shape.len()).ok_or_else(|| err(node, format!("axis {axis} out of range")))?;
            if x.shape[a] == 0 {
                return Err(err(node, format!("axis {a} of {:?} is empty: no element is the extreme", x.shape)));
            }
            let mut shape = x.shape.clone();
            if *keepdims {
                shape[a] = 1;
            } else {
                shape.remove(a);
            }
            let op = Op::ArgExtreme {
                max: *max,
                axis: a as i64,
                keepdims: *keepdims,
                select_last_index: *select_last_index,
            };
            (op, vec![Meta::new(DType::I64, &shape)])
        }
        Op::Pad { mode, pads, value } => {
            let x = m(0)?;
            let r = x.shape.len();
            let given = match ints(1, "pads")? {
                Some(p) => p,
                None => pads.clone(),
            };
            let value = match bound(2, "constant_value")? {
                Some(v) => v as f64,
                None => *value,
            };
            let axes: Vec<usize> = match ints(3, "axes")? {
                Some(a) => a
                    .iter()
                    .map(|&a| norm_axis(a, r).ok_or_else(|| err(node, format!("axis {a} out of range"))))
                    .collect::<Result<_>>()?,
                None => (0..r).collect(),
            };
            if given.len() != 2 * axes.len() {
                return Err(err(
                    node,
                    format!("{} pads given for {} axes (begin and end pads expected)", given.len(), axes.len()),
                ));
            }
            if *mode != PadMode::Constant && x.numel() == 0 {
                return Err(err(node, format!("{mode:?} padding of an empty input {:?}", x.shape)));
            }
            let mut full = vec![0i64; 2 * r];
            for (k, &a) in axes.iter().enumerate() {
                full[a] = given[k];
                full[r + a] = given[axes.len() + k];
            }
            let mut shape = Vec::with_capacity(r);
            for (a, &n) in x.shape.iter().enumerate() {
                // Added without wrapping: pads near i64's ends must not wrap to a small size.
                let size = (n as i64).checked_add(full[a]).and_then(|s| s.checked_add(full[r + a]));
                match size {
                    Some(size) if size >= 0 => shape.push(size as usize),
                    Some(_) => {
                        return Err(err(node, format!("pads {given:?} crop axis {a} of size {n} below nothing")))
                    }
                    None => return Err(err(node, format!("pads {given:?} make axis {a} too large to address"))),
                }
            }
            (Op::Pad { mode: *mode, pads: full, value }, vec![Meta::new(x.dtype, &shape)])
        }
        Op::CumSum { axis, exclusive, reverse } => {
            let x = m(0)?;
            let axis = match ints(1, "axis")? {
                Some(a) if a.len() == 1 => a[0],
                Some(a) => return Err(err(node, format!("axis {a:?} must be one integer"))),
                None => *axis,
            };
            let a = norm_axis(axis, x.shape.len()).ok_or_else(|| err(node, format!("axis {axis} out of range")))?;
            (Op::CumSum { axis: a as i64, exclusive: *exclusive, reverse: *reverse }, vec![x.clone()])
        }
        Op::PadGrad { input_shape, .. } => (op.clone(), vec![Meta::new(m(0)?.dtype, input_shape)]),
        Op::GatherND { batch_dims } => {
            let (x, idx) = (m(0)?, m(1)?);
            let (b, k) = (*batch_dims, nd_tuple(node, x, idx, *batch_dims)?);
            let mut shape = idx.shape[..idx.shape.len() - 1].to_vec();
            shape.extend_from_slice(&x.shape[b + k..]);
            (op, vec![Meta::new(x.dtype, &shape)])
        }
        Op::ScatterND { .. } => {
            let (x, idx, upd) = (m(0)?, m(1)?, m(2)?);
            let k = nd_tuple(node, x, idx, 0)?;
            let mut want = idx.shape[..idx.shape.len() - 1].to_vec();
            want.extend_from_slice(&x.shape[k..]);
            if upd.shape != want || upd.dtype != x.dtype {
                return Err(err(
                    node,
                    format!("updates are {} {:?}; {} {want:?} expected", upd.dtype, upd.shape, x.dtype),
                ));
            }
            (op, vec![x.clone()])
        }
        Op::ScatterElements { axis, reduction } => {
            let (x, idx, upd) = (m(0)?, m(1)?, m(2)?);
            let a = norm_axis(*axis, x.shape.len()).ok_or_else(|| err(node, format!("axis {axis} out of range")))?;
            if idx.dtype.is_float()
                || idx.shape.len() != x.shape.len()
                || upd.shape != idx.shape
                || upd.dtype != x.dtype
            {
                return Err(err(
                    node,
                    format!(
                        "indices {:?} and updates {} {:?} must be of data's rank, one shape",
                        idx.shape, upd.dtype, upd.shape
                    ),
                ));
            }
            if idx.shape.iter().zip(&x.shape).enumerate().any(|(d, (i, n))| d != a && i > n) {
                return Err(err(node, format!("indices of shape {:?} reach past data {:?}", idx.shape, x.shape)));
            }
            (Op::ScatterElements { axis: a as i64, reduction: *reduction }, vec![x.clone()])
        }
        Op::GatherNDGrad { data_shape, .. } => (op.clone(), vec![Meta::new(m(0)?.dtype, data_shape)]),
        Op::GatherElements { axis } => {
            let (x, idx) = (m(0)?, m(1)?);
            let a = norm_axis(*axis, x.shape.len()).ok_or_else(|| err(node, format!("axis {axis} out of range")))?;
            if idx.dtype.is_float() || idx.shape.len() != x.shape.len() {
                return Err(err(node, format!("indices must be integers of data's rank {}", x.shape.len())));
            }
            // Along the other axes an index position addresses data directly.
            if idx.shape.iter().zip(&x.shape).enumerate().any(|(d, (i, n))| d != a && i > n) {
                return Err(err(node, format!("indices of shape {:?} reach past data {:?}", idx.shape, x.shape)));
            }
            (Op::GatherElements { axis: a as i64 }, vec![Meta::new(x.dtype, &idx.shape)])
        }
        Op::Gather { axis, padding_row } => {
            let (x, idx) = (m(0)?, m(1)?);
            let a = norm_axis(*axis, x.shape.len()).ok_or_else(|| err(node, "axis out of range"))?;
            let mut shape = x.shape[..a].to_vec();
            shape.extend_from_slice(&idx.shape);
            shape.extend_from_slice(&x.shape[a + 1..]);
            (Op::Gather { axis: a as i64, padding_row: *padding_row }, vec![Meta::new(x.dtype, &shape)])
        }
        Op::Expand => {
            let x = m(0)?;
            let target = match ints(1, "shape")? {
                Some(t) => t,
                None => return Ok((op, vec![metas.get(1).cloned().flatten().unwrap_or_else(|| x.clone())])),
            };
            let t: Vec<usize> = target.iter().map(|&d| d.max(0) as usize).collect();
            let shape = broadcast(&x.shape, &t)
                .ok_or_else(|| err(node, format!("cannot expand {:?} to {:?}", x.shape, target)))?;
            (Op::Expand, vec![Meta::new(x.dtype, &shape)])
        }
        Op::Trilu { upper, k } => {
            let x = m(0)?;
            if x.shape.len() < 2 {
                return Err(err(node, "Trilu needs rank 2 or more"));
            }
            let k = ints(1, "k")?.and_then(|v| v.first().copied()).unwrap_or(*k);
            (Op::Trilu { upper: *upper, k }, same(0)?)
        }
        Op::ReduceOp { kind, axes, keepdims, noop_with_empty_axes } => {
            let x = m(0)?;
            let axes_in = match ints(1, "axes")? {
                Some(a) => Some(a),
                None => axes.clone(),
            };
            let r = x.shape.len();
            let resolved: Vec<i64> = match axes_in {
                Some(a) if !a.is_empty() => {
                    let mut v = Vec::new();
                    for ax in a {
                        v.push(norm_axis(ax, r).ok_or_else(|| err(node, format!("axis {ax} out of range")))? as i64);
                    }
                    v
                }
                _ if *noop_with_empty_axes => vec![],
                _ => (0..r as i64).collect(),
            };
            let mut shape = Vec::new();
            for (d, &s) in x.shape.iter().enumerate() {
                if resolved.contains(&(d as i64)) {
                    if *keepdims {
                        shape.push(1);
                    }
                } else {
                    shape.push(s);
                }
            }
            (
                Op::ReduceOp { kind: *kind, axes: Some(resolved), keepdims: *keepdims, noop_with_empty_axes: false },
                vec![Meta::new(x.dtype, &shape)],
            )
        }
        Op::Conv { window, group } => {
            let (x, w) = (m(0)?, m(1)?);
            if x.shape.len() < 3 || w.shape.len() != x.shape.len() {
                return Err(err(node, format!("X {:?} and W {:?} need the same rank, 3 or more", x.shape, w.shape)));
            }
            let mut win = window.clone();
            if win.kernel.is_empty() {
                win.kernel = w.shape[2..].to_vec();
                let n = win.kernel.len();
                if win.strides.is_empty() {
                    win.strides = vec![1; n];
                }
                if win.dilations.is_empty() {
                    win.dilations = vec![1; n];
                }
                if win.pads.is_empty() {
                    win.pads = vec![0; 2 * n];
                }
            }
            let n = win.kernel.len();
            if win.kernel != w.shape[2..]
                || win.strides.len() != n
                || win.dilations.len() != n
                || win.pads.len() != 2 * n
            {
                return Err(err(
                    node,
                    format!("kernel_shape, strides, dilations or pads do not fit W of shape {:?}", w.shape),
                ));
            }
            let win = resolve_window(&win, &x.shape[2..]);
            same_dtype(&[0, 1, 2])?;
            has_len(2, w.shape[0], "the bias")?;
            if w.shape[1].checked_mul(*group) != Some(x.shape[1]) || w.shape[0] % group != 0 {
                return Err(err(
                    node,
                    format!("channels of X {:?} and W {:?} do not match group {group}", x.shape, w.shape),
                ));
            }
            let spatial =
                window_output(&win, &x.shape[2..]).ok_or_else(|| err(node, "the kernel is larger than the input"))?;
            let mut shape = vec![x.shape[0], w.shape[0]];
            shape.extend(spatial);
            (Op::Conv { window: win, group: *group }, vec![Meta::new(x.dtype, &shape)])
        }
        Op::ConvTranspose { .. } => {
            same_dtype(&[0, 1, 2])?;
            let (op, y) = conv_transpose(&node.op, m(0)?, m(1)?).map_err(|e| err(node, e))?;
            has_len(2, y.shape[1], "the bias")?;
            (op, vec![y])
        }
        Op::Resize(r) => {
            let x = m(0)?;
            // A float operand folded in: None where it is omitted or empty.
            let floats = |i: usize, what: &str| -> Result<Option<Vec<f32>>> {
                match (metas.get(i).and_then(|x| x.as_ref()), c(i)) {
                    (None, _) => Ok(None),
                    (Some(_), Some(t)) => {
                        Ok((t.numel() > 0).then(|| t.to_f64_vec().iter().map(|&v| v as f32).collect()))
                    }
                    (Some(_), None) => {
                        Err(err(node, format!("{what} (input {i}) must be known when the graph is planned")))
                    }
                }
            };
            let bound = if r.legacy {
                r.with_operands(None, floats(1, "scales")?, None)
            } else {
                let sizes = ints(3, "sizes")?.filter(|s| !s.is_empty());
                r.with_operands(floats(1, "roi")?, floats(2, "scales")?, sizes)
            };
            let bound = bound.map_err(|e| err(node, e))?;
            let geometry = bound.geometry(&x.shape).map_err(|e| err(node, e))?;
            (Op::Resize(bound), vec![Meta::new(x.dtype, &geometry.output)])
        }
        Op::Pool { kind, window } => {
            let x = m(0)?;
            if x.shape.len() < 3 || window.kernel.len() != x.shape.len() - 2 {
                return Err(err(node, format!("kernel_shape {:?} does not fit input {:?}", window.kernel, x.shape)));
            }
            let win = resolve_window(window, &x.shape[2..]);
            let spatial =
                window_output(&win, &x.shape[2..]).ok_or_else(|| err(node, "the kernel is larger than the input"))?;
            let mut shape = x.shape[..2].to_vec();
            shape.extend(spatial);
            let mut outs = vec![Meta::new(x.dtype, &shape)];
            if matches!(kind, PoolKind::Max) && node.output(1).is_some() {
                outs.push(Meta::new(DType::I64, &shape));
            }
            (Op::Pool { kind: *kind, window: win }, outs)
        }
        Op::GlobalAveragePool => {
            let x = m(0)?;
            let mut shape = x.shape.clone();
            for d in shape.iter_mut().skip(2) {
                *d = 1;
            }
            (op, vec![Meta::new(x.dtype, &shape)])
        }
        Op::BatchNorm { epsilon, momentum, training: t } => {
            let x = m(0)?;
            let c = m(1)?;
            if x.shape.len() < 2 {
                return Err(err(node, format!("X of shape {:?} has no channel dimension", x.shape)));
            }
            // Mixed precision leaves X (and Y) half beside f32 parameters, as autocast does.
            let half_x = matches!(x.dtype, DType::F16 | DType::BF16) && c.dtype == DType::F32;
            same_dtype(if half_x { &[1, 2, 3, 4] } else { &[0, 1, 2, 3, 4] })?;
            for (i, what) in [(1, "scale"), (2, "B"), (3, "input_mean"), (4, "input_var")] {
                m(i)?;
                has_len(i, x.shape[1], what)?;
            }
            let training = *t || (training && node.outputs.len() > 1);
            let mut outs = vec![x.clone()];
            if training {
                outs.push(c.clone());
                outs.push(c.clone());
            }
            (Op::BatchNorm { epsilon: *epsilon, momentum: *momentum, training }, outs)
        }
        Op::SoftmaxCrossEntropyLoss { reduction, .. } | Op::NegativeLogLikelihoodLoss { reduction, .. } => {
            let (s, l) = (m(0)?, m(1)?);
            if let Some(Some(w)) = metas.get(2) {
                same_dtype(&[0, 2])?;
                if s.shape.len() >= 2 && w.shape != [s.shape[1]] {
                    return Err(err(node, format!("weights of shape {:?} are not [C] = [{}]", w.shape, s.shape[1])));
                }
            }
            if s.shape.len() < 2
                || l.shape.len() != s.shape.len() - 1
                || l.shape[0] != s.shape[0]
                || l.shape[1..] != s.shape[2..]
            {
                return Err(err(
                    node,
                    format!("scores {:?} and labels {:?} do not match ([N,C,...] and [N,...])", s.shape, l.shape),
                ));
            }
            let loss = match reduction {
                LossReduction::None => Meta::new(s.dtype, &l.shape),
                _ => Meta::new(s.dtype, &[]),
            };
            // SoftmaxCrossEntropyLoss's second output: the log-probabilities.
            match op {
                Op::SoftmaxCrossEntropyLoss { .. } => (op, vec![loss, s.clone()]),
                _ => (op, vec![loss]),
            }
        }
        Op::NegativeLogLikelihoodLossGrad { input_shape, .. } => {
            (op.clone(), vec![Meta::new(m(0)?.dtype, input_shape)])
        }
        Op::Constant { value } => (op.clone(), vec![Meta::new(value.dtype(), value.shape())]),
        Op::Sequence(_)
        | Op::Tile
        | Op::Sum { .. }
        | Op::OneHot { .. }
        | Op::Normalization { .. }
        | Op::Recurrent(_)
        | Op::TopK { .. }
        | Op::Einsum { .. } => return Err(err(node, "binding rewrites this op into other ops before inference")),
        Op::TopKIndices { axis, k, largest } => {
            let x = m(0)?;
            let a = norm_axis(*axis, x.shape.len()).filter(|_| !x.shape.is_empty());
            let a = a.ok_or_else(|| err(node, format!("axis {axis} out of range for shape {:?}", x.shape)))?;
            if *k > x.shape[a] {
                return Err(err(node, format!("K = {k} is more than the {} elements along axis {a}", x.shape[a])));
            }
            let mut shape = x.shape.clone();
            shape[a] = *k;
            (Op::TopKIndices { axis: a as i64, k: *k, largest: *largest }, vec![Meta::new(DType::I64, &shape)])
        }
        Op::Shape { .. } | Op::ConstantOfShape { .. } | Op::Range | Op::Size => {
            return Err(err(node, "shape computations must be computable when the graph is planned"));
        }
        Op::ReduceSumTo { shape } => (op.clone(), vec![Meta::new(m(0)?.dtype, shape)]),
        Op::UnaryGrad(_) | Op::DropoutGrad { .. } => (op, same(0)?),
        Op::SoftmaxGrad { .. } | Op::LogSoftmaxGrad { .. } => (op, same(0)?),
        Op::LayerNormGrad { .. } => (op, vec![m(1)?.clone(), m(2)?.clone(), m(2)?.clone()]),
        Op::SoftmaxCrossEntropyLossGrad { .. } => (op, vec![m(1)?.clone()]),
        // The fused loss (`fuse::loss_lse`) over rows [N, C]: an f32 loss and log-sum-exp, as
        // its kernels write whatever the scores' type; its gradient is the scores' shape.
        Op::SoftmaxCrossEntropyLse { reduction, .. } => {
            let (s, l) = (m(0)?, m(1)?);
            if s.shape.len() != 2 || l.shape != s.shape[..1] {
                return Err(err(node, format!("scores {:?} and labels {:?} are not [N, C] and [N]", s.shape, l.shape)));
            }
            let loss = match reduction {
                LossReduction::None => Meta::new(DType::F32, &l.shape),
                _ => Meta::new(DType::F32, &[]),
            };
            (op, vec![loss, Meta::new(DType::F32, &l.shape)])
        }
        Op::SoftmaxCrossEntropyLseGrad { .. } => (op, vec![m(1)?.clone()]),
        Op::GatherGrad { data_shape, .. } | Op::GatherElementsGrad { data_shape, .. } => {
            (op.clone(), vec![Meta::new(m(0)?.dtype, data_shape)])
        }
        Op::AllReduce { .. } | Op::TensorParallelCopy => (op, same(0)?),
        Op::ShardGather { .. } => {
            let (table, ids) = (m(0)?, m(1)?);
            if table.shape.len() != 2 || ids.dtype.is_float() {
                return Err(err(node, "needs a [rows, C] table and integer ids"));
            }
            let mut shape = ids.shape.clone();
            shape.push(table.shape[1]);
            (op, vec![Meta::new(table.dtype, &shape)])
        }
        Op::ShardGatherGrad { rows, .. } => {
            let dy = m(0)?;
            let c = *dy.shape.last().ok_or_else(|| err(node, "dY has no axes"))?;
            (op.clone(), vec![Meta::new(dy.dtype, &[*rows, c])])
        }
        Op::VocabShardCrossEntropy { .. } => {
            let scores = m(0)?;
            if scores.shape.len() != 2 || m(1)?.shape != scores.shape[..1] || m(2)?.shape != scores.shape[..1] {
                return Err(err(node, "needs scores [N, V], labels [N] and row maxima [N]"));
            }
            let rows = Meta::new(scores.dtype, &scores.shape[..1]);
            (op, vec![rows.clone(), rows])
        }
        Op::VocabShardCrossEntropyGrad { .. } => (op, vec![m(2)?.clone()]),
        Op::VocabParallelLoss { reduction, .. } => {
            let rows = m(0)?;
            let shape: &[usize] = if *reduction == LossReduction::None { &rows.shape } else { &[] };
            (op.clone(), vec![Meta::new(rows.dtype, shape)])
        }
        Op::VocabParallelLossGrad { .. } => (op, vec![m(1)?.clone(), m(1)?.clone()]),
        Op::SliceGrad { input_shape, .. } => (op.clone(), vec![Meta::new(m(0)?.dtype, input_shape)]),
        Op::ConvGrad { .. } => {
            let (x, w) = (m(1)?, m(2)?);
            (op, vec![x.clone(), w.clone(), Meta::new(w.dtype, &w.shape[..1])])
        }
        Op::ConvTransposeGrad { .. } => {
            let (dy, x, w) = (m(0)?, m(1)?, m(2)?);
            (op, vec![x.clone(), w.clone(), Meta::new(w.dtype, &dy.shape[1..2])])
        }
        Op::ResizeGrad { input_shape, .. } => (op.clone(), vec![Meta::new(m(0)?.dtype, input_shape)]),
        Op::PoolGrad { .. } => (op, vec![m(1)?.clone()]),
        Op::BatchNormGrad { .. } | Op::BatchNormReluGrad { .. } => {
            (op, vec![m(1)?.clone(), m(2)?.clone(), m(2)?.clone()])
        }
        Op::BatchNormRelu { .. } => (op, vec![m(0)?.clone(), m(1)?.clone(), m(1)?.clone()]),
    };
    Ok(out)
}

/// ConvTranspose bound to X [N, C, D...] and W [C, M/group, k...]: the op with its pads
/// resolved (from output_shape or auto_pad as the ONNX spec computes them; a negative end pad
/// becomes output padding) and Y's meta [N, M, O...], O = s·(D − 1) + output_padding + the
/// dilated kernel − the pads.
fn conv_transpose(op: &Op, x: &Meta, w: &Meta) -> std::result::Result<(Op, Meta), String> {
    let Op::ConvTranspose { window, group, output_padding, output_shape } = op else { unreachable!("ConvTranspose") };
    let n = x.shape.len().saturating_sub(2);
    if n == 0 || w.shape.len() != x.shape.len() {
        return Err(format!("X {:?} and W {:?} need the same rank, 3 or more", x.shape, w.shape));
    }
    let mut win = window.clone();
    if win.kernel.is_empty() {
        win.kernel = w.shape[2..].to_vec();
        for v in [&mut win.strides, &mut win.dilations] {
            if v.is_empty() {
                *v = vec![1; n];
            }
        }
        if win.pads.is_empty() {
            win.pads = vec![0; 2 * n];
        }
    }
    // In i128: attributes near i64's limits make sizes no machine addresses, refused below
    // rather than wrapped.
    let mut padding: Vec<i128> = output_padding.iter().map(|&p| p as i128).collect();
    padding.resize(n, 0);
    let fits = win.kernel == w.shape[2..] && win.strides.len() == n && win.dilations.len() == n;
    if !fits
        || win.pads.len() != 2 * n
        || output_padding.len() > n
        || output_shape.as_ref().is_some_and(|s| s.len() != n)
    {
        return Err(format!(
            "kernel_shape, strides, dilations, pads, output_padding or output_shape do not fit W {:?}",
            w.shape
        ));
    }
    if w.shape[0] != x.shape[1] || !x.shape[1].is_multiple_of(*group) {
        return Err(format!("channels of X {:?} and W {:?} do not match group {group}", x.shape, w.shape));
    }
    let mut pads: Vec<i128> = win.pads.iter().map(|&p| p as i128).collect();
    let channels = w.shape[1].checked_mul(*group).ok_or("the output's channels overflow")?;
    let mut shape = vec![x.shape[0], channels];
    for i in 0..n {
        let (stride, size) = (win.strides[i] as i128, x.shape[2 + i] as i128);
        let span = stride * (size - 1) + (win.kernel[i] as i128 - 1) * win.dilations[i] as i128 + 1;
        let target = match (output_shape, win.auto_pad.as_str()) {
            (Some(shape), _) => Some(shape[i] as i128),
            (None, "SAME_UPPER" | "SAME_LOWER") => Some(size * stride),
            (None, "VALID") => Some(span + padding[i]),
            _ => None,
        };
        if let Some(target) = target {
            // The spec's split of the total padding: the odd one at the end for SAME_UPPER,
            // at the start otherwise (floor division: the total may be negative).
            let total = span + padding[i] - target;
            let (half, rest) = (total.div_euclid(2), total - total.div_euclid(2));
            (pads[i], pads[i + n]) = if win.auto_pad == "SAME_UPPER" { (half, rest) } else { (rest, half) };
        }
        if pads[i] < 0 {
            return Err(format!("output_shape {output_shape:?} asks for a negative begin pad on axis {}", i + 2));
        }
        // Output past the end that no input reaches is output padding.
        if pads[i + n] < 0 {
            padding[i] -= pads[i + n];
            pads[i + n] = 0;
        }
        let out = span + padding[i] - pads[i] - pads[i + n];
        match usize::try_from(out) {
            Ok(out) if out > 0 && out <= isize::MAX as usize => shape.push(out),
            _ => return Err(format!("the output's axis {} would have {out} elements", i + 2)),
        }
    }
    let to_usize = |v: &[i128], what: &str| -> std::result::Result<Vec<usize>, String> {
        v.iter().map(|&p| usize::try_from(p).map_err(|_| format!("{what} {p} is out of range"))).collect()
    };
    win.pads = to_usize(&pads, "a pad")?;
    win.auto_pad = "NOTSET".into();
    let output_padding = to_usize(&padding, "an output padding")?;
    let op = Op::ConvTranspose { window: win, group: *group, output_padding, output_shape: None };
    Ok((op, Meta::new(x.dtype, &shape)))
}

/// ONNX Reshape target: 0 copies the input dim, -1 is inferred.
/// The tuple length k of GatherND's and ScatterND's indices [.., k] into `data`, checked: integer
/// indices whose first `batch` dims are data's, and a tuple that does not pass data's rank.
fn nd_tuple(node: &Node, data: &Meta, idx: &Meta, batch: usize) -> Result<usize> {
    let k = *idx.shape.last().ok_or_else(|| err(node, "indices must have at least one axis"))?;
    if idx.dtype.is_float() {
        return Err(err(node, format!("indices must be integers, not {}", idx.dtype)));
    }
    if batch >= idx.shape.len() || data.shape.len() < batch + k || idx.shape[..batch] != data.shape[..batch] {
        return Err(err(
            node,
            format!("indices {:?} do not index data {:?} with {batch} batch dims", idx.shape, data.shape),
        ));
    }
    Ok(k)
}

/// `allow_zero`: a 0 in the target is a dimension of size 0 (ONNX's allowzero=1), not a copy.
pub fn reshape_target(input: &[usize], target: &[i64], allow_zero: bool) -> Option<Vec<usize>> {
    // Counted without wrapping: a target whose product wraps around to the input's count is
    // no reshape of it.
    let total = checked_numel(input)?;
    let mut shape = Vec::with_capacity(target.len());
    let mut infer_at = None;
    for (i, &t) in target.iter().enumerate() {
        match t {
            -1 if infer_at.is_none() => {
                infer_at = Some(i);
                shape.push(1);
            }
            0 if !allow_zero => shape.push(*input.get(i)?),
            t if t >= 0 => shape.push(t as usize),
            _ => return None,
        }
    }
    let known = checked_numel(&shape)?;
    if let Some(i) = infer_at {
        if known == 0 || !total.is_multiple_of(known) {
            return None;
        }
        shape[i] = total / known;
    }
    (checked_numel(&shape) == Some(total)).then_some(shape)
}

/// Evaluates ops that only exist to compute shapes, or any node whose inputs are all constant.
fn fold(
    node: &Node,
    op: &Op,
    metas: &[Option<Meta>],
    consts: &[Option<&Tensor>],
    outs: &[Meta],
) -> Result<Option<Vec<Tensor>>> {
    // Shape operands need not be constant to fold: inference has read them (CastLike's second
    // input, whose type is all it gives, is often an activation).
    let operands = node.op.static_operand_inputs();
    let all_const = node
        .inputs
        .iter()
        .zip(consts)
        .enumerate()
        .all(|(k, (i, c))| i.is_none() || c.is_some() || operands.contains(&k));
    match op {
        Op::Shape { start, end } => {
            let x = metas.first().and_then(Option::as_ref).ok_or_else(|| err(node, "input 0 is missing"))?;
            let r = x.shape.len() as i64;
            let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
            let (s, e) = (clamp(*start), clamp(end.unwrap_or(r)));
            let dims: Vec<i64> = x.shape[s..e.max(s)].iter().map(|&d| d as i64).collect();
            return Ok(Some(vec![Tensor::from_vec(&[dims.len()], dims)]));
        }
        Op::Size => {
            let x = metas.first().and_then(Option::as_ref).ok_or_else(|| err(node, "input 0 is missing"))?;
            return Ok(Some(vec![Tensor::scalar(x.numel() as i64)]));
        }
        Op::Constant { value } => return Ok(Some(vec![value.clone()])),
        Op::ConstantOfShape { value } => {
            let dims = consts
                .first()
                .copied()
                .flatten()
                .and_then(|t| t.to_i64_vec())
                .ok_or_else(|| err(node, "the shape input must be known when the graph is planned"))?;
            let shape: Vec<usize> = dims.iter().map(|&d| d.max(0) as usize).collect();
            let v = value.reshaped_scalar();
            let meta = Meta::new(v.dtype(), &shape);
            addressable(node, &meta)?;
            fits_in_memory(node, std::slice::from_ref(&meta))?;
            let mut out = Tensor::zeros(v.dtype(), &shape);
            kernels::broadcast_fill(&v, &mut out);
            return Ok(Some(vec![out]));
        }
        Op::Range => {
            let get = |i: usize| {
                consts
                    .get(i)
                    .copied()
                    .flatten()
                    .ok_or_else(|| err(node, "Range inputs must be known when the graph is planned"))
            };
            let (s, l, d) = (get(0)?, get(1)?, get(2)?);
            return Ok(Some(vec![kernels::range(s, l, d).map_err(|e| err(node, e))?]));
        }
        _ => {}
    }
    if !all_const || op.is_random() || node.inputs.is_empty() {
        return Ok(None);
    }
    let inputs: Vec<Option<&Tensor>> = consts.to_vec();
    fits_in_memory(node, outs)?;
    let mut outputs: Vec<Tensor> = outs.iter().map(|m| Tensor::zeros(m.dtype, &m.shape)).collect();
    kernels::run_on_tensors(op, &inputs, &mut outputs).map_err(|e| err(node, e))?;
    Ok(Some(outputs))
}

impl Tensor {
    /// A one-element tensor as a scalar (ConstantOfShape's `value` is shaped [1]).
    fn reshaped_scalar(&self) -> Tensor {
        self.clone().reshaped(&[])
    }
}

/// Binds `graph` to static shapes. `training` switches Dropout and BatchNormalization to their
/// training behaviour. Returns a new graph in which every value has a meta and every node is
/// static; folded values become initializers.
pub fn bind(graph: &Graph, bindings: &Bindings, training: bool) -> Result<Graph> {
    let mut g = graph.clone();
    let mut consts: HashMap<ValueId, Tensor> = HashMap::new();
    for (&v, t) in &graph.initializers {
        if !bindings.variables.contains(&v) {
            consts.insert(v, t.clone());
        }
    }
    for decl in &graph.inputs {
        if graph.initializers.contains_key(&decl.value) {
            continue; // an initializer that is also declared as input: its value is the default
        }
        if let Some(t) = bindings.constants.get(&decl.value) {
            g.values[decl.value].meta = Some(Meta::new(t.dtype(), t.shape()));
            consts.insert(decl.value, t.clone());
            continue;
        }
        if let Some(shape) = bindings.shapes.get(&decl.value) {
            g.values[decl.value].meta = Some(Meta::new(decl.dtype, shape));
            continue;
        }
        let mut shape = Vec::new();
        for (i, d) in decl.dims.iter().enumerate() {
            shape.push(match d {
                Dim::Fixed(n) => *n,
                Dim::Named(name) => *bindings.dims.get(name).ok_or_else(|| {
                    Error::Config(format!(
                        "graph input '{}': dimension {i} is named '{name}'; give its size in the configuration",
                        graph.name_of(decl.value)
                    ))
                })?,
                Dim::Unknown => {
                    return Err(Error::Config(format!(
                    "graph input '{}': dimension {i} has no size or name; give the input's shape in the configuration",
                    graph.name_of(decl.value)
                )))
                }
            });
        }
        g.values[decl.value].meta = Some(Meta::new(decl.dtype, &shape));
    }

    let mut kept = Vec::with_capacity(g.nodes.len());
    let mut queue: VecDeque<Node> = std::mem::take(&mut g.nodes).into();
    let mut sequences = super::sequence::Sequences::new();
    while let Some(mut node) = queue.pop_front() {
        if let Op::Sequence(s) = &node.op {
            let s = *s;
            for n in super::sequence::resolve(&mut g, &mut consts, &mut sequences, &node, &s)?.into_iter().rev() {
                queue.push_front(n);
            }
            continue;
        }
        let metas: Vec<Option<Meta>> = node.inputs.iter().map(|i| i.and_then(|v| g.values[v].meta.clone())).collect();
        for (k, i) in node.inputs.iter().enumerate() {
            if let Some(v) = i {
                if metas[k].is_none() {
                    return Err(err(
                        &node,
                        format!("input '{}' is not produced by any node, input or initializer", g.name_of(*v)),
                    ));
                }
            }
        }
        let rewritten = match node.op {
            Op::Sum { mean } => Some(expand_sum(&mut g, &mut consts, &node, &metas, mean)?),
            Op::OneHot { axis } => Some(expand_one_hot(&mut g, &mut consts, &node, &metas, axis)?),
            Op::Normalization { kind, epsilon } => {
                Some(expand_norm(&mut g, &mut consts, &node, &metas, kind, epsilon)?)
            }
            Op::Recurrent(ref r) => Some(super::recurrent::expand(&mut g, &mut consts, &node, &metas, r)?),
            Op::TopK { axis, largest, .. } => Some(expand_top_k(&mut g, &consts, &node, axis, largest)?),
            Op::Einsum { ref equation } => Some(super::einsum::expand(&mut g, &mut consts, &node, &metas, equation)?),
            _ => expand_tile(&mut g, &mut consts, &node, &metas)?,
        };
        if let Some(expanded) = rewritten {
            for n in expanded.into_iter().rev() {
                queue.push_front(n);
            }
            continue;
        }
        if let Some(expanded) = expand_coerced_softmax(&mut g, &mut consts, &node, &metas) {
            for n in expanded.into_iter().rev() {
                queue.push_front(n);
            }
            continue;
        }
        let cvals: Vec<Option<&Tensor>> = node.inputs.iter().map(|i| i.and_then(|v| consts.get(&v))).collect();
        // Shape-only ops have no inference of their own: they fold or fail.
        let folded_early = matches!(node.op, Op::Shape { .. } | Op::ConstantOfShape { .. } | Op::Range | Op::Size);
        let (op, out_metas) =
            if folded_early { (node.op.clone(), vec![]) } else { infer_node(&node, &metas, &cvals, training)? };
        for m in &out_metas {
            addressable(&node, m)?;
        }
        if let Some(values) = fold(&node, &op, &metas, &cvals, &out_metas)? {
            for (o, t) in node.outputs.iter().zip(values) {
                if let Some(o) = o {
                    g.values[*o].meta = Some(Meta::new(t.dtype(), t.shape()));
                    consts.insert(*o, t);
                }
            }
            continue;
        }
        // Kernels address outputs by position: an omitted output before a used one still
        // needs a place, trailing omitted ones are dropped.
        while node.outputs.last().is_some_and(|o| o.is_none()) {
            node.outputs.pop();
        }
        node.outputs.truncate(out_metas.len());
        for k in 0..node.outputs.len() {
            if node.outputs[k].is_none() {
                node.outputs[k] = Some(g.fresh(&format!("{}:unused{k}", node.name)));
            }
        }
        for (o, meta) in node.outputs.iter().zip(&out_metas) {
            if let Some(o) = o {
                g.values[*o].meta = Some(meta.clone());
            }
        }
        // Shape operands are now attributes or output metas: drop them from the inputs.
        let operands = node.op.static_operand_inputs();
        if !operands.is_empty() {
            node.inputs =
                node.inputs.iter().enumerate().filter(|(k, _)| !operands.contains(k)).map(|(_, v)| *v).collect();
        }
        node.op = op;
        kept.push(node);
    }
    g.nodes = kept;
    // Folded values that survive as inputs of kept nodes or as graph outputs become initializers.
    let uses = g.use_counts();
    for (v, t) in consts {
        if uses[v] > 0 && !g.initializers.contains_key(&v) && !bindings.constants.contains_key(&v) {
            g.initializers.insert(v, t);
        }
    }
    for (v, t) in &bindings.constants {
        if uses[*v] > 0 {
            g.initializers.insert(*v, t.clone());
        }
    }
    g.inputs.retain(|d| !bindings.constants.contains_key(&d.value) && !graph.initializers.contains_key(&d.value));
    g.prune();
    Ok(g)
}

/// Tile as the ops that make it: x [d0, d1, ...] viewed as [1, d0, 1, d1, ...], expanded to
/// [r0, d0, r1, d1, ...] and viewed as [r0·d0, r1·d1, ...], queued for binding in its place.
fn expand_tile(
    g: &mut Graph,
    consts: &mut HashMap<ValueId, Tensor>,
    node: &Node,
    metas: &[Option<Meta>],
) -> Result<Option<Vec<Node>>> {
    if node.op != Op::Tile {
        return Ok(None);
    }
    let x = metas.first().cloned().flatten().ok_or_else(|| err(node, "input 0 is missing"))?;
    let repeats = node
        .input(1)
        .and_then(|v| consts.get(&v))
        .and_then(|t| t.to_i64_vec())
        .ok_or_else(|| err(node, "repeats (input 1) must be known when the graph is planned"))?;
    if repeats.len() != x.shape.len() || repeats.iter().any(|&r| r < 0) {
        return Err(err(node, format!("repeats {repeats:?} for an input of shape {:?}", x.shape)));
    }
    let (input, output) = (node.input(0).expect("checked"), node.output(0).ok_or_else(|| err(node, "no output"))?);
    let dims = |f: &dyn Fn(usize, i64) -> [i64; 2]| -> Vec<i64> {
        x.shape.iter().zip(&repeats).flat_map(|(&d, &r)| f(d, r)).collect()
    };
    let interleaved = dims(&|d, _| [1, d as i64]);
    let expanded = dims(&|d, r| [r, d as i64]);
    let tiled: Vec<i64> = x.shape.iter().zip(&repeats).map(|(&d, &r)| d as i64 * r).collect();
    let mut operand = |name: &str, dims: Vec<i64>| {
        constant_value(g, consts, &format!("{}:{name}", node.name), Tensor::from_vec(&[dims.len()], dims))
    };
    let (s1, s2, s3) = (operand("interleaved", interleaved), operand("expanded", expanded), operand("tiled", tiled));
    let (a, b) = (g.fresh(&format!("{}:interleaved_x", node.name)), g.fresh(&format!("{}:expanded_x", node.name)));
    let name = |suffix: &str| format!("{}{suffix}", node.name);
    Ok(Some(vec![
        node1(name(":interleave"), Op::Reshape, &[input, s1], a),
        node1(name(":expand"), Op::Expand, &[a, s2], b),
        node1(name(""), Op::Reshape, &[b, s3], output),
    ]))
}

/// A constant of the graph, known when it is bound.
pub(super) fn constant_value(g: &mut Graph, consts: &mut HashMap<ValueId, Tensor>, name: &str, t: Tensor) -> ValueId {
    let v = g.fresh(name);
    g.values[v].meta = Some(Meta::new(t.dtype(), t.shape()));
    consts.insert(v, t);
    v
}

/// A node of one output.
pub(super) fn node1(name: String, op: Op, inputs: &[ValueId], output: ValueId) -> Node {
    Node { name, op, inputs: inputs.iter().copied().map(Some).collect(), outputs: vec![Some(output)] }
}

/// Sum (Mean) as ((x0 + x1) + x2) + … (then × 1/n), queued for binding in its place.
fn expand_sum(
    g: &mut Graph,
    consts: &mut HashMap<ValueId, Tensor>,
    node: &Node,
    metas: &[Option<Meta>],
    mean: bool,
) -> Result<Vec<Node>> {
    let ins: Vec<ValueId> =
        node.inputs.iter().map(|i| i.ok_or_else(|| err(node, "an omitted input"))).collect::<Result<_>>()?;
    let output = node.output(0).ok_or_else(|| err(node, "no output"))?;
    let first = ins.first().ok_or_else(|| err(node, "no inputs"))?;
    let dtype = metas.first().and_then(Option::as_ref).ok_or_else(|| err(node, "input 0 is missing"))?.dtype;
    let mut nodes = Vec::new();
    let mut acc = *first;
    let last = ins.len() - 1 + mean as usize;
    for (k, &x) in ins.iter().enumerate().skip(1) {
        let out = if k == last { output } else { g.fresh(&format!("{}:sum{k}", node.name)) };
        nodes.push(node1(format!("{}:add{k}", node.name), Op::Binary(crate::op::Binary::Add), &[acc, x], out));
        acc = out;
    }
    if mean {
        let scale = Tensor::scalar(1.0 / ins.len() as f64).cast(dtype);
        let k = constant_value(g, consts, &format!("{}:1/n", node.name), scale);
        nodes.push(node1(node.name.clone(), Op::Binary(crate::op::Binary::Mul), &[acc, k], output));
    } else if ins.len() == 1 {
        nodes.push(node1(node.name.clone(), Op::Identity, &[acc], output));
    }
    Ok(nodes)
}

/// Instance, group and RMS normalization written out: x (viewed as [N, G, rest] for groups)
/// less its mean over the normalized dims (not for RMS), divided by √(mean of squares + ε),
/// viewed back, times scale and plus bias laid along the channel axis (or the group axis, for
/// opset 18's per-group scale), queued for binding in its place.
fn expand_norm(
    g: &mut Graph,
    consts: &mut HashMap<ValueId, Tensor>,
    node: &Node,
    metas: &[Option<Meta>],
    kind: NormKind,
    epsilon: f32,
) -> Result<Vec<Node>> {
    use crate::op::{Binary, Reduce};
    let x = metas.first().cloned().flatten().ok_or_else(|| err(node, "input 0 is missing"))?;
    let scale = metas.get(1).cloned().flatten().ok_or_else(|| err(node, "scale (input 1) is missing"))?;
    let (input, output) = (node.input(0).expect("checked"), node.output(0).ok_or_else(|| err(node, "no output"))?);
    let r = x.shape.len();
    if r < 2 && !matches!(kind, NormKind::Rms { .. }) {
        return Err(err(node, format!("X of shape {:?} has no channel dimension", x.shape)));
    }
    let c = x.shape.get(1).copied().unwrap_or(1);
    // The view normalized, its normalized axes, and the shape scale and bias take in that view
    // (None: they apply after viewing back, along the channels).
    let (view, axes, on_view): (Vec<usize>, Vec<i64>, Option<Vec<usize>>) = match kind {
        NormKind::Instance => (x.shape.clone(), (2..r as i64).collect(), None),
        NormKind::Group { groups } => {
            if c % groups != 0 {
                return Err(err(node, format!("{c} channels do not split into {groups} groups")));
            }
            let rest = x.numel() / x.shape[0].saturating_mul(groups).max(1);
            let per_group = (scale.numel() == groups && groups != c).then(|| vec![groups, 1]);
            (vec![x.shape[0], groups, rest], vec![2], per_group)
        }
        NormKind::Rms { axis } => {
            let a = norm_axis(axis, r).ok_or_else(|| err(node, format!("axis {axis} out of range")))?;
            (x.shape.clone(), (a as i64..r as i64).collect(), Some(x.shape[a..].to_vec()))
        }
    };
    let name = |s: &str| format!("{}:{s}", node.name);
    let mut nodes = Vec::new();
    let fresh = |g: &mut Graph, s: &str| g.fresh(&name(s));
    let shape_of = |g: &mut Graph, consts: &mut HashMap<ValueId, Tensor>, s: &str, dims: &[usize]| {
        let t = Tensor::from_vec(&[dims.len()], dims.iter().map(|&d| d as i64).collect::<Vec<_>>());
        constant_value(g, consts, &name(s), t)
    };
    let mean = |axes: &[i64]| Op::ReduceOp {
        kind: Reduce::Mean,
        axes: Some(axes.to_vec()),
        keepdims: true,
        noop_with_empty_axes: false,
    };
    let v = if view != x.shape {
        let (s, v) = (shape_of(g, consts, "view_shape", &view), fresh(g, "view"));
        nodes.push(node1(name("view"), Op::Reshape, &[input, s], v));
        v
    } else {
        input
    };
    let centered = if matches!(kind, NormKind::Rms { .. }) {
        v
    } else {
        let (m, d) = (fresh(g, "mean"), fresh(g, "centered"));
        nodes.push(node1(name("mean"), mean(&axes), &[v], m));
        nodes.push(node1(name("center"), Op::Binary(Binary::Sub), &[v, m], d));
        d
    };
    let eps = constant_value(g, consts, &name("epsilon"), Tensor::scalar(epsilon).cast(x.dtype));
    let (sq, ms, shifted, root, normed) = (
        fresh(g, "square"),
        fresh(g, "mean_square"),
        fresh(g, "plus_epsilon"),
        fresh(g, "root"),
        fresh(g, "normalized"),
    );
    nodes.push(node1(name("square"), Op::Binary(Binary::Mul), &[centered, centered], sq));
    nodes.push(node1(name("mean_square"), mean(&axes), &[sq], ms));
    nodes.push(node1(name("plus_epsilon"), Op::Binary(Binary::Add), &[ms, eps], shifted));
    nodes.push(node1(name("root"), Op::Unary(crate::op::Unary::Sqrt), &[shifted], root));
    nodes.push(node1(name("divide"), Op::Binary(Binary::Div), &[centered, root], normed));
    // scale and bias along the channels ([C, 1, …] against [N, C, …]) or as `on_view` says.
    let lay = |g: &mut Graph, consts: &mut HashMap<ValueId, Tensor>, nodes: &mut Vec<Node>, k: usize, s: &str| {
        let operand = node.input(k)?;
        let dims = on_view.clone().unwrap_or_else(|| {
            let mut d = vec![1usize; r - 1];
            d[0] = c;
            d
        });
        let (shape, laid) = (shape_of(g, consts, &format!("{s}_shape"), &dims), g.fresh(&name(&format!("{s}_laid"))));
        nodes.push(node1(name(&format!("lay_{s}")), Op::Reshape, &[operand, shape], laid));
        Some(laid)
    };
    // Back to x's shape before a per-channel scale; after a scale laid on the view.
    let back = |g: &mut Graph, consts: &mut HashMap<ValueId, Tensor>, nodes: &mut Vec<Node>, y: ValueId| {
        if view == x.shape {
            return y;
        }
        let (s, out) = (shape_of(g, consts, "back_shape", &x.shape), g.fresh(&name("back")));
        nodes.push(node1(name("back"), Op::Reshape, &[y, s], out));
        out
    };
    let mut y = normed;
    if on_view.is_none() {
        y = back(g, consts, &mut nodes, y);
    }
    let scale_v = lay(g, consts, &mut nodes, 1, "scale").expect("scale exists");
    let scaled = fresh(g, "scaled");
    nodes.push(node1(name("scale"), Op::Binary(Binary::Mul), &[y, scale_v], scaled));
    y = scaled;
    if let Some(b) = lay(g, consts, &mut nodes, 2, "bias") {
        let biased = fresh(g, "biased");
        nodes.push(node1(name("bias"), Op::Binary(Binary::Add), &[y, b], biased));
        y = biased;
    }
    if on_view.is_some() {
        y = back(g, consts, &mut nodes, y);
    }
    nodes.push(node1(node.name.clone(), Op::Identity, &[y], output));
    Ok(nodes)
}

/// OneHot as the ops that make it: the indices as i64, negative ones moved up by depth, given
/// the output's axis (Unsqueeze) and compared with 0..depth laid along it (Equal), choosing
/// values[1] or values[0] (Where). An index outside −depth..depth matches nothing.
fn expand_one_hot(
    g: &mut Graph,
    consts: &mut HashMap<ValueId, Tensor>,
    node: &Node,
    metas: &[Option<Meta>],
    axis: i64,
) -> Result<Vec<Node>> {
    let known = |k: usize, what: &str| {
        node.input(k)
            .and_then(|v| consts.get(&v))
            .cloned()
            .ok_or_else(|| err(node, format!("{what} (input {k}) must be known when the graph is planned")))
    };
    let (depth_t, values) = (known(1, "depth")?, known(2, "values")?);
    let depth = match depth_t.to_f64_vec()[..] {
        [d] if d >= 1.0 => d as i64,
        _ => return Err(err(node, format!("depth must be one positive number, not {:?}", depth_t.to_f64_vec()))),
    };
    if values.numel() != 2 {
        return Err(err(node, format!("values must be [off, on], not {} elements", values.numel())));
    }
    let idx = metas.first().and_then(Option::as_ref).ok_or_else(|| err(node, "input 0 is missing"))?;
    let rank = idx.shape.len() + 1;
    let a = norm_axis(axis, rank).ok_or_else(|| err(node, format!("axis {axis} out of range for rank {rank}")))?;
    let (input, output) = (node.input(0).expect("checked"), node.output(0).ok_or_else(|| err(node, "no output"))?);
    let name = |s: &str| format!("{}:{s}", node.name);
    let mut c = |s: &str, t: Tensor| constant_value(g, consts, &name(s), t);
    let zero = c("zero", Tensor::scalar(0i64));
    let depth_v = c("depth_i64", Tensor::scalar(depth));
    let mut line = vec![1usize; rank];
    line[a] = depth as usize;
    let range = c("range", Tensor::from_vec(&line, (0..depth).collect::<Vec<i64>>()));
    let pick = |k: usize| Tensor::scalar(values.to_f64_vec()[k]).cast(values.dtype());
    let (off, on) = (c("off", pick(0)), c("on", pick(1)));
    let fresh = |g: &mut Graph, s: &str| g.fresh(&name(s));
    let ids = fresh(g, "ids");
    let negative = fresh(g, "negative");
    let moved = fresh(g, "moved");
    let wrapped = fresh(g, "wrapped");
    let lined = fresh(g, "lined");
    let hit = fresh(g, "hit");
    use crate::op::Binary;
    Ok(vec![
        node1(name("cast"), Op::Cast { to: DType::I64 }, &[input], ids),
        node1(name("is_negative"), Op::Binary(Binary::Less), &[ids, zero], negative),
        node1(name("add_depth"), Op::Binary(Binary::Add), &[ids, depth_v], moved),
        node1(name("wrap"), Op::Where, &[negative, moved, ids], wrapped),
        node1(name("unsqueeze"), Op::Unsqueeze { axes: Some(vec![a as i64]) }, &[wrapped], lined),
        node1(name("equal"), Op::Binary(Binary::Equal), &[lined, range], hit),
        node1(node.name.clone(), Op::Where, &[hit, on, off], output),
    ])
}

/// TopK as the indices of its K largest (smallest) elements along the axis (TopKIndices) and
/// the values GatherElements reads there, so that the values' gradient is GatherElements'.
/// K must be known: it sets the outputs' shapes. `sorted` asks nothing of us: the indices
/// always come in order.
fn expand_top_k(
    g: &mut Graph,
    consts: &HashMap<ValueId, Tensor>,
    node: &Node,
    axis: i64,
    largest: bool,
) -> Result<Vec<Node>> {
    let k = node
        .input(1)
        .and_then(|v| consts.get(&v))
        .ok_or_else(|| err(node, "K (input 1) must be known when the graph is planned"))?;
    let k = match k.to_i64_vec().as_deref() {
        Some(&[k]) if k >= 0 => k as usize,
        _ => return Err(err(node, format!("K must be one non-negative integer, not {:?}", k.to_f64_vec()))),
    };
    let input = node.input(0).ok_or_else(|| err(node, "input 0 is missing"))?;
    let name = |s: &str| format!("{}:{s}", node.name);
    let indices = node.output(1).unwrap_or_else(|| g.fresh(&name("indices")));
    let mut nodes = vec![node1(name("indices"), Op::TopKIndices { axis, k, largest }, &[input], indices)];
    if let Some(values) = node.output(0) {
        nodes.push(node1(node.name.clone(), Op::GatherElements { axis }, &[input, indices], values));
    }
    Ok(nodes)
}

/// Before opset 13, Softmax and LogSoftmax normalize over all dims from `axis` on, as if the
/// input were flattened to 2-D there. Where that differs from normalizing over `axis` alone,
/// the node becomes Reshape → (Log)Softmax over the last axis → Reshape, queued for binding
/// in its place.
fn expand_coerced_softmax(
    g: &mut Graph,
    consts: &mut HashMap<ValueId, Tensor>,
    node: &Node,
    metas: &[Option<Meta>],
) -> Option<Vec<Node>> {
    let (Op::Softmax { axis } | Op::LogSoftmax { axis }) = node.op else { return None };
    let x = metas.first()?.as_ref()?;
    let a = norm_axis(axis, x.shape.len())?;
    if g.opset >= 13 || a + 1 >= x.shape.len() {
        return None;
    }
    let (input, output) = (node.input(0)?, node.output(0)?);
    let outer: usize = x.shape[..a].iter().product();
    let flat = [outer as i64, x.shape[a..].iter().product::<usize>() as i64];
    let back: Vec<i64> = x.shape.iter().map(|&d| d as i64).collect();
    let mut shape_operand = |name: &str, dims: &[i64]| {
        let v = g.fresh(&format!("{}:{name}", node.name));
        let t = Tensor::from_vec(&[dims.len()], dims.to_vec());
        g.values[v].meta = Some(Meta::new(t.dtype(), t.shape()));
        consts.insert(v, t);
        v
    };
    let (flat_shape, back_shape) = (shape_operand("2d_shape", &flat), shape_operand("shape", &back));
    let (x2d, y2d) = (g.fresh(&format!("{}:2d", node.name)), g.fresh(&format!("{}:2d_out", node.name)));
    let op = match node.op {
        Op::Softmax { .. } => Op::Softmax { axis: 1 },
        _ => Op::LogSoftmax { axis: 1 },
    };
    let make = |suffix: &str, op: Op, inputs: Vec<ValueId>, out: ValueId| Node {
        name: format!("{}{suffix}", node.name),
        op,
        inputs: inputs.into_iter().map(Some).collect(),
        outputs: vec![Some(out)],
    };
    Some(vec![
        make(":to_2d", Op::Reshape, vec![input, flat_shape], x2d),
        make("", op, vec![x2d], y2d),
        make(":from_2d", Op::Reshape, vec![y2d, back_shape], output),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::exec::Executor;
    use std::sync::Arc;

    /// Binds and runs a one-node graph on input `x`; returns the output.
    fn run_one(opset: i64, op: Op, x: &Tensor) -> Result<Tensor> {
        let mut g = Graph::new("t", opset);
        let input = g.add_input("x", x.dtype(), x.shape().iter().map(|&d| super::super::ir::Dim::Fixed(d)).collect());
        let y = g.op1("n", op, &[input]);
        g.outputs.push(y);
        let bound = bind(&g, &Bindings::default(), false)?;
        let mut ex = Executor::new(Arc::new(CpuBackend::new()), bound, &[])?;
        ex.feed(input, x)?;
        ex.run(0)?;
        ex.fetch(y)
    }

    #[test]
    fn flatten_counts_a_negative_axis_from_the_rank() {
        let x = Tensor::zeros(DType::F32, &[2, 3, 4]);
        assert_eq!(run_one(13, Op::Flatten { axis: -1 }, &x).unwrap().shape(), &[6, 4]);
        assert_eq!(run_one(13, Op::Flatten { axis: -3 }, &x).unwrap().shape(), &[1, 24]);
        assert!(run_one(13, Op::Flatten { axis: -4 }, &x).is_err());
    }

    /// A target whose product wraps around to the input's count (found by fuzzing with overflow
    /// checks: (2^62 + 1) × 4 ≡ 4 mod 2^64) is no reshape of a 4-element input; without checked
    /// products a release build took it, and a dimension of 2^62 + 1 with it.
    #[test]
    fn a_reshape_whose_target_count_wraps_around_is_refused() {
        assert_eq!(reshape_target(&[4], &[(1 << 62) + 1, 4], false), None);
        assert_eq!(reshape_target(&[4], &[-1, (1 << 62) + 1, 4], false), None);
        assert_eq!(reshape_target(&[usize::MAX, 2], &[-1], false), None);
        assert_eq!(reshape_target(&[2, 3, 4], &[0, -1], false), Some(vec![2, 12]));
    }

    /// Pads near i64's ends wrapped the padded size around to a small one (2 + 2·(2^63 − 1)
    /// is 0 in wrapping arithmetic): refused, naming the node.
    #[test]
    fn pads_that_wrap_the_size_around_are_refused() {
        let mut g = Graph::new("t", 18);
        let input = g.add_input("x", DType::F32, vec![super::super::ir::Dim::Fixed(2)]);
        let pads = vec![i64::MAX, i64::MAX];
        let y = g.op1("pad", Op::Pad { mode: PadMode::Constant, pads, value: 0.0 }, &[input]);
        g.outputs.push(y);
        let Err(e) = bind(&g, &Bindings::default(), false) else { panic!("bound") };
        assert!(e.to_string().contains("too large to address"), "{e}");
    }

    /// Slices with steps at i64's ends took one element; the count used to overflow.
    #[test]
    fn slices_with_extreme_steps_take_one_element() {
        assert_eq!(slice_range(0, 5, i64::MAX, 10), (0, i64::MAX, 1));
        assert_eq!(slice_range(9, i64::MIN, i64::MIN, 10), (9, i64::MIN, 1));
        assert_eq!(slice_range(0, 10, 3, 10).2, 4);
        assert_eq!(slice_range(9, -11, -3, 10).2, 4);
        assert_eq!(slice_range(2, 2, 1, 10).2, 0);
    }

    /// Split sizes whose sum wraps around i64 to the axis' length (found by fuzzing with
    /// overflow checks) cover nothing: refused, naming the node.
    #[test]
    fn split_sizes_whose_sum_wraps_around_are_refused() {
        let mut g = Graph::new("t", 18);
        let input = g.add_input("x", DType::F32, vec![super::super::ir::Dim::Fixed(2)]);
        let sizes = vec![i64::MAX, i64::MAX, 4];
        let outs = g.add_node("split", Op::Split { axis: 0, sizes, num_outputs: None }, &[input], 3);
        g.outputs.extend(outs);
        let Err(e) = bind(&g, &Bindings::default(), false) else { panic!("bound") };
        assert!(e.to_string().contains("do not cover axis 0"), "{e}");
    }

    /// Before opset 13 Softmax normalizes over every dim from `axis` on; from 13, over `axis`.
    #[test]
    fn softmax_before_opset_13_normalizes_the_flattened_tail() {
        let x = Tensor::from_vec(&[2, 3, 2], (0..12).map(|i| i as f32 * 0.1).collect());
        let sum_over = |t: &Tensor, lane: &[usize]| lane.iter().map(|&i| t.as_slice::<f32>()[i] as f64).sum::<f64>();
        let old = run_one(11, Op::Softmax { axis: 1 }, &x).unwrap();
        assert_eq!(old.shape(), &[2, 3, 2]);
        assert!((sum_over(&old, &[0, 1, 2, 3, 4, 5]) - 1.0).abs() < 1e-6);
        let new = run_one(13, Op::Softmax { axis: 1 }, &x).unwrap();
        assert!((sum_over(&new, &[0, 2, 4]) - 1.0).abs() < 1e-6);
        let log_old = run_one(11, Op::LogSoftmax { axis: 1 }, &x).unwrap();
        let back: Vec<f32> = log_old.as_slice::<f32>().iter().map(|v| v.exp()).collect();
        assert!(back.iter().zip(old.as_slice::<f32>()).all(|(a, b)| (a - b).abs() < 1e-6));
    }
}

#[cfg(test)]
mod upsampling_tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::exec::Executor;
    use crate::graph::ir::Dim;
    use crate::op::resize::{Coordinates, Interpolation, Resize, Target};
    use std::sync::Arc;

    fn forward(g: &Graph, x: &Tensor) -> Tensor {
        let mut ex = Executor::new(Arc::new(CpuBackend::new()), g.clone(), &[]).unwrap();
        ex.feed(g.inputs[0].value, x).unwrap();
        ex.run(0).unwrap();
        ex.fetch(g.outputs[0]).unwrap()
    }

    /// ConvTranspose's output_shape and Resize's sizes are resolved when bound; the bound ops
    /// are saved with explicit pads and output padding, and with roi, scales and sizes as
    /// inputs, which read back into the same ops.
    #[test]
    fn bound_conv_transpose_and_resize_save_as_they_read_back() {
        let mut g = Graph::new("up", 19);
        let x = g.add_input("x", DType::F32, vec![Dim::Fixed(1), Dim::Fixed(2), Dim::Fixed(3), Dim::Fixed(3)]);
        let w = g.add_initializer("w", Tensor::from_vec(&[2, 3, 3, 3], (0..54).map(|i| (i as f32).cos()).collect()));
        let window = Window::explicit(&[3, 3], &[2, 2], &[1, 1], &[0, 1, 0, 1], false);
        let transposed = Op::ConvTranspose { window, group: 1, output_padding: vec![], output_shape: Some(vec![8, 6]) };
        let t = g.op1("t", transposed, &[x, w]);
        let r = Resize::new(Interpolation::Linear, Coordinates::AlignCorners, Target::Sizes(vec![1, 3, 5, 9]));
        let y = g.op1("r", Op::Resize(r), &[t]);
        g.outputs = vec![y];
        let bound = bind(&g, &Bindings::default(), false).unwrap();
        let t_op = &bound.nodes.iter().find(|n| n.name == "t").unwrap().op;
        let Op::ConvTranspose { window, output_padding, output_shape, .. } = t_op else { panic!("{t_op:?}") };
        // 2·(3 − 1) + 3 = 7 rows and columns: 8 rows asked, one more at the end; 6 columns, one
        // pad, at the start (the given pads give way to output_shape's).
        assert_eq!((&window.pads[..], &output_padding[..], output_shape), (&[0, 1, 0, 0][..], &[1, 0][..], &None));
        assert_eq!(bound.meta(y).unwrap().shape, [1, 3, 5, 9]);

        let model = super::super::onnx_io::to_model(&bound, "test");
        let read = super::super::onnx_io::from_model(&model, "up.onnx").unwrap();
        let rebound = bind(&read, &Bindings::default(), false).unwrap();
        let ops = |g: &Graph| g.nodes.iter().map(|n| n.op.clone()).collect::<Vec<_>>();
        assert_eq!(ops(&rebound), ops(&bound));
        let input = Tensor::from_vec(&[1, 2, 3, 3], (0..18).map(|i| (i as f32 * 0.7).sin()).collect());
        assert_eq!(forward(&rebound, &input).as_slice::<f32>(), forward(&bound, &input).as_slice::<f32>());
    }
}

#[cfg(test)]
mod normalization_tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::exec::Executor;
    use crate::graph::ir::Dim;
    use std::sync::Arc;

    /// RMSNormalization (opset 23, which the ONNX node tests of onnx 1.17 do not cover) against
    /// its definition: x / √(mean over the dims from `axis` of x² + ε) · scale.
    #[test]
    fn rms_normalization_binds_to_its_definition() {
        let mut g = Graph::new("rms", 23);
        let x = g.add_input("x", DType::F32, vec![Dim::Fixed(2), Dim::Fixed(3), Dim::Fixed(4)]);
        let scale: Vec<f32> = (0..12).map(|i| 0.5 + i as f32 / 10.0).collect();
        let s = g.add_initializer("scale", Tensor::from_vec(&[3, 4], scale.clone()));
        let y = g.op1("y", Op::Normalization { kind: NormKind::Rms { axis: 1 }, epsilon: 1e-3 }, &[x, s]);
        g.outputs = vec![y];
        let bound = bind(&g, &Bindings::default(), false).unwrap();
        let mut ex = Executor::new(Arc::new(CpuBackend::new()), bound, &[]).unwrap();
        let xs: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin()).collect();
        ex.feed(x, &Tensor::from_vec(&[2, 3, 4], xs.clone())).unwrap();
        ex.run(1).unwrap();
        let got = ex.fetch(y).unwrap();
        for (n, row) in xs.chunks(12).enumerate() {
            let rms = (row.iter().map(|v| (v * v) as f64).sum::<f64>() / 12.0 + 1e-3).sqrt();
            for (k, &v) in row.iter().enumerate() {
                let want = v as f64 / rms * scale[k] as f64;
                let have = got.as_slice::<f32>()[n * 12 + k] as f64;
                assert!((have - want).abs() < 1e-6, "element {n},{k}: {have} against {want}");
            }
        }
    }
}
