//! The engine's operator vocabulary: every ONNX op we run, with its attributes parsed and
//! checked once at load time, plus the internal ops the gradient rules and fusion passes emit
//! (the `tensorfleet` domain, like ONNX Runtime's `com.microsoft` training ops).
//!
//! Backends, shape inference and autodiff all `match` on [`Op`]; there is no string dispatch
//! after loading.

pub mod einsum;
pub mod resize;

pub use resize::Resize;

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use std::collections::BTreeMap;

/// Internal ops live in this domain when a graph is saved.
pub const TF_DOMAIN: &str = "dev.tensorfleet";

#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    Float(f32),
    Int(i64),
    Str(String),
    Tensor(Tensor),
    Floats(Vec<f32>),
    Ints(Vec<i64>),
    Strings(Vec<String>),
}

/// A node's attributes by name, with typed getters that name the node and attribute on error.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Attrs {
    pub map: BTreeMap<String, AttrValue>,
    /// "node 'name' (OpType)" for messages.
    pub origin: String,
}

impl Attrs {
    pub(super) fn bad(&self, name: &str, want: &str) -> Error {
        Error::Corrupt(format!("{}: attribute '{name}' must be {want}", self.origin))
    }
    pub fn int(&self, name: &str, default: i64) -> Result<i64> {
        match self.map.get(name) {
            None => Ok(default),
            Some(AttrValue::Int(v)) => Ok(*v),
            Some(_) => Err(self.bad(name, "an integer")),
        }
    }
    pub fn opt_int(&self, name: &str) -> Result<Option<i64>> {
        match self.map.get(name) {
            None => Ok(None),
            Some(AttrValue::Int(v)) => Ok(Some(*v)),
            Some(_) => Err(self.bad(name, "an integer")),
        }
    }
    pub fn float(&self, name: &str, default: f32) -> Result<f32> {
        match self.map.get(name) {
            None => Ok(default),
            Some(AttrValue::Float(v)) => Ok(*v),
            Some(AttrValue::Int(v)) => Ok(*v as f32),
            Some(_) => Err(self.bad(name, "a float")),
        }
    }
    pub fn ints(&self, name: &str) -> Result<Option<Vec<i64>>> {
        match self.map.get(name) {
            None => Ok(None),
            Some(AttrValue::Ints(v)) => Ok(Some(v.clone())),
            Some(AttrValue::Int(v)) => Ok(Some(vec![*v])),
            Some(_) => Err(self.bad(name, "a list of integers")),
        }
    }
    pub fn floats(&self, name: &str) -> Result<Option<Vec<f32>>> {
        match self.map.get(name) {
            None => Ok(None),
            Some(AttrValue::Floats(v)) => Ok(Some(v.clone())),
            Some(AttrValue::Float(v)) => Ok(Some(vec![*v])),
            Some(_) => Err(self.bad(name, "a list of floats")),
        }
    }
    pub fn strings(&self, name: &str) -> Result<Option<Vec<String>>> {
        match self.map.get(name) {
            None => Ok(None),
            Some(AttrValue::Strings(v)) => Ok(Some(v.clone())),
            Some(AttrValue::Str(v)) => Ok(Some(vec![v.clone()])),
            Some(_) => Err(self.bad(name, "a list of strings")),
        }
    }
    pub fn string(&self, name: &str, default: &str) -> Result<String> {
        match self.map.get(name) {
            None => Ok(default.to_string()),
            Some(AttrValue::Str(v)) => Ok(v.clone()),
            Some(_) => Err(self.bad(name, "a string")),
        }
    }
    pub fn tensor(&self, name: &str) -> Result<Option<Tensor>> {
        match self.map.get(name) {
            None => Ok(None),
            Some(AttrValue::Tensor(t)) => Ok(Some(t.clone())),
            Some(_) => Err(self.bad(name, "a tensor")),
        }
    }
}

/// Pointwise functions of one input. Those with parameters carry them (ONNX's attributes, and
/// Clip's bounds once folded); `code` and `params` are what the CUDA kernels switch on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Unary {
    Neg,
    Exp,
    Log,
    Sqrt,
    Tanh,
    Erf,
    Relu,
    Sigmoid,
    Abs,
    Reciprocal,
    Floor,
    Ceil,
    Not,
    /// Gelu with the exact erf form.
    Gelu,
    /// Gelu with the tanh approximation (GPT-2's).
    GeluTanh,
    Sin,
    Cos,
    Tan,
    Asin,
    Acos,
    Atan,
    Sinh,
    Cosh,
    Asinh,
    Acosh,
    Atanh,
    Sign,
    /// Round half to even, as ONNX and numpy round.
    Round,
    /// ln(1 + eˣ).
    Softplus,
    /// x / (1 + |x|).
    Softsign,
    /// x·tanh(softplus(x)).
    Mish,
    /// x·HardSigmoid(x) with α = 1/6, β = 1/2.
    HardSwish,
    /// max(0, min(1, αx + β)).
    HardSigmoid {
        alpha: f32,
        beta: f32,
    },
    LeakyRelu {
        alpha: f32,
    },
    /// x for x > 0, else α(eˣ − 1).
    Elu {
        alpha: f32,
    },
    /// γ·x for x > 0, else γ·α(eˣ − 1).
    Selu {
        alpha: f32,
        gamma: f32,
    },
    /// max(0, x) + min(0, α(e^(x/α) − 1)).
    Celu {
        alpha: f32,
    },
    /// x for x > α, else 0.
    ThresholdedRelu {
        alpha: f32,
    },
    /// min(max(x, min), max); NaN stays NaN. The gradient passes where min ≤ x ≤ max, as
    /// PyTorch's clamp's does.
    Clip {
        min: f32,
        max: f32,
    },
    /// Bool: x is NaN.
    IsNaN,
    /// Bool: x is +∞ (when `positive`) or −∞ (when `negative`).
    IsInf {
        negative: bool,
        positive: bool,
    },
    /// x·σ(x) (SiLU, Swish with β = 1): no ONNX op of the opsets read here; `fuse::silu` makes
    /// it from the Sigmoid and Mul that models are exported as.
    Silu,
}

impl Unary {
    /// The case the CUDA kernels' `unary_f` and `unary_df` switch on (kernels/elementwise.cu).
    pub fn code(self) -> i32 {
        use Unary::*;
        match self {
            Neg => 0,
            Exp => 1,
            Log => 2,
            Sqrt => 3,
            Tanh => 4,
            Erf => 5,
            Relu => 6,
            Sigmoid => 7,
            Abs => 8,
            Reciprocal => 9,
            Floor => 10,
            Ceil => 11,
            Not => 12,
            Gelu => 13,
            GeluTanh => 14,
            Sin => 15,
            Cos => 16,
            Tan => 17,
            Asin => 18,
            Acos => 19,
            Atan => 20,
            Sinh => 21,
            Cosh => 22,
            Asinh => 23,
            Acosh => 24,
            Atanh => 25,
            Sign => 26,
            Round => 27,
            Softplus => 28,
            Softsign => 29,
            Mish => 30,
            HardSwish => 31,
            HardSigmoid { .. } => 32,
            LeakyRelu { .. } => 33,
            Elu { .. } => 34,
            Selu { .. } => 35,
            Celu { .. } => 36,
            ThresholdedRelu { .. } => 37,
            Clip { .. } => 38,
            IsNaN => 39,
            IsInf { .. } => 40,
            Silu => 41,
        }
    }

    /// The parameters the kernels read as (p0, p1); unused ones are 0.
    pub fn params(self) -> [f32; 2] {
        use Unary::*;
        match self {
            HardSigmoid { alpha, beta } => [alpha, beta],
            LeakyRelu { alpha } | Elu { alpha } | Celu { alpha } | ThresholdedRelu { alpha } => [alpha, 0.0],
            Selu { alpha, gamma } => [alpha, gamma],
            Clip { min, max } => [min, max],
            IsInf { negative, positive } => [negative as u8 as f32, positive as u8 as f32],
            _ => [0.0, 0.0],
        }
    }

    /// Predicates give bool whatever their input is.
    pub fn is_predicate(self) -> bool {
        matches!(self, Unary::Not | Unary::IsNaN | Unary::IsInf { .. })
    }

    /// Step functions and predicates: their gradient is zero almost everywhere, so none flows.
    pub fn is_differentiable(self) -> bool {
        !matches!(self, Unary::Floor | Unary::Ceil | Unary::Round | Unary::Sign) && !self.is_predicate()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Max,
    Min,
    Equal,
    Less,
    Greater,
    LessOrEqual,
    GreaterOrEqual,
    And,
    Or,
    Xor,
    /// The remainder with the divisor's sign (Python's %, ONNX Mod with fmod=0).
    Mod,
    /// The remainder with the dividend's sign (C's fmod, ONNX Mod with fmod=1).
    Fmod,
    /// x for x ≥ 0, else slope·x, the slope broadcast to x (ONNX PRelu).
    PRelu,
}

impl Binary {
    /// Comparisons and logic produce bool whatever their inputs are.
    pub fn is_predicate(self) -> bool {
        use Binary::*;
        matches!(self, Equal | Less | Greater | LessOrEqual | GreaterOrEqual | And | Or | Xor)
    }

    /// And, Or and Xor: bool operands.
    pub fn is_logic(self) -> bool {
        matches!(self, Binary::And | Binary::Or | Binary::Xor)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Mean,
    Max,
    Min,
    SumSquare,
    /// Σ|x|.
    L1,
    /// √Σx².
    L2,
    /// ln Σx.
    LogSum,
    /// ln Σeˣ, taken as max + ln Σe^(x − max).
    LogSumExp,
    /// Πx.
    Prod,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolKind {
    Max,
    Average { count_include_pad: bool },
}

/// Spatial window parameters shared by Conv and pooling, with pads resolved to explicit values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    pub kernel: Vec<usize>,
    pub strides: Vec<usize>,
    pub dilations: Vec<usize>,
    /// begin pads then end pads, as ONNX lists them.
    pub pads: Vec<usize>,
    /// `auto_pad` still to resolve against the input shape ("NOTSET" once resolved).
    pub auto_pad: String,
    pub ceil_mode: bool,
}

impl Window {
    /// A window with its pads given (auto_pad NOTSET): how models and tests build one.
    pub fn explicit(
        kernel: &[usize],
        strides: &[usize],
        dilations: &[usize],
        pads: &[usize],
        ceil_mode: bool,
    ) -> Window {
        Window {
            kernel: kernel.to_vec(),
            strides: strides.to_vec(),
            dilations: dilations.to_vec(),
            pads: pads.to_vec(),
            auto_pad: "NOTSET".into(),
            ceil_mode,
        }
    }
}

/// How ScatterND combines an update with the element it lands on, in the order the CUDA
/// kernels number them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScatterReduction {
    /// The update replaces the element (of indices that repeat, the last wins).
    None,
    Add,
    Mul,
    Max,
    Min,
}

/// The normalizations binding writes out as reductions and arithmetic (`infer::expand_norm`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormKind {
    /// InstanceNormalization: each (sample, channel) over its spatial dims; scale and bias [C].
    Instance,
    /// GroupNormalization: each sample's channels in `groups` groups, each over its channels and
    /// spatial dims; scale and bias [C] (opset 21), or [groups] (opset 18).
    Group { groups: usize },
    /// RMSNormalization: x / √(mean(x²) + ε) over the dims from `axis` on, times scale.
    Rms { axis: i64 },
}

/// The ops over sequences of tensors; `graph::sequence` resolves them when the graph is bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SequenceOp {
    /// SplitToSequence: x (, split) -> the parts along `axis`; without `split`, parts of one
    /// element, the axis dropped unless `keepdims`.
    Split { axis: i64, keepdims: bool },
    /// SequenceConstruct: tensors -> the sequence of them.
    Construct,
    /// SequenceEmpty.
    Empty,
    /// SequenceAt: sequence, position -> the element.
    At,
    /// SequenceLength: sequence -> its length (i64 scalar).
    Length,
    /// SequenceInsert: sequence, tensor (, position; default the end).
    Insert,
    /// SequenceErase: sequence (, position; default the last).
    Erase,
    /// ConcatFromSequence: the elements concatenated along `axis`, or stacked along a new one.
    Concat { axis: i64, new_axis: bool },
}

