//! Einsum, written out when the graph is bound into ops the engine already has. Each operand's
//! repeated letters become its diagonal (Transpose, Reshape and a strided Slice); the letters
//! that neither another operand nor the output reads are summed at once (ReduceSum); then the
//! operands are contracted pairwise, left to right, each pair as one batched MatMul between
//! Transposes and Reshapes ([batch.., A's own, summed] · [batch.., summed, B's own]), or as a
//! broadcasting Mul where the pair sums no letter (outer and elementwise products). Those ops
//! have CPU and CUDA kernels and gradient rules, so training through an Einsum needs nothing
//! of its own.
//!
//! The notation (`Equation`) is the operator vocabulary's: `op::einsum`.

use super::infer::{constant_value, node1};
use super::ir::{Graph, Meta, Node, ValueId};
use crate::error::{Error, Result};
use crate::op::einsum::{show, Equation, Label, ELLIPSIS};
use crate::op::{Binary, Op, Reduce};
use crate::tensor::Tensor;
use std::collections::{BTreeMap, HashMap, HashSet};

fn err(node: &Node, msg: impl std::fmt::Display) -> Error {
    Error::Corrupt(format!("{}: {msg}", node.describe()))
}

/// A value on its way through the contraction: its labels (repeats until its diagonals are
/// taken) and its shape.
#[derive(Clone, Debug)]
struct Operand {
    v: ValueId,
    labels: Vec<Label>,
    shape: Vec<usize>,
}

impl Operand {
    fn dims(&self, labels: &[Label]) -> Vec<usize> {
        labels.iter().map(|l| self.shape[self.labels.iter().position(|m| m == l).expect("a label of x")]).collect()
    }
}

/// Rewrites one Einsum node into the nodes that compute it, to be bound in its place.
pub fn expand(
    g: &mut Graph,
    consts: &mut HashMap<ValueId, Tensor>,
    node: &Node,
    metas: &[Option<Meta>],
    equation: &str,
) -> Result<Vec<Node>> {
    let unsupported = |why: String| Error::Unsupported(format!("{}: equation '{equation}': {why}", node.describe()));
    let eq = Equation::parse(equation).map_err(unsupported)?;
    let output_v = node.output(0).ok_or_else(|| err(node, "no output"))?;
    let (operands, rank) = label_operands(node, &eq, metas)?;
    let output = output_labels(&eq, rank).map_err(unsupported)?;
    let sizes = sizes(node, &operands)?;
    let all: Vec<Vec<Label>> = operands.iter().map(|x| x.labels.clone()).collect();
    let mut w = Writer { g, consts, node, nodes: vec![] };
    let mut prepared = Vec::with_capacity(operands.len());
    for (i, x) in operands.into_iter().enumerate() {
        let x = w.diagonals(x);
        let read_elsewhere =
            |l: Label| output.contains(&l) || all.iter().enumerate().any(|(j, o)| j != i && o.contains(&l));
        let x = w.sum_unless(x, read_elsewhere);
        prepared.push(w.broadcast(x, &sizes));
    }
    let mut prepared = prepared.into_iter();
    let mut acc = prepared.next().ok_or_else(|| err(node, "no operands"))?;
    for (i, b) in prepared.enumerate() {
        // Operand i + 1 joins; the output and the operands after it read the labels kept.
        let later: HashSet<Label> = output.iter().chain(all[i + 2..].iter().flatten()).copied().collect();
        acc = w.contract(acc, b, &|l| later.contains(&l));
    }
    let acc = w.transpose(acc, &output);
    w.nodes.push(node1(node.name.clone(), Op::Identity, &[acc.v], output_v));
    Ok(w.nodes)
}

/// The operands with their labels: each term against its operand's rank, the ellipses aligned
/// on the right of the broadcast ellipsis, whose rank comes second.
fn label_operands(node: &Node, eq: &Equation, metas: &[Option<Meta>]) -> Result<(Vec<Operand>, usize)> {
    if eq.inputs.len() != node.inputs.len() {
        let (t, n) = (eq.inputs.len(), node.inputs.len());
        return Err(err(node, format!("the equation has {t} terms for {n} operands")));
    }
    let mut dtype = None;
    let mut covered = Vec::with_capacity(node.inputs.len());
    let mut given = Vec::with_capacity(node.inputs.len());
    for (k, term) in eq.inputs.iter().enumerate() {
        let (Some(v), Some(Some(m))) = (node.input(k), metas.get(k)) else {
            return Err(err(node, format!("operand {k} is missing")));
        };
        let first = *dtype.get_or_insert(m.dtype);
        if m.dtype != first {
            return Err(err(node, format!("operand {k} is {}; operand 0 is {first}", m.dtype)));
        }
        let (letters, r) = (term.letters.len(), m.shape.len());
        covered.push(match term.ellipsis {
            None if r == letters => 0,
            Some(_) if r >= letters => r - letters,
            _ => return Err(err(node, format!("term '{term}' does not fit operand {k} of shape {:?}", m.shape))),
        });
        given.push((v, m.shape.clone()));
    }
    let rank = covered.iter().copied().max().unwrap_or(0);
    let operands = eq.inputs.iter().zip(covered).zip(given);
    Ok((operands.map(|((term, c), (v, shape))| Operand { v, labels: term.labels(c, rank), shape }).collect(), rank))
}

