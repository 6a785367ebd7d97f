//! Builtin models, emitted as ONNX-op graphs (so the engine trains them like any imported
//! model and the exporter writes them like any other), and the loss attached to a model.

pub mod gpt2;
pub mod llama;
pub mod mlp;
pub mod squeezenet;

use crate::config::{LossConfig, LossKind, ModelConfig, ModelSpec};
use crate::error::{Error, Result};
use crate::graph::ir::{Dim, Graph, ValueId};
use crate::op::{Binary, LossReduction, Op, Reduce};
use crate::rng::Rng;
use crate::tensor::{DType, Tensor};
use std::collections::{BTreeMap, HashSet};

/// A model ready to train: its graph (forward + loss), the loss value, and the forward
/// outputs an inference export keeps.
pub struct Model {
    pub graph: Graph,
    pub loss: ValueId,
    /// The forward graph's own outputs (the exported model's outputs).
    pub outputs: Vec<ValueId>,
    /// Graph inputs that are fed labels (removed on export).
    pub label_inputs: Vec<ValueId>,
}

/// Builds or loads the configured model and attaches its loss.
pub fn load(cfg: &ModelSpec, seed: u64) -> Result<Model> {
    check_size(cfg)?;
    let (graph, loss_cfg) = match cfg.kind()? {
        ModelConfig::Gpt2(c) => (gpt2::build(c, seed)?, builtin_loss()),
        ModelConfig::Llama(c) => (llama::build(c, seed)?, builtin_loss()),
        ModelConfig::Squeezenet(c) => (squeezenet::build(c, seed)?, builtin_loss()),
        ModelConfig::Mlp(c) => (mlp::build(c, seed)?, builtin_loss()),
        ModelConfig::Onnx(c) => {
            let origin = c.path.display().to_string();
            let proto = crate::onnx::load_model(&c.path)?;
            let mut graph = crate::graph::onnx_io::from_model(&proto, &origin)?;
            set_padding_rows(&mut graph, &c.padding_idx)?;
            (graph, c.loss.clone())
        }
    };
    let mut graph = graph;
    inference_batch_norm(&mut graph);
    with_loss(graph, &loss_cfg)
}

/// A builtin model whose weights and their gradients pass this machine's memory is refused before
/// it is built (building it would abort when an allocation fails, or run for minutes first):
/// exit 2 naming the model's keys, with the bytes needed and the bytes there are. Training needs
/// more still (optimizer moments, activations); the memory plan reports that later.
fn check_size(cfg: &ModelSpec) -> Result<()> {
    let (key, params) = match cfg.kind()? {
        ModelConfig::Gpt2(c) => ("model.gpt2 (layers, embed, seqLen, vocab)", gpt2::parameter_count(c)),
        ModelConfig::Llama(c) => ("model.llama (layers, embed, ffn, vocab)", llama::parameter_count(c)),
        ModelConfig::Mlp(c) => {
            let widths: Vec<u128> = std::iter::once(c.inputs)
                .chain(c.hidden.iter().copied())
                .chain([c.classes])
                .map(|w| w as u128)
                .collect();
            ("model.mlp (inputs, hidden, classes)", widths.windows(2).map(|w| (w[0] + 1) * w[1]).sum())
        }
        ModelConfig::Squeezenet(_) | ModelConfig::Onnx(_) => return Ok(()),
    };
    let bytes = params.saturating_mul(8);
    match crate::host::memory_bytes() {
        Some(memory) if bytes > memory as u128 => Err(Error::Config(format!(
            "{key}: the model's {params} parameters need {bytes} bytes for their f32 weights and gradients alone; \
             this machine has {memory}"
        ))),
        _ => Ok(()),
    }
}

/// Marks the lookups of each configured embedding (`model.onnx.paddingIdx`): every Gather on
/// axis 0 whose data is the initializer, read directly or through Identity nodes, keeps the
/// row's gradient at zero.
fn set_padding_rows(g: &mut Graph, rows: &BTreeMap<String, i64>) -> Result<()> {
    for (name, &row) in rows {
        let field = format!("model.onnx.paddingIdx.{name}");
        let table = g
            .find(name)
            .filter(|v| g.initializers.contains_key(v))
            .ok_or_else(|| Error::Config(format!("{field}: the model has no initializer named '{name}'")))?;
        let vocab = g.initializers[&table].shape().first().map_or(0, |&n| n as i64);
        if !(-vocab..vocab).contains(&row) {
            return Err(Error::Config(format!("{field}: row {row} is outside the embedding's {vocab} rows")));
        }
        let mut reads = HashSet::from([table]);
        let mut marked = 0;
        for node in &mut g.nodes {
            let reads_table = node.input(0).is_some_and(|v| reads.contains(&v));
            match &mut node.op {
                Op::Identity if reads_table => reads.extend(node.outputs.iter().flatten()),
                Op::Gather { axis: 0, padding_row } if reads_table => {
                    *padding_row = Some(row.rem_euclid(vocab));
                    marked += 1;
                }
                _ => {}
            }
        }
        if marked == 0 {
            return Err(Error::Config(format!("{field}: no Gather on axis 0 looks rows up in '{name}'")));
        }
    }
    Ok(())
}

