//! Sequences of tensors, as the dynamo exporter writes `torch.split`, `unbind` and lists of
//! tensors (SplitToSequence, SequenceAt, ConcatFromSequence, ...). Shapes are static per run, so
//! every sequence's length and elements are known when the graph is bound: binding maps each
//! sequence value to the values of its elements and rewrites each sequence op into the tensor
//! ops it stands for (Split, Squeeze, Identity, Unsqueeze, Concat), or into nothing. No
//! sequence survives binding; kernels never see one.

use super::ir::{Graph, Meta, Node, ValueId};
use crate::error::{Error, Result};
use crate::op::{Op, SequenceOp};
use crate::tensor::Tensor;
use std::collections::HashMap;

/// The elements of each sequence value bound so far.
pub type Sequences = HashMap<ValueId, Vec<ValueId>>;

fn err(node: &Node, msg: impl std::fmt::Display) -> Error {
    Error::Corrupt(format!("{}: {msg}", node.describe()))
}

/// Resolves one sequence op: records the sequences it makes in `seqs` and returns the tensor
/// nodes that replace it, to be bound in its place. `consts` holds the values known at bind time
/// (positions and split sizes must be among them).
pub fn resolve(
    g: &mut Graph,
    consts: &mut HashMap<ValueId, Tensor>,
    seqs: &mut Sequences,
    node: &Node,
    op: &SequenceOp,
) -> Result<Vec<Node>> {
    let input = |i: usize| node.input(i);
    let elements = |seqs: &Sequences, i: usize| -> Result<Vec<ValueId>> {
        input(i).and_then(|v| seqs.get(&v).cloned()).ok_or_else(|| err(node, format!("input {i} is not a sequence")))
    };
    let known = |i: usize, what: &str| -> Result<Option<Vec<i64>>> {
        match input(i) {
            None => Ok(None),
            Some(v) => consts
                .get(&v)
                .and_then(|t| t.to_i64_vec())
                .map(Some)
                .ok_or_else(|| err(node, format!("{what} (input {i}) must be known when the graph is planned"))),
        }
    };
    // A position in a sequence of `len`: negative counts from the end; `end` allows len itself.
    let position = |p: i64, len: usize, end: bool| -> Result<usize> {
        let q = if p < 0 { p + len as i64 } else { p };
        let top = len as i64 + end as i64;
        (0..top)
            .contains(&q)
            .then_some(q as usize)
            .ok_or_else(|| err(node, format!("position {p} is out of range for a sequence of {len}")))
    };
    let output = node.output(0).ok_or_else(|| err(node, "the output is missing"))?;
    let make = |suffix: &str, op: Op, inputs: Vec<ValueId>, outputs: Vec<ValueId>| Node {
        name: format!("{}{suffix}", node.name),
        op,
        inputs: inputs.into_iter().map(Some).collect(),
        outputs: outputs.into_iter().map(Some).collect(),
    };
    let mut nodes = Vec::new();
    match *op {
        SequenceOp::Split { axis, keepdims } => {
            let x = input(0).ok_or_else(|| err(node, "input 0 is missing"))?;
            let shape = g.values[x]
                .meta
                .as_ref()
                .map(|m: &Meta| m.shape.clone())
                .ok_or_else(|| err(node, "input 0 has no shape"))?;
            let a = crate::shape::norm_axis(axis, shape.len())
                .ok_or_else(|| err(node, format!("axis {axis} out of range")))?;
            let n = shape[a] as i64;
            let split = known(1, "split")?;
            let sizes: Vec<i64> = match &split {
                // A scalar: parts of that size, the last one shorter.
                Some(s)
                    if s.len() == 1
                        && g.values[input(1).expect("given")].meta.as_ref().is_some_and(|m| m.shape.is_empty()) =>
                {
                    let c = s[0].max(1);
                    let parts = (n as u64).div_ceil(c as u64) as i64;
                    (0..parts).map(|i| c.min(n - i * c)).collect()
                }
                Some(s) => s.clone(),
                None => vec![1; n as usize],
            };
            let parts: Vec<ValueId> = (0..sizes.len()).map(|k| g.fresh(&format!("{}:part{k}", node.name))).collect();
            nodes.push(make("", Op::Split { axis: a as i64, sizes, num_outputs: None }, vec![x], parts.clone()));
            // Without `split`, keepdims=0 drops the split axis from every part.
            let elems = if split.is_none() && !keepdims {
                parts
                    .iter()
                    .enumerate()
                    .map(|(k, &p)| {
                        let e = g.fresh(&format!("{}:element{k}", node.name));
                        nodes.push(make(
                            &format!(":squeeze{k}"),
                            Op::Squeeze { axes: Some(vec![a as i64]) },
                            vec![p],
                            vec![e],
                        ));
                        e
                    })
                    .collect()
            } else {
                parts
            };
            seqs.insert(output, elems);
        }
        SequenceOp::Construct => {
            let elems =
                node.inputs.iter().map(|i| i.ok_or_else(|| err(node, "an omitted input"))).collect::<Result<_>>()?;
            seqs.insert(output, elems);
        }
        SequenceOp::Empty => {
            seqs.insert(output, vec![]);
        }
        SequenceOp::At => {
            let elems = elements(seqs, 0)?;
            let p = known(1, "position")?
                .and_then(|p| p.first().copied())
                .ok_or_else(|| err(node, "position is missing"))?;
            nodes.push(make("", Op::Identity, vec![elems[position(p, elems.len(), false)?]], vec![output]));
        }
        SequenceOp::Length => {
            let len = Tensor::scalar(elements(seqs, 0)?.len() as i64);
            g.values[output].meta = Some(Meta::new(len.dtype(), len.shape()));
            consts.insert(output, len);
        }
        SequenceOp::Insert => {
            let mut elems = elements(seqs, 0)?;
            let t = input(1).ok_or_else(|| err(node, "the tensor to insert is missing"))?;
            let at = match known(2, "position")? {
                Some(p) => position(*p.first().ok_or_else(|| err(node, "an empty position"))?, elems.len(), true)?,
                None => elems.len(),
            };
            elems.insert(at, t);
            seqs.insert(output, elems);
        }
        SequenceOp::Erase => {
            let mut elems = elements(seqs, 0)?;
            if elems.is_empty() {
                return Err(err(node, "erasing from an empty sequence"));
            }
            let at = match known(1, "position")? {
                Some(p) => position(*p.first().ok_or_else(|| err(node, "an empty position"))?, elems.len(), false)?,
                None => elems.len() - 1,
            };
            elems.remove(at);
            seqs.insert(output, elems);
        }
        SequenceOp::Concat { axis, new_axis } => {
            let elems = elements(seqs, 0)?;
            if elems.is_empty() {
                return Err(err(node, "concatenating an empty sequence"));
            }
            let parts = if new_axis {
                // Each element gains the axis (of size 1) first; a negative axis counts from the
                // result's rank.
                elems
                    .iter()
                    .enumerate()
                    .map(|(k, &e)| {
                        let u = g.fresh(&format!("{}:unsqueezed{k}", node.name));
                        nodes.push(make(
                            &format!(":unsqueeze{k}"),
                            Op::Unsqueeze { axes: Some(vec![axis]) },
                            vec![e],
                            vec![u],
                        ));
                        u
                    })
                    .collect()
            } else {
                elems
            };
            nodes.push(make("", Op::Concat { axis }, parts, vec![output]));
        }
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use crate::backend::cpu::CpuBackend;
    use crate::exec::Executor;
    use crate::graph::infer::{bind, Bindings};
    use crate::graph::ir::Graph;
    use crate::op::{Op, SequenceOp};
    use crate::tensor::{DType, Tensor};
    use std::sync::Arc;

    /// x [3, 4] split by [1, 2] rows: the last part; split into single columns without keepdims,
    /// one column erased and one inserted at the front, then stacked along a new axis; and the
    /// sequence's length.
    #[test]
    fn sequences_resolve_into_the_tensors_they_hold() {
        let mut g = Graph::new("sequences", 18);
        let x = g.add_input("x", DType::F32, vec![crate::graph::ir::Dim::Fixed(3), crate::graph::ir::Dim::Fixed(4)]);
        let split = g.add_initializer("split", Tensor::from_vec(&[2], vec![1i64, 2]));
        let rows = g.op1("rows", Op::Sequence(SequenceOp::Split { axis: 0, keepdims: true }), &[x, split]);
        let last = g.add_initializer("last", Tensor::scalar(-1i64));
        let tail = g.op1("tail", Op::Sequence(SequenceOp::At), &[rows, last]);
        let cols = g.op1("cols", Op::Sequence(SequenceOp::Split { axis: 1, keepdims: false }), &[x]);
        let second = g.add_initializer("second", Tensor::scalar(1i64));
        let cols = g.op1("erase", Op::Sequence(SequenceOp::Erase), &[cols, second]);
        let first = g.add_initializer("first", Tensor::scalar(0i64));
        let row0 = g.op1("row0", Op::Sequence(SequenceOp::At), &[rows, first]);
        let row0 = g.op1("row0_flat", Op::Squeeze { axes: Some(vec![0]) }, &[row0]);
        let row0 =
            g.op1("row0_head", Op::Slice { starts: vec![0], ends: vec![3], axes: vec![0], steps: vec![1] }, &[row0]);
        let cols = g.op1("insert", Op::Sequence(SequenceOp::Insert), &[cols, row0, first]);
        let stacked = g.op1("stacked", Op::Sequence(SequenceOp::Concat { axis: -1, new_axis: true }), &[cols]);
        let len = g.op1("len", Op::Sequence(SequenceOp::Length), &[cols]);
        g.outputs = vec![tail, stacked, len];

        let bound = bind(&g, &Bindings::default(), false).unwrap();
        assert!(bound.nodes.iter().all(|n| !matches!(n.op, Op::Sequence(_))));
        let mut ex = Executor::new(Arc::new(CpuBackend::new()), bound, &[]).unwrap();
        let xs: Vec<f32> = (0..12).map(|v| v as f32).collect();
        ex.feed(x, &Tensor::from_vec(&[3, 4], xs)).unwrap();
        ex.run(1).unwrap();
        let tail = ex.fetch(tail).unwrap();
        assert_eq!(
            (tail.shape(), tail.as_slice::<f32>()),
            (&[2usize, 4][..], &[4.0f32, 5., 6., 7., 8., 9., 10., 11.][..])
        );
        // Columns 0, 2, 3 of x after row 0's first three elements, stacked as the last axis.
        let stacked = ex.fetch(stacked).unwrap();
        assert_eq!(stacked.shape(), &[3, 4]);
        assert_eq!(stacked.as_slice::<f32>(), &[0.0f32, 0., 2., 3., 1., 4., 6., 7., 2., 8., 10., 11.]);
        assert_eq!(ex.fetch(len).unwrap().to_i64_vec().unwrap(), vec![4]);
    }
}