/// The output's labels: the explicit term's, or the ellipsis's then the letters that appear
/// once, in alphabetical (ASCII) order.
fn output_labels(eq: &Equation, rank: usize) -> std::result::Result<Vec<Label>, String> {
    match &eq.output {
        Some(term) if term.ellipsis.is_none() && rank > 0 => Err(format!(
            "the operands' ellipsis covers {rank} dims, which the output leaves out; only outputs that keep \
             them (with '...') are supported"
        )),
        Some(term) => Ok(term.labels(rank, rank)),
        None => {
            let mut count: BTreeMap<u8, usize> = BTreeMap::new();
            for &c in eq.inputs.iter().flat_map(|t| t.letters.iter()) {
                *count.entry(c).or_default() += 1;
            }
            let once = count.into_iter().filter(|&(_, n)| n == 1).map(|(c, _)| c as Label);
            Ok((0..rank as Label).map(|j| ELLIPSIS + j).chain(once).collect())
        }
    }
}

/// Each label's size, the same wherever it appears; an ellipsis's dim of 1 broadcasts.
fn sizes(node: &Node, operands: &[Operand]) -> Result<BTreeMap<Label, usize>> {
    let mut sizes = BTreeMap::new();
    for (k, x) in operands.iter().enumerate() {
        for (&l, &n) in x.labels.iter().zip(&x.shape) {
            let size = sizes.entry(l).or_insert(n);
            match (*size, n) {
                (m, n) if m == n => {}
                (1, n) | (n, 1) if l >= ELLIPSIS => *size = n,
                (m, n) => {
                    return Err(err(node, format!("{} is {m} long elsewhere but {n} in operand {k}", show(l))));
                }
            }
        }
    }
    Ok(sizes)
}

/// Writes nodes named after the Einsum's node, each making one fresh value.
struct Writer<'a> {
    g: &'a mut Graph,
    consts: &'a mut HashMap<ValueId, Tensor>,
    node: &'a Node,
    nodes: Vec<Node>,
}

