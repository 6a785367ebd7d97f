//! Tensor parallelism, Megatron-style, as a pass over a bound forward graph (as ONNX Runtime's
//! Megatron transformer rewrites a graph): the same pass shards the builtin GPT-2 and Llama and
//! the ones exported from PyTorch, since all are found by the shape of their dataflow, not by
//! names.
//!
//! What it finds and how it splits it over the `size` ranks of a tensor-parallel group:
//! - **column → row pairs** (attention, MLP): a MatMul of a replicated activation by a weight
//!   (`x·W`, or `x·Wᵀ` with W behind a Transpose, as PyTorch exports nn.Linear) starts a region
//!   whose output columns are split; head-local ops (bias, Split into q/k/v, Reshape into heads,
//!   Transpose, a Reshape that folds the heads into the batch and back, RoPE's Slice/Concat
//!   halves, the Expand that repeats kv-heads, the q·kᵀ and p·v
//!   MatMuls, scale, mask, Softmax, GELU) keep the split; column regions that an op joins (Llama's
//!   separate q, k and v products at q·kᵀ, SwiGLU's gate and up at their Mul) merge into one
//!   region, whose every column MatMul gets the input copy; a MatMul of
//!   the split activation by a second weight (split by rows) ends it with a partial sum that an
//!   all-reduce completes (Megatron's `g`). Its input gets a `TensorParallelCopy` (Megatron's
//!   `f`: identity forward, all-reduce of the gradient backward).
//! - **vocab-parallel embedding**: a Gather of a table's rows by indices from the batch; each rank
//!   holds a contiguous range of rows, looks up the ids in its range (zero rows elsewhere) and
//!   an all-reduce sums the ranks' rows.
//! - **vocab-parallel cross-entropy**: a column region (the LM head) that ends in
//!   SoftmaxCrossEntropyLoss over [N, V]: the loss is computed from each rank's slice of the
//!   classes with three all-reduces per row (max, Σexp, target logit), never gathering logits.
//!
//! A region that meets anything else (LayerNorm, a graph output, dropout inside it, a weight used
//! elsewhere unsplit) stays replicated, and so does every region sharing a weight with it; the
//! pass iterates until the split weights are consistent. A weight's split is a [`TensorSplit`]:
//! an axis cut into `blocks` equal blocks (3 for a fused q/k/v weight), each divided among the
//! ranks as evenly as possible (the first ranks get one more when it does not divide; only
//! vocabularies are allowed not to divide).

use crate::comm::ReduceOp;
use crate::error::{Error, Result};
use crate::graph::ir::{Graph, Meta, Node, ValueId};
use crate::op::{Op, Reduce};
use crate::tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;

/// Items `[start, end)` of `n` that rank `rank` of `size` holds: contiguous, the first
/// `n % size` ranks one more.
pub fn share(n: usize, rank: usize, size: usize) -> Range<usize> {
    let (base, extra) = (n / size, n % size);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// How a weight of the whole model is divided among the ranks of a tensor-parallel group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TensorSplit {
    /// The whole weight's shape.
    pub shape: Vec<usize>,
    pub axis: usize,
    /// Equal blocks of the axis, each divided among the ranks (3 for a fused q/k/v weight).
    pub blocks: usize,
}

impl TensorSplit {
    /// The ranges of `axis` that rank `rank` of `size` holds, one per block.
    pub fn ranges(&self, rank: usize, size: usize) -> Vec<Range<usize>> {
        let block = self.shape[self.axis] / self.blocks;
        (0..self.blocks)
            .map(|b| {
                let r = share(block, rank, size);
                b * block + r.start..b * block + r.end
            })
            .collect()
    }

    /// The shape of rank `rank`'s shard.
    pub fn local_shape(&self, rank: usize, size: usize) -> Vec<usize> {
        let mut s = self.shape.clone();
        s[self.axis] = self.ranges(rank, size).iter().map(|r| r.len()).sum();
        s
    }

    /// (outer count, bytes of one index of `axis`): the axis seen as rows of contiguous bytes.
    fn strides(&self, elem: usize) -> (usize, usize) {
        let outer = self.shape[..self.axis].iter().product();
        let inner = self.shape[self.axis + 1..].iter().product::<usize>() * elem;
        (outer, inner)
    }

    /// Rank `rank`'s shard of the whole tensor `full` (any element type; a flat tensor of the
    /// right size is read in the whole shape).
    pub fn slice(&self, full: &Tensor, rank: usize, size: usize) -> Result<Tensor> {
        if full.numel() != self.shape.iter().product::<usize>() {
            return Err(Error::Corrupt(format!(
                "a tensor of shape {:?} cannot be split as one of shape {:?}",
                full.shape(),
                self.shape
            )));
        }
        let elem = full.dtype().size();
        let (outer, inner) = self.strides(elem);
        let n = self.shape[self.axis];
        let ranges = self.ranges(rank, size);
        let src = full.bytes();
        let mut out = Vec::with_capacity(full.byte_len() / size + inner);
        for o in 0..outer {
            for r in &ranges {
                out.extend_from_slice(&src[(o * n + r.start) * inner..(o * n + r.end) * inner]);
            }
        }
        Ok(Tensor::from_bytes(full.dtype(), &self.local_shape(rank, size), &out).expect("sized above"))
    }

