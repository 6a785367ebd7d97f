//! Activation recomputation (ONNX Runtime's gelu_recompute and transformer_layer_recompute,
//! Megatron's activation checkpointing): some forward values are computed again in the
//! backward pass, just before their first backward reader, instead of being kept alive from
//! the forward pass. The memory planner frees the originals after their last forward reader,
//! so the planned peak falls; the price is running those forward nodes twice.
//!
//! The clones are the same ops on the same inputs, so results are bit-identical. Dropout
//! clones draw the same mask because a dropout's randomness is fixed by its own seed
//! attribute (see `pin_dropout_seeds`), not by where the node sits in the graph.

use crate::config::Recompute;
use crate::error::{Error, Result};
use crate::graph::ir::{Graph, Node, ValueId};
use crate::op::{Op, Unary};
use std::collections::{BTreeMap, HashMap, HashSet};

/// Gives each training dropout a seed of its own, derived from its position in the forward
/// graph; the executor mixes only that seed with the step's seed. Run it before autodiff.
pub fn pin_dropout_seeds(g: &mut Graph) {
    for (i, n) in g.nodes.iter_mut().enumerate() {
        if let Op::Dropout { training: true, seed, .. } = &mut n.op {
            *seed = crate::rng::mix(*seed ^ i as u64);
        }
    }
}

/// The transformer block a node belongs to, by its name: the prefix up to the block index
/// after `h.`, `layers.`, `layer.` or `blocks.` (the builtin GPT-2's `h.3.mlp.c_fc`, or an
/// exported `/transformer/h.3/attn/MatMul`).
pub fn block_of(name: &str) -> Option<&str> {
    for key in ["h.", "layers.", "layer.", "blocks."] {
        let mut from = 0;
        while let Some(at) = name[from..].find(key).map(|k| k + from) {
            let starts_segment = at == 0 || matches!(name.as_bytes()[at - 1], b'.' | b'/' | b'_');
            let digits = name[at + key.len()..].bytes().take_while(u8::is_ascii_digit).count();
            if starts_segment && digits > 0 {
                return Some(&name[..at + key.len() + digits]);
            }
            from = at + key.len();
        }
    }
    None
}

/// Rewrites `g`, whose first `n_forward` nodes are the forward pass and the rest the
/// backward pass appended by `gradients`, so that `mode`'s values are recomputed.
pub fn apply(g: &mut Graph, n_forward: usize, mode: Recompute) -> Result<()> {
    // Groups of forward nodes recomputed together, in forward order, and whether the
    // backward pass reads all their outputs from the clones (GELU: the activation is what is
    // saved) or only the values private to the group (a block's output is the checkpoint the
    // next block starts from, and stays).
    let (groups, private_only): (Vec<Vec<usize>>, bool) = match mode {
        Recompute::None => return Ok(()),
        Recompute::Gelu => {
            let gelus = (0..n_forward)
                .filter(|&i| matches!(g.nodes[i].op, Op::Unary(Unary::Gelu | Unary::GeluTanh)))
                .map(|i| vec![i])
                .collect();
            (gelus, false)
        }
        Recompute::Layer => {
            let mut blocks: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
            let mut order: HashMap<String, usize> = HashMap::new();
            for i in 0..n_forward {
                if let Some(b) = block_of(&g.nodes[i].name) {
                    let next = order.len();
                    let k = *order.entry(b.to_string()).or_insert(next);
                    blocks.entry(k).or_default().push(i);
                }
            }
            if blocks.is_empty() {
                return Err(Error::Config(
                    "recompute: layer finds no transformer blocks (node names with h.<i>, layers.<i> or blocks.<i>)"
                        .into(),
                ));
            }
            (blocks.into_values().collect(), true)
        }
    };
    let graph_outputs: HashSet<ValueId> = g.outputs.iter().copied().collect();
    let mut inserts: Vec<(usize, Vec<Node>)> = Vec::new();
    let mut remap: HashMap<ValueId, ValueId> = HashMap::new();
    for group in groups {
        let members: HashSet<usize> = group.iter().copied().collect();
        let produced: HashSet<ValueId> =
            group.iter().flat_map(|&i| g.nodes[i].outputs.iter().flatten().copied()).collect();
        // Values the backward pass will read from the clones.
        let recomputed: HashSet<ValueId> = produced
            .iter()
            .copied()
            .filter(|v| !graph_outputs.contains(v))
            .filter(|v| {
                !private_only || !(0..n_forward).any(|j| !members.contains(&j) && g.nodes[j].inputs.contains(&Some(*v)))
            })
            .collect();
        let Some(first_reader) =
            (n_forward..g.nodes.len()).find(|&j| g.nodes[j].inputs.iter().flatten().any(|v| recomputed.contains(v)))
        else {
            continue;
        };
        let mut clones = Vec::with_capacity(group.len());
        let mut local: HashMap<ValueId, ValueId> = HashMap::new();
        for &i in &group {
            let mut node = g.nodes[i].clone();
            node.name = format!("{}.recompute", node.name);
            for input in node.inputs.iter_mut().flatten() {
                if let Some(&c) = local.get(input) {
                    *input = c;
                }
            }
            for output in node.outputs.iter_mut().flatten() {
                let meta = g.meta(*output).cloned();
                let c = g.fresh(&format!("{}.recompute", g.name_of(*output)));
                g.values[c].meta = meta;
                local.insert(*output, c);
                *output = c;
            }
            clones.push(node);
        }
        remap.extend(recomputed.iter().map(|v| (*v, local[v])));
        inserts.push((first_reader, clones));
    }
    // Backward readers take the clones; forward readers keep the originals.
    for node in &mut g.nodes[n_forward..] {
        for input in node.inputs.iter_mut().flatten() {
            if let Some(&c) = remap.get(input) {
                *input = c;
            }
        }
    }
    // Insert from the back so earlier positions stay valid; groups with the same first
    // reader go in forward order.
    inserts.sort_by_key(|(at, _)| *at);
    for (at, clones) in inserts.into_iter().rev() {
        g.nodes.splice(at..at, clones);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::block_of;

    #[test]
    fn blocks_are_found_in_builtin_and_exported_names() {
        assert_eq!(block_of("h.3.mlp.c_fc"), Some("h.3"));
        assert_eq!(block_of("/transformer/h.11/attn/MatMul"), Some("/transformer/h.11"));
        assert_eq!(block_of("model.layers.0.self_attn.q_proj"), Some("model.layers.0"));
        assert_eq!(block_of("ln_f"), None);
        assert_eq!(block_of("graph.hidden"), None, "'h.' must start a name segment and be followed by digits");
    }
}