/// The recurrent layers; `graph::recurrent` writes each out at bind time, unrolled over the
/// sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecurrentKind {
    /// Gates i, o, f, c; activations f, g, h (default Sigmoid, Tanh, Tanh).
    Lstm,
    /// Gates z, r, h; activations f, g (default Sigmoid, Tanh).
    Gru,
    /// One gate; activation f (default Tanh).
    Rnn,
}

impl RecurrentKind {
    /// Blocks of hidden_size rows in W and R (and in each half of B).
    pub fn gates(self) -> usize {
        match self {
            RecurrentKind::Lstm => 4,
            RecurrentKind::Gru => 3,
            RecurrentKind::Rnn => 1,
        }
    }

    /// The activation functions of one direction, by default.
    pub fn default_activations(self) -> &'static [&'static str] {
        match self {
            RecurrentKind::Lstm => &["Sigmoid", "Tanh", "Tanh"],
            RecurrentKind::Gru => &["Sigmoid", "Tanh"],
            RecurrentKind::Rnn => &["Tanh"],
        }
    }

    pub fn onnx_name(self) -> &'static str {
        match self {
            RecurrentKind::Lstm => "LSTM",
            RecurrentKind::Gru => "GRU",
            RecurrentKind::Rnn => "RNN",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Forward,
    Reverse,
    /// Forward, then reverse: every per-direction input and output holds both, forward first.
    Bidirectional,
}

impl Direction {
    pub fn count(self) -> usize {
        if self == Direction::Bidirectional {
            2
        } else {
            1
        }
    }

    /// Whether direction `d` (0 or 1 of `count()`) runs from the sequence's end.
    pub fn reversed(self, d: usize) -> bool {
        self == Direction::Reverse || (self == Direction::Bidirectional && d == 1)
    }
}

/// An activation function of a recurrent layer: a pointwise op, or one of the two ONNX names
/// (Affine, ScaledTanh) that no op of its own stands for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    Unary(Unary),
    /// αx + β.
    Affine {
        alpha: f32,
        beta: f32,
    },
    /// α·tanh(βx).
    ScaledTanh {
        alpha: f32,
        beta: f32,
    },
}

impl Activation {
    /// Parses an ONNX activation name (any case, as ONNX Runtime reads them), taking its α and
    /// β from the fronts of `alphas` and `betas` (the lists are consumed in the order of the
    /// activations) or their defaults when a list has run out.
    fn parse(name: &str, alphas: &mut std::slice::Iter<f32>, betas: &mut std::slice::Iter<f32>) -> Option<Activation> {
        let mut alpha = |default: f32| alphas.next().copied().unwrap_or(default);
        let act = match name.to_ascii_lowercase().as_str() {
            "relu" => Activation::Unary(Unary::Relu),
            "tanh" => Activation::Unary(Unary::Tanh),
            "sigmoid" => Activation::Unary(Unary::Sigmoid),
            "softsign" => Activation::Unary(Unary::Softsign),
            "softplus" => Activation::Unary(Unary::Softplus),
            "leakyrelu" => Activation::Unary(Unary::LeakyRelu { alpha: alpha(0.01) }),
            "thresholdedrelu" => Activation::Unary(Unary::ThresholdedRelu { alpha: alpha(1.0) }),
            "elu" => Activation::Unary(Unary::Elu { alpha: alpha(1.0) }),
            "hardsigmoid" => {
                let alpha = alpha(0.2);
                Activation::Unary(Unary::HardSigmoid { alpha, beta: betas.next().copied().unwrap_or(0.5) })
            }
            "affine" => {
                let alpha = alpha(1.0);
                Activation::Affine { alpha, beta: betas.next().copied().unwrap_or(0.0) }
            }
            "scaledtanh" => {
                let alpha = alpha(1.0);
                Activation::ScaledTanh { alpha, beta: betas.next().copied().unwrap_or(1.0) }
            }
            _ => return None,
        };
        Some(act)
    }

    /// The ONNX name, and the α and β it consumes from the attribute lists.
    fn onnx(self) -> (&'static str, Vec<f32>, Vec<f32>) {
        match self {
            Activation::Unary(u @ Unary::HardSigmoid { alpha, beta }) => {
                (Op::Unary(u).onnx_name().0, vec![alpha], vec![beta])
            }
            Activation::Unary(
                u @ (Unary::LeakyRelu { alpha } | Unary::ThresholdedRelu { alpha } | Unary::Elu { alpha }),
            ) => (Op::Unary(u).onnx_name().0, vec![alpha], vec![]),
            Activation::Unary(u) => (Op::Unary(u).onnx_name().0, vec![], vec![]),
            Activation::Affine { alpha, beta } => ("Affine", vec![alpha], vec![beta]),
            Activation::ScaledTanh { alpha, beta } => ("ScaledTanh", vec![alpha], vec![beta]),
        }
    }
}

/// LSTM, GRU and RNN's attributes. Inputs: X, W, R (, B, sequence_lens, initial_h, initial_c,
/// P); outputs Y (, Y_h, Y_c), any of them omitted.
#[derive(Clone, Debug, PartialEq)]
pub struct Recurrent {
    pub kind: RecurrentKind,
    pub direction: Direction,
    /// None: R's last dimension.
    pub hidden_size: Option<usize>,
    /// The activations of each direction in turn (forward's first), as many per direction as
    /// `kind.default_activations()` lists.
    pub activations: Vec<Activation>,
    /// Each gate's input is clipped to [−clip, clip] before its activation.
    pub clip: Option<f32>,
    /// LSTM: the forget gate is 1 − the input gate (ONNX Runtime's reading of input_forget).
    pub input_forget: bool,
    /// GRU: the reset gate applies after R's product (and its bias), as cuDNN and PyTorch do.
    pub linear_before_reset: bool,
    /// layout 1: X, Y, initial_h/c and Y_h/c are batch-major ([batch, seq, ...], [batch, dirs, ...]).
    pub batch_first: bool,
}

impl Recurrent {
    fn from_onnx(kind: RecurrentKind, a: &Attrs) -> Result<Recurrent> {
        let direction = match a.string("direction", "forward")?.as_str() {
            "forward" => Direction::Forward,
            "reverse" => Direction::Reverse,
            "bidirectional" => Direction::Bidirectional,
            other => return Err(a.bad("direction", &format!("forward, reverse or bidirectional, not '{other}'"))),
        };
        let activations = Recurrent::activations(kind, direction, a)?;
        let hidden_size = match a.opt_int("hidden_size")? {
            None => None,
            Some(h) => {
                Some(usize::try_from(h).ok().filter(|&h| h > 0).ok_or_else(|| a.bad("hidden_size", "positive"))?)
            }
        };
        let clip = a.map.contains_key("clip").then(|| a.float("clip", 0.0)).transpose()?;
        if clip.is_some_and(|c| c.is_nan() || c <= 0.0) {
            return Err(a.bad("clip", "a positive threshold"));
        }
        let batch_first = match a.int("layout", 0)? {
            0 => false,
            1 => true,
            other => return Err(a.bad("layout", &format!("0 or 1, not {other}"))),
        };
        Ok(Recurrent {
            kind,
            direction,
            hidden_size,
            activations,
            clip,
            input_forget: kind == RecurrentKind::Lstm && a.int("input_forget", 0)? != 0,
            linear_before_reset: kind == RecurrentKind::Gru && a.int("linear_before_reset", 0)? != 0,
            batch_first,
        })
    }

    /// `activations` (each direction's, or the defaults) with their α and β.
    fn activations(kind: RecurrentKind, direction: Direction, a: &Attrs) -> Result<Vec<Activation>> {
        let per_direction = kind.default_activations();
        let n = per_direction.len() * direction.count();
        let mut names = a
            .strings("activations")?
            .unwrap_or_else(|| per_direction.iter().cycle().take(n).map(|s| s.to_string()).collect());
        // RNN's schema default is ["Tanh", "Tanh"] whatever the direction; one direction takes
        // the first, as ONNX Runtime does.
        if kind == RecurrentKind::Rnn && n == 1 && names.len() == 2 {
            names.truncate(1);
        }
        if names.len() != n {
            let want = format!("{n} names ({} per direction), not {names:?}", per_direction.len());
            return Err(a.bad("activations", &want));
        }
        let (alphas, betas) =
            (a.floats("activation_alpha")?.unwrap_or_default(), a.floats("activation_beta")?.unwrap_or_default());
        let (mut alphas, mut betas) = (alphas.iter(), betas.iter());
        names
            .iter()
            .map(|name| {
                Activation::parse(name, &mut alphas, &mut betas).ok_or_else(|| {
                    Error::Unsupported(format!(
                        "{}: activation '{name}' is not supported (Relu, Tanh, Sigmoid, Affine, LeakyRelu, \
                         ThresholdedRelu, ScaledTanh, HardSigmoid, Elu, Softsign, Softplus are)",
                        a.origin
                    ))
                })
            })
            .collect()
    }

    /// The attributes `from_onnx` reads back into this (activations always written out).
    fn onnx_attrs(&self) -> Vec<(String, AttrValue)> {
        let (mut names, mut alphas, mut betas) = (vec![], vec![], vec![]);
        for act in &self.activations {
            let (name, a, b) = act.onnx();
            names.push(name.to_string());
            alphas.extend(a);
            betas.extend(b);
        }
        let direction = match self.direction {
            Direction::Forward => "forward",
            Direction::Reverse => "reverse",
            Direction::Bidirectional => "bidirectional",
        };
        let mut v = vec![
            ("direction".to_string(), AttrValue::Str(direction.into())),
            ("activations".to_string(), AttrValue::Strings(names)),
        ];
        // Written only when set: opsets before 14 have no layout.
        if self.batch_first {
            v.push(("layout".into(), AttrValue::Int(1)));
        }
        if !alphas.is_empty() {
            v.push(("activation_alpha".into(), AttrValue::Floats(alphas)));
        }
        if !betas.is_empty() {
            v.push(("activation_beta".into(), AttrValue::Floats(betas)));
        }
        if let Some(h) = self.hidden_size {
            v.push(("hidden_size".into(), AttrValue::Int(h as i64)));
        }
        if let Some(c) = self.clip {
            v.push(("clip".into(), AttrValue::Float(c)));
        }
        match self.kind {
            RecurrentKind::Lstm => v.push(("input_forget".into(), AttrValue::Int(self.input_forget as i64))),
            RecurrentKind::Gru => {
                v.push(("linear_before_reset".into(), AttrValue::Int(self.linear_before_reset as i64)))
            }
            RecurrentKind::Rnn => {}
        }
        v
    }
}

/// How Pad fills the border: ONNX's modes, in the order the CUDA kernels number them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PadMode {
    /// A constant value.
    Constant,
    /// The input mirrored about its edge elements (which are not repeated).
    Reflect,
    /// The edge element repeated.
    Edge,
    /// The input repeated, as if it were periodic.
    Wrap,
}

impl PadMode {
    /// The input coordinate that output coordinate `o` reads along an axis of `n` elements with
    /// `begin` padding before it (negative padding crops); None for the constant border.
    pub fn source(self, o: i64, begin: i64, n: i64) -> Option<i64> {
        let i = o - begin;
        if (0..n).contains(&i) {
            return Some(i);
        }
        match self {
            PadMode::Constant => None,
            PadMode::Edge => Some(i.clamp(0, n - 1)),
            PadMode::Wrap => Some(i.rem_euclid(n)),
            PadMode::Reflect if n == 1 => Some(0),
            PadMode::Reflect => {
                let j = i.rem_euclid(2 * n - 2);
                Some(if j >= n { 2 * n - 2 - j } else { j })
            }
        }
    }
}

/// How fused attention's q, k and v (and y, dY and the gradients) lie in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionLayout {
    /// q, k, v and y [.., T, D]: a group's (batch × head's) rows one after another.
    HeadsFirst,
    /// [.., T, H, D]: each token's heads side by side, as the projections write them and the
    /// output projection reads them (`fuse::attention_token_major`).
    TokenMajor,
    /// One operand qkv [.., T, 3, H, D]: each token's q, k and v heads side by side, as one
    /// projection writes them (GPT-2's c_attn; `fuse::attention_packed`), and its gradient dqkv
    /// alike; y and dY stay [.., T, H, D].
    Packed,
}