    /// The whole tensor from every rank's shard, in rank order (shards may be flat).
    pub fn join(&self, shards: &[Tensor]) -> Result<Tensor> {
        let size = shards.len();
        let Some(first) = shards.first() else {
            return Err(Error::Corrupt("no shards to join".into()));
        };
        let elem = first.dtype().size();
        let (outer, inner) = self.strides(elem);
        let n = self.shape[self.axis];
        let mut out = vec![0u8; outer * n * inner];
        for (rank, t) in shards.iter().enumerate() {
            let want: usize = self.local_shape(rank, size).iter().product();
            if t.numel() != want || t.dtype() != first.dtype() {
                return Err(Error::Corrupt(format!(
                    "the shard of tensor-parallel rank {rank} is {}{:?}; {} elements of {} expected",
                    t.dtype(),
                    t.shape(),
                    want,
                    first.dtype()
                )));
            }
            let src = t.bytes();
            let mut at = 0;
            for o in 0..outer {
                for r in self.ranges(rank, size) {
                    let len = r.len() * inner;
                    out[(o * n + r.start) * inner..(o * n + r.start) * inner + len].copy_from_slice(&src[at..at + len]);
                    at += len;
                }
            }
        }
        Ok(Tensor::from_bytes(first.dtype(), &self.shape, &out).expect("sized above"))
    }
}

/// A value inside a region: split along `axis`; `blocked` while the axis is still made of the
/// region's blocks (before the Split that separates q, k and v); `folded` runs of the split
/// dimension make up the axis, each split alike, where a Reshape folded the axes before it into
/// it (the dynamo exporter's attention folds heads into the batch: [B, H, T, D] → [B·H, T, D]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sharded {
    axis: usize,
    region: usize,
    blocked: bool,
    folded: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// A MatMul whose output is a partial sum to all-reduce.
    Row,
    /// SoftmaxCrossEntropyLoss over class slices.
    Loss,
}

#[derive(Debug, Default)]
struct Region {
    /// The column MatMul, or the embedding Gather.
    start: usize,
    /// The column MatMuls of regions merged into this one (Llama's separate q, k and v
    /// products, which attention joins; SwiGLU's gate and up, which a Mul joins).
    merged_starts: Vec<usize>,
    /// Merged into another region: nothing of its own is left.
    absorbed: bool,
    embedding: bool,
    /// Blocks of the column axis (a Split into equal parts sets it; anything else fixes it at 1).
    blocks: Option<usize>,
    /// (weight, axis of the weight, blocked) for every weight the region splits.
    weights: Vec<(ValueId, usize, bool)>,
    /// Nodes that read a split weight (directly or through its Transpose).
    weight_uses: Vec<usize>,
    ends: Vec<(usize, End)>,
    /// Why the region cannot be split; None while it can.
    invalid: Option<String>,
}

/// What one analysis pass found.
struct Analysis {
    regions: Vec<Region>,
    values: HashMap<ValueId, Sharded>,
    /// Activations that get a TensorParallelCopy, per column MatMul: (node, input position).
    copies: Vec<(usize, usize)>,
}

/// `v` as a weight: an f32 initializer, or a Transpose ([1, 0]) of one. Returns the
/// initializer, the Transpose node (if any), and which of its axes is `v`'s axis `axis`.
fn weight_ref(
    g: &Graph,
    producers: &[Option<usize>],
    v: ValueId,
    axis: usize,
) -> Option<(ValueId, Option<usize>, usize)> {
    let is_weight = |w: ValueId| g.initializers.get(&w).is_some_and(|t| t.dtype().is_float() && t.shape().len() <= 2);
    if is_weight(v) {
        return Some((v, None, axis));
    }
    let n = producers[v]?;
    let node = &g.nodes[n];
    match &node.op {
        Op::Transpose { perm } if perm.as_deref().is_none_or(|p| p == [1, 0]) => {
            let w = node.input(0)?;
            (is_weight(w) && g.initializers[&w].shape().len() == 2).then_some((w, Some(n), 1 - axis))
        }
        _ => None,
    }
}

