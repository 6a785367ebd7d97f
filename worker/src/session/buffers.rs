//! Float initializers that are not parameters. PyTorch keeps buffers (BatchNorm's running
//! statistics) apart from parameters, but an ONNX file does not say which is which the same way
//! from one exporter to the next: TorchScript writes both as plain initializers under their
//! module names, the dynamo exporter annotates them, and its optimizer lifts constants (Clip's
//! bounds, say) into initializers with made-up names. What both exporters agree on is how the
//! graph reads each value, so the rule (`roles`) is decided by that:
//!
//! - read only as BatchNormalization's input_mean / input_var (inputs 3 and 4): a running
//!   statistic. It does not train; every training forward pass updates it as PyTorch does, and
//!   it is checkpointed and exported with the weights;
//! - otherwise read only where no gradient can flow (an operand folded when the graph is bound,
//!   such as Clip's bounds, a shape or an axis; an op without gradient, such as Shape or a
//!   comparison; or a mix of these with running-statistic reads): a constant, never trained;
//! - otherwise, when the exporter declared it a buffer or constant of the module (the dynamo
//!   exporter's annotation, `Graph::declared_buffers`: RoPE's `inv_freq`, say, which a
//!   gradient could reach through Cos and Sin): a constant, as PyTorch never trains a buffer;
//! - anything else, including an initializer nothing reads, is a parameter and trains.
//!
//! TorchScript exports write no such annotation, but they write a non-persistent buffer such
//! as `inv_freq` as a Constant node, not an initializer, so the reads decide there.
//! Reads through Identity nodes count as reads of the initializer. frozenWeights and
//! weightsToTrain override the rule (`Session::new`).

use crate::autodiff::rules::differentiable;
use crate::error::{Error, Result};
use crate::graph::ir::{Graph, ValueId};
use crate::op::Op;
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

/// What a float initializer is to training.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Parameter,
    RunningStatistic,
    Constant,
}

/// What one read of a value can pass back to it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Read {
    Gradient,
    Statistic,
    Nothing,
}

fn read(op: &Op, input: usize) -> Read {
    match op {
        Op::BatchNorm { .. } if input >= 3 => Read::Statistic,
        _ if op.static_operand_inputs().contains(&input) || !differentiable(op) => Read::Nothing,
        _ => Read::Gradient,
    }
}

/// The role of each float initializer of `g` (see the module's comment for the rule).
pub fn roles(g: &Graph) -> HashMap<ValueId, Role> {
    let mut readers: HashMap<ValueId, Vec<(usize, usize)>> = HashMap::new();
    for (n, node) in g.nodes.iter().enumerate() {
        for (k, v) in node.inputs.iter().enumerate() {
            if let Some(v) = v {
                readers.entry(*v).or_default().push((n, k));
            }
        }
    }
    let role = |v: ValueId| {
        let mut reads = Vec::new();
        let mut through = vec![v];
        while let Some(x) = through.pop() {
            if g.outputs.contains(&x) {
                return Role::Parameter; // a model output: nothing to infer
            }
            for &(n, k) in readers.get(&x).map_or(&[][..], |r| &r[..]) {
                match &g.nodes[n].op {
                    Op::Identity => through.extend(g.nodes[n].outputs.iter().flatten()),
                    op => reads.push(read(op, k)),
                }
            }
        }
        if !reads.is_empty() && reads.iter().all(|&r| r == Read::Statistic) {
            Role::RunningStatistic
        } else if g.declared_buffers.contains(&v) {
            Role::Constant
        } else if reads.is_empty() || reads.contains(&Read::Gradient) {
            Role::Parameter
        } else {
            Role::Constant
        }
    };
    g.float_initializers().into_iter().map(|v| (v, role(v))).collect()
}