impl AttentionLayout {
    /// The attention's operands in the forward pass: q, k and v, or the one qkv.
    pub fn operands(self) -> usize {
        if self == AttentionLayout::Packed {
            1
        } else {
            3
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AttentionLayout::HeadsFirst => "headsFirst",
            AttentionLayout::TokenMajor => "tokenMajor",
            AttentionLayout::Packed => "packed",
        }
    }
}

/// Fused attention's operands as both backends walk them: `groups` independent attentions
/// (batch × heads) of `tq` query and `tk` key rows of `d` elements. k and v may have fewer heads
/// than q (grouped-query attention, as Hugging Face's `repeat_kv` and SDPA's `enable_gqa` mean
/// it): each of theirs serves `rep` query heads side by side, query group g reading key group
/// g / rep. A group's rows lie one row apart ([.., H, T, D]: `interleaved` 1) or, token-major,
/// `interleaved` = H groups' rows side by side in each token ([.., T, H, D]; k's and v's
/// [`kv_interleaved`](Self::kv_interleaved) = H / rep); `packed`, q's, k's and v's heads side by
/// side in each token of one operand, each token 3·H·D elements on (k and v start at
/// [`parts`](Self::parts)), while y and dY stay [.., T, H, D]. The log-sum-exp is [groups, tq]
/// either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub groups: usize,
    pub interleaved: usize,
    pub rep: usize,
    pub tq: usize,
    pub tk: usize,
    pub d: usize,
    pub packed: bool,
}

impl AttentionShape {
    /// From q's and k's shapes (qkv's, twice, packed), None where they are not attention's:
    /// ranks or D differ, or another axis than the rows' and the heads' (the one before the
    /// rows, or token-major after them), or k's heads do not divide q's; packed, qkv not
    /// [.., T, 3, H, D].
    pub fn of(q: &[usize], k: &[usize], layout: AttentionLayout) -> Option<AttentionShape> {
        if layout == AttentionLayout::Packed {
            let r = q.len();
            if r < 4 || q[r - 3] != 3 || k != q {
                return None;
            }
            let heads = [&q[..r - 3], &q[r - 2..]].concat();
            let a = AttentionShape::of(&heads, &heads, AttentionLayout::TokenMajor)?;
            return Some(AttentionShape { packed: true, ..a });
        }
        let token_major = layout == AttentionLayout::TokenMajor;
        let r = q.len();
        let inner = if token_major { 3 } else { 2 };
        if r < inner || k.len() != r {
            return None;
        }
        // The rows' axis, and the heads' (none for heads-first [T, D]).
        let t = r - inner;
        let heads = if token_major { Some(r - 2) } else { t.checked_sub(1) };
        let agree = (0..r).filter(|&a| a != t && Some(a) != heads).all(|a| q[a] == k[a]);
        let rep = match heads.map(|h| (q[h], k[h])) {
            None => 1,
            Some((qh, kh)) if kh == qh => 1,
            Some((qh, kh)) if kh > 0 && qh > 0 && qh % kh == 0 => qh / kh,
            Some(_) => return None,
        };
        if !agree {
            return None;
        }
        let interleaved = if token_major { q[r - 2] } else { 1 };
        let groups = q[..t].iter().product::<usize>() * interleaved;
        Some(AttentionShape { groups, interleaved, rep, tq: q[t], tk: k[t], d: q[r - 1], packed: false })
    }

    /// y's shape (and dY's) for q (or qkv) of `q`: q's, or packed [.., T, H, D].
    pub fn y_shape(q: &[usize], layout: AttentionLayout) -> Vec<usize> {
        match (layout, q.len()) {
            (AttentionLayout::Packed, r) if r >= 4 => [&q[..r - 3], &q[r - 2..]].concat(),
            _ => q.to_vec(),
        }
    }

    /// The log-sum-exp's shape for q (or qkv) of `q`: [.., H, Tq] (token-major) or [.., Tq].
    pub fn lse_shape(q: &[usize], layout: AttentionLayout) -> Vec<usize> {
        let q = AttentionShape::y_shape(q, layout);
        let r = q.len();
        match layout {
            AttentionLayout::TokenMajor | AttentionLayout::Packed if r >= 3 => {
                [&q[..r - 3], &[q[r - 2], q[r - 3]]].concat()
            }
            _ => q[..r.saturating_sub(1)].to_vec(),
        }
    }

    /// Where q, k and v (dq, dk and dv) start in the packed operand (its gradient), in
    /// elements; all 0 unpacked, where each is an operand of its own.
    pub fn parts(&self) -> [usize; 3] {
        let width = self.interleaved * self.d;
        if self.packed {
            [0, width, 2 * width]
        } else {
            [0; 3]
        }
    }

    /// The elements from a token's q row of a group to the next token's (in q and dq).
    pub fn q_ld(&self) -> usize {
        if self.packed {
            3 * self.interleaved * self.d
        } else {
            self.interleaved * self.d
        }
    }

    /// The same in k and v (and dk and dv).
    pub fn kv_ld(&self) -> usize {
        if self.packed {
            self.q_ld()
        } else {
            self.kv_interleaved() * self.d
        }
    }

    /// Where row `i` of query group `g` starts in q (and dq), in elements from q's part.
    pub fn q_row(&self, g: usize, i: usize) -> usize {
        let h = self.interleaved;
        (g / h * self.tq + i) * self.q_ld() + g % h * self.d
    }

    /// Where row `i` of query group `g` starts in y (and dY), never packed.
    pub fn y_row(&self, g: usize, i: usize) -> usize {
        let h = self.interleaved;
        ((g / h * self.tq + i) * h + g % h) * self.d
    }

    /// k's (and v's) groups side by side in each token: 1 heads-first, H / rep token-major.
    pub fn kv_interleaved(&self) -> usize {
        (self.interleaved / self.rep).max(1)
    }