fn analyse(g: &Graph, loss: ValueId, size: usize, disabled: &HashSet<usize>) -> Analysis {
    let producers = g.producers();
    let batch_inputs: HashSet<ValueId> = g.inputs.iter().map(|d| d.value).collect();
    let mut a = Analysis { regions: vec![], values: HashMap::new(), copies: vec![] };
    let meta = |v: ValueId| g.meta(v).cloned().expect("bound");
    for (i, node) in g.nodes.iter().enumerate() {
        let sharded: Vec<Option<Sharded>> =
            node.inputs.iter().map(|x| x.and_then(|v| a.values.get(&v).copied())).collect();
        let first_sharded = sharded.iter().flatten().next().copied();
        // A fresh region at a column MatMul or an embedding Gather of replicated inputs.
        if first_sharded.is_none() && !disabled.contains(&i) {
            match &node.op {
                Op::MatMul => {
                    let (x, w) = (node.input(0), node.input(1));
                    let (Some(x), Some(w)) = (x, w) else { continue };
                    let out = node.output(0).expect("MatMul has an output");
                    let rank = meta(out).shape.len();
                    if g.initializers.contains_key(&x) || rank < 2 {
                        continue;
                    }
                    if let Some((weight, transpose, axis)) = weight_ref(g, &producers, w, 1) {
                        let r = a.regions.len();
                        let mut region = Region { start: i, ..Default::default() };
                        region.weights.push((weight, axis, true));
                        region.weight_uses.push(i);
                        region.weight_uses.extend(transpose);
                        a.regions.push(region);
                        a.values.insert(out, Sharded { axis: rank - 1, region: r, blocked: true, folded: 1 });
                        a.copies.push((i, 0));
                    }
                }
                // A padded embedding (model.onnx.paddingIdx) stays whole on every rank.
                Op::Gather { axis: 0, padding_row: None } => {
                    let (Some(table), Some(ids)) = (node.input(0), node.input(1)) else { continue };
                    let is_table =
                        g.initializers.get(&table).is_some_and(|t| t.dtype().is_float() && t.shape().len() == 2);
                    if is_table && batch_inputs.contains(&ids) {
                        let mut region = Region { start: i, embedding: true, blocks: Some(1), ..Default::default() };
                        region.weights.push((table, 0, false));
                        region.weight_uses.push(i);
                        region.ends.push((i, End::Row));
                        a.regions.push(region);
                    }
                }
                _ => {}
            }
            continue;
        }
        let Some(s) = first_sharded else { continue };
        let r = s.region;
        let invalid = |a: &mut Analysis, why: String| {
            if a.regions[r].invalid.is_none() {
                a.regions[r].invalid = Some(why);
            }
        };
        // Sharded inputs from several regions join them into one, if each can still be split.
        let others: HashSet<usize> = sharded.iter().flatten().map(|x| x.region).filter(|&x| x != r).collect();
        if !others.is_empty() {
            if others.iter().chain([&r]).any(|&x| a.regions[x].invalid.is_some()) {
                for x in others.into_iter().chain([r]) {
                    a.regions[x].invalid.get_or_insert_with(|| format!("{} joins two split regions", node.describe()));
                }
                continue;
            }
            for other in others {
                merge(&mut a, r, other);
            }
        }
        let sharded: Vec<Option<Sharded>> =
            node.inputs.iter().map(|x| x.and_then(|v| a.values.get(&v).copied())).collect();
        let out_meta = |k: usize| node.output(k).map(meta);
        let mark_folded = |a: &mut Analysis, v: Option<ValueId>, axis: usize, blocked: bool, folded: usize| {
            if let Some(v) = v {
                a.values.insert(v, Sharded { axis, region: r, blocked, folded });
            }
        };
        let mark = |a: &mut Analysis, v: Option<ValueId>, axis: usize, blocked: bool| {
            mark_folded(a, v, axis, blocked, s.folded)
        };
        match &node.op {
            Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } | Op::Identity => {
                let out = out_meta(0).expect("an output");
                let ro = out.shape.len();
                // Inputs broadcast against the output from the right: the split axis in its terms.
                let k0 = sharded.iter().position(Option::is_some).expect("an input is split");
                let axis = s.axis + ro - meta(node.input(k0).expect("a split input")).shape.len();
                let mut ok = true;
                for (k, x) in node.inputs.iter().enumerate() {
                    let Some(x) = *x else { continue };
                    let xm = meta(x);
                    let offset = ro - xm.shape.len();
                    match sharded[k] {
                        Some(xs) => ok &= xs.axis + offset == axis && xs.blocked == s.blocked && xs.folded == s.folded,
                        None if axis < offset || xm.shape[axis - offset] == 1 => {}
                        None => match weight_ref(g, &producers, x, axis - offset) {
                            // A bias over the split axis: split with it.
                            Some((w, None, waxis)) if s.folded == 1 => {
                                a.regions[r].weights.push((w, waxis, s.blocked));
                                a.regions[r].weight_uses.push(i);
                            }
                            _ => ok = false,
                        },
                    }
                }
                if ok {
                    mark(&mut a, node.output(0), axis, s.blocked);
                } else {
                    invalid(&mut a, format!("{} mixes the split axis with an unsplit value", node.describe()));
                }
            }
            // (Whether or not it trains: the training and evaluation graphs must split alike.)
            Op::Dropout { ratio, .. } if *ratio > 0.0 => {
                invalid(&mut a, format!("{}: dropout inside a split region would draw other masks", node.describe()))
            }
            Op::Dropout { .. } => mark(&mut a, node.output(0), s.axis, s.blocked),
            Op::Softmax { axis } | Op::LogSoftmax { axis } => {
                let rank = meta(node.input(0).unwrap()).shape.len();
                if crate::shape::norm_axis(*axis, rank) == Some(s.axis) {
                    invalid(&mut a, format!("{} normalizes over the split axis", node.describe()));
                } else {
                    mark(&mut a, node.output(0), s.axis, s.blocked);
                }
            }
            Op::Transpose { perm } => {
                let rank = meta(node.input(0).unwrap()).shape.len();
                let perm: Vec<usize> = perm
                    .as_ref()
                    .map_or_else(|| (0..rank).rev().collect(), |p| p.iter().map(|&x| x as usize).collect());
                let axis = perm.iter().position(|&p| p == s.axis).expect("a permutation");
                mark(&mut a, node.output(0), axis, s.blocked);
            }
            Op::Split { axis, sizes, .. } => {
                let rank = meta(node.input(0).unwrap()).shape.len();
                let split_axis = crate::shape::norm_axis(*axis, rank);
                if split_axis == Some(s.axis) {
                    let k = node.outputs.len();
                    let equal = sizes.windows(2).all(|w| w[0] == w[1]);
                    let region = &mut a.regions[r];
                    if !s.blocked || !equal || s.folded > 1 || region.blocks.is_some_and(|b| b != k) {
                        invalid(&mut a, format!("{} splits the split axis unevenly", node.describe()));
                        continue;
                    }
                    region.blocks = Some(k);
                    for o in node.outputs.clone() {
                        mark(&mut a, o, s.axis, false);
                    }
                } else {
                    for o in node.outputs.clone() {
                        mark(&mut a, o, s.axis, s.blocked);
                    }
                }
            }
            // Slices of the head dimension (RoPE's halves, as Hugging Face's rotate_half cuts them).
            Op::Slice { axes, steps, .. } => {
                let (x, y) = (meta(node.input(0).unwrap()), out_meta(0).unwrap());
                let on_split = axes.iter().position(|&ax| ax as usize == s.axis);
                let whole = on_split.is_none_or(|k| steps[k] == 1 && x.shape[s.axis] == y.shape[s.axis]);
                if whole {
                    mark(&mut a, node.output(0), s.axis, s.blocked);
                } else {
                    invalid(&mut a, format!("{} slices the split axis", node.describe()));
                }
            }
            // RoPE's rotate-half: halves of the head dimension, concatenated back.
            Op::Concat { axis } => {
                let rank = meta(node.input(0).unwrap()).shape.len();
                let alike = sharded
                    .iter()
                    .all(|x| x.is_some_and(|x| x.axis == s.axis && x.blocked == s.blocked && x.folded == s.folded));
                if alike && crate::shape::norm_axis(*axis, rank) != Some(s.axis) {
                    mark(&mut a, node.output(0), s.axis, s.blocked);
                } else {
                    invalid(&mut a, format!("{} concatenates split and unsplit values", node.describe()));
                }
            }
            // Grouped-query attention's repeat of each kv-head, along an axis that is not split.
            Op::Expand => {
                let (x, y) = (meta(node.input(0).unwrap()), out_meta(0).unwrap());
                let axis = s.axis + y.shape.len() - x.shape.len();
                if y.shape[axis] == x.shape[s.axis] {
                    mark(&mut a, node.output(0), axis, s.blocked);
                } else {
                    invalid(&mut a, format!("{} broadcasts the split axis", node.describe()));
                }
            }
            Op::Reshape => {
                let (x, y) = (meta(node.input(0).unwrap()), out_meta(0).unwrap());
                let unblocked = !s.blocked || a.regions[r].blocks.unwrap_or(1) == 1;
                let carried = match s.folded {
                    1 => reshape_axis(&x.shape, &y.shape, s.axis, size).map(|axis| (axis, 1)),
                    _ => None,
                };
                match carried.or_else(|| fold_axis(&x.shape, &y.shape, s.axis, s.folded)) {
                    Some((axis, folded)) if unblocked => {
                        if s.blocked {
                            a.regions[r].blocks = Some(1);
                        }
                        let blocked = s.blocked && x.shape[s.axis] == y.shape[axis];
                        mark_folded(&mut a, node.output(0), axis, blocked, folded);
                    }
                    _ => invalid(&mut a, format!("{} regroups the split axis", node.describe())),
                }
            }
            Op::MatMul => {
                let (x, w) = (node.input(0).unwrap(), node.input(1).unwrap());
                let (xs, ws) = (sharded[0], sharded[1]);
                let ro = meta(node.output(0).unwrap()).shape.len();
                match (xs, ws) {
                    // Per-head products: both split on the same batch axis.
                    (Some(p), Some(q))
                        if p.axis == q.axis
                            && p.folded == q.folded
                            && p.axis + 2 < ro
                            && meta(x).shape.len() == ro
                            && meta(w).shape.len() == ro =>
                    {
                        mark(&mut a, node.output(0), p.axis, p.blocked && q.blocked)
                    }
                    // The row-parallel end.
                    (Some(p), None) if p.axis + 1 == meta(x).shape.len() && p.folded == 1 => {
                        match weight_ref(g, &producers, w, 0) {
                            Some((weight, transpose, axis)) if !p.blocked || a.regions[r].blocks.unwrap_or(1) == 1 => {
                                let region = &mut a.regions[r];
                                if p.blocked {
                                    region.blocks = Some(1);
                                }
                                region.weights.push((weight, axis, false));
                                region.weight_uses.push(i);
                                region.weight_uses.extend(transpose);
                                region.ends.push((i, End::Row));
                            }
                            _ => invalid(&mut a, format!("{} multiplies the split axis by no weight", node.describe())),
                        }
                    }
                    _ => invalid(
                        &mut a,
                        format!("{} reads the split axis in a way that cannot stay split", node.describe()),
                    ),
                }
            }
            Op::SoftmaxCrossEntropyLoss { .. } => {
                let scores = meta(node.input(0).unwrap());
                let ok = sharded[0].is_some()
                    && sharded[1].is_none()
                    && node.input(2).is_none()
                    && node.output(1).is_none_or(|v| g.use_counts()[v] == 0)
                    && scores.shape.len() == 2
                    && s.axis == 1
                    && s.folded == 1
                    && (!s.blocked || a.regions[r].blocks.unwrap_or(1) == 1);
                if ok {
                    a.regions[r].blocks = Some(1);
                    a.regions[r].ends.push((i, End::Loss));
                } else {
                    invalid(&mut a, format!("{} cannot compute its loss from class slices", node.describe()));
                }
            }
            _ => invalid(&mut a, format!("{} reads a split value", node.describe())),
        }
    }
    // Split values must not leave through the graph's outputs (the loss is replicated; logits
    // of a split LM head are dropped from the outputs, which only the loss needs).
    if let Some(s) = a.values.get(&loss).copied() {
        let r = s.region;
        a.regions[r].invalid.get_or_insert_with(|| "the loss would be split".into());
    }
    for region in &mut a.regions {
        if region.ends.is_empty() && region.invalid.is_none() && !region.absorbed {
            region.invalid = Some("the split never ends in a row-parallel MatMul or a loss".into());
        }
    }
    a
}