/// BatchNormalization as the model's own forward pass runs it (evaluation, the exported
/// model): in inference mode, over the running statistics, whatever mode the exporter wrote
/// (TorchScript writes `training_mode=1` and two more outputs, the updated statistics, from a
/// module in training mode). The session gives its training graph training mode back
/// (`session::buffers::training_form`). A node whose extra outputs something reads keeps them.
pub fn inference_batch_norm(g: &mut Graph) {
    let uses = g.use_counts();
    for node in &mut g.nodes {
        let Op::BatchNorm { epsilon, momentum, .. } = node.op else { continue };
        if node.outputs.iter().skip(1).flatten().all(|&o| uses[o] == 0) {
            node.op = Op::BatchNorm { epsilon, momentum, training: false };
            node.outputs.truncate(1);
        }
    }
}

fn builtin_loss() -> LossConfig {
    LossConfig {
        kind: Some(LossKind::SoftmaxCrossEntropy),
        output: "logits".into(),
        label: "labels".into(),
        ignore_index: Some(-100),
    }
}

/// Attaches the configured loss to `g` (or finds the loss the model computes itself).
pub fn with_loss(mut g: Graph, cfg: &LossConfig) -> Result<Model> {
    let out = g.find(&cfg.output).filter(|v| g.outputs.contains(v)).ok_or_else(|| {
        let names: Vec<&str> = g.outputs.iter().map(|&v| g.name_of(v)).collect();
        Error::Config(format!(
            "model.onnx.loss.output: '{}' is not an output of the model (outputs: {})",
            cfg.output,
            names.join(", ")
        ))
    })?;
    let forward_outputs = g.outputs.clone();
    let Some(kind) = cfg.kind else {
        // The model computes its loss: every non-float input is data, and labels are whatever
        // the data provides beyond the model's inputs.
        return Ok(Model {
            loss: out,
            outputs: forward_outputs.into_iter().filter(|&v| v != out).collect(),
            label_inputs: vec![],
            graph: g,
        });
    };
    if g.find(&cfg.label).is_some_and(|v| g.inputs.iter().any(|d| d.value == v)) {
        return Err(Error::Config(format!(
            "model.onnx.loss.label: the model already has an input named '{}'",
            cfg.label
        )));
    }
    let loss = match kind {
        LossKind::SoftmaxCrossEntropy => {
            // Class scores on the last axis, as language models and classifiers emit them:
            // flatten to [N, C] and labels to [N].
            let labels = g.add_input(&cfg.label, DType::I64, vec![Dim::Named(format!("{}.shape", cfg.label))]);
            let shape = g.op1("loss.scores_shape", Op::Shape { start: -1, end: None }, &[out]);
            let minus_one = ints(&mut g, "loss.minus_one", &[-1]);
            let target = g.op1("loss.target_shape", Op::Concat { axis: 0 }, &[minus_one, shape]);
            let scores = g.op1("loss.scores", Op::Reshape, &[out, target]);
            let labels_flat = g.op1("loss.labels", Op::Reshape, &[labels, minus_one]);
            g.op1(
                "loss",
                Op::SoftmaxCrossEntropyLoss { reduction: LossReduction::Mean, ignore_index: cfg.ignore_index },
                &[scores, labels_flat],
            )
        }
        LossKind::Mse => {
            let target = g.add_input(&cfg.label, DType::F32, vec![Dim::Named(format!("{}.shape", cfg.label))]);
            let diff = g.op1("loss.diff", Op::Binary(Binary::Sub), &[out, target]);
            let sq = g.op1("loss.sq", Op::Binary(Binary::Mul), &[diff, diff]);
            g.op1(
                "loss",
                Op::ReduceOp { kind: Reduce::Mean, axes: None, keepdims: false, noop_with_empty_axes: false },
                &[sq],
            )
        }
    };
    let label = g.find(&cfg.label).expect("added above");
    g.outputs.push(loss);
    Ok(Model { graph: g, loss, outputs: forward_outputs, label_inputs: vec![label] })
}

/// Weight initialization shared by the builders.
pub struct Init {
    pub rng: Rng,
}

impl Init {
    pub fn new(seed: u64) -> Init {
        Init { rng: Rng::new(seed) }
    }
    pub fn normal(&mut self, shape: &[usize], std: f64) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_vec(shape, (0..n).map(|_| (self.rng.normal() * std) as f32).collect())
    }
    pub fn uniform(&mut self, shape: &[usize], bound: f64) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_vec(shape, (0..n).map(|_| ((self.rng.next_f64() * 2.0 - 1.0) * bound) as f32).collect())
    }
    pub fn constant(shape: &[usize], v: f32) -> Tensor {
        Tensor::from_vec(shape, vec![v; shape.iter().product()])
    }
}

/// A constant the model needs but never trains (masks, scales, shapes): a Constant node, so
/// it is folded when the graph is bound and never mistaken for a weight.
pub fn constant(g: &mut Graph, name: &str, value: Tensor) -> ValueId {
    g.op1(name, Op::Constant { value }, &[])
}

/// An int64 vector constant (shapes, axes).
pub fn ints(g: &mut Graph, name: &str, v: &[i64]) -> ValueId {
    constant(g, name, Tensor::from_vec(&[v.len()], v.to_vec()))
}