/// The forward graph training binds: every BatchNormalization in training mode (batch
/// statistics), whatever mode the export wrote, and those with a running statistic in `tracked`
/// writing the new values to outputs 1 and 2 (given where the export left them out).
/// `g` itself when it has no BatchNormalization.
pub fn training_form<'g>(g: &'g Graph, tracked: &HashSet<ValueId>) -> Cow<'g, Graph> {
    if !g.nodes.iter().any(|n| matches!(n.op, Op::BatchNorm { .. })) {
        return Cow::Borrowed(g);
    }
    let mut g = g.clone();
    for n in 0..g.nodes.len() {
        let Op::BatchNorm { epsilon, momentum, .. } = g.nodes[n].op else { continue };
        g.nodes[n].op = Op::BatchNorm { epsilon, momentum, training: true };
        if [3, 4].iter().any(|&k| g.nodes[n].input(k).is_some_and(|v| tracked.contains(&v))) {
            g.nodes[n].outputs.resize(3, None);
            for k in 1..3 {
                if g.nodes[n].outputs[k].is_none() {
                    let name = match g.nodes[n].input(k + 2) {
                        Some(stat) => format!("{}:updated", g.name_of(stat)),
                        None => format!("{}:updated{k}", g.nodes[n].name),
                    };
                    g.nodes[n].outputs[k] = Some(g.fresh(&name));
                }
            }
        }
    }
    Cow::Owned(g)
}

/// A running statistic and where each training forward pass leaves its new value.
#[derive(Clone, Debug)]
pub struct RunningStatistic {
    /// The initializer (running_mean or running_var).
    pub value: ValueId,
    /// BatchNormalization's output 1 or 2 in the training graph.
    pub updated: ValueId,
    /// After a pass: value = keep·value + scale·updated.
    pub keep: f32,
    pub scale: f32,
}

