//! Pipeline stages: the forward graph (with its loss) cut into consecutive pieces, one per
//! pipeline rank, as ONNX Runtime's pipeline partition cuts a graph at "cut edges".
//!
//! A cut is a set of value names; it falls just after the node that computes the last of them
//! (in the bound graph's topological order). Everything computed before a stage and read by it
//! or by a later stage travels through it: stage `s` receives its `receives` from `s - 1` and
//! sends its `sends` to `s + 1` (a value that skips stages is passed along, so every message
//! goes to a neighbour, which the schedules' deadlock freedom relies on). Graph inputs (the
//! batch) are fed to every stage that reads them; weights live in every stage that reads them
//! (GPT-2's tied embedding is in the first and the last), and the session sums such a weight's
//! gradient over the stages that hold it.
//!
//! Cuts come from `parallelism.pipelineCuts`, or are chosen here: among the positions where a
//! single float tensor crosses (between transformer blocks, or the halves of a block; between
//! a CNN's modules), the ones closest to equal shares of the forward FLOPs.

use crate::error::{Error, Result};
use crate::graph::ir::{Dim, Graph, InputDecl, ValueId};
use crate::tensor::DType;

/// One stage's part of a bound forward graph.
#[derive(Clone, Debug)]
pub struct Stage {
    /// The stage's nodes, its graph inputs (batch inputs it reads, then `receives`), the weights
    /// it reads; its outputs are `sends`, or the loss on the last stage.
    pub graph: Graph,
    /// Activations from the previous stage, in message order.
    pub receives: Vec<ValueId>,
    /// Activations for the next stage, in message order (the next stage's `receives`).
    pub sends: Vec<ValueId>,
    /// The loss, on the last stage.
    pub loss: Option<ValueId>,
}

/// For each value computed by a node: (its producer's position, the position of its last reader;
/// `nodes.len()` for the loss, which the graph's end reads).
fn live_ranges(g: &Graph, loss: ValueId) -> Vec<Option<(usize, usize)>> {
    let mut r: Vec<Option<(usize, usize)>> = vec![None; g.values.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        for &o in n.outputs.iter().flatten() {
            r[o] = Some((i, i));
        }
        for &v in n.inputs.iter().flatten() {
            if let Some((_, last)) = r[v].as_mut() {
                *last = i;
            }
        }
    }
    if let Some((_, last)) = r[loss].as_mut() {
        *last = g.nodes.len();
    }
    r
}

/// Values computed before position `p` and read at or after it, in value order.
fn crossing(ranges: &[Option<(usize, usize)>], p: usize) -> Vec<ValueId> {
    (0..ranges.len()).filter(|&v| ranges[v].is_some_and(|(prod, last)| prod < p && p <= last)).collect()
}

/// Cuts for `stages` stages chosen by FLOPs (see the module comment), each stage reading at
/// least one of the trained `weights` (an untied LM head, say, holds most of a small model's
/// FLOPs: a cut just after it would leave the last stage only the loss).
pub fn balanced_cuts(g: &Graph, loss: ValueId, stages: usize, weights: &[ValueId]) -> Result<Vec<Vec<String>>> {
    let n = g.nodes.len();
    let mut reading_before = vec![0usize; n + 1];
    for (i, node) in g.nodes.iter().enumerate() {
        let reads = node.inputs.iter().flatten().any(|v| weights.contains(v));
        reading_before[i + 1] = reading_before[i] + usize::from(reads);
    }
    let reads_weights = |from: usize, to: usize| reading_before[to] > reading_before[from];
    let ranges = live_ranges(g, loss);
    // Cost of a node: its dense FLOPs, and one per output element so that element-wise work
    // is not free.
    let cost: Vec<f64> = g
        .nodes
        .iter()
        .map(|node| {
            let elems: usize = node.outputs.iter().flatten().filter_map(|&o| g.meta(o)).map(|m| m.numel()).sum();
            crate::graph::flops::node(g, node) + elems as f64
        })
        .collect();
    let mut before = vec![0.0; n + 1];
    for i in 0..n {
        before[i + 1] = before[i] + cost[i];
    }
    let total = before[n];
    let single_float = |p: usize| {
        let c = crossing(&ranges, p);
        c.len() == 1 && g.meta(c[0]).is_some_and(|m| m.dtype == DType::F32)
    };
    let candidates: Vec<usize> = (1..n).filter(|&p| single_float(p)).collect();
    let mut cuts = Vec::new();
    let mut after = 0;
    for k in 1..stages {
        let target = total * k as f64 / stages as f64;
        // Leave at least one candidate for each later cut.
        let left = stages - 1 - k;
        let usable: Vec<usize> = candidates
            .iter()
            .copied()
            .filter(|&p| p > after && reads_weights(after, p) && reads_weights(p, n))
            .collect();
        let usable = &usable[..usable.len().saturating_sub(left)];
        let p =
            usable.iter().copied().min_by(|&a, &b| (before[a] - target).abs().total_cmp(&(before[b] - target).abs()));
        let Some(p) = p else {
            return Err(Error::Config(format!(
                "parallelism.pipeline: the model has {} place(s) where a single float tensor crosses, too few for \
                 {stages} stages that each hold a trained weight; use fewer stages or give parallelism.pipelineCuts",
                candidates.len()
            )));
        };
        cuts.push(crossing(&ranges, p).into_iter().map(|v| g.name_of(v).to_string()).collect());
        after = p;
    }
    Ok(cuts)
}