/// Moves region `from` into region `into`: its values, weights, ends and column MatMuls.
fn merge(a: &mut Analysis, into: usize, from: usize) {
    for s in a.values.values_mut().filter(|s| s.region == from) {
        s.region = into;
    }
    let gone = std::mem::take(&mut a.regions[from]);
    a.regions[from].absorbed = true;
    let region = &mut a.regions[into];
    region.merged_starts.extend([gone.start].into_iter().chain(gone.merged_starts));
    region.weights.extend(gone.weights);
    region.weight_uses.extend(gone.weight_uses);
    region.ends.extend(gone.ends);
    match (region.blocks, gone.blocks) {
        (None, b) => region.blocks = b,
        (Some(x), Some(y)) if x != y => {
            region.invalid.get_or_insert_with(|| "it joins regions split into different blocks".into());
        }
        _ => {}
    }
}

/// Where the split axis `axis` of a value of shape `from` lands after a Reshape to `to`:
/// the output axis whose leading elements cover the same rows, if the split carries over.
fn reshape_axis(from: &[usize], to: &[usize], axis: usize, size: usize) -> Option<usize> {
    let outer: usize = from[..axis].iter().product();
    let n = from[axis];
    let mut prefix = 1;
    for (b, &d) in to.iter().enumerate() {
        if prefix == outer && d != 1 {
            let divides = n.is_multiple_of(size) && d.is_multiple_of(size);
            let inner_from: usize = from[axis + 1..].iter().product();
            let inner_to: usize = to[b + 1..].iter().product();
            return ((n == d && inner_from == inner_to) || (divides && n * inner_from == d * inner_to)).then_some(b);
        }
        prefix *= d;
        if prefix > outer {
            return None;
        }
    }
    None
}