/// The running statistics of bound training graph `g` that are `tracked`, with how each is
/// updated after a forward pass. ONNX's BatchNormalization (momentum m = 1 − PyTorch's) writes
/// mean' = m·mean + (1−m)·μ and var' = m·var + (1−m)·σ², σ² the biased batch variance over the
/// n = N·H·W values of a channel; PyTorch's var' uses the unbiased one, σ²·n/(n−1), which is
/// var' = (n·out − m·var)/(n−1) from ONNX's output `out`.
pub fn running_statistics(g: &Graph, tracked: &HashSet<ValueId>) -> Result<Vec<RunningStatistic>> {
    let mut out: Vec<RunningStatistic> = Vec::new();
    for node in &g.nodes {
        let Op::BatchNorm { momentum, training: true, .. } = node.op else { continue };
        let stats = (node.input(3), node.input(4), node.output(1), node.output(2));
        let (Some(mean), Some(var), Some(new_mean), Some(new_var)) = stats else { continue };
        let x = node.input(0).and_then(|x| g.meta(x)).expect("a bound graph gives every value a meta");
        let n = x.numel() / x.shape[1].max(1);
        if n < 2 {
            return Err(Error::Config(format!(
                "{}: training normalizes each channel over {n} value (input of shape {:?}); PyTorch refuses this \
                 too: use a larger batch",
                node.describe(),
                x.shape
            )));
        }
        if let Some(v) = [mean, var].into_iter().find(|v| tracked.contains(v) && out.iter().any(|r| r.value == *v)) {
            return Err(Error::Config(format!(
                "running statistic '{}' is read by more than one BatchNormalization, whose updates would \
                 conflict; list it in frozenWeights to keep it as it is",
                g.name_of(v)
            )));
        }
        let (n, m) = (n as f64, momentum as f64);
        if tracked.contains(&mean) {
            out.push(RunningStatistic { value: mean, updated: new_mean, keep: 0.0, scale: 1.0 });
        }
        if tracked.contains(&var) {
            let (keep, scale) = ((-m / (n - 1.0)) as f32, (n / (n - 1.0)) as f32);
            out.push(RunningStatistic { value: var, updated: new_var, keep, scale });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::infer::{bind, Bindings};
    use crate::op::Unary;
    use crate::tensor::{DType, Tensor};

    /// x [2,3,4] → Conv-less BatchNormalization → Clip(min, max) → output, with `min` and
    /// `max` lifted into initializers and a weight `w` read through an Identity.
    fn graph() -> Graph {
        let mut g = Graph::new("bn", 17);
        let x = g.add_input("x", DType::F32, vec![]);
        let c = |v: f32| Tensor::from_vec(&[3], vec![v; 3]);
        let w = g.add_initializer("w", c(1.0));
        let b = g.add_initializer("b", c(0.0));
        let mean = g.add_initializer("running_mean", c(0.0));
        let var = g.add_initializer("running_var", c(1.0));
        let lo = g.add_initializer("min", Tensor::scalar(0f32));
        let hi = g.add_initializer("max", Tensor::scalar(6f32));
        let w_copy = g.op1("w_copy", Op::Identity, &[w]);
        let bn = Op::BatchNorm { epsilon: 1e-5, momentum: 0.9, training: false };
        let y = g.op1("bn", bn, &[x, w_copy, b, mean, var]);
        let out = g.op1("clip", Op::Unary(Unary::Clip { min: f32::NEG_INFINITY, max: f32::INFINITY }), &[y, lo, hi]);
        g.outputs.push(out);
        g
    }

    #[test]
    fn roles_follow_the_reads() {
        let g = graph();
        let roles = roles(&g);
        let role = |name: &str| roles[&g.find(name).unwrap()];
        assert_eq!(role("w"), Role::Parameter, "read through an Identity as the scale");
        assert_eq!(role("b"), Role::Parameter);
        assert_eq!(role("running_mean"), Role::RunningStatistic);
        assert_eq!(role("running_var"), Role::RunningStatistic);
        assert_eq!(role("min"), Role::Constant);
        assert_eq!(role("max"), Role::Constant);
    }

    #[test]
    fn declared_buffers_do_not_train_but_running_statistics_still_update() {
        let mut g = graph();
        // What the dynamo exporter annotates BUFFER: RoPE's inv_freq (read on the gradient
        // path, through Mul) and BatchNorm's running statistics.
        let x = g.find("x").unwrap();
        let inv_freq = g.add_initializer("inv_freq", Tensor::from_vec(&[3], vec![1f32, 0.1, 0.01]));
        let angles = g.op1("angles", Op::Binary(crate::op::Binary::Mul), &[x, inv_freq]);
        g.outputs.push(angles);
        g.declared_buffers = ["inv_freq", "running_mean", "running_var"].iter().map(|n| g.find(n).unwrap()).collect();
        let roles = roles(&g);
        let role = |name: &str| roles[&g.find(name).unwrap()];
        assert_eq!(role("inv_freq"), Role::Constant);
        assert_eq!(role("running_mean"), Role::RunningStatistic);
        assert_eq!(role("w"), Role::Parameter);
    }

    #[test]
    fn training_form_updates_tracked_statistics_with_pytorch_semantics() {
        let g = graph();
        let tracked: HashSet<ValueId> = ["running_mean", "running_var"].iter().map(|n| g.find(n).unwrap()).collect();
        let train = training_form(&g, &tracked);
        let node = train.nodes.iter().find(|n| matches!(n.op, Op::BatchNorm { .. })).unwrap();
        assert!(matches!(node.op, Op::BatchNorm { training: true, .. }));
        assert_eq!(node.outputs.iter().flatten().count(), 3);

        let x = g.find("x").unwrap();
        let b = Bindings { shapes: [(x, vec![2, 3, 4])].into_iter().collect(), ..Default::default() };
        let bound = bind(&train, &b, true).unwrap();
        let stats = running_statistics(&bound, &tracked).unwrap();
        assert_eq!(stats.len(), 2);
        // n = 2·4 values per channel: var' = (8·out − 0.9·var)/7.
        let var = stats.iter().find(|r| r.value == g.find("running_var").unwrap()).unwrap();
        assert!((var.scale - 8.0 / 7.0).abs() < 1e-7 && (var.keep + 0.9 / 7.0).abs() < 1e-7);
        // out = 0.9·var + 0.1·σ²: the update gives 0.9·var + 0.1·σ²·8/7, PyTorch's.
        let (old, sigma2) = (1.0f64, 0.5f64);
        let out = 0.9 * old + 0.1 * sigma2;
        let got = var.keep as f64 * old + var.scale as f64 * out;
        assert!((got - (0.9 * old + 0.1 * sigma2 * 8.0 / 7.0)).abs() < 1e-6);

        // Untracked (frozen) statistics: batch statistics still, no update.
        let frozen = training_form(&g, &HashSet::new());
        let bound = bind(&frozen, &b, true).unwrap();
        assert!(running_statistics(&bound, &tracked).unwrap().is_empty());
    }

    #[test]
    fn one_value_per_channel_is_refused() {
        let g = graph();
        let tracked: HashSet<ValueId> = ["running_mean", "running_var"].iter().map(|n| g.find(n).unwrap()).collect();
        let x = g.find("x").unwrap();
        let b = Bindings { shapes: [(x, vec![1, 3, 1])].into_iter().collect(), ..Default::default() };
        let bound = bind(&training_form(&g, &tracked), &b, true).unwrap();
        let e = running_statistics(&bound, &tracked).unwrap_err().to_string();
        assert!(e.contains("over 1 value"), "{e}");
    }
}
