//! The training configuration: the file `tensorfleet-worker train --config` reads and the
//! `spec.training` of a `TrainingJob` (the operator embeds this very type). Keys are camelCase;
//! unknown keys are errors that name the key.

use crate::error::{Error, Result};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TrainingConfig {
    /// The model: one builtin builder or an ONNX file.
    pub model: ModelSpec,
    /// Training and evaluation data.
    pub data: DataConfig,
    /// Seed of weight initialization, data order and dropout.
    #[serde(default = "d_seed")]
    pub seed: u64,
    /// Samples per data-parallel rank per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per weight update.
    #[serde(default = "d_one")]
    pub gradient_accumulation_steps: usize,
    /// Weight updates to run.
    pub steps: u64,
    /// The optimizer and its hyperparameters (PyTorch's semantics).
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    /// Weights (initializer names) that do not train (ONNX Runtime's weights_not_to_train).
    #[serde(default)]
    pub frozen_weights: Vec<String>,
    /// Only these weights (initializer names) train; empty: every float initializer not in
    /// frozenWeights (ONNX Runtime's weights_to_train).
    #[serde(default)]
    pub weights_to_train: Vec<String>,
    /// The learning-rate schedule, with warmup.
    #[serde(default)]
    pub lr_schedule: LrSchedule,
    /// Global gradient-norm clipping threshold; 0 switches clipping off.
    #[serde(default)]
    pub grad_clip_norm: f64,
    /// fp32, or fp16 / bf16 with fp32 master weights (CUDA backend).
    #[serde(default)]
    pub precision: Precision,
    /// The fp16 loss scale; 0 = dynamic (see `dynamic_loss_scale`). A step whose gradients
    /// overflow is skipped either way. fp32 and bf16 use none.
    #[serde(default)]
    pub loss_scale: f64,
    /// The dynamic fp16 loss scale: where it starts and how many clean steps double it; an
    /// overflow halves it, within [1, 2^24].
    #[serde(default)]
    pub dynamic_loss_scale: DynamicLossScale,
    /// Activations recomputed in the backward pass instead of kept from the forward pass:
    /// none, gelu (the MLP's GELU outputs) or layer (everything inside a transformer block).
    #[serde(default)]
    pub recompute: Recompute,
    /// auto (CUDA when a GPU is present, else the CPU), cpu or cuda.
    #[serde(default)]
    pub device: DeviceKind,
    /// Data × tensor × pipeline parallel sizes (their product is the MPI world size) and the ZeRO stage.
    #[serde(default)]
    pub parallelism: Parallelism,
    /// Periodic evaluation on data.eval (off by default).
    #[serde(default)]
    pub evaluation: EvaluationConfig,
    /// Periodic checkpoints in output.dir/checkpoints and where to resume from.
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// How often to log, TensorBoard events, and the progress endpoint's port.
    #[serde(default)]
    pub logging: LoggingConfig,
    /// Where the run writes its outputs.
    #[serde(default)]
    pub output: OutputConfig,
    /// Per-op timings of a range of steps, written as Chrome trace JSON (off by default).
    #[serde(default)]
    pub profiling: ProfilingConfig,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProfilingConfig {
    /// The first weight update to profile (counting from 1); 0 switches profiling off.
    #[serde(default)]
    pub from_step: u64,
    /// The last weight update to profile (inclusive).
    #[serde(default)]
    pub to_step: u64,
}

fn d_seed() -> u64 {
    42
}
fn d_one() -> usize {
    1
}

/// The model: exactly one of a builtin builder or an ONNX file. (A struct of options rather
/// than an enum, so YAML reads `model: {gpt2: {...}}` and the CRD schema stays structural.)
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelSpec {
    /// A GPT-2 built in the worker: tied embeddings, tanh GELU, causal attention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpt2: Option<Gpt2Config>,
    /// A Llama built in the worker: RMSNorm, rotary embeddings, grouped-query attention,
    /// SwiGLU, an untied head.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llama: Option<LlamaConfig>,
    /// SqueezeNet 1.1 built in the worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub squeezenet: Option<SqueezeNetConfig>,
    /// A multilayer perceptron built in the worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp: Option<MlpConfig>,
    /// An ONNX model file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub onnx: Option<OnnxModelConfig>,
}

/// The chosen model, once `ModelSpec` is checked to name exactly one.
#[derive(Clone, Copy, Debug)]
pub enum ModelConfig<'a> {
    Gpt2(&'a Gpt2Config),
    Llama(&'a LlamaConfig),
    Squeezenet(&'a SqueezeNetConfig),
    Mlp(&'a MlpConfig),
    Onnx(&'a OnnxModelConfig),
}

impl ModelSpec {
    /// The one model this spec names (validation guarantees there is exactly one).
    pub fn kind(&self) -> Result<ModelConfig<'_>> {
        let mut found = Vec::new();
        if let Some(c) = &self.gpt2 {
            found.push(ModelConfig::Gpt2(c));
        }
        if let Some(c) = &self.llama {
            found.push(ModelConfig::Llama(c));
        }
        if let Some(c) = &self.squeezenet {
            found.push(ModelConfig::Squeezenet(c));
        }
        if let Some(c) = &self.mlp {
            found.push(ModelConfig::Mlp(c));
        }
        if let Some(c) = &self.onnx {
            found.push(ModelConfig::Onnx(c));
        }
        match found.len() {
            1 => Ok(found[0]),
            0 => Err(Error::Config("key 'model': name one of gpt2, llama, squeezenet, mlp or onnx".into())),
            _ => Err(Error::Config("key 'model': name only one of gpt2, llama, squeezenet, mlp or onnx".into())),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Gpt2Config {
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads per block (embed must be a multiple).
    pub heads: usize,
    /// Embedding width; a multiple of `heads`.
    pub embed: usize,
    /// Sequence length (and number of learned positions).
    pub seq_len: usize,
    /// Vocabulary size (50257 for the GPT-2 BPE).
    #[serde(default = "d_vocab")]
    pub vocab: usize,
    /// Dropout probability on embeddings, attention output and MLP output (0 = none).
    #[serde(default)]
    pub dropout: f32,
    /// Pads the embedding's rows and the logits up to a multiple of this, as Megatron's
    /// --make-vocab-size-divisible-by and nanoGPT's 50304 do, so that the LM head's products run
    /// on aligned rows; the padded logits are masked to −∞, so the loss, its gradient and every
    /// trained value are the unpadded model's (1 = no padding).
    #[serde(default = "d_one")]
    #[schemars(range(min = 1))]
    pub make_vocab_size_divisible_by: usize,
}

/// GPT-2 small (124M: 12 layers of width 768, 12 heads, 1024 positions) with the keys' defaults,
/// for code that names only what it changes.
impl Default for Gpt2Config {
    fn default() -> Self {
        Gpt2Config {
            layers: 12,
            heads: 12,
            embed: 768,
            seq_len: 1024,
            vocab: d_vocab(),
            dropout: 0.0,
            make_vocab_size_divisible_by: d_one(),
        }
    }
}

impl Gpt2Config {
    /// The vocabulary as the model holds it: `vocab` rounded up to the padding's multiple.
    pub fn padded_vocab(&self) -> usize {
        self.vocab.checked_next_multiple_of(self.make_vocab_size_divisible_by.max(1)).unwrap_or(self.vocab)
    }
}

fn d_vocab() -> usize {
    50257
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LlamaConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Query heads per block (embed must be a multiple).
    pub heads: usize,
    /// Key/value heads (grouped-query attention; heads must be a multiple). Equal to heads for
    /// multi-head attention.
    pub kv_heads: usize,
    /// Embedding width; a multiple of `heads`, with an even head width.
    pub embed: usize,
    /// Width of the SwiGLU MLP.
    pub ffn: usize,
    /// Sequence length.
    pub seq_len: usize,
    /// Vocabulary size (32000 for Llama 2's tokenizer).
    pub vocab: usize,
    /// Base of the rotary embedding's angles.
    #[serde(default = "d_rope_theta")]
    pub rope_theta: f64,
    /// ε of the RMSNorms.
    #[serde(default = "d_norm_eps")]
    pub norm_eps: f64,
}

fn d_rope_theta() -> f64 {
    10000.0
}
fn d_norm_eps() -> f64 {
    1e-6
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SqueezeNetConfig {
    /// Output classes.
    #[serde(default = "d_classes")]
    pub classes: usize,
    /// Height and width of the (square, 3-channel) input image.
    #[serde(default = "d_image")]
    pub image_size: usize,
}

fn d_classes() -> usize {
    1000
}
fn d_image() -> usize {
    224
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MlpConfig {
    /// Input features.
    pub inputs: usize,
    /// Widths of the hidden layers (ReLU after each).
    pub hidden: Vec<usize>,
    /// Output classes.
    pub classes: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OnnxModelConfig {
    /// The model file (relative paths are relative to the configuration file).
    pub path: PathBuf,
    /// The loss: attached by `type`, or already in the model (`output` only).
    pub loss: LossConfig,
    /// Sizes of symbolic dimensions of the inputs (e.g. `batch: 8`); the batch dimension is
    /// bound from `batchSize` when not given.
    #[serde(default)]
    pub dims: BTreeMap<String, usize>,
    /// Embedding rows that do not train through their lookup, as PyTorch's
    /// `nn.Embedding(padding_idx=…)` keeps them (ONNX exports lose padding_idx): the
    /// embedding's initializer name → the row (negative counts from the end). A tied use of
    /// the same weight, such as an LM head, still trains the row.
    #[serde(default)]
    pub padding_idx: BTreeMap<String, i64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LossConfig {
    /// `softmaxCrossEntropy` or `mse` to attach a loss; absent when the model computes it.
    #[serde(default, rename = "type")]
    pub kind: Option<LossKind>,
    /// The graph output the loss reads (or, without `type`, the loss itself).
    pub output: String,
    /// The name of the label input the attached loss adds.
    #[serde(default = "d_label")]
    pub label: String,
    /// Label value that does not count (softmaxCrossEntropy).
    #[serde(default)]
    pub ignore_index: Option<i64>,
}

fn d_label() -> String {
    "labels".into()
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum LossKind {
    SoftmaxCrossEntropy,
    Mse,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DataConfig {
    /// The training shards.
    pub train: DataSource,
    /// The evaluation shards (needed when evaluation.every > 0).
    #[serde(default)]
    pub eval: Option<DataSource>,
    /// Shuffle the order of samples (token windows or sample records) with the seed.
    #[serde(default = "d_true")]
    pub shuffle: bool,
}

fn d_true() -> bool {
    true
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DataSource {
    /// A directory of shards, or one shard file.
    pub path: PathBuf,
    /// tokens (llm.c .bin shards) or onnxSamples (ONNX Runtime .pb shards).
    pub format: DataFormat,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum DataFormat {
    /// llm.c token shards (`*.bin`).
    Tokens,
    /// ONNX Runtime sample shards (`*.pb`).
    OnnxSamples,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OptimizerConfig {
    /// sgd, adam, adamw or lamb.
    #[serde(default)]
    pub name: OptimizerName,
    /// Peak learning rate.
    #[serde(default = "d_lr")]
    pub lr: f64,
    /// Adam/LAMB first-moment decay.
    #[serde(default = "d_beta1")]
    pub beta1: f64,
    /// Adam/LAMB second-moment decay.
    #[serde(default = "d_beta2")]
    pub beta2: f64,
    /// Adam/LAMB denominator epsilon.
    #[serde(default = "d_eps")]
    pub epsilon: f64,
    /// Weight decay (decoupled for adamw and lamb, L2 for sgd and adam).
    #[serde(default)]
    pub weight_decay: f64,
    /// SGD momentum.
    #[serde(default)]
    pub momentum: f64,
    /// Nesterov momentum (sgd with a momentum only).
    #[serde(default)]
    pub nesterov: bool,
    /// Weights whose name contains one of these strings get no weight decay. Empty: the
    /// default rule, no decay for weights of rank below 2 (biases, normalization scales).
    #[serde(default)]
    pub no_decay: Vec<String>,
    /// Per-weight hyperparameters, like PyTorch's parameter groups (ONNX Runtime's per-weight
    /// optimizer attributes): a weight takes the first group with a matching pattern, and the
    /// keys a group sets replace the ones above for it.
    #[serde(default)]
    pub groups: Vec<ParamGroup>,
}

/// Hyperparameters for the weights whose names contain one of `weights`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ParamGroup {
    /// Name patterns: substrings of initializer names, or `*` for every weight.
    pub weights: Vec<String>,
    /// Multiplies the scheduled learning rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr_scale: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta1: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta2: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epsilon: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub momentum: Option<f64>,
}

impl ParamGroup {
    pub fn matches(&self, weight: &str) -> bool {
        self.weights.iter().any(|p| p == "*" || weight.contains(p.as_str()))
    }
}

fn d_lr() -> f64 {
    1e-3
}
fn d_beta1() -> f64 {
    0.9
}
fn d_beta2() -> f64 {
    0.999
}
fn d_eps() -> f64 {
    1e-8
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            name: OptimizerName::Adamw,
            lr: d_lr(),
            beta1: d_beta1(),
            beta2: d_beta2(),
            epsilon: d_eps(),
            weight_decay: 0.0,
            momentum: 0.0,
            nesterov: false,
            no_decay: vec![],
            groups: vec![],
        }
    }
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum OptimizerName {
    Sgd,
    Adam,
    #[default]
    Adamw,
    /// Layer-wise adaptive moments (You et al.): Adam's step scaled per tensor by ‖w‖/‖step‖.
    Lamb,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LrSchedule {
    /// constant, linear, polynomial, cosine or warmupStableDecay.
    #[serde(default)]
    pub name: ScheduleName,
    /// Updates of linear warmup from lr/warmupSteps to lr.
    #[serde(default)]
    pub warmup_steps: u64,
    /// The rate decaying schedules end at (0 when absent).
    #[serde(default)]
    pub min_lr: Option<f64>,
    /// Exponent of the polynomial schedule.
    #[serde(default = "d_power")]
    pub power: f64,
    /// Share of the post-warmup steps that warmup-stable-decay spends decaying.
    #[serde(default = "d_decay_fraction")]
    pub decay_fraction: f64,
}

fn d_power() -> f64 {
    1.0
}
fn d_decay_fraction() -> f64 {
    0.2
}

impl Default for LrSchedule {
    fn default() -> Self {
        LrSchedule {
            name: ScheduleName::Constant,
            warmup_steps: 0,
            min_lr: None,
            power: d_power(),
            decay_fraction: d_decay_fraction(),
        }
    }
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum ScheduleName {
    #[default]
    Constant,
    Linear,
    Polynomial,
    Cosine,
    WarmupStableDecay,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum Precision {
    #[default]
    Fp32,
    Fp16,
    Bf16,
}

/// fp16's dynamic loss scale (PyTorch's GradScaler and ONNX Runtime's defaults).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DynamicLossScale {
    /// The scale of the first step (2^16).
    #[serde(default = "d_initial_loss_scale")]
    pub initial: f64,
    /// Consecutive steps without an overflow after which the scale doubles (2000).
    #[serde(default = "d_growth_interval")]
    pub growth_interval: u64,
}

fn d_initial_loss_scale() -> f64 {
    65536.0
}
fn d_growth_interval() -> u64 {
    2000
}

impl Default for DynamicLossScale {
    fn default() -> Self {
        DynamicLossScale { initial: d_initial_loss_scale(), growth_interval: d_growth_interval() }
    }
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum Recompute {
    #[default]
    None,
    Gelu,
    Layer,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
pub enum PipelineSchedule {
    /// One forward, one backward (PipeDream-Flush, Megatron's default): at most `stages - stage`
    /// micro-batches in flight per stage.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Every micro-batch's forward, then every backward: all micro-batches in flight.
    #[serde(rename = "gpipe")]
    Gpipe,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum DeviceKind {
    /// CUDA when a GPU is present, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Parallelism {
    /// Data-parallel replicas.
    #[serde(default = "d_one")]
    pub data: usize,
    /// Tensor-parallel (Megatron) shards per layer.
    #[serde(default = "d_one")]
    pub tensor: usize,
    /// Pipeline stages.
    #[serde(default = "d_one")]
    pub pipeline: usize,
    /// ZeRO stage: 0 off, 1 optimizer state sharded, 2 gradients too.
    #[serde(default)]
    pub zero: u8,
    /// The order in which pipeline stages run the micro-batches' forward and backward passes.
    #[serde(default)]
    pub schedule: PipelineSchedule,
    /// Where the pipeline's stages meet, as ONNX Runtime's cut edges: one list of value names per
    /// cut (`pipeline - 1` lists); the cut falls just after the last of them is computed. Empty:
    /// cuts placed automatically, balancing the stages' FLOPs.
    #[serde(default)]
    pub pipeline_cuts: Vec<Vec<String>>,
    /// MiB of gradients per data-parallel all-reduce (PyTorch DDP's `bucket_cap_mb`): buckets
    /// start as soon as the backward pass has finished their gradients.
    #[serde(default = "d_bucket_mb")]
    pub bucket_mb: f64,
    /// Combine data-parallel gradients with Adasum instead of averaging them.
    #[serde(default)]
    pub adasum: bool,
    /// Collectives on GPUs go through NCCL; false sends them through MPI (host copies).
    #[serde(default = "d_true")]
    pub nccl: bool,
    /// Seconds a collective may wait for the other ranks before this rank gives up and exits
    /// (a dead or hung peer must not hang the job forever).
    #[serde(default = "d_collective_timeout")]
    pub timeout_seconds: u64,
}

fn d_bucket_mb() -> f64 {
    25.0
}

fn d_collective_timeout() -> u64 {
    600
}

impl Default for Parallelism {
    fn default() -> Self {
        Parallelism {
            data: 1,
            tensor: 1,
            pipeline: 1,
            zero: 0,
            schedule: PipelineSchedule::default(),
            pipeline_cuts: vec![],
            bucket_mb: d_bucket_mb(),
            adasum: false,
            nccl: true,
            timeout_seconds: d_collective_timeout(),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EvaluationConfig {
    /// Evaluate every this many updates (0 = never).
    #[serde(default)]
    pub every: u64,
    /// Batches per evaluation.
    #[serde(default = "d_eval_batches")]
    pub batches: usize,
    /// Samples per evaluation batch and data-parallel rank (default: batchSize).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<usize>,
}

fn d_eval_batches() -> usize {
    4
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Save every this many updates (0 = never).
    #[serde(default)]
    pub every: u64,
    /// How many checkpoints to keep (the newest).
    #[serde(default = "d_keep")]
    pub keep: usize,
    /// `auto`: continue from the newest complete checkpoint in `output.dir/checkpoints` (a
    /// damaged one is skipped with a warning); `never`; or the path of one checkpoint.
    #[serde(default = "d_resume")]
    pub resume: String,
    /// Where checkpoints go (default: output.dir/checkpoints; relative to the outputs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
}

fn d_resume() -> String {
    "auto".into()
}

fn d_keep() -> usize {
    3
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig { every: 0, keep: d_keep(), resume: d_resume(), dir: None }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LoggingConfig {
    /// Log every this many updates.
    #[serde(default = "d_log_every")]
    pub every: u64,
    /// Also write the logged scalars as TensorBoard events (`output.dir/tensorboard/`).
    #[serde(default = "d_true")]
    pub tensorboard: bool,
    /// Serve `/progress` (JSON) and `/metrics` (Prometheus) on this TCP port; 0 = off. The
    /// operator sets it to the TrainingJob's spec.progressPort.
    #[serde(default)]
    pub port: u16,
    /// Where TensorBoard events go (default: output.dir/tensorboard; relative to the outputs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensorboard_dir: Option<PathBuf>,
    /// Weights whose value and gradient histograms are logged to TensorBoard at each logged
    /// step: initializer names, or `*` for all.
    #[serde(default)]
    pub histograms: Vec<String>,
    /// Weights whose value and gradient L2 norms are logged to TensorBoard: names, or `*`.
    #[serde(default)]
    pub norms: Vec<String>,
    /// Further scalar values of the training graph (by name) logged beside the loss.
    #[serde(default)]
    pub scalars: Vec<String>,
    /// The device's peak FLOP/s, in TFLOP/s, that model FLOPs utilization (MFU) is measured
    /// against; 0 = the GPU's known dense peak for the precision (none on the CPU, so no MFU).
    #[serde(default)]
    pub peak_tflops: f64,
}

fn d_log_every() -> u64 {
    1
}

impl Default for LoggingConfig {
    fn default() -> Self {
        LoggingConfig {
            every: 1,
            tensorboard: true,
            port: 0,
            tensorboard_dir: None,
            histograms: vec![],
            norms: vec![],
            scalars: vec![],
            peak_tflops: 0.0,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OutputConfig {
    /// Where metrics.jsonl, checkpoints/ and model.onnx go (relative to the configuration file).
    #[serde(default = "d_out")]
    pub dir: PathBuf,
    /// Also save the model with its loss attached, before differentiation, as ONNX (for
    /// inspection; relative to the outputs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_with_loss: Option<PathBuf>,
    /// Also save the training graph (forward, loss, gradients, after fusion) as ONNX, for
    /// inspection in Netron; fused and gradient ops are in the `dev.tensorfleet` domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub training_graph: Option<PathBuf>,
}

fn d_out() -> PathBuf {
    PathBuf::from("out")
}

impl Default for OutputConfig {
    fn default() -> Self {
        OutputConfig { dir: d_out(), model_with_loss: None, training_graph: None }
    }
}

/// Sets `a.b.c = value` in a YAML document; `value` is parsed as YAML (so `3`, `true`,
/// `[1,2]` and `{x: 1}` keep their types).
pub fn apply_override(doc: &mut serde_yaml::Value, assignment: &str) -> Result<()> {
    let (path, raw) = assignment
        .split_once('=')
        .ok_or_else(|| Error::Config(format!("--set '{assignment}': expected key.path=value")))?;
    let value: serde_yaml::Value = serde_yaml::from_str(raw)
        .map_err(|e| Error::Config(format!("--set {path}: the value '{raw}' is not valid YAML: {e}")))?;
    let mut node = doc;
    let keys: Vec<&str> = path.split('.').collect();
    for (i, key) in keys.iter().enumerate() {
        if key.is_empty() {
            return Err(Error::Config(format!("--set '{assignment}': empty key in '{path}'")));
        }
        if !node.is_mapping() {
            return Err(Error::Config(format!("--set {path}: '{}' is not a mapping", keys[..i].join("."))));
        }
        let map = node.as_mapping_mut().expect("checked above");
        let k = serde_yaml::Value::String(key.to_string());
        if i + 1 == keys.len() {
            map.insert(k, value);
            return Ok(());
        }
        if !map.contains_key(&k) {
            map.insert(k.clone(), serde_yaml::Value::Mapping(Default::default()));
        }
        node = map.get_mut(&k).expect("inserted above");
    }
    Ok(())
}

impl TrainingConfig {
    /// Parses YAML (or JSON) text; `origin` names the file in messages. Errors name the key.
    pub fn parse(text: &str, origin: &str, overrides: &[String]) -> Result<TrainingConfig> {
        let mut doc: serde_yaml::Value =
            serde_yaml::from_str(text).map_err(|e| Error::Config(format!("{origin}: not valid YAML: {e}")))?;
        for o in overrides {
            apply_override(&mut doc, o)?;
        }
        let cfg: TrainingConfig = serde_path_to_error::deserialize(doc).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            Error::Config(format!("{origin}: key '{path}': {inner}"))
        })?;
        cfg.validate(origin)?;
        Ok(cfg)
    }

    /// Reads a configuration file; relative paths inside it become relative to its directory.
    pub fn load(path: &Path, overrides: &[String]) -> Result<TrainingConfig> {
        let bytes = crate::files::read_input(path)
            .map_err(|e| Error::Config(format!("configuration file {}: {e}", path.display())))?;
        let text = String::from_utf8(bytes)
            .map_err(|e| Error::Config(format!("configuration file {}: not UTF-8 text: {e}", path.display())))?;
        let mut cfg = TrainingConfig::parse(&text, &path.display().to_string(), overrides)?;
        let base = path.parent().unwrap_or(Path::new("."));
        cfg.resolve_paths(base, base);
        Ok(cfg)
    }

    /// Makes relative paths absolute: the model and the data under `inputs`, the output
    /// directory and a resume path under `outputs`. A configuration file resolves both against
    /// its own directory; the operator puts inputs on the data volume and outputs on the claim.
    pub fn resolve_paths(&mut self, inputs: &Path, outputs: &Path) {
        let fix = |p: &mut PathBuf, base: &Path| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        if let Some(o) = &mut self.model.onnx {
            fix(&mut o.path, inputs);
        }
        fix(&mut self.data.train.path, inputs);
        if let Some(e) = &mut self.data.eval {
            fix(&mut e.path, inputs);
        }
        fix(&mut self.output.dir, outputs);
        for p in [
            &mut self.checkpoint.dir,
            &mut self.logging.tensorboard_dir,
            &mut self.output.model_with_loss,
            &mut self.output.training_graph,
        ]
        .into_iter()
        .flatten()
        {
            fix(p, outputs);
        }
        if !matches!(self.checkpoint.resume.as_str(), "auto" | "never")
            && Path::new(&self.checkpoint.resume).is_relative()
        {
            self.checkpoint.resume = outputs.join(&self.checkpoint.resume).display().to_string();
        }
    }

    /// Where checkpoints go: checkpoint.dir, else output.dir/checkpoints.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint.dir.clone().unwrap_or_else(|| self.output.dir.join("checkpoints"))
    }

    /// Where TensorBoard events go: logging.tensorboardDir, else output.dir/tensorboard.
    pub fn tensorboard_dir(&self) -> PathBuf {
        self.logging.tensorboard_dir.clone().unwrap_or_else(|| self.output.dir.join("tensorboard"))
    }

    /// Samples per evaluation batch and data-parallel rank.
    pub fn eval_batch_size(&self) -> usize {
        self.evaluation.batch_size.unwrap_or(self.batch_size)
    }

    /// Checks what the types cannot: ranges and combinations. Messages name the key.
    pub fn validate(&self, origin: &str) -> Result<()> {
        let bad = |key: &str, why: String| Err(Error::Config(format!("{origin}: key '{key}': {why}")));
        if self.batch_size == 0 {
            return bad("batchSize", "must be at least 1".into());
        }
        if self.gradient_accumulation_steps == 0 {
            return bad("gradientAccumulationSteps", "must be at least 1".into());
        }
        if self.steps == 0 {
            return bad("steps", "must be at least 1".into());
        }
        if !(self.optimizer.lr > 0.0 && self.optimizer.lr.is_finite()) {
            return bad("optimizer.lr", format!("must be a positive number, not {}", self.optimizer.lr));
        }
        for (k, v) in [
            ("optimizer.beta1", self.optimizer.beta1),
            ("optimizer.beta2", self.optimizer.beta2),
            ("optimizer.momentum", self.optimizer.momentum),
        ] {
            if !(0.0..1.0).contains(&v) {
                return bad(k, format!("must be in [0, 1), not {v}"));
            }
        }
        // Written as what a value must be, so that NaN (for which every comparison is false)
        // fails each check rather than passing it.
        if !(self.optimizer.epsilon > 0.0 && self.optimizer.epsilon.is_finite()) {
            return bad("optimizer.epsilon", format!("must be a positive number, not {}", self.optimizer.epsilon));
        }
        if !(self.optimizer.weight_decay >= 0.0 && self.optimizer.weight_decay.is_finite()) {
            return bad(
                "optimizer.weightDecay",
                format!("must be a non-negative number, not {}", self.optimizer.weight_decay),
            );
        }
        if self.optimizer.nesterov && (self.optimizer.name != OptimizerName::Sgd || self.optimizer.momentum == 0.0) {
            return bad("optimizer.nesterov", "needs optimizer.name sgd with a momentum".into());
        }
        for (i, g) in self.optimizer.groups.iter().enumerate() {
            let key = |k: &str| format!("optimizer.groups[{i}].{k}");
            if g.weights.is_empty() || g.weights.iter().any(|p| p.is_empty()) {
                return bad(&key("weights"), "give at least one non-empty name pattern (or '*')".into());
            }
            for (k, v) in [("beta1", g.beta1), ("beta2", g.beta2), ("momentum", g.momentum)] {
                if let Some(v) = v.filter(|v| !(0.0..1.0).contains(v)) {
                    return bad(&key(k), format!("must be in [0, 1), not {v}"));
                }
            }
            for (k, v) in [("lrScale", g.lr_scale), ("weightDecay", g.weight_decay)] {
                if let Some(v) = v.filter(|v| !(*v >= 0.0 && v.is_finite())) {
                    return bad(&key(k), format!("must be a non-negative number, not {v}"));
                }
            }
            if let Some(e) = g.epsilon.filter(|e| !(*e > 0.0 && e.is_finite())) {
                return bad(&key("epsilon"), format!("must be a positive number, not {e}"));
            }
        }
        if let Some(w) = self.weights_to_train.iter().find(|w| self.frozen_weights.contains(w)) {
            return bad("weightsToTrain", format!("'{w}' is also in frozenWeights"));
        }
        if !(self.loss_scale >= 0.0 && self.loss_scale.is_finite()) {
            return bad("lossScale", format!("must be a non-negative number (0 = dynamic), not {}", self.loss_scale));
        }
        let dynamic = self.dynamic_loss_scale;
        if !(1.0..=16777216.0).contains(&dynamic.initial) {
            return bad("dynamicLossScale.initial", format!("must be within [1, 2^24], not {}", dynamic.initial));
        }
        if dynamic.growth_interval == 0 {
            return bad("dynamicLossScale.growthInterval", "must be at least 1".into());
        }
        if self.evaluation.batch_size == Some(0) {
            return bad("evaluation.batchSize", "must be at least 1".into());
        }
        if !(self.logging.peak_tflops >= 0.0 && self.logging.peak_tflops.is_finite()) {
            return bad("logging.peakTflops", "must be a non-negative number (0 = the GPU's known peak)".into());
        }
        if !(self.grad_clip_norm >= 0.0 && self.grad_clip_norm.is_finite()) {
            return bad(
                "gradClipNorm",
                format!("must be a non-negative number (0 switches clipping off), not {}", self.grad_clip_norm),
            );
        }
        if let Some(m) = self.lr_schedule.min_lr {
            if !(m >= 0.0 && m <= self.optimizer.lr) {
                return bad("lrSchedule.minLr", format!("must be in [0, optimizer.lr], not {m}"));
            }
        }
        if !(0.0..=1.0).contains(&self.lr_schedule.decay_fraction) {
            return bad("lrSchedule.decayFraction", "must be in [0, 1]".into());
        }
        if self.lr_schedule.warmup_steps > self.steps {
            return bad(
                "lrSchedule.warmupSteps",
                format!("{} exceeds steps ({})", self.lr_schedule.warmup_steps, self.steps),
            );
        }
        let p = &self.parallelism;
        if p.data == 0 || p.tensor == 0 || p.pipeline == 0 {
            return bad("parallelism", "sizes must be at least 1".into());
        }
        if p.zero > 2 {
            return bad("parallelism.zero", format!("stage {} does not exist (0, 1 or 2)", p.zero));
        }
        if p.adasum && p.zero > 0 {
            return bad(
                "parallelism.adasum",
                "Adasum combines whole gradients; it does not run with ZeRO (parallelism.zero > 0)".into(),
            );
        }
        if !p.pipeline_cuts.is_empty() && p.pipeline_cuts.len() + 1 != p.pipeline {
            return bad(
                "parallelism.pipelineCuts",
                format!(
                    "{} cut(s) make {} stages, but parallelism.pipeline is {}",
                    p.pipeline_cuts.len(),
                    p.pipeline_cuts.len() + 1,
                    p.pipeline
                ),
            );
        }
        if let Some(i) = p.pipeline_cuts.iter().position(|c| c.is_empty()) {
            return bad(&format!("parallelism.pipelineCuts[{i}]"), "names no value".into());
        }
        if !(p.bucket_mb > 0.0 && p.bucket_mb.is_finite()) {
            return bad("parallelism.bucketMb", format!("must be a positive number of MiB, not {}", p.bucket_mb));
        }
        if p.timeout_seconds == 0 {
            return bad("parallelism.timeoutSeconds", "must be at least 1".into());
        }
        if self.evaluation.every > 0 && self.data.eval.is_none() {
            return bad("evaluation.every", "needs data.eval".into());
        }
        if self.evaluation.every > 0 && self.evaluation.batches == 0 {
            return bad("evaluation.batches", "must be at least 1".into());
        }
        if self.checkpoint.keep == 0 {
            return bad("checkpoint.keep", "must be at least 1".into());
        }
        let prof = &self.profiling;
        if prof.from_step > 0 && (prof.to_step < prof.from_step || prof.to_step > self.steps) {
            return bad(
                "profiling.toStep",
                format!(
                    "must be in [profiling.fromStep ({}), steps ({})], not {}",
                    prof.from_step, self.steps, prof.to_step
                ),
            );
        }
        if self.logging.every == 0 {
            return bad("logging.every", "must be at least 1".into());
        }
        let kind = self.model.kind().map_err(|e| Error::Config(format!("{origin}: {e}")))?;
        match kind {
            ModelConfig::Gpt2(g) => {
                if g.layers == 0 || g.heads == 0 || g.embed == 0 || g.seq_len == 0 || g.vocab == 0 {
                    return bad("model.gpt2", "layers, heads, embed, seqLen and vocab must be at least 1".into());
                }
                if g.make_vocab_size_divisible_by == 0
                    || g.vocab.checked_next_multiple_of(g.make_vocab_size_divisible_by).is_none()
                {
                    return bad(
                        "model.gpt2.makeVocabSizeDivisibleBy",
                        "must be at least 1, and vocab rounded up to it must fit".into(),
                    );
                }
                if g.embed % g.heads != 0 {
                    return bad("model.gpt2.embed", format!("{} is not a multiple of heads ({})", g.embed, g.heads));
                }
                if !(0.0..1.0).contains(&g.dropout) {
                    return bad("model.gpt2.dropout", "must be in [0, 1)".into());
                }
                if self.data.train.format != DataFormat::Tokens {
                    return bad("data.train.format", "GPT-2 trains on token shards (format: tokens)".into());
                }
            }
            ModelConfig::Llama(l) => {
                let sizes = [l.layers, l.heads, l.kv_heads, l.embed, l.ffn, l.seq_len, l.vocab];
                if sizes.contains(&0) {
                    return bad(
                        "model.llama",
                        "layers, heads, kvHeads, embed, ffn, seqLen and vocab must be at least 1".into(),
                    );
                }
                if l.embed % l.heads != 0 || (l.embed / l.heads) % 2 != 0 {
                    return bad(
                        "model.llama.embed",
                        format!(
                            "{} is not an even multiple of heads ({}): the rotary embedding halves each head",
                            l.embed, l.heads
                        ),
                    );
                }
                if l.heads % l.kv_heads != 0 {
                    return bad("model.llama.kvHeads", format!("{} does not divide heads ({})", l.kv_heads, l.heads));
                }
                if !(l.rope_theta > 1.0 && l.rope_theta.is_finite() && l.norm_eps > 0.0 && l.norm_eps.is_finite()) {
                    return bad("model.llama", "ropeTheta must exceed 1 and normEps be positive".into());
                }
                if self.data.train.format != DataFormat::Tokens {
                    return bad("data.train.format", "Llama trains on token shards (format: tokens)".into());
                }
            }
            ModelConfig::Squeezenet(s) => {
                if s.image_size < 32 || s.classes == 0 {
                    return bad("model.squeezenet", "imageSize must be at least 32 and classes at least 1".into());
                }
            }
            ModelConfig::Mlp(m) => {
                if m.inputs == 0 || m.classes == 0 || m.hidden.contains(&0) {
                    return bad("model.mlp", "inputs, classes and hidden widths must be at least 1".into());
                }
            }
            ModelConfig::Onnx(_) => {}
        }
        Ok(())
    }

    /// The JSON schema of the configuration (the operator embeds it as `spec.training`).
    pub fn schema() -> schemars::Schema {
        schemars::schema_for!(TrainingConfig)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "model: {gpt2: {layers: 2, heads: 2, embed: 64, seqLen: 64}}\n\
                        data: {train: {path: data/train, format: tokens}}\nbatchSize: 8\nsteps: 10\n";

    #[test]
    fn parses_defaults_and_overrides() {
        let c = TrainingConfig::parse(BASE, "t.yaml", &["optimizer.lr=0.01".into(), "seed=7".into()]).unwrap();
        assert_eq!(c.seed, 7);
        assert_eq!(c.optimizer.lr, 0.01);
        assert_eq!(c.optimizer.name, OptimizerName::Adamw);
        assert!(matches!(c.model.kind().unwrap(), ModelConfig::Gpt2(Gpt2Config { vocab: 50257, .. })));
    }

    /// NaN and infinities fail every range check (each is written as what a value must be).
    #[test]
    fn non_finite_numbers_are_refused_naming_the_key() {
        for (key, yaml) in [
            ("gradClipNorm", "gradClipNorm: .nan"),
            ("gradClipNorm", "gradClipNorm: .inf"),
            ("optimizer.epsilon", "optimizer: {lr: 0.1, epsilon: .nan}"),
            ("optimizer.weightDecay", "optimizer: {lr: 0.1, weightDecay: .nan}"),
            ("optimizer.lr", "optimizer: {lr: .nan}"),
            ("lrSchedule.minLr", "optimizer: {lr: 0.1}\nlrSchedule: {name: cosine, minLr: .nan}"),
            ("optimizer.groups[0].epsilon", "optimizer: {lr: 0.1, groups: [{weights: ['*'], epsilon: .nan}]}"),
        ] {
            let e = TrainingConfig::parse(&format!("{BASE}{yaml}\n"), "t.yaml", &[]).unwrap_err();
            assert!(e.to_string().contains(&format!("key '{key}'")), "{yaml}: {e}");
            assert_eq!(e.exit_code(), 2, "{yaml}: {e}");
        }
    }

    #[test]
    fn errors_name_the_key() {
        let e =
            TrainingConfig::parse(&format!("{BASE}optimizer: {{lr: 1, betta1: 0.9}}\n"), "t.yaml", &[]).unwrap_err();
        assert!(e.to_string().contains("optimizer"), "{e}");
        assert!(e.to_string().contains("betta1"), "{e}");
        assert_eq!(e.exit_code(), 2);
        let e = TrainingConfig::parse(BASE, "t.yaml", &["batchSize=0".into()]).unwrap_err();
        assert!(e.to_string().contains("batchSize"), "{e}");
        let e = TrainingConfig::parse(BASE, "t.yaml", &["optimizer.lr=fast".into()]).unwrap_err();
        assert!(e.to_string().contains("optimizer.lr"), "{e}");
        let e = TrainingConfig::parse(BASE, "t.yaml", &["model.gpt2.embed=65".into()]).unwrap_err();
        assert!(e.to_string().contains("model.gpt2.embed"), "{e}");
        let overflowing = [format!("model.gpt2.vocab={}", usize::MAX), "model.gpt2.makeVocabSizeDivisibleBy=2".into()];
        for sets in [&["model.gpt2.makeVocabSizeDivisibleBy=0".to_string()][..], &overflowing[..]] {
            let e = TrainingConfig::parse(BASE, "t.yaml", sets).unwrap_err();
            assert!(e.to_string().contains("model.gpt2.makeVocabSizeDivisibleBy"), "{e}");
        }
        let c = TrainingConfig::parse(BASE, "t.yaml", &["model.gpt2.makeVocabSizeDivisibleBy=128".into()]).unwrap();
        let ModelConfig::Gpt2(g) = c.model.kind().unwrap() else { panic!("not GPT-2") };
        assert_eq!((g.vocab, g.padded_vocab()), (50257, 50304));
    }

    #[test]
    fn json_is_yaml_and_schema_builds() {
        let json = r#"{"model": {"mlp": {"inputs": 4, "hidden": [8], "classes": 3}},
                      "data": {"train": {"path": "d", "format": "onnxSamples"}}, "batchSize": 2, "steps": 1}"#;
        TrainingConfig::parse(json, "t.json", &[]).unwrap();
        let s = serde_json::to_string(&TrainingConfig::schema()).unwrap();
        assert!(s.contains("batchSize"));
    }
}