/// Where the split dimension lands after a Reshape from `from` to `to` that folds the axes
/// before it into it or unfolds them again: the split axis `axis` of `from` holds `folded` runs
/// of the split dimension; returns the output axis that holds whole runs of it, ending where
/// its rows end, and how many runs that axis holds. ([B, H, T, D] → [B·H, T, D] with H split:
/// axis 0 holding B runs; and back.)
fn fold_axis(from: &[usize], to: &[usize], axis: usize, folded: usize) -> Option<(usize, usize)> {
    let n = from[axis] / folded;
    let runs_before = from[..axis].iter().product::<usize>() * folded;
    let inner: usize = from[axis + 1..].iter().product();
    (0..to.len()).find_map(|b| {
        let (d, before, after) = (to[b], to[..b].iter().product::<usize>(), to[b + 1..].iter().product::<usize>());
        let runs = d.checked_div(n).unwrap_or(0);
        (runs > 0 && after == inner && d.is_multiple_of(n) && before * runs == runs_before).then_some((b, runs))
    })
}

/// Shards the bound forward graph `g` for rank `rank` of a tensor-parallel group of `size`
/// (see the module comment): slices the split weights, fixes the shapes inside each region and
/// inserts the collectives. Returns every split weight's [`TensorSplit`] by name. `loss` is the
/// value the graph must still compute; graph outputs that end up split are dropped.
pub fn shard(g: &mut Graph, loss: ValueId, rank: usize, size: usize) -> Result<BTreeMap<String, TensorSplit>> {
    let mut disabled: HashSet<usize> = HashSet::new();
    let mut reasons: Vec<String> = Vec::new();
    let analysis = loop {
        let a = analyse(g, loss, size, &disabled);
        let before = disabled.len();
        for region in &a.regions {
            if let Some(why) = &region.invalid {
                for start in std::iter::once(region.start).chain(region.merged_starts.iter().copied()) {
                    if disabled.insert(start) {
                        reasons.push(why.clone());
                    }
                }
            }
        }
        // A weight is split one way, and every node that reads it is in a region that splits it.
        let mut specs: HashMap<ValueId, Vec<(usize, usize, bool)>> = HashMap::new();
        let mut users: HashMap<ValueId, HashSet<usize>> = HashMap::new();
        for (r, region) in a.regions.iter().enumerate().filter(|(_, x)| x.invalid.is_none()) {
            for &(w, axis, blocked) in &region.weights {
                specs.entry(w).or_default().push((r, axis, blocked && region.blocks.unwrap_or(1) > 1));
                users.entry(w).or_default().extend(region.weight_uses.iter().copied());
            }
        }
        for (w, uses) in &specs {
            let (_, axis0, blocked0) = uses[0];
            let consistent = uses.iter().all(|&(_, axis, blocked)| axis == axis0 && blocked == blocked0);
            let readers: HashSet<usize> =
                g.nodes.iter().enumerate().filter(|(_, n)| n.inputs.contains(&Some(*w))).map(|(i, _)| i).collect();
            let all_in_regions = readers.iter().all(|i| users[w].contains(i));
            if !consistent || !all_in_regions {
                for &(r, _, _) in uses {
                    let region = &a.regions[r];
                    for start in std::iter::once(region.start).chain(region.merged_starts.iter().copied()) {
                        if disabled.insert(start) {
                            reasons
                                .push(format!("weight '{}' is also used unsplit or split another way", g.name_of(*w)));
                        }
                    }
                }
            }
        }
        if disabled.len() == before {
            break a;
        }
    };
    let valid: Vec<usize> = (0..analysis.regions.len())
        .filter(|&r| analysis.regions[r].invalid.is_none() && !analysis.regions[r].absorbed)
        .collect();
    if valid.is_empty() {
        return Err(Error::Config(format!(
            "parallelism.tensor ({size}): the model has no part that tensor parallelism can split (Megatron's \
             attention and MLP pairs, a vocab-parallel embedding or LM head){}",
            reasons.first().map_or(String::new(), |r| format!("; for example, {r}"))
        )));
    }
    for why in &reasons {
        tracing::debug!(why, "a region stays replicated under tensor parallelism");
    }
    rewrite(g, &analysis, rank, size)
}