    /// Where key row `j` that query group `g` reads starts in k (and v, dk, dv), in elements
    /// from k's (v's) part.
    pub fn kv_row(&self, g: usize, j: usize) -> usize {
        let (g, h) = (g / self.rep, self.kv_interleaved());
        (g / h * self.tk + j) * self.kv_ld() + g % h * self.d
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossReduction {
    Mean,
    Sum,
    None,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    // ---- ONNX ops ----
    Unary(Unary),
    Binary(Binary),
    Where,
    Cast {
        to: DType,
    },
    Identity,
    /// x, like -> x cast to like's element type; becomes Cast when bound.
    CastLike,
    /// `ratio`; the mask output is optional. Inference graphs run it as Identity.
    Dropout {
        ratio: f32,
        training: bool,
        seed: u64,
    },
    MatMul,
    Gemm {
        alpha: f32,
        beta: f32,
        trans_a: bool,
        trans_b: bool,
    },
    Softmax {
        axis: i64,
    },
    LogSoftmax {
        axis: i64,
    },
    /// Outputs: Y, and optionally mean and inverse std-dev (saved for the backward pass).
    /// `rms`: RMSNorm, x / √(mean(x²) + ε) · scale without re-centering or bias (its mean
    /// output is zeros); `fuse::rms_norm` makes it from the ops a model writes it out as.
    LayerNorm {
        axis: i64,
        epsilon: f32,
        rms: bool,
    },
    /// X (f32), B, scale (, bias) -> Y, S (, mean, inv_std): the residual add S = X + B and the
    /// LayerNorm (RMSNorm's where `rms`) of S in one sweep, Y and the statistics as LayerNorm's;
    /// B is of Y's type (f32, or the half type mixed precision writes Y in), widened. Emitted by
    /// `fuse::residual_layer_norm`.
    ResidualLayerNorm {
        axis: i64,
        epsilon: f32,
        rms: bool,
    },
    /// Reshape, Flatten, Squeeze and Unsqueeze all become this once shapes are known.
    Reshape,
    /// Reshape with allowzero=1: a 0 in the target is a dimension of size 0, not a copy of the
    /// input's; becomes Reshape when bound.
    ReshapeAllowZero,
    Transpose {
        perm: Option<Vec<i64>>,
    },
    Concat {
        axis: i64,
    },
    /// `sizes` empty: equal parts (or from the `split` input until resolved).
    Split {
        axis: i64,
        sizes: Vec<i64>,
        num_outputs: Option<usize>,
    },
    /// Static slice; `Slice`'s operand inputs are folded into it.
    Slice {
        starts: Vec<i64>,
        ends: Vec<i64>,
        axes: Vec<i64>,
        steps: Vec<i64>,
    },
    Gather {
        axis: i64,
        /// A row of the data whose gradient through this gather stays zero, as PyTorch's
        /// nn.Embedding(padding_idx) keeps it (ONNX has no such attribute: the configuration
        /// sets it, `model.onnx.paddingIdx`). Other reads of the data still train the row.
        padding_row: Option<i64>,
    },
    /// data, indices [.., k] -> out [indices' leading dims, data's dims past batch_dims + k]:
    /// each k-tuple of indices picks a slice of data, within its batch (the first `batch_dims`
    /// dims, shared by data and indices).
    GatherND {
        batch_dims: usize,
    },
    /// data, indices, updates (both of data's rank, one shape) -> data with each update combined
    /// into the element GatherElements would read at its position, in index order.
    ScatterElements {
        axis: i64,
        reduction: ScatterReduction,
    },
    /// data, indices [.., k], updates -> data with each update slice combined into the slice
    /// its k-tuple names, in index order.
    ScatterND {
        reduction: ScatterReduction,
    },
    /// data, indices (of data's rank) -> out shaped like indices: out[i] = data[i with its
    /// coordinate along `axis` replaced by indices[i]].
    GatherElements {
        axis: i64,
    },
    Expand,
    /// Running sums along `axis` (folded from its input): with `exclusive` each sum leaves out
    /// its own element, with `reverse` they run from the end.
    CumSum {
        axis: i64,
        exclusive: bool,
        reverse: bool,
    },
    /// Sum (or, with `mean`, Mean) of one or more inputs, broadcast; binding rewrites it as a
    /// chain of Add (then a Mul by 1/n), whose kernels and gradients serve it.
    Sum {
        mean: bool,
    },
    /// indices, depth, values [off, on] -> values[1] where the output's coordinate along `axis`
    /// equals the index (negative ones counting from depth), values[0] elsewhere; binding
    /// rewrites it as Cast, Where, Unsqueeze, Equal and Where over a Range of depth.
    OneHot {
        axis: i64,
    },
    /// x, scale (, bias) -> the normalization `kind`; binding writes it out as ReduceMean, Sub,
    /// Mul, Add, Sqrt and Div, whose kernels and gradients serve it.
    Normalization {
        kind: NormKind,
        epsilon: f32,
    },
    /// x, repeats -> x repeated along each axis; binding rewrites it as Reshape → Expand →
    /// Reshape (x viewed as [1, d0, 1, d1, ...] expanded to [r0, d0, r1, d1, ...]), whose kernels
    /// and gradients serve it.
    Tile,
    /// `pads`: ONNX's begin pads then end pads, one per axis of the input once bound (its
    /// `pads`, `constant_value` and `axes` inputs are folded in); `value` fills the constant
    /// border.
    Pad {
        mode: PadMode,
        pads: Vec<i64>,
        value: f64,
    },
    /// `k`: the diagonal offset (Trilu's optional second input, folded).
    Trilu {
        upper: bool,
        k: i64,
    },
    ReduceOp {
        kind: Reduce,
        axes: Option<Vec<i64>>,
        keepdims: bool,
        noop_with_empty_axes: bool,
    },
    Conv {
        window: Window,
        group: usize,
    },
    /// X [N, C, D...], W [C, M/group, k...] (, B [M]) -> Y [N, M, O...]: the data gradient of a
    /// Conv of `window` whose input is Y. `output_shape` (or auto_pad) is resolved into the
    /// window's pads and `output_padding` when bound; a negative end pad becomes output padding.
    ConvTranspose {
        window: Window,
        group: usize,
        output_padding: Vec<usize>,
        output_shape: Option<Vec<usize>>,
    },
    /// Resize and Upsample (`op::resize`): nearest, linear and cubic interpolation over any
    /// axes, its scales or sizes (and roi) folded in when bound.
    Resize(Resize),
    Pool {
        kind: PoolKind,
        window: Window,
    },
    GlobalAveragePool,
    BatchNorm {
        epsilon: f32,
        momentum: f32,
        training: bool,
    },
    SoftmaxCrossEntropyLoss {
        reduction: LossReduction,
        ignore_index: Option<i64>,
    },
    /// An op over sequences of tensors, resolved into tensor ops when the graph is bound.
    Sequence(SequenceOp),
    /// LSTM, GRU or RNN; binding unrolls it over the sequence into Gemm, Split, pointwise ops
    /// and Concat (`graph::recurrent`), whose kernels and gradients serve it.
    Recurrent(Recurrent),
    /// log-probabilities [N, C, D...], labels [N, D...] (, weights [C]) -> −x[n, label, d]·w[label]
    /// per position (0 where the label is ignored), reduced as SoftmaxCrossEntropyLoss's.
    NegativeLogLikelihoodLoss {
        reduction: LossReduction,
        ignore_index: Option<i64>,
    },
    /// Shape-producing ops; fully folded into constants at plan time.
    Constant {
        value: Tensor,
    },
    Shape {
        start: i64,
        end: Option<i64>,
    },
    ConstantOfShape {
        value: Tensor,
    },
    Range,
    /// The index (i64) of the largest (`max`) or smallest element along `axis`: the first of
    /// equal ones, or the last with `select_last_index`; NaN counts as the extreme (numpy's).
    ArgExtreme {
        max: bool,
        axis: i64,
        keepdims: bool,
        select_last_index: bool,
    },
    /// The element count of the input as an i64 scalar; folded at plan time.
    Size,
    Squeeze {
        axes: Option<Vec<i64>>,
    },
    Unsqueeze {
        axes: Option<Vec<i64>>,
    },
    Flatten {
        axis: i64,
    },
    /// X, K -> the K largest (or smallest) elements along `axis` and their indices (i64), in
    /// order (whatever `sorted` says); binding rewrites it as TopKIndices and a GatherElements of
    /// X at them, so the values' gradient is GatherElements'.
    TopK {
        axis: i64,
        largest: bool,
        sorted: bool,
    },
    /// The operands contracted as `equation` (numpy's einsum notation) says; binding writes it
    /// out as Transpose, Reshape, Slice, ReduceSum, Expand, Mul and MatMul (`graph::einsum`).
    Einsum {
        equation: String,
    },

    // ---- internal ops (gradients and fusions) ----
    /// Sums a broadcast gradient back down to `shape` (the inverse of broadcasting).
    ReduceSumTo {
        shape: Vec<usize>,
    },
    /// dY, X -> dX for pointwise activations.
    UnaryGrad(Unary),
    /// dY, Y -> dX.
    SoftmaxGrad {
        axis: i64,
    },
    LogSoftmaxGrad {
        axis: i64,
    },
    /// dY, X, scale, mean, inv_std (, dX_in, added to dX) -> dX, dScale, dBias (, dX rounded
    /// to dY's half type) (RMSNorm's where `rms`).
    LayerNormGrad {
        axis: i64,
        rms: bool,
    },
    /// dLoss, log_prob, labels -> dLogits.
    SoftmaxCrossEntropyLossGrad {
        reduction: LossReduction,
        ignore_index: Option<i64>,
    },
    /// dY, indices -> dData (scatter-add into zeros of `data_shape`).
    GatherGrad {
        axis: i64,
        data_shape: Vec<usize>,
    },
    /// dLoss, labels (, weights) -> dX of `input_shape`: −w[label]·dLoss (÷ the summed weights
    /// for a mean) at each counted position's label, zeros elsewhere.
    NegativeLogLikelihoodLossGrad {
        reduction: LossReduction,
        ignore_index: Option<i64>,
        input_shape: Vec<usize>,
    },
    /// dY, indices -> dData: dY scatter-added into zeros of `data_shape` where GatherElements
    /// read it.
    GatherElementsGrad {
        axis: i64,
        data_shape: Vec<usize>,
    },
    /// dY, indices -> dData: dY scatter-added into zeros of `data_shape` at the slices
    /// GatherND read.
    GatherNDGrad {
        batch_dims: usize,
        data_shape: Vec<usize>,
    },
    /// dY -> dX for Pad: each element of dY added to the input element it was read from (none
    /// for the constant border).
    PadGrad {
        mode: PadMode,
        pads: Vec<i64>,
        input_shape: Vec<usize>,
    },
    /// dY -> dX: dY written into zeros of `input_shape` at the slice.
    SliceGrad {
        input_shape: Vec<usize>,
        starts: Vec<i64>,
        ends: Vec<i64>,
        axes: Vec<i64>,
        steps: Vec<i64>,
    },
    /// dY, mask -> dX for Dropout.
    DropoutGrad {
        ratio: f32,
    },
    /// dY, X, W -> dX, dW, dB.
    ConvGrad {
        window: Window,
        group: usize,
    },
    /// dY, X, W -> dX, dW, dB of ConvTranspose: dX is dY's Conv by W, dW is Conv's weight
    /// gradient with X and dY in each other's places.
    ConvTransposeGrad {
        window: Window,
        group: usize,
    },
    /// dY -> dX of Resize: dY spread back over the input with the interpolation's weights
    /// (nearest: added to the element each output read).
    ResizeGrad {
        resize: Resize,
        input_shape: Vec<usize>,
    },
    /// dY, X -> dX.
    PoolGrad {
        kind: PoolKind,
        window: Window,
    },
    /// dY, X, scale -> dX, dScale, dBias (batch statistics are recomputed from X).
    BatchNormGrad {
        epsilon: f32,
    },
    /// Training-mode BatchNormalization followed by ReLU: X, scale, B, input_mean, input_var ->
    /// Z = max(Y, 0), and the running statistics as BatchNormalization writes them; emitted by
    /// `fuse::batch_norm_relu`, so that Y (which ReLU's gradient read) is neither written nor
    /// kept.
    BatchNormRelu {
        epsilon: f32,
        momentum: f32,
    },
    /// dZ, X, scale, Z -> dX, dScale, dBias: BatchNormGrad of dY = dZ · (Z > 0), the ReLU's
    /// gradient taken as each element of dZ is read.
    BatchNormReluGrad {
        epsilon: f32,
    },
    /// Attention over heads without the T×T scores: q [.., Tq, D], k, v [.., Tk, D] →
    /// y = softmax(q·kᵀ·scale, masked above the diagonal when `causal`)·v [.., Tq, D], and each
    /// row's log-sum-exp [.., Tq] in f32, which the backward pass recomputes the
    /// probabilities from (FlashAttention's scheme); emitted by `fuse::attention`. k and v may
    /// have fewer heads than q, each serving as many query heads side by side (grouped-query
    /// attention; `fuse::attention_shared_heads`). Token-major, q, k, v and y are [.., T, H, D]
    /// and the log-sum-exp [.., H, Tq]; packed, the one operand qkv [.., T, 3, H, D] takes q's,
    /// k's and v's place. See [`AttentionLayout`] and [`AttentionShape`].
    Attention {
        scale: f32,
        causal: bool,
        layout: AttentionLayout,
    },
    /// dY, q, k, v, y, lse -> dq, dk, dv, in the layout of the Attention they differentiate;
    /// packed, dY, qkv, y, lse -> dqkv.
    AttentionGrad {
        scale: f32,
        causal: bool,
        layout: AttentionLayout,
    },
    /// a, b -> SiLU(a)·b: SwiGLU's gate times its up projection, as Llama's MLP computes it;
    /// emitted by `fuse::swiglu`.
    Swiglu,
    /// dY, a, b -> dA = dY·b·SiLU'(a), dB = dY·SiLU(a).
    SwigluGrad,
    /// x, cos, sin -> x·cos + rotate_half(x)·sin, rotate_half(x) = [−x₂, x₁] of the last dim's
    /// halves: the rotary position embedding as Hugging Face's Llama applies it (the halves, not
    /// interleaved pairs), cos and sin broadcast to x [.., D]; emitted by `fuse::rotary`.
    Rotary,
    /// dY, cos, sin -> dX of Rotary: dY·cos plus the rotation transposed, [dY₂·sin₂, −dY₁·sin₁].
    RotaryGrad,
    /// A·B (+ bias) (then GELU): MatMul + Add (+ Gelu) fused; emitted by the fusion pass. With
    /// an activation it may have a second output, the pre-activation, for the gradient to read.
    FusedMatMul {
        trans_a: bool,
        trans_b: bool,
        activation: Option<Unary>,
    },
    /// A, B, X -> op(A)·op(B) ⊙ activation'(X): a product that is the gradient of an
    /// activation's output, taken to the gradient of its input X (UnaryGrad of a product, fused
    /// like cuBLASLt's DGELU epilogue); emitted by the fusion pass.
    MatMulUnaryGrad {
        trans_a: bool,
        trans_b: bool,
        activation: Unary,
    },
    /// scores [N, C], labels [N] (, weights [C]) -> loss, each row's log-sum-exp [N] (f32):
    /// SoftmaxCrossEntropyLoss keeping the rows' log-sum-exp instead of the log-probabilities
    /// [N, C]; emitted by `fuse::loss_lse` when only the gradient reads them.
    SoftmaxCrossEntropyLse {
        reduction: LossReduction,
        ignore_index: Option<i64>,
    },
    /// dLoss, scores [N, C], log-sum-exp [N], labels (, weights) -> dScores: the softmax
    /// recomputed from the scores, exp(x − lse), less the one-hot, scaled as
    /// SoftmaxCrossEntropyLossGrad's.
    SoftmaxCrossEntropyLseGrad {
        reduction: LossReduction,
        ignore_index: Option<i64>,
    },
    /// X -> the indices (i64) along `axis` of its `k` largest (or smallest) elements, largest
    /// (smallest) first: equal elements in index order (ONNX's rule), and a NaN above every
    /// number (numpy's sort, PyTorch's topk). TopK's first half.
    TopKIndices {
        axis: i64,
        k: usize,
        largest: bool,
    },

    // ---- tensor parallelism (`parallel::tensor`); the executor runs the collectives ----
    /// Megatron's `g`: the value combined by `op` over the tensor-parallel group (a sum completes
    /// a row-parallel product's partial sums). Its gradient passes through unchanged.
    AllReduce {
        op: crate::comm::ReduceOp,
    },
    /// Megatron's `f`: the identity, whose gradient is summed over the tensor-parallel group.
    TensorParallelCopy,
    /// table [R, C] (rows `start..start + R` of the whole table), ids -> [ids.., C]: the rows
    /// of the ids in range, zeros for the others.
    ShardGather {
        start: i64,
    },
    /// dY, ids -> dTable [rows, C]: dY scatter-added at the ids in range.
    ShardGatherGrad {
        start: i64,
        rows: usize,
    },
    /// scores [N, Vr] (classes `start..start + Vr` of the whole), labels [N], max [N] (over all
    /// classes) -> Σ_j exp(x_j − max) [N], and x[label] − max where the label is in this slice
    /// (0 elsewhere, and where it is ignored). `classes`: the whole vocabulary's size, which
    /// the labels are checked against before a run (a label past it is in no rank's slice).
    VocabShardCrossEntropy {
        start: i64,
        classes: i64,
        ignore_index: Option<i64>,
    },
    /// dΣexp, dTarget, scores, labels, max -> dScores.
    VocabShardCrossEntropyGrad {
        start: i64,
        ignore_index: Option<i64>,
    },
    /// Σexp [N], target [N], labels [N] -> the cross-entropy (ln Σexp − target) reduced over
    /// the rows whose label is not ignored.
    VocabParallelLoss {
        reduction: LossReduction,
        ignore_index: Option<i64>,
    },
    /// dLoss, Σexp, labels -> dΣexp, dTarget.
    VocabParallelLossGrad {
        reduction: LossReduction,
        ignore_index: Option<i64>,
    },
}

/// The ONNX op types `Op::from_onnx` accepts, for error messages and reports.
pub const SUPPORTED_ONNX_OPS: &[&str] = &[
    "Abs",
    "Acos",
    "Acosh",
    "Add",
    "And",
    "ArgMax",
    "ArgMin",
    "Asin",
    "Asinh",
    "Atan",
    "Atanh",
    "AveragePool",
    "BatchNormalization",
    "Cast",
    "CastLike",
    "Ceil",
    "Celu",
    "Clip",
    "Concat",
    "ConcatFromSequence",
    "Constant",
    "ConstantOfShape",
    "Conv",
    "ConvTranspose",
    "Cos",
    "Cosh",
    "CumSum",
    "Div",
    "Dropout",
    "Einsum",
    "Elu",
    "Equal",
    "Erf",
    "Exp",
    "Expand",
    "Flatten",
    "Floor",
    "GRU",
    "Gather",
    "GatherElements",
    "GatherND",
    "Gelu",
    "Gemm",
    "GlobalAveragePool",
    "Greater",
    "GreaterOrEqual",
    "GroupNormalization",
    "HardSigmoid",
    "HardSwish",
    "Identity",
    "InstanceNormalization",
    "IsInf",
    "IsNaN",
    "LSTM",
    "LayerNormalization",
    "LeakyRelu",
    "Less",
    "LessOrEqual",
    "Log",
    "LogSoftmax",
    "MatMul",
    "Max",
    "MaxPool",
    "Mean",
    "Min",
    "Mish",
    "Mod",
    "Mul",
    "Neg",
    "NegativeLogLikelihoodLoss",
    "Not",
    "OneHot",
    "Or",
    "PRelu",
    "Pad",
    "Pow",
    "RMSNormalization",
    "RNN",
    "Range",
    "Reciprocal",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceProd",
    "ReduceSum",
    "ReduceSumSquare",
    "Relu",
    "Reshape",
    "Resize",
    "Round",
    "Scatter",
    "ScatterElements",
    "ScatterND",
    "Selu",
    "SequenceAt",
    "SequenceConstruct",
    "SequenceEmpty",
    "SequenceErase",
    "SequenceInsert",
    "SequenceLength",
    "Shape",
    "Sigmoid",
    "Sign",
    "Sin",
    "Sinh",
    "Size",
    "Slice",
    "Softmax",
    "SoftmaxCrossEntropyLoss",
    "Softplus",
    "Softsign",
    "Split",
    "SplitToSequence",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Sum",
    "Tan",
    "Tanh",
    "ThresholdedRelu",
    "Tile",
    "TopK",
    "Transpose",
    "Trilu",
    "Unsqueeze",
    "Upsample",
    "Where",
    "Xor",
];

/// The inputs an ONNX op of the default domain takes, as its schema says: how many must be
/// given (at the front; later ones are optional, an empty name standing for one left out) and
/// at most how many (None: variadic). At `opset`, for the ops whose inputs were attributes in
/// early opsets. Kernels, inference and the gradient rules read the required inputs without
/// looking: `graph::onnx_io` refuses a node that breaks this before anything reads it. None
/// for an op type not in [`SUPPORTED_ONNX_OPS`].
pub fn onnx_input_arity(op_type: &str, opset: i64) -> Option<(usize, Option<usize>)> {
    let from = |early: usize, since: i64, later: usize| if opset >= since { later } else { early };
    Some(match op_type {
        "Constant" | "SequenceEmpty" => (0, Some(0)),
        "Concat" | "Einsum" | "Max" | "Mean" | "Min" | "SequenceConstruct" | "Sum" => (1, None),
        "ArgMax" | "ArgMin" | "AveragePool" | "Cast" | "ConcatFromSequence" | "ConstantOfShape" | "Flatten"
        | "GlobalAveragePool" | "Identity" | "LogSoftmax" | "MaxPool" | "SequenceLength" | "Shape" | "Size"
        | "Softmax" | "Transpose" => (1, Some(1)),
        "ReduceL1" | "ReduceL2" | "ReduceLogSum" | "ReduceLogSumExp" | "ReduceMax" | "ReduceMean" | "ReduceMin"
        | "ReduceProd" | "ReduceSum" | "ReduceSumSquare" | "Squeeze" | "Split" | "SplitToSequence" | "Trilu" => {
            (1, Some(2))
        }
        "Unsqueeze" => (1, Some(from(1, 13, 2))),
        "TopK" => (from(1, 10, 2), Some(from(1, 10, 2))),
        "Upsample" => (from(1, 9, 2), Some(from(1, 9, 2))),
        "Clip" | "Dropout" => (1, Some(3)),
        "Pad" => (1, Some(4)),
        "Resize" => (1, Some(4)),
        "Slice" => (from(1, 10, 3), Some(from(1, 10, 5))),
        "Reshape" => (from(1, 5, 2), Some(from(1, 5, 2))),
        "Add" | "And" | "BitShift" | "CastLike" | "CumSum" | "Div" | "Equal" | "Expand" | "Gather"
        | "GatherElements" | "GatherND" | "Greater" | "GreaterOrEqual" | "Less" | "LessOrEqual" | "MatMul" | "Mod"
        | "Mul" | "Or" | "PRelu" | "Pow" | "SequenceAt" | "Sub" | "Tile" | "Xor" => (2, Some(2)),
        "SequenceErase" => (1, Some(2)),
        "SequenceInsert" => (2, Some(3)),
        "RMSNormalization" => (2, Some(2)),
        "Conv"
        | "ConvTranspose"
        | "Gemm"
        | "LayerNormalization"
        | "NegativeLogLikelihoodLoss"
        | "SoftmaxCrossEntropyLoss" => (2, Some(3)),
        "GroupNormalization"
        | "InstanceNormalization"
        | "OneHot"
        | "Range"
        | "Scatter"
        | "ScatterElements"
        | "ScatterND"
        | "Where" => (3, Some(3)),
        "BatchNormalization" => (5, Some(5)),
        "GRU" | "RNN" => (3, Some(6)),
        "LSTM" => (3, Some(8)),
        // One input, the rest attributes: the element-wise functions.
        op if SUPPORTED_ONNX_OPS.contains(&op) => (1, Some(1)),
        _ => return None,
    })
}

fn window(a: &Attrs, spatial_from_kernel: bool) -> Result<Window> {
    let kernel = a.ints("kernel_shape")?.unwrap_or_default();
    if spatial_from_kernel && kernel.is_empty() {
        return Err(Error::Corrupt(format!("{}: attribute 'kernel_shape' is required", a.origin)));
    }
    let n = kernel.len();
    let to_usize = |v: Vec<i64>, what: &str| -> Result<Vec<usize>> {
        v.into_iter().map(|x| usize::try_from(x).map_err(|_| a.bad(what, "non-negative integers"))).collect()
    };
    let strides = a.ints("strides")?.map(|v| to_usize(v, "strides")).transpose()?;
    let dilations = a.ints("dilations")?.map(|v| to_usize(v, "dilations")).transpose()?;
    let pads = a.ints("pads")?.map(|v| to_usize(v, "pads")).transpose()?;
    let w = Window {
        kernel: to_usize(kernel, "kernel_shape")?,
        strides: strides.unwrap_or_else(|| vec![1; n]),
        dilations: dilations.unwrap_or_else(|| vec![1; n]),
        pads: pads.unwrap_or_else(|| vec![0; 2 * n]),
        auto_pad: a.string("auto_pad", "NOTSET")?,
        ceil_mode: a.int("ceil_mode", 0)? != 0,
    };
    // Without kernel_shape (Conv) the sizes come from W at inference; with it, all agree.
    let positive = |v: &[usize]| v.iter().all(|&x| x > 0);
    if !positive(&w.kernel) || !positive(&w.strides) || !positive(&w.dilations) {
        return Err(a.bad("kernel_shape, strides and dilations", "positive integers"));
    }
    if n > 0 && (w.strides.len() != n || w.dilations.len() != n || w.pads.len() != 2 * n) {
        return Err(Error::Corrupt(format!(
            "{}: strides, dilations and pads must give {n}, {n} and {} values for a {n}-D kernel_shape",
            a.origin,
            2 * n
        )));
    }
    if !matches!(w.auto_pad.as_str(), "NOTSET" | "SAME_UPPER" | "SAME_LOWER" | "VALID") {
        return Err(a.bad("auto_pad", "NOTSET, SAME_UPPER, SAME_LOWER or VALID"));
    }
    Ok(w)
}

fn scatter_reduction(a: &Attrs) -> Result<ScatterReduction> {
    match a.string("reduction", "none")?.as_str() {
        "none" => Ok(ScatterReduction::None),
        "add" => Ok(ScatterReduction::Add),
        "mul" => Ok(ScatterReduction::Mul),
        "max" => Ok(ScatterReduction::Max),
        "min" => Ok(ScatterReduction::Min),
        other => Err(a.bad("reduction", &format!("none, add, mul, max or min, not '{other}'"))),
    }
}

fn reduction(a: &Attrs) -> Result<LossReduction> {
    match a.string("reduction", "mean")?.as_str() {
        "mean" => Ok(LossReduction::Mean),
        "sum" => Ok(LossReduction::Sum),
        "none" => Ok(LossReduction::None),
        other => Err(Error::Corrupt(format!("{}: reduction '{other}' is not mean, sum or none", a.origin))),
    }
}

impl Op {
    /// Parses an ONNX node of the default domain. `opset` is the model's default-domain opset,
    /// which decides attribute defaults that changed between versions.
    pub fn from_onnx(op_type: &str, domain: &str, a: &Attrs, opset: i64) -> Result<Op> {
        if !(domain.is_empty() || domain == "ai.onnx" || domain == TF_DOMAIN) {
            return Err(Error::Unsupported(format!("{}: operator domain '{domain}' is not supported", a.origin)));
        }
        use Binary as B;
        use Unary as U;
        Ok(match op_type {
            "Neg" => Op::Unary(U::Neg),
            "Exp" => Op::Unary(U::Exp),
            "Log" => Op::Unary(U::Log),
            "Sqrt" => Op::Unary(U::Sqrt),
            "Tanh" => Op::Unary(U::Tanh),
            "Erf" => Op::Unary(U::Erf),
            "Relu" => Op::Unary(U::Relu),
            "Sigmoid" => Op::Unary(U::Sigmoid),
            "Abs" => Op::Unary(U::Abs),
            "Reciprocal" => Op::Unary(U::Reciprocal),
            "Floor" => Op::Unary(U::Floor),
            "Ceil" => Op::Unary(U::Ceil),
            "Not" => Op::Unary(U::Not),
            "Sin" => Op::Unary(U::Sin),
            "Cos" => Op::Unary(U::Cos),
            "Tan" => Op::Unary(U::Tan),
            "Asin" => Op::Unary(U::Asin),
            "Acos" => Op::Unary(U::Acos),
            "Atan" => Op::Unary(U::Atan),
            "Sinh" => Op::Unary(U::Sinh),
            "Cosh" => Op::Unary(U::Cosh),
            "Asinh" => Op::Unary(U::Asinh),
            "Acosh" => Op::Unary(U::Acosh),
            "Atanh" => Op::Unary(U::Atanh),
            "Sign" => Op::Unary(U::Sign),
            "Round" => Op::Unary(U::Round),
            "Softplus" => Op::Unary(U::Softplus),
            "Softsign" => Op::Unary(U::Softsign),
            "Mish" => Op::Unary(U::Mish),
            "HardSwish" => Op::Unary(U::HardSwish),
            "HardSigmoid" => Op::Unary(U::HardSigmoid { alpha: a.float("alpha", 0.2)?, beta: a.float("beta", 0.5)? }),
            "LeakyRelu" => Op::Unary(U::LeakyRelu { alpha: a.float("alpha", 0.01)? }),
            "Elu" => Op::Unary(U::Elu { alpha: a.float("alpha", 1.0)? }),
            "Selu" => Op::Unary(U::Selu { alpha: a.float("alpha", 1.673_263_2)?, gamma: a.float("gamma", 1.050_701)? }),
            "Celu" => Op::Unary(U::Celu { alpha: a.float("alpha", 1.0)? }),
            "ThresholdedRelu" => Op::Unary(U::ThresholdedRelu { alpha: a.float("alpha", 1.0)? }),
            // Before opset 11 the bounds are attributes; later optional inputs that inference
            // folds in.
            "Clip" => {
                Op::Unary(U::Clip { min: a.float("min", f32::NEG_INFINITY)?, max: a.float("max", f32::INFINITY)? })
            }
            "IsNaN" => Op::Unary(U::IsNaN),
            "IsInf" => Op::Unary(U::IsInf {
                negative: a.int("detect_negative", 1)? != 0,
                positive: a.int("detect_positive", 1)? != 0,
            }),
            "Gelu" => match a.string("approximate", "none")?.as_str() {
                "none" => Op::Unary(U::Gelu),
                "tanh" => Op::Unary(U::GeluTanh),
                other => {
                    return Err(Error::Corrupt(format!("{}: approximate '{other}' is not none or tanh", a.origin)))
                }
            },
            "Add" => Op::Binary(B::Add),
            "Sub" => Op::Binary(B::Sub),
            "Mul" => Op::Binary(B::Mul),
            "Div" => Op::Binary(B::Div),
            "Pow" => Op::Binary(B::Pow),
            "Max" => Op::Binary(B::Max),
            "Min" => Op::Binary(B::Min),
            "Equal" => Op::Binary(B::Equal),
            "Less" => Op::Binary(B::Less),
            "Greater" => Op::Binary(B::Greater),
            "LessOrEqual" => Op::Binary(B::LessOrEqual),
            "GreaterOrEqual" => Op::Binary(B::GreaterOrEqual),
            "And" => Op::Binary(B::And),
            "Or" => Op::Binary(B::Or),
            "Xor" => Op::Binary(B::Xor),
            "Mod" => Op::Binary(if a.int("fmod", 0)? != 0 { B::Fmod } else { B::Mod }),
            "PRelu" => Op::Binary(B::PRelu),
            "CastLike" => Op::CastLike,
            "Where" => Op::Where,
            "Cast" => {
                let code = a.int("to", 0)?;
                let to = DType::from_onnx(code as i32).ok_or_else(|| {
                    Error::Unsupported(format!("{}: Cast to element type {code} is not supported", a.origin))
                })?;
                Op::Cast { to }
            }
            "Identity" => Op::Identity,
            "Dropout" => Op::Dropout { ratio: a.float("ratio", 0.5)?, training: false, seed: a.int("seed", 0)? as u64 },
            "MatMul" => Op::MatMul,
            "Gemm" => Op::Gemm {
                alpha: a.float("alpha", 1.0)?,
                beta: a.float("beta", 1.0)?,
                trans_a: a.int("transA", 0)? != 0,
                trans_b: a.int("transB", 0)? != 0,
            },
            "Softmax" => Op::Softmax { axis: a.int("axis", if opset >= 13 { -1 } else { 1 })? },
            "LogSoftmax" => Op::LogSoftmax { axis: a.int("axis", if opset >= 13 { -1 } else { 1 })? },
            "LayerNormalization" => {
                if a.int("stash_type", 1)? != 1 {
                    return Err(Error::Unsupported(format!("{}: only stash_type 1 (float32) is supported", a.origin)));
                }
                Op::LayerNorm { axis: a.int("axis", -1)?, epsilon: a.float("epsilon", 1e-5)?, rms: false }
            }
            "Reshape" => {
                if a.int("allowzero", 0)? != 0 {
                    Op::ReshapeAllowZero
                } else {
                    Op::Reshape
                }
            }
            "Flatten" => Op::Flatten { axis: a.int("axis", 1)? },
            "Squeeze" => Op::Squeeze { axes: a.ints("axes")? },
            "Unsqueeze" => Op::Unsqueeze { axes: a.ints("axes")? },
            "Transpose" => Op::Transpose { perm: a.ints("perm")? },
            "Concat" => Op::Concat { axis: a.opt_int("axis")?.ok_or_else(|| a.bad("axis", "given"))? },
            "Split" => Op::Split {
                axis: a.int("axis", 0)?,
                sizes: a.ints("split")?.unwrap_or_default(),
                num_outputs: a.opt_int("num_outputs")?.map(|n| n as usize),
            },
            // Before opset 10 the slice is given by attributes; later by operand inputs that
            // inference folds in.
            "Slice" => {
                let starts = a.ints("starts")?.unwrap_or_default();
                let ends = a.ints("ends")?.unwrap_or_default();
                let axes = a.ints("axes")?.unwrap_or_else(|| (0..starts.len() as i64).collect());
                Op::Slice { steps: vec![1; starts.len()], starts, ends, axes }
            }
            "Gather" => Op::Gather { axis: a.int("axis", 0)?, padding_row: None },
            "GatherElements" => Op::GatherElements { axis: a.int("axis", 0)? },
            "GatherND" => Op::GatherND {
                batch_dims: usize::try_from(a.int("batch_dims", 0)?)
                    .map_err(|_| a.bad("batch_dims", "non-negative"))?,
            },
            "ScatterND" => Op::ScatterND { reduction: scatter_reduction(a)? },
            // Scatter is ScatterElements' name before opset 11.
            "ScatterElements" | "Scatter" => {
                Op::ScatterElements { axis: a.int("axis", 0)?, reduction: scatter_reduction(a)? }
            }
            "Expand" => Op::Expand,
            "Tile" => Op::Tile,
            "InstanceNormalization" => {
                Op::Normalization { kind: NormKind::Instance, epsilon: a.float("epsilon", 1e-5)? }
            }
            "GroupNormalization" | "RMSNormalization" => {
                if a.int("stash_type", 1)? != 1 {
                    return Err(Error::Unsupported(format!("{}: only stash_type 1 (float32) is supported", a.origin)));
                }
                let kind = match op_type {
                    "GroupNormalization" => NormKind::Group {
                        groups: usize::try_from(a.opt_int("num_groups")?.ok_or_else(|| a.bad("num_groups", "given"))?)
                            .ok()
                            .filter(|&g| g > 0)
                            .ok_or_else(|| a.bad("num_groups", "positive"))?,
                    },
                    _ => NormKind::Rms { axis: a.int("axis", -1)? },
                };
                Op::Normalization { kind, epsilon: a.float("epsilon", 1e-5)? }
            }
            "Sum" => Op::Sum { mean: false },
            "Mean" => Op::Sum { mean: true },
            "OneHot" => Op::OneHot { axis: a.int("axis", -1)? },
            "LSTM" => Op::Recurrent(Recurrent::from_onnx(RecurrentKind::Lstm, a)?),
            "GRU" => Op::Recurrent(Recurrent::from_onnx(RecurrentKind::Gru, a)?),
            "RNN" => Op::Recurrent(Recurrent::from_onnx(RecurrentKind::Rnn, a)?),
            "CumSum" => {
                Op::CumSum { axis: 0, exclusive: a.int("exclusive", 0)? != 0, reverse: a.int("reverse", 0)? != 0 }
            }
            // Before opset 11 pads and value are attributes; later inputs that inference folds.
            "Pad" => Op::Pad {
                mode: match a.string("mode", "constant")?.as_str() {
                    "constant" => PadMode::Constant,
                    "reflect" => PadMode::Reflect,
                    "edge" => PadMode::Edge,
                    "wrap" => PadMode::Wrap,
                    other => return Err(a.bad("mode", &format!("constant, reflect, edge or wrap, not '{other}'"))),
                },
                pads: a.ints("pads")?.unwrap_or_default(),
                value: a.float("value", 0.0)? as f64,
            },
            "Trilu" => Op::Trilu { upper: a.int("upper", 1)? != 0, k: 0 },
            "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceSumSquare" | "ReduceL1" | "ReduceL2"
            | "ReduceLogSum" | "ReduceLogSumExp" | "ReduceProd" => Op::ReduceOp {
                kind: match op_type {
                    "ReduceSum" => Reduce::Sum,
                    "ReduceMean" => Reduce::Mean,
                    "ReduceMax" => Reduce::Max,
                    "ReduceMin" => Reduce::Min,
                    "ReduceSumSquare" => Reduce::SumSquare,
                    "ReduceL1" => Reduce::L1,
                    "ReduceL2" => Reduce::L2,
                    "ReduceLogSum" => Reduce::LogSum,
                    "ReduceLogSumExp" => Reduce::LogSumExp,
                    _ => Reduce::Prod,
                },
                axes: a.ints("axes")?,
                keepdims: a.int("keepdims", 1)? != 0,
                noop_with_empty_axes: a.int("noop_with_empty_axes", 0)? != 0,
            },
            "Conv" => Op::Conv { window: window(a, false)?, group: a.int("group", 1)?.max(1) as usize },
            "ConvTranspose" => {
                let to_usize = |v: Option<Vec<i64>>, what: &str| -> Result<Option<Vec<usize>>> {
                    v.map(|v| {
                        v.into_iter().map(|x| usize::try_from(x).map_err(|_| a.bad(what, "non-negative"))).collect()
                    })
                    .transpose()
                };
                Op::ConvTranspose {
                    window: window(a, false)?,
                    group: a.int("group", 1)?.max(1) as usize,
                    output_padding: to_usize(a.ints("output_padding")?, "output_padding")?.unwrap_or_default(),
                    output_shape: to_usize(a.ints("output_shape")?, "output_shape")?,
                }
            }
            "Resize" | "Upsample" => Op::Resize(Resize::from_onnx(op_type, a, opset)?),
            "MaxPool" => {
                if a.int("storage_order", 0)? != 0 {
                    return Err(Error::Unsupported(format!("{}: MaxPool storage_order=1 is not supported", a.origin)));
                }
                Op::Pool { kind: PoolKind::Max, window: window(a, true)? }
            }
            "AveragePool" => Op::Pool {
                kind: PoolKind::Average { count_include_pad: a.int("count_include_pad", 0)? != 0 },
                window: window(a, true)?,
            },
            "GlobalAveragePool" => Op::GlobalAveragePool,
            "BatchNormalization" => Op::BatchNorm {
                epsilon: a.float("epsilon", 1e-5)?,
                momentum: a.float("momentum", 0.9)?,
                training: a.int("training_mode", 0)? != 0,
            },
            "NegativeLogLikelihoodLoss" => {
                Op::NegativeLogLikelihoodLoss { reduction: reduction(a)?, ignore_index: a.opt_int("ignore_index")? }
            }
            "SoftmaxCrossEntropyLoss" => {
                Op::SoftmaxCrossEntropyLoss { reduction: reduction(a)?, ignore_index: a.opt_int("ignore_index")? }
            }
            "Constant" => Op::Constant { value: constant_value(a)? },
            "Shape" => Op::Shape { start: a.int("start", 0)?, end: a.opt_int("end")? },
            "ConstantOfShape" => Op::ConstantOfShape {
                value: a.tensor("value")?.unwrap_or_else(|| Tensor::from_vec(&[1], vec![0.0f32])),
            },
            "Range" => Op::Range,
            "Size" => Op::Size,
            "SplitToSequence" => {
                Op::Sequence(SequenceOp::Split { axis: a.int("axis", 0)?, keepdims: a.int("keepdims", 1)? != 0 })
            }
            "SequenceConstruct" => Op::Sequence(SequenceOp::Construct),
            "SequenceEmpty" => Op::Sequence(SequenceOp::Empty),
            "SequenceAt" => Op::Sequence(SequenceOp::At),
            "SequenceLength" => Op::Sequence(SequenceOp::Length),
            "SequenceInsert" => Op::Sequence(SequenceOp::Insert),
            "SequenceErase" => Op::Sequence(SequenceOp::Erase),
            "ConcatFromSequence" => Op::Sequence(SequenceOp::Concat {
                axis: a.opt_int("axis")?.ok_or_else(|| a.bad("axis", "given"))?,
                new_axis: a.int("new_axis", 0)? != 0,
            }),
            "ArgMax" | "ArgMin" => Op::ArgExtreme {
                max: op_type == "ArgMax",
                axis: a.int("axis", 0)?,
                keepdims: a.int("keepdims", 1)? != 0,
                select_last_index: a.int("select_last_index", 0)? != 0,
            },
            "TopK" if opset < 10 => {
                return Err(Error::Unsupported(format!(
                    "{}: TopK before opset 10 (k an attribute) is not supported; K is an input from opset 10",
                    a.origin
                )))
            }
            "TopK" => Op::TopK {
                axis: a.int("axis", -1)?,
                largest: a.int("largest", 1)? != 0,
                sorted: a.int("sorted", 1)? != 0,
            },
            "Einsum" => {
                if !a.map.contains_key("equation") {
                    return Err(a.bad("equation", "given"));
                }
                let equation = a.string("equation", "")?;
                einsum::Equation::parse(&equation)
                    .map_err(|why| Error::Unsupported(format!("{}: equation '{equation}': {why}", a.origin)))?;
                Op::Einsum { equation }
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "{}: operator '{other}' is not supported (supported: {})",
                    a.origin,
                    SUPPORTED_ONNX_OPS.join(", ")
                )))
            }
        })
    }

    /// The name this op is saved under, and its domain.
    pub fn onnx_name(&self) -> (&'static str, &'static str) {
        let onnx = |n| (n, "");
        let internal = |n| (n, TF_DOMAIN);
        match self {
            Op::Unary(u) => {
                let name = match u {
                    Unary::Neg => "Neg",
                    Unary::Exp => "Exp",
                    Unary::Log => "Log",
                    Unary::Sqrt => "Sqrt",
                    Unary::Tanh => "Tanh",
                    Unary::Erf => "Erf",
                    Unary::Relu => "Relu",
                    Unary::Sigmoid => "Sigmoid",
                    Unary::Abs => "Abs",
                    Unary::Reciprocal => "Reciprocal",
                    Unary::Floor => "Floor",
                    Unary::Ceil => "Ceil",
                    Unary::Not => "Not",
                    Unary::Gelu | Unary::GeluTanh => "Gelu",
                    Unary::Sin => "Sin",
                    Unary::Cos => "Cos",
                    Unary::Tan => "Tan",
                    Unary::Asin => "Asin",
                    Unary::Acos => "Acos",
                    Unary::Atan => "Atan",
                    Unary::Sinh => "Sinh",
                    Unary::Cosh => "Cosh",
                    Unary::Asinh => "Asinh",
                    Unary::Acosh => "Acosh",
                    Unary::Atanh => "Atanh",
                    Unary::Sign => "Sign",
                    Unary::Round => "Round",
                    Unary::Softplus => "Softplus",
                    Unary::Softsign => "Softsign",
                    Unary::Mish => "Mish",
                    Unary::HardSwish => "HardSwish",
                    Unary::HardSigmoid { .. } => "HardSigmoid",
                    Unary::LeakyRelu { .. } => "LeakyRelu",
                    Unary::Elu { .. } => "Elu",
                    Unary::Selu { .. } => "Selu",
                    Unary::Celu { .. } => "Celu",
                    Unary::ThresholdedRelu { .. } => "ThresholdedRelu",
                    Unary::Clip { .. } => "Clip",
                    Unary::IsNaN => "IsNaN",
                    Unary::IsInf { .. } => "IsInf",
                    Unary::Silu => "Silu",
                };
                if *u == Unary::Silu {
                    internal(name)
                } else {
                    onnx(name)
                }
            }
            Op::Binary(b) => onnx(match b {
                Binary::Add => "Add",
                Binary::Sub => "Sub",
                Binary::Mul => "Mul",
                Binary::Div => "Div",
                Binary::Pow => "Pow",
                Binary::Max => "Max",
                Binary::Min => "Min",
                Binary::Equal => "Equal",
                Binary::Less => "Less",
                Binary::Greater => "Greater",
                Binary::LessOrEqual => "LessOrEqual",
                Binary::GreaterOrEqual => "GreaterOrEqual",
                Binary::And => "And",
                Binary::Or => "Or",
                Binary::Xor => "Xor",
                Binary::Mod | Binary::Fmod => "Mod",
                Binary::PRelu => "PRelu",
            }),
            Op::Where => onnx("Where"),
            Op::Cast { .. } => onnx("Cast"),
            Op::Identity => onnx("Identity"),
            Op::CastLike => onnx("CastLike"),
            Op::Dropout { .. } => onnx("Dropout"),
            Op::MatMul => onnx("MatMul"),
            Op::Gemm { .. } => onnx("Gemm"),
            Op::Softmax { .. } => onnx("Softmax"),
            Op::LogSoftmax { .. } => onnx("LogSoftmax"),
            Op::LayerNorm { rms: false, .. } => onnx("LayerNormalization"),
            Op::LayerNorm { rms: true, .. } => onnx("RMSNormalization"),
            Op::Reshape | Op::ReshapeAllowZero => onnx("Reshape"),
            Op::Transpose { .. } => onnx("Transpose"),
            Op::Concat { .. } => onnx("Concat"),
            Op::Split { .. } => onnx("Split"),
            Op::Slice { .. } => onnx("Slice"),
            Op::Gather { .. } => onnx("Gather"),
            Op::GatherElements { .. } => onnx("GatherElements"),
            Op::GatherND { .. } => onnx("GatherND"),
            Op::ScatterND { .. } => onnx("ScatterND"),
            Op::ScatterElements { .. } => onnx("ScatterElements"),
            Op::Expand => onnx("Expand"),
            Op::Tile => onnx("Tile"),
            Op::Normalization { kind, .. } => onnx(match kind {
                NormKind::Instance => "InstanceNormalization",
                NormKind::Group { .. } => "GroupNormalization",
                NormKind::Rms { .. } => "RMSNormalization",
            }),
            Op::Sum { mean: false } => onnx("Sum"),
            Op::Sum { mean: true } => onnx("Mean"),
            Op::OneHot { .. } => onnx("OneHot"),
            Op::Recurrent(r) => onnx(r.kind.onnx_name()),
            Op::CumSum { .. } => onnx("CumSum"),
            Op::Pad { .. } => onnx("Pad"),
            Op::Trilu { .. } => onnx("Trilu"),
            Op::ReduceOp { kind, .. } => onnx(match kind {
                Reduce::Sum => "ReduceSum",
                Reduce::Mean => "ReduceMean",
                Reduce::Max => "ReduceMax",
                Reduce::Min => "ReduceMin",
                Reduce::SumSquare => "ReduceSumSquare",
                Reduce::L1 => "ReduceL1",
                Reduce::L2 => "ReduceL2",
                Reduce::LogSum => "ReduceLogSum",
                Reduce::LogSumExp => "ReduceLogSumExp",
                Reduce::Prod => "ReduceProd",
            }),
            Op::Conv { .. } => onnx("Conv"),
            Op::ConvTranspose { .. } => onnx("ConvTranspose"),
            Op::Resize(_) => onnx("Resize"),
            Op::Pool { kind: PoolKind::Max, .. } => onnx("MaxPool"),
            Op::Pool { .. } => onnx("AveragePool"),
            Op::GlobalAveragePool => onnx("GlobalAveragePool"),
            Op::BatchNorm { .. } => onnx("BatchNormalization"),
            Op::SoftmaxCrossEntropyLoss { .. } => onnx("SoftmaxCrossEntropyLoss"),
            Op::NegativeLogLikelihoodLoss { .. } => onnx("NegativeLogLikelihoodLoss"),
            Op::NegativeLogLikelihoodLossGrad { .. } => internal("NegativeLogLikelihoodLossGrad"),
            Op::Constant { .. } => onnx("Constant"),
            Op::Shape { .. } => onnx("Shape"),
            Op::ConstantOfShape { .. } => onnx("ConstantOfShape"),
            Op::Range => onnx("Range"),
            Op::Size => onnx("Size"),
            Op::Sequence(s) => onnx(match s {
                SequenceOp::Split { .. } => "SplitToSequence",
                SequenceOp::Construct => "SequenceConstruct",
                SequenceOp::Empty => "SequenceEmpty",
                SequenceOp::At => "SequenceAt",
                SequenceOp::Length => "SequenceLength",
                SequenceOp::Insert => "SequenceInsert",
                SequenceOp::Erase => "SequenceErase",
                SequenceOp::Concat { .. } => "ConcatFromSequence",
            }),
            Op::ArgExtreme { max: true, .. } => onnx("ArgMax"),
            Op::ArgExtreme { max: false, .. } => onnx("ArgMin"),
            Op::Squeeze { .. } => onnx("Squeeze"),
            Op::Unsqueeze { .. } => onnx("Unsqueeze"),
            Op::Flatten { .. } => onnx("Flatten"),
            Op::ReduceSumTo { .. } => internal("ReduceSumTo"),
            Op::UnaryGrad(_) => internal("UnaryGrad"),
            Op::SoftmaxGrad { .. } => internal("SoftmaxGrad"),
            Op::LogSoftmaxGrad { .. } => internal("LogSoftmaxGrad"),
            Op::ResidualLayerNorm { rms: false, .. } => internal("ResidualLayerNormalization"),
            Op::ResidualLayerNorm { rms: true, .. } => internal("ResidualRMSNormalization"),
            Op::LayerNormGrad { rms: false, .. } => internal("LayerNormalizationGrad"),
            Op::LayerNormGrad { rms: true, .. } => internal("RMSNormalizationGrad"),
            Op::SoftmaxCrossEntropyLossGrad { .. } => internal("SoftmaxCrossEntropyLossGrad"),
            Op::GatherGrad { .. } => internal("GatherGrad"),
            Op::GatherElementsGrad { .. } => internal("GatherElementsGrad"),
            Op::GatherNDGrad { .. } => internal("GatherNDGrad"),
            Op::SliceGrad { .. } => internal("SliceGrad"),
            Op::PadGrad { .. } => internal("PadGrad"),
            Op::DropoutGrad { .. } => internal("DropoutGrad"),
            Op::ConvGrad { .. } => internal("ConvGrad"),
            Op::ConvTransposeGrad { .. } => internal("ConvTransposeGrad"),
            Op::ResizeGrad { .. } => internal("ResizeGrad"),
            Op::PoolGrad { .. } => internal("PoolGrad"),
            Op::BatchNormGrad { .. } => internal("BatchNormalizationGrad"),
            Op::BatchNormRelu { .. } => internal("BatchNormalizationRelu"),
            Op::BatchNormReluGrad { .. } => internal("BatchNormalizationReluGrad"),
            Op::FusedMatMul { .. } => internal("FusedMatMul"),
            Op::MatMulUnaryGrad { .. } => internal("MatMulUnaryGrad"),
            Op::SoftmaxCrossEntropyLse { .. } => internal("SoftmaxCrossEntropyLse"),
            Op::SoftmaxCrossEntropyLseGrad { .. } => internal("SoftmaxCrossEntropyLseGrad"),
            Op::Attention { .. } => internal("Attention"),
            Op::AttentionGrad { .. } => internal("AttentionGrad"),
            Op::Swiglu => internal("Swiglu"),
            Op::SwigluGrad => internal("SwigluGrad"),
            Op::Rotary => internal("Rotary"),
            Op::RotaryGrad => internal("RotaryGrad"),
            Op::AllReduce { .. } => internal("AllReduce"),
            Op::TensorParallelCopy => internal("TensorParallelCopy"),
            Op::ShardGather { .. } => internal("ShardGather"),
            Op::ShardGatherGrad { .. } => internal("ShardGatherGrad"),
            Op::VocabShardCrossEntropy { .. } => internal("VocabShardCrossEntropy"),
            Op::VocabShardCrossEntropyGrad { .. } => internal("VocabShardCrossEntropyGrad"),
            Op::VocabParallelLoss { .. } => internal("VocabParallelLoss"),
            Op::VocabParallelLossGrad { .. } => internal("VocabParallelLossGrad"),
            Op::TopK { .. } => onnx("TopK"),
            Op::Einsum { .. } => onnx("Einsum"),
            Op::TopKIndices { .. } => internal("TopKIndices"),
        }
    }

    /// The attributes this op is saved with (the inverse of `from_onnx` for ONNX ops; internal
    /// ops save what they need to be read back by our own loader).
    pub fn onnx_attrs(&self) -> Vec<(String, AttrValue)> {
        let i = |k: &str, v: i64| (k.to_string(), AttrValue::Int(v));
        let f = |k: &str, v: f32| (k.to_string(), AttrValue::Float(v));
        let is = |k: &str, v: &[i64]| (k.to_string(), AttrValue::Ints(v.to_vec()));
        let us = |k: &str, v: &[usize]| (k.to_string(), AttrValue::Ints(v.iter().map(|&x| x as i64).collect()));
        let win = |w: &Window| {
            vec![
                us("kernel_shape", &w.kernel),
                us("strides", &w.strides),
                us("dilations", &w.dilations),
                us("pads", &w.pads),
                i("ceil_mode", w.ceil_mode as i64),
            ]
        };
        match self {
            Op::Unary(Unary::GeluTanh) => vec![("approximate".into(), AttrValue::Str("tanh".into()))],
            Op::Unary(Unary::HardSigmoid { alpha, beta }) => vec![f("alpha", *alpha), f("beta", *beta)],
            Op::Unary(
                Unary::LeakyRelu { alpha }
                | Unary::Elu { alpha }
                | Unary::Celu { alpha }
                | Unary::ThresholdedRelu { alpha },
            ) => vec![f("alpha", *alpha)],
            Op::Unary(Unary::Selu { alpha, gamma }) => vec![f("alpha", *alpha), f("gamma", *gamma)],
            Op::Unary(Unary::IsInf { negative, positive }) => {
                vec![i("detect_negative", *negative as i64), i("detect_positive", *positive as i64)]
            }
            Op::Binary(Binary::Fmod) => vec![i("fmod", 1)],
            Op::Recurrent(r) => r.onnx_attrs(),
            Op::ReshapeAllowZero => vec![i("allowzero", 1)],
            Op::Normalization { kind, epsilon } => {
                let mut v = vec![f("epsilon", *epsilon)];
                match kind {
                    NormKind::Instance => {}
                    NormKind::Group { groups } => v.push(i("num_groups", *groups as i64)),
                    NormKind::Rms { axis } => v.push(i("axis", *axis)),
                }
                v
            }
            Op::CumSum { exclusive, reverse, .. } => {
                vec![i("exclusive", *exclusive as i64), i("reverse", *reverse as i64)]
            }
            Op::GatherND { batch_dims } | Op::GatherNDGrad { batch_dims, .. } => {
                vec![i("batch_dims", *batch_dims as i64)]
            }
            Op::ScatterND { reduction } => {
                let r = ["none", "add", "mul", "max", "min"][*reduction as usize];
                vec![("reduction".into(), AttrValue::Str(r.into()))]
            }
            Op::ScatterElements { axis, reduction } => {
                let r = ["none", "add", "mul", "max", "min"][*reduction as usize];
                vec![i("axis", *axis), ("reduction".into(), AttrValue::Str(r.into()))]
            }
            Op::Pad { mode, .. } | Op::PadGrad { mode, .. } => {
                let m = ["constant", "reflect", "edge", "wrap"][*mode as usize];
                vec![("mode".into(), AttrValue::Str(m.into()))]
            }
            Op::ArgExtreme { axis, keepdims, select_last_index, .. } => vec![
                i("axis", *axis),
                i("keepdims", *keepdims as i64),
                i("select_last_index", *select_last_index as i64),
            ],
            Op::Cast { to } => vec![i("to", to.onnx_code() as i64)],
            // Dropout's ratio is an input since opset 12 (`onnx_io::to_model` writes it).
            Op::Dropout { seed, .. } => vec![i("seed", *seed as i64)],
            Op::Gemm { alpha, beta, trans_a, trans_b } => {
                vec![f("alpha", *alpha), f("beta", *beta), i("transA", *trans_a as i64), i("transB", *trans_b as i64)]
            }
            Op::Softmax { axis }
            | Op::LogSoftmax { axis }
            | Op::Concat { axis }
            | Op::Gather { axis, .. }
            | Op::GatherElements { axis }
            | Op::GatherElementsGrad { axis, .. } => {
                vec![i("axis", *axis)]
            }
            Op::Flatten { axis } => vec![i("axis", *axis)],
            Op::LayerNorm { axis, epsilon, .. } | Op::ResidualLayerNorm { axis, epsilon, .. } => {
                vec![i("axis", *axis), f("epsilon", *epsilon)]
            }
            Op::Transpose { perm: Some(p) } => vec![is("perm", p)],
            // Split's sizes (and Squeeze/Unsqueeze/Reduce axes) are inputs in the opsets we
            // write; `operand_inputs` gives them.
            Op::Split { axis, .. } => vec![i("axis", *axis)],
            Op::Trilu { upper, .. } => vec![i("upper", *upper as i64)],
            Op::ReduceOp { keepdims, noop_with_empty_axes, .. } => {
                vec![i("keepdims", *keepdims as i64), i("noop_with_empty_axes", *noop_with_empty_axes as i64)]
            }
            Op::Conv { window, group } | Op::ConvTransposeGrad { window, group } => {
                // Conv has no ceil_mode (pooling has).
                let mut v: Vec<_> = win(window).into_iter().filter(|(k, _)| k != "ceil_mode").collect();
                v.push(i("group", *group as i64));
                v
            }
            Op::ConvTranspose { window, group, output_padding, output_shape } => {
                let mut v: Vec<_> = win(window).into_iter().filter(|(k, _)| k != "ceil_mode").collect();
                v.push(i("group", *group as i64));
                if window.auto_pad != "NOTSET" {
                    v.retain(|(k, _)| k != "pads");
                    v.push(("auto_pad".into(), AttrValue::Str(window.auto_pad.clone())));
                }
                if output_padding.iter().any(|&p| p > 0) {
                    v.push(us("output_padding", output_padding));
                }
                if let Some(shape) = output_shape {
                    v.push(us("output_shape", shape));
                }
                v
            }
            Op::Resize(r) | Op::ResizeGrad { resize: r, .. } => r.onnx_attrs(),
            Op::Pool { kind, window } => {
                let mut v = win(window);
                if let PoolKind::Average { count_include_pad } = kind {
                    v.push(i("count_include_pad", *count_include_pad as i64));
                }
                v
            }
            Op::BatchNorm { epsilon, momentum, training } => {
                vec![f("epsilon", *epsilon), f("momentum", *momentum), i("training_mode", *training as i64)]
            }
            Op::BatchNormRelu { epsilon, momentum } => vec![f("epsilon", *epsilon), f("momentum", *momentum)],
            Op::SoftmaxCrossEntropyLoss { reduction, ignore_index }
            | Op::NegativeLogLikelihoodLoss { reduction, ignore_index }
            | Op::NegativeLogLikelihoodLossGrad { reduction, ignore_index, .. }
            | Op::VocabParallelLoss { reduction, ignore_index }
            | Op::VocabParallelLossGrad { reduction, ignore_index }
            | Op::SoftmaxCrossEntropyLossGrad { reduction, ignore_index }
            | Op::SoftmaxCrossEntropyLse { reduction, ignore_index }
            | Op::SoftmaxCrossEntropyLseGrad { reduction, ignore_index } => {
                let r = match reduction {
                    LossReduction::Mean => "mean",
                    LossReduction::Sum => "sum",
                    LossReduction::None => "none",
                };
                let mut v = vec![("reduction".to_string(), AttrValue::Str(r.into()))];
                if let Some(ii) = ignore_index {
                    v.push(i("ignore_index", *ii));
                }
                v
            }
            Op::AllReduce { op } => {
                vec![("op".into(), AttrValue::Str(format!("{op:?}").to_lowercase()))]
            }
            Op::ShardGather { start } => vec![i("start", *start)],
            Op::ShardGatherGrad { start, rows } => vec![i("start", *start), i("rows", *rows as i64)],
            Op::VocabShardCrossEntropy { start, ignore_index, .. }
            | Op::VocabShardCrossEntropyGrad { start, ignore_index } => {
                let mut v = vec![i("start", *start)];
                if let Some(ii) = ignore_index {
                    v.push(i("ignore_index", *ii));
                }
                v
            }
            Op::Constant { value } => vec![("value".into(), AttrValue::Tensor(value.clone()))],
            Op::ConstantOfShape { value } => vec![("value".into(), AttrValue::Tensor(value.clone()))],
            Op::Shape { start, end } => {
                let mut v = vec![i("start", *start)];
                if let Some(e) = end {
                    v.push(i("end", *e));
                }
                v
            }
            Op::Attention { scale, causal, layout } | Op::AttentionGrad { scale, causal, layout } => {
                vec![
                    f("scale", *scale),
                    i("causal", *causal as i64),
                    ("layout".into(), AttrValue::Str(layout.name().into())),
                ]
            }
            Op::FusedMatMul { trans_a, trans_b, activation } => vec![
                i("transA", *trans_a as i64),
                i("transB", *trans_b as i64),
                i("gelu", matches!(activation, Some(Unary::GeluTanh)) as i64),
            ],
            Op::MatMulUnaryGrad { trans_a, trans_b, activation } => vec![
                i("transA", *trans_a as i64),
                i("transB", *trans_b as i64),
                i("gelu", (*activation == Unary::GeluTanh) as i64),
            ],
            Op::TopK { axis, largest, sorted } => {
                vec![i("axis", *axis), i("largest", *largest as i64), i("sorted", *sorted as i64)]
            }
            Op::Einsum { equation } => vec![("equation".into(), AttrValue::Str(equation.clone()))],
            Op::TopKIndices { axis, k, largest } => {
                vec![i("axis", *axis), i("k", *k as i64), i("largest", *largest as i64)]
            }
            _ => vec![],
        }
    }

    /// Operands that ONNX (opset 13 and later, 18 for ReduceMean/Max/Min) takes as inputs but
    /// this vocabulary keeps as attributes: what a saved node appends to its inputs.
    pub fn operand_inputs(&self) -> Vec<Tensor> {
        let ints = |v: &[i64]| Tensor::from_vec(&[v.len()], v.to_vec());
        match self {
            Op::Dropout { ratio, .. } => vec![Tensor::scalar(*ratio)],
            Op::Unary(Unary::Clip { min, max }) => vec![Tensor::scalar(*min), Tensor::scalar(*max)],
            Op::Pad { pads, value, .. } => vec![ints(pads), Tensor::scalar(*value as f32)],
            Op::CumSum { axis, .. } => vec![Tensor::scalar(*axis)],
            Op::Split { sizes, .. } if !sizes.is_empty() => vec![ints(sizes)],
            Op::Squeeze { axes: Some(a) } | Op::Unsqueeze { axes: Some(a) } => vec![ints(a)],
            Op::ReduceOp { axes: Some(a), .. } if !a.is_empty() => vec![ints(a)],
            Op::Resize(r) => r.operands(),
            _ => vec![],
        }
    }

    /// Ops whose inputs beyond the first are shape operands, folded away at plan time.
    pub fn static_operand_inputs(&self) -> std::ops::Range<usize> {
        match self {
            Op::Reshape | Op::ReshapeAllowZero | Op::Expand | Op::CastLike | Op::Tile | Op::CumSum { .. } => 1..2,
            Op::Unary(Unary::Clip { .. }) => 1..3,
            Op::OneHot { .. } => 1..3,
            // sequence_lens: binding must know it (it unrolls over the lengths).
            Op::Recurrent(_) => 4..5,
            Op::Pad { .. } => 1..4,
            // Split sizes and positions (a sequence op's other inputs are tensors or sequences).
            Op::Sequence(SequenceOp::Split { .. } | SequenceOp::At | SequenceOp::Erase) => 1..2,
            Op::Sequence(SequenceOp::Insert) => 2..3,
            Op::Squeeze { .. } | Op::Unsqueeze { .. } | Op::Split { .. } | Op::ReduceOp { .. } => 1..2,
            Op::Slice { .. } => 1..5,
            Op::ConstantOfShape { .. } => 0..1,
            Op::Range => 0..3,
            Op::Trilu { .. } => 1..2,
            Op::Dropout { .. } => 1..3,
            Op::TopK { .. } => 1..2,
            // roi, scales and sizes (Upsample and opset 10's Resize: scales).
            Op::Resize(r) => 1..if r.legacy { 2 } else { 4 },
            _ => 0..0,
        }
    }

    /// Ops that draw random numbers in training (their results are not folded).
    pub fn is_random(&self) -> bool {
        matches!(self, Op::Dropout { training: true, ratio, .. } if *ratio > 0.0)
    }
}

fn constant_value(a: &Attrs) -> Result<Tensor> {
    if let Some(t) = a.tensor("value")? {
        return Ok(t);
    }
    match (a.map.get("value_float"), a.map.get("value_int"), a.map.get("value_floats"), a.map.get("value_ints")) {
        (Some(AttrValue::Float(v)), ..) => Ok(Tensor::scalar(*v)),
        (_, Some(AttrValue::Int(v)), ..) => Ok(Tensor::scalar(*v)),
        (_, _, Some(AttrValue::Floats(v)), _) => Ok(Tensor::from_vec(&[v.len()], v.clone())),
        (_, _, _, Some(AttrValue::Ints(v))) => Ok(Tensor::from_vec(&[v.len()], v.clone())),
        _ => Err(Error::Corrupt(format!("{}: Constant needs a 'value' attribute of a supported kind", a.origin))),
    }
}