impl Writer<'_> {
    fn op(&mut self, what: &str, op: Op, inputs: &[ValueId]) -> ValueId {
        let name = format!("{}:{what}{}", self.node.name, self.nodes.len());
        let out = self.g.fresh(&name);
        self.nodes.push(node1(name, op, inputs, out));
        out
    }

    /// A shape operand (of Reshape or Expand).
    fn shape(&mut self, dims: &[usize]) -> ValueId {
        let t = Tensor::from_vec(&[dims.len()], dims.iter().map(|&d| d as i64).collect::<Vec<_>>());
        constant_value(self.g, self.consts, &format!("{}:shape{}", self.node.name, self.nodes.len()), t)
    }

    fn reshape(&mut self, v: ValueId, from: &[usize], to: &[usize]) -> ValueId {
        if from == to {
            return v;
        }
        let shape = self.shape(to);
        self.op("reshape", Op::Reshape, &[v, shape])
    }

    /// `x` with its dims in the order `perm` gives (positions, as Transpose's perm).
    fn permute(&mut self, x: Operand, perm: &[usize]) -> Operand {
        if perm.iter().enumerate().all(|(k, &p)| k == p) {
            return x;
        }
        let op = Op::Transpose { perm: Some(perm.iter().map(|&p| p as i64).collect()) };
        let v = self.op("transpose", op, &[x.v]);
        Operand {
            v,
            labels: perm.iter().map(|&p| x.labels[p]).collect(),
            shape: perm.iter().map(|&p| x.shape[p]).collect(),
        }
    }

    /// `x` with its (distinct) labels in the order of `labels`.
    fn transpose(&mut self, x: Operand, labels: &[Label]) -> Operand {
        let perm: Vec<usize> =
            labels.iter().map(|l| x.labels.iter().position(|m| m == l).expect("a permutation of x's labels")).collect();
        self.permute(x, &perm)
    }

    /// `x` with each repeated label down to its diagonal: the pair of dims moved last, viewed as
    /// one dim of n² elements, of which every (n + 1)-th is on the diagonal.
    fn diagonals(&mut self, mut x: Operand) -> Operand {
        while let Some((p, q)) = first_repeat(&x.labels) {
            let (label, n, r) = (x.labels[p], x.shape[p], x.labels.len());
            let perm: Vec<usize> = (0..r).filter(|&d| d != p && d != q).chain([p, q]).collect();
            let x2 = self.permute(x, &perm);
            let mut flat = x2.shape[..r - 2].to_vec();
            flat.push(n * n);
            let v = self.reshape(x2.v, &x2.shape, &flat);
            let (end, step) = ((n * n) as i64, n as i64 + 1);
            let slice = Op::Slice { starts: vec![0], ends: vec![end], axes: vec![(r - 2) as i64], steps: vec![step] };
            let v = self.op("diagonal", slice, &[v]);
            let (mut labels, mut shape) = (x2.labels[..r - 2].to_vec(), x2.shape[..r - 2].to_vec());
            labels.push(label);
            shape.push(n);
            x = Operand { v, labels, shape };
        }
        x
    }

    /// `x` summed over the labels `keep` rejects.
    fn sum_unless(&mut self, x: Operand, keep: impl Fn(Label) -> bool) -> Operand {
        let axes: Vec<i64> = (0..x.labels.len()).filter(|&d| !keep(x.labels[d])).map(|d| d as i64).collect();
        if axes.is_empty() {
            return x;
        }
        let op = Op::ReduceOp { kind: Reduce::Sum, axes: Some(axes), keepdims: false, noop_with_empty_axes: false };
        let v = self.op("sum", op, &[x.v]);
        let (labels, shape) = x.labels.iter().zip(&x.shape).filter(|(&l, _)| keep(l)).map(|(&l, &n)| (l, n)).unzip();
        Operand { v, labels, shape }
    }

    /// `x` expanded where an ellipsis's dim of 1 broadcasts against a longer one, so that every
    /// operand holds each of its labels at its full size.
    fn broadcast(&mut self, x: Operand, sizes: &BTreeMap<Label, usize>) -> Operand {
        let full: Vec<usize> = x.labels.iter().map(|l| sizes[l]).collect();
        if full == x.shape {
            return x;
        }
        let shape = self.shape(&full);
        let v = self.op("broadcast", Op::Expand, &[x.v, shape]);
        Operand { v, labels: x.labels, shape: full }
    }

    /// a and b (distinct labels each) as one operand labelled batch, a's own, b's own: the
    /// labels they share and `later` reads are the batch; the shared ones it does not read are
    /// summed over, as are those that only one of them has and `later` does not read.
    fn contract(&mut self, a: Operand, b: Operand, later: &dyn Fn(Label) -> bool) -> Operand {
        let (a_labels, b_labels) = (a.labels.clone(), b.labels.clone());
        let a = self.sum_unless(a, |l| later(l) || b_labels.contains(&l));
        let b = self.sum_unless(b, |l| later(l) || a_labels.contains(&l));
        let pick = |x: &Operand, f: &dyn Fn(Label) -> bool| -> Vec<Label> {
            x.labels.iter().copied().filter(|&l| f(l)).collect()
        };
        let batch = pick(&a, &|l| b.labels.contains(&l) && later(l));
        let summed = pick(&a, &|l| b.labels.contains(&l) && !later(l));
        let own_a = pick(&a, &|l| !b.labels.contains(&l));
        let own_b = pick(&b, &|l| !a.labels.contains(&l));
        let (batch_dims, dims_a, dims_b) = (a.dims(&batch), a.dims(&own_a), b.dims(&own_b));
        let labels = [&batch[..], &own_a, &own_b].concat();
        let shape = [&batch_dims[..], &dims_a, &dims_b].concat();
        let a = self.transpose(a, &[&batch[..], &own_a, &summed].concat());
        let b = self.transpose(b, &[&batch[..], &summed, &own_b].concat());
        let v = if summed.is_empty() {
            // [batch, A's own, 1…] ⊙ [batch, 1…, B's own].
            let ones = |n: usize| vec![1; n];
            let a_view = [&batch_dims[..], &dims_a, &ones(own_b.len())].concat();
            let b_view = [&batch_dims[..], &ones(own_a.len()), &dims_b].concat();
            let (va, vb) = (self.reshape(a.v, &a.shape, &a_view), self.reshape(b.v, &b.shape, &b_view));
            self.op("product", Op::Binary(Binary::Mul), &[va, vb])
        } else {
            // [batch, M, K] · [batch, K, N], M, K and N each a product of labels' sizes.
            let (m, k, n) = (dims_a.iter().product(), a.dims(&summed).iter().product(), dims_b.iter().product());
            let a_view = [&batch_dims[..], &[m, k]].concat();
            let b_view = [&batch_dims[..], &[k, n]].concat();
            let (va, vb) = (self.reshape(a.v, &a.shape, &a_view), self.reshape(b.v, &b.shape, &b_view));
            let p = self.op("matmul", Op::MatMul, &[va, vb]);
            self.reshape(p, &[&batch_dims[..], &[m, n]].concat(), &shape)
        };
        Operand { v, labels, shape }
    }
}