fn rewrite(g: &mut Graph, a: &Analysis, rank: usize, size: usize) -> Result<BTreeMap<String, TensorSplit>> {
    let active = |r: usize| a.regions[r].invalid.is_none() && !a.regions[r].absorbed;
    let blocks_of = |r: usize| a.regions[r].blocks.unwrap_or(1);
    // 1. The weights: sliced, their Transposes' outputs reshaped.
    let mut splits = BTreeMap::new();
    let mut by_value: HashMap<ValueId, TensorSplit> = HashMap::new();
    for (r, region) in a.regions.iter().enumerate().filter(|(r, _)| active(*r)) {
        for &(w, axis, blocked) in &region.weights {
            let t = &g.initializers[&w];
            let split = TensorSplit { shape: t.shape().to_vec(), axis, blocks: if blocked { blocks_of(r) } else { 1 } };
            by_value.insert(w, split);
        }
    }
    for (&w, split) in &by_value {
        let local = split.slice(&g.initializers[&w], rank, size)?;
        g.values[w].meta = Some(Meta::new(local.dtype(), local.shape()));
        g.initializers.insert(w, local);
        splits.insert(g.name_of(w).to_string(), split.clone());
    }
    // 2. Split values take their shard's shape.
    let local_len = |n: usize, s: &Sharded| -> usize {
        if s.blocked && blocks_of(s.region) > 1 {
            let b = blocks_of(s.region);
            b * share(n / b, rank, size).len()
        } else {
            s.folded * share(n / s.folded, rank, size).len()
        }
    };
    let mut sharded_values: Vec<(ValueId, Sharded)> =
        a.values.iter().filter(|(_, s)| active(s.region)).map(|(&v, &s)| (v, s)).collect();
    sharded_values.sort_by_key(|x| x.0);
    for (v, s) in &sharded_values {
        let m = g.values[*v].meta.as_mut().expect("bound");
        m.shape[s.axis] = local_len(m.shape[s.axis], s);
    }
    let is_split = |v: ValueId| a.values.get(&v).is_some_and(|s| active(s.region));
    for n in 0..g.nodes.len() {
        let (input, outs) = {
            let node = &g.nodes[n];
            (node.input(0), node.outputs.iter().flatten().copied().collect::<Vec<_>>())
        };
        let Some(x) = input else { continue };
        match &g.nodes[n].op {
            Op::Transpose { .. } if by_value.contains_key(&x) => {
                let s = g.values[x].meta.as_ref().expect("bound").shape.clone();
                g.values[outs[0]].meta.as_mut().expect("bound").shape = s.into_iter().rev().collect();
            }
            Op::Split { axis, .. } if is_split(x) => {
                let s = a.values[&x];
                let rank_x = g.values[x].meta.as_ref().expect("bound").shape.len();
                if crate::shape::norm_axis(*axis, rank_x) == Some(s.axis) {
                    let local: Vec<i64> =
                        outs.iter().map(|&o| g.values[o].meta.as_ref().expect("bound").shape[s.axis] as i64).collect();
                    if let Op::Split { sizes, .. } = &mut g.nodes[n].op {
                        *sizes = local;
                    }
                }
            }
            _ => {}
        }
    }
    // 3. The collectives, in a new node list.
    let starts: HashMap<usize, usize> = a
        .regions
        .iter()
        .enumerate()
        .filter(|(r, _)| active(*r))
        .flat_map(|(r, x)| std::iter::once(x.start).chain(x.merged_starts.iter().copied()).map(move |s| (s, r)))
        .collect();
    let ends: HashMap<usize, End> =
        a.regions.iter().enumerate().filter(|(r, _)| active(*r)).flat_map(|(_, x)| x.ends.iter().copied()).collect();
    let copies: HashSet<(usize, usize)> =
        a.copies.iter().copied().filter(|(n, _)| starts.get(n).is_some_and(|&r| !a.regions[r].embedding)).collect();
    let old = std::mem::take(&mut g.nodes);
    let mut nodes: Vec<Node> = Vec::with_capacity(old.len() + 4 * ends.len());
    let push = |nodes: &mut Vec<Node>, name: String, op: Op, inputs: Vec<ValueId>, outputs: Vec<ValueId>| {
        nodes.push(Node {
            name,
            op,
            inputs: inputs.into_iter().map(Some).collect(),
            outputs: outputs.into_iter().map(Some).collect(),
        });
    };
    let fresh = |g: &mut Graph, hint: String, meta: Meta| {
        let v = g.fresh(&hint);
        g.values[v].meta = Some(meta);
        v
    };
    for (i, mut node) in old.into_iter().enumerate() {
        for (_, k) in copies.iter().copied().filter(|&(n, _)| n == i) {
            let x = node.input(k).expect("the activation");
            let m = g.meta(x).cloned().expect("bound");
            let copy = fresh(g, format!("{}.tp_copy", g.name_of(x)), m);
            push(&mut nodes, format!("{}.tp_copy", node.name), Op::TensorParallelCopy, vec![x], vec![copy]);
            node.inputs[k] = Some(copy);
        }
        match ends.get(&i) {
            None => nodes.push(node),
            Some(End::Row) => {
                let out = node.output(0).expect("an output");
                let m = g.meta(out).cloned().expect("bound");
                let partial = fresh(g, format!("{}.partial", g.name_of(out)), m);
                let name = node.name.clone();
                node.outputs[0] = Some(partial);
                if let Op::Gather { .. } = node.op {
                    // This rank's rows of the table start here; other ids look up zeros.
                    let start = by_value[&node.input(0).expect("the table")].ranges(rank, size)[0].start;
                    node.op = Op::ShardGather { start: start as i64 };
                }
                nodes.push(node);
                push(
                    &mut nodes,
                    format!("{name}.tp_all_reduce"),
                    Op::AllReduce { op: ReduceOp::Sum },
                    vec![partial],
                    vec![out],
                );
            }
            Some(End::Loss) => {
                let Op::SoftmaxCrossEntropyLoss { reduction, ignore_index } = node.op.clone() else { unreachable!() };
                let (scores, labels) = (node.input(0).unwrap(), node.input(1).unwrap());
                let out = node.output(0).unwrap();
                let sm = g.meta(scores).cloned().unwrap();
                let rows = Meta::new(sm.dtype, &sm.shape[..1]);
                // The class slice's first class: the LM head's weight split gives it.
                let vocab: usize = {
                    let (w, axis, _) = a.regions[a.values[&scores].region].weights[0];
                    by_value[&w].shape[axis]
                };
                let first = share(vocab, rank, size).start as i64;
                let name = node.name.clone();
                let local_max = fresh(g, format!("{name}.local_max"), rows.clone());
                let max = fresh(g, format!("{name}.max"), rows.clone());
                let local_sum = fresh(g, format!("{name}.local_sum_exp"), rows.clone());
                let local_target = fresh(g, format!("{name}.local_target"), rows.clone());
                let sum = fresh(g, format!("{name}.sum_exp"), rows.clone());
                let target = fresh(g, format!("{name}.target"), rows.clone());
                let reduce = Op::ReduceOp {
                    kind: Reduce::Max,
                    axes: Some(vec![1]),
                    keepdims: false,
                    noop_with_empty_axes: false,
                };
                push(&mut nodes, format!("{name}.local_max"), reduce, vec![scores], vec![local_max]);
                push(
                    &mut nodes,
                    format!("{name}.max"),
                    Op::AllReduce { op: ReduceOp::Max },
                    vec![local_max],
                    vec![max],
                );
                push(
                    &mut nodes,
                    format!("{name}.shard"),
                    Op::VocabShardCrossEntropy { start: first, classes: vocab as i64, ignore_index },
                    vec![scores, labels, max],
                    vec![local_sum, local_target],
                );
                push(
                    &mut nodes,
                    format!("{name}.sum_exp"),
                    Op::AllReduce { op: ReduceOp::Sum },
                    vec![local_sum],
                    vec![sum],
                );
                push(
                    &mut nodes,
                    format!("{name}.target"),
                    Op::AllReduce { op: ReduceOp::Sum },
                    vec![local_target],
                    vec![target],
                );
                push(
                    &mut nodes,
                    name,
                    Op::VocabParallelLoss { reduction, ignore_index },
                    vec![sum, target, labels],
                    vec![out],
                );
            }
        }
    }
    g.nodes = nodes;
    g.outputs.retain(|&v| !is_split(v));
    Ok(splits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_axis_in_order() {
        for n in [1, 5, 8, 50257] {
            for size in 1..5 {
                let mut next = 0;
                for r in 0..size {
                    let s = share(n, r, size);
                    assert_eq!(s.start, next);
                    assert!(s.len() == n / size || s.len() == n / size + 1);
                    next = s.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn slices_join_back_into_the_whole() {
        // A fused q/k/v weight [4, 3·6] split by columns in 3 blocks over 2 and 4 ranks, and an
        // embedding [7, 2] split by rows unevenly.
        let qkv = Tensor::from_vec(&[4, 18], (0..72).map(|x| x as f32).collect());
        let split = TensorSplit { shape: vec![4, 18], axis: 1, blocks: 3 };
        for size in [2, 3] {
            let shards: Vec<Tensor> = (0..size).map(|r| split.slice(&qkv, r, size).unwrap()).collect();
            assert_eq!(split.join(&shards).unwrap(), qkv);
        }
        let first = split.slice(&qkv, 0, 2).unwrap();
        assert_eq!(first.shape(), &[4, 9]);
        // Row 0 of rank 0: q columns 0..3, k columns 6..9, v columns 12..15.
        assert_eq!(&first.as_slice::<f32>()[..9], &[0., 1., 2., 6., 7., 8., 12., 13., 14.]);
        let table = Tensor::from_vec(&[7, 2], (0..14).map(|x| x as f32).collect());
        let rows = TensorSplit { shape: vec![7, 2], axis: 0, blocks: 1 };
        let shards: Vec<Tensor> = (0..3).map(|r| rows.slice(&table, r, 3).unwrap()).collect();
        assert_eq!(shards.iter().map(|t| t.shape()[0]).collect::<Vec<_>>(), vec![3, 2, 2]);
        assert_eq!(rows.join(&shards).unwrap(), table);
        // Flat shards (as ZeRO's pieces join) are read in the shard's shape.
        let flat: Vec<Tensor> =
            shards.iter().map(|t| Tensor::from_vec(&[t.numel()], t.as_slice::<f32>().to_vec())).collect();
        assert_eq!(rows.join(&flat).unwrap(), table);
    }

    #[test]
    fn a_reshape_carries_the_split_to_the_leading_axis_of_its_group() {
        // [B,T,C] → [B,T,H,D]: C's split lands on H when H divides.
        assert_eq!(reshape_axis(&[2, 8, 32], &[2, 8, 4, 8], 2, 2), Some(2));
        assert_eq!(reshape_axis(&[2, 8, 32], &[2, 8, 3, 8], 2, 2), None);
        // [B,T,H,D] → [B,T,C], and [B,T,V] → [B·T, V].
        assert_eq!(reshape_axis(&[2, 8, 4, 8], &[2, 8, 32], 2, 2), Some(2));
        assert_eq!(reshape_axis(&[2, 8, 50257], &[16, 50257], 2, 2), Some(1));
        // An odd head count cannot be split evenly.
        assert_eq!(reshape_axis(&[2, 8, 24], &[2, 8, 3, 8], 2, 2), None);
    }

    #[test]
    fn a_reshape_folds_the_split_heads_into_the_batch_and_back() {
        // [B,H,T,D] → [B·H,T,D]: H's split folds into axis 0 as B runs; the transposed
        // [B·H,D,T] unfolds into [B,H,D,T] with H split again.
        assert_eq!(reshape_axis(&[4, 6, 8, 2], &[24, 8, 2], 1, 2), None);
        assert_eq!(fold_axis(&[4, 6, 8, 2], &[24, 8, 2], 1, 1), Some((0, 4)));
        assert_eq!(fold_axis(&[24, 2, 8], &[4, 6, 2, 8], 0, 4), Some((1, 1)));
        // Folding the axes after the split one in is not a fold of runs.
        assert_eq!(fold_axis(&[4, 6, 8, 2], &[4, 96], 1, 1), None);
        // A Reshape that moves rows across runs keeps nothing.
        assert_eq!(fold_axis(&[24, 8, 2], &[12, 16, 2], 0, 4), None);
    }
}