/// Cuts `g` (bound, its loss computed by a node) into `cuts.len() + 1` stages.
pub fn split(g: &Graph, loss: ValueId, cuts: &[Vec<String>]) -> Result<Vec<Stage>> {
    let n = g.nodes.len();
    let ranges = live_ranges(g, loss);
    // Position of each cut: just after the node that computes the last of its values.
    let mut bounds = vec![0];
    for (k, names) in cuts.iter().enumerate() {
        let key = format!("parallelism.pipelineCuts[{k}]");
        let mut p = 0;
        for name in names {
            let v = g.find(name).ok_or_else(|| Error::Config(format!("{key}: the model has no value '{name}'")))?;
            let (prod, _) = ranges[v].ok_or_else(|| {
                Error::Config(format!("{key}: '{name}' is an input or a weight, not a value a node computes"))
            })?;
            p = p.max(prod + 1);
        }
        if p <= *bounds.last().expect("starts with 0") || p >= n {
            return Err(Error::Config(format!(
                "{key}: the cut after '{}' leaves a stage without nodes; cuts must follow one another through the model",
                names.join("', '")
            )));
        }
        bounds.push(p);
    }
    bounds.push(n);
    let stages = bounds.len() - 1;
    let stage_of = |i: usize| bounds.partition_point(|&b| b <= i) - 1;
    let last = stages - 1;
    if ranges[loss].is_none_or(|(prod, _)| stage_of(prod) != last) {
        return Err(Error::Config("parallelism.pipelineCuts: the loss must be computed in the last stage".into()));
    }
    // A value crossing a boundary passes through every stage between its producer's and its
    // last reader's.
    let mut carried: Vec<Vec<ValueId>> = vec![vec![]; stages]; // carried[s]: received by s
    for (v, r) in ranges.iter().enumerate() {
        let Some((prod, last)) = *r else { continue };
        let (from, to) = (stage_of(prod), stage_of(last.min(n - 1)));
        for list in carried.iter_mut().take(to + 1).skip(from + 1) {
            list.push(v);
        }
    }
    let mut out = Vec::with_capacity(stages);
    for s in 0..stages {
        let mut sg = g.clone();
        sg.nodes = g.nodes[bounds[s]..bounds[s + 1]].to_vec();
        let receives = carried[s].clone();
        let sends = if s == last { vec![] } else { carried[s + 1].clone() };
        for &v in receives.iter().chain(&sends) {
            let meta = g.meta(v).expect("bound");
            if meta.dtype != DType::F32 {
                return Err(Error::Config(format!(
                    "parallelism.pipelineCuts: '{}' ({}) would cross between stages; only float32 activations can, \
                     so cut elsewhere",
                    g.name_of(v),
                    meta.dtype
                )));
            }
        }
        let reads: std::collections::HashSet<ValueId> =
            sg.nodes.iter().flat_map(|node| node.inputs.iter().flatten().copied()).collect();
        sg.inputs.retain(|d| reads.contains(&d.value));
        for &v in &receives {
            let meta = g.meta(v).expect("bound");
            let dims = meta.shape.iter().map(|&d| Dim::Fixed(d)).collect();
            sg.inputs.push(InputDecl { value: v, dtype: meta.dtype, dims });
        }
        sg.outputs = if s == last { vec![loss] } else { sends.clone() };
        sg.prune();
        out.push(Stage { graph: sg, receives, sends, loss: (s == last).then_some(loss) });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Gpt2Config;
    use crate::graph::infer::{bind, Bindings};

    fn gpt2(layers: usize) -> (Graph, ValueId) {
        let c = Gpt2Config { layers, heads: 2, embed: 16, seq_len: 8, vocab: 40, ..Default::default() };
        let m = crate::models::load(&crate::config::ModelSpec { gpt2: Some(c), ..Default::default() }, 1).unwrap();
        let mut fwd = m.graph.clone();
        fwd.outputs = vec![m.loss];
        let shapes = [(m.graph.find("input_ids").unwrap(), vec![2, 8]), (m.graph.find("labels").unwrap(), vec![2, 8])];
        // The weights are variables (not folded into constants), as the session binds them.
        let variables = m.graph.float_initializers().into_iter().collect();
        let b = Bindings { shapes: shapes.into_iter().collect(), variables, ..Default::default() };
        (bind(&fwd, &b, true).unwrap(), m.loss)
    }

    #[test]
    fn gpt2_cuts_between_blocks_and_the_stages_chain() {
        let (g, loss) = gpt2(4);
        let cuts = balanced_cuts(&g, loss, 2, &g.float_initializers()).unwrap();
        assert_eq!(cuts.len(), 1);
        assert_eq!(cuts[0].len(), 1, "one tensor crosses: {cuts:?}");
        let stages = split(&g, loss, &cuts).unwrap();
        assert_eq!(stages.len(), 2);
        assert_eq!(stages[0].sends, stages[1].receives);
        assert_eq!(stages[1].loss, Some(loss));
        // Every node lands in exactly one stage.
        assert_eq!(stages.iter().map(|s| s.graph.nodes.len()).sum::<usize>(), g.nodes.len());
        // The tied embedding lives in both; every other weight in one.
        let wte = g.find("wte").unwrap();
        assert!(stages.iter().all(|s| s.graph.initializers.contains_key(&wte)));
        let h0 = g.find("h.0.mlp.c_fc.weight").unwrap();
        let h3 = g.find("h.3.mlp.c_fc.weight").unwrap();
        assert!(stages[0].graph.initializers.contains_key(&h0) && !stages[1].graph.initializers.contains_key(&h0));
        assert!(stages[1].graph.initializers.contains_key(&h3) && !stages[0].graph.initializers.contains_key(&h3));
        // The labels are read only by the last stage, the token ids only by the first.
        let names = |s: &Stage| s.graph.inputs.iter().map(|d| g.name_of(d.value).to_string()).collect::<Vec<_>>();
        assert!(names(&stages[0]).contains(&"input_ids".to_string()));
        assert!(!names(&stages[0]).contains(&"labels".to_string()));
        assert!(names(&stages[1]).contains(&"labels".to_string()));
    }

    #[test]
    fn four_stages_of_eight_blocks_get_similar_flops() {
        let (g, loss) = gpt2(8);
        let stages = split(&g, loss, &balanced_cuts(&g, loss, 4, &g.float_initializers()).unwrap()).unwrap();
        let flops: Vec<f64> = stages.iter().map(|s| crate::graph::flops::forward(&s.graph)).collect();
        let mean = flops.iter().sum::<f64>() / 4.0;
        for f in &flops {
            assert!((f - mean).abs() < 0.35 * mean, "unbalanced: {flops:?}");
        }
    }

    #[test]
    fn a_value_that_skips_a_stage_is_passed_through_it() {
        // Cut after the first block's attention residual and again inside its MLP: the residual
        // stream x crosses both cuts (the MLP's residual add reads it), so the middle stage
        // receives x and sends it on.
        let (g, loss) = gpt2(1);
        let cuts = vec![vec!["h.0.attn.residual".to_string()], vec!["h.0.mlp.gelu".to_string()]];
        let stages = split(&g, loss, &cuts).unwrap();
        let x = g.find("h.0.attn.residual").unwrap();
        assert!(stages[1].receives.contains(&x) && stages[1].sends.contains(&x));
        assert_eq!(stages[1].sends, stages[2].receives);
    }

    #[test]
    fn bad_cuts_name_the_key() {
        let (g, loss) = gpt2(2);
        let e = split(&g, loss, &[vec!["nope".into()]]).unwrap_err().to_string();
        assert!(e.contains("parallelism.pipelineCuts[0]") && e.contains("nope"), "{e}");
        let e = split(&g, loss, &[vec!["wte".into()]]).unwrap_err().to_string();
        assert!(e.contains("weight"), "{e}");
        let e = split(&g, loss, &[vec!["h.1.mlp.residual".into()], vec!["h.0.mlp.residual".into()]])
            .unwrap_err()
            .to_string();
        assert!(e.contains("parallelism.pipelineCuts[1]"), "{e}");
        let e = balanced_cuts(&g, loss, 400, &g.float_initializers()).unwrap_err().to_string();
        assert!(e.contains("parallelism.pipeline"), "{e}");
    }
}