/// The first pair of positions that hold the same label.
fn first_repeat(labels: &[Label]) -> Option<(usize, usize)> {
    (0..labels.len()).find_map(|q| labels[..q].iter().position(|&l| l == labels[q]).map(|p| (p, q)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::exec::Executor;
    use crate::graph::infer::{bind, Bindings};
    use crate::graph::ir::Dim;
    use std::sync::Arc;

    /// Binds and runs one Einsum node on `inputs`.
    fn einsum(equation: &str, inputs: &[Tensor]) -> Result<Tensor> {
        let mut g = Graph::new("einsum", 12);
        let ins: Vec<ValueId> = inputs
            .iter()
            .enumerate()
            .map(|(k, t)| g.add_input(&format!("x{k}"), t.dtype(), t.shape().iter().map(|&d| Dim::Fixed(d)).collect()))
            .collect();
        let y = g.op1("e", Op::Einsum { equation: equation.into() }, &ins);
        g.outputs = vec![y];
        let bound = bind(&g, &Bindings::default(), false)?;
        let mut ex = Executor::new(Arc::new(CpuBackend::new()), bound, &[])?;
        for (&v, t) in ins.iter().zip(inputs) {
            ex.feed(v, t)?;
        }
        ex.run(0)?;
        ex.fetch(y)
    }

    /// Einsum by its definition, for equations of letters only: every assignment of the letters'
    /// values, each output element the sum of the operands' products at the ones that agree.
    fn reference(equation: &str, inputs: &[Tensor]) -> Tensor {
        let eq = Equation::parse(equation).unwrap();
        let mut size: BTreeMap<u8, usize> = BTreeMap::new();
        for (term, t) in eq.inputs.iter().zip(inputs) {
            for (&c, &n) in term.letters.iter().zip(t.shape()) {
                size.insert(c, n);
            }
        }
        let out: Vec<u8> = match &eq.output {
            Some(t) => t.letters.clone(),
            None => size
                .keys()
                .copied()
                .filter(|c| eq.inputs.iter().flat_map(|t| &t.letters).filter(|&d| d == c).count() == 1)
                .collect(),
        };
        let letters: Vec<u8> = size.keys().copied().collect();
        let out_shape: Vec<usize> = out.iter().map(|c| size[c]).collect();
        let mut y = vec![0f64; out_shape.iter().product()];
        let vals: Vec<Vec<f64>> = inputs.iter().map(|t| t.to_f64_vec()).collect();
        let total: usize = letters.iter().map(|c| size[c]).product();
        for mut at in 0..total {
            let mut value = BTreeMap::new();
            for c in letters.iter().rev() {
                value.insert(*c, at % size[c]);
                at /= size[c];
            }
            let offset = |cs: &[u8], shape: &[usize]| cs.iter().zip(shape).fold(0, |o, (c, &n)| o * n + value[c]);
            let product: f64 = eq
                .inputs
                .iter()
                .zip(inputs)
                .zip(&vals)
                .map(|((term, t), v)| v[offset(&term.letters, t.shape())])
                .product();
            y[offset(&out, &out_shape)] += product;
        }
        Tensor::from_vec(&out_shape, y)
    }

    fn values(shape: &[usize], seed: usize) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_vec(shape, (0..n).map(|i| ((i * 7 + seed * 13) % 11) as f64 / 4.0 - 1.2).collect::<Vec<f64>>())
    }

    fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
        assert_eq!(got.shape(), want.shape(), "{what}");
        for (k, (a, b)) in got.to_f64_vec().iter().zip(want.to_f64_vec()).enumerate() {
            assert!((a - b).abs() < 1e-9 * (1.0 + b.abs()), "{what}: element {k}: {a} against {b}");
        }
    }

    #[test]
    fn equations_of_letters_match_their_definition() {
        let cases: &[(&str, &[&[usize]])] = &[
            ("ij->ji", &[&[3, 4]]),
            ("ij->i", &[&[3, 4]]),
            ("ij", &[&[3, 4]]),
            ("ji", &[&[3, 4]]),
            ("ii->i", &[&[4, 4]]),
            ("ii", &[&[4, 4]]),
            ("iji->ij", &[&[3, 2, 3]]),
            ("iii->i", &[&[3, 3, 3]]),
            ("i,i", &[&[5], &[5]]),
            ("i,j->ij", &[&[3], &[4]]),
            ("ij,ij->ij", &[&[2, 3], &[2, 3]]),
            ("bij,bjk->bik", &[&[2, 3, 4], &[2, 4, 5]]),
            ("ij,jk", &[&[2, 3], &[3, 4]]),
            ("ij,jk->i", &[&[2, 3], &[3, 4]]),
            ("ij,kj->", &[&[2, 3], &[4, 3]]),
            ("bhqd,bhkd->bhqk", &[&[2, 2, 3, 4], &[2, 2, 5, 4]]),
            ("ab,bc,cd->ad", &[&[2, 3], &[3, 4], &[4, 2]]),
            ("ab,cd,ac->bd", &[&[2, 3], &[4, 5], &[2, 4]]),
            ("ii,ij->j", &[&[3, 3], &[3, 2]]),
            ("Ab,bA->A", &[&[2, 3], &[3, 2]]),
            (",i->i", &[&[], &[3]]),
        ];
        for &(equation, shapes) in cases {
            let inputs: Vec<Tensor> = shapes.iter().enumerate().map(|(k, s)| values(s, k)).collect();
            let got = einsum(equation, &inputs).unwrap_or_else(|e| panic!("{equation}: {e}"));
            assert_close(equation, &got, &reference(equation, &inputs));
        }
    }

    /// An ellipsis stands for the same dims as letters would, broadcast across the operands.
    #[test]
    fn ellipses_broadcast_as_letters_would() {
        let (a, b) = (values(&[2, 3, 4], 1), values(&[2, 4, 5], 2));
        let want = einsum("bij,bjk->bik", &[a.clone(), b.clone()]).unwrap();
        assert_close("...ij,...jk", &einsum("...ij,...jk->...ik", &[a.clone(), b.clone()]).unwrap(), &want);
        assert_close("implicit", &einsum("...ij,...jk", &[a, b]).unwrap(), &want);
        let x = values(&[3, 5, 5], 3);
        assert_close(
            "...ii->...i",
            &einsum("...ii->...i", std::slice::from_ref(&x)).unwrap(),
            &einsum("bii->bi", &[x]).unwrap(),
        );
        // [2, 1, 3] against [4, 3]: the ellipsis is [2, 4].
        let (p, q) = (values(&[2, 1, 3], 4), values(&[4, 3], 5));
        let wide =
            Tensor::from_vec(&[2, 4, 3], (0..24).map(|i| p.to_f64_vec()[(i / 12) * 3 + i % 3]).collect::<Vec<_>>());
        let got = einsum("...i,...i->...", &[p, q.clone()]).unwrap();
        assert_close("broadcast", &got, &reference("abi,bi->ab", &[wide, q]));
    }

    #[test]
    fn what_is_not_einsum_or_not_supported_is_refused() {
        for bad in ["ij->kk", "i.j", "i->j", "i...j...", "ij->i->j", "i1"] {
            assert!(Equation::parse(bad).is_err(), "{bad}");
        }
        let x = values(&[2, 3, 4], 1);
        let e = einsum("...ij->ij", std::slice::from_ref(&x)).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains("'e'"), "{e}");
        assert!(einsum("ij->ij", &[x]).is_err(), "a term of 2 letters for a rank-3 operand");
        assert!(einsum("ij,jk->ik", &[values(&[2, 3], 0), values(&[4, 2], 1)]).is_err(), "j is 3 and 4");
        let ints = Tensor::from_vec(&[2, 2], vec![1i64, 2, 3, 4]);
        assert_eq!(einsum("ij,jk", &[ints.clone(), ints]).unwrap().to_f64_vec(), vec![7.0, 10.0, 15.0, 22.0]);
    }
}
