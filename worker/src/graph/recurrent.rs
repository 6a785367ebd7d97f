//! LSTM, GRU and RNN, written out when the graph is bound. Shapes are static per run, so the
//! sequence length is known and a layer unrolls into ops the engine already has: per direction,
//! one projection of every time step's input at once (a Gemm with both biases), then per step
//! the recurrent product (a Gemm that adds the step's projection) and the gates' pointwise ops;
//! Concat and Reshape lay the states out as Y, Y_h and Y_c. Those ops have CPU and CUDA kernels
//! and gradient rules, so training through a layer needs nothing of its own.
//!
//! Shapes, with layout 0 (layout 1 puts the batch first in X, Y and the states):
//! X [T, N, I], W [D, G·H, I], R [D, G·H, H], B [D, 2·G·H], initial_h/c [D, N, H], P [D, 3H]
//! → Y [T, D, N, H], Y_h and Y_c [D, N, H]; T steps, N the batch, D directions (forward, then
//! reverse), G gates (LSTM 4: i, o, f, c; GRU 3: z, r, h; RNN 1).

use super::infer::{constant_value, node1};
use super::ir::{Graph, Meta, Node, ValueId};
use crate::error::{Error, Result};
use crate::op::{Activation, Binary, Op, Recurrent, RecurrentKind, Unary};
use crate::tensor::{DType, Tensor};
use std::collections::HashMap;

fn err(node: &Node, msg: impl std::fmt::Display) -> Error {
    Error::Corrupt(format!("{}: {msg}", node.describe()))
}

/// The ONNX input positions.
const B_IN: usize = 3;
const SEQUENCE_LENS: usize = 4;
const INITIAL_H: usize = 5;
const INITIAL_C: usize = 6;
const P_IN: usize = 7;

/// The most steps (over all directions) a recurrent layer is unrolled into.
const MAX_STEPS: usize = 1 << 16;

/// The sizes read off the inputs.
#[derive(Clone, Copy)]
struct Sizes {
    steps: usize,
    batch: usize,
    input: usize,
    hidden: usize,
    dirs: usize,
}

/// Rewrites one LSTM, GRU or RNN node into the nodes that compute it, to be bound in its place.
pub fn expand(
    g: &mut Graph,
    consts: &mut HashMap<ValueId, Tensor>,
    node: &Node,
    metas: &[Option<Meta>],
    r: &Recurrent,
) -> Result<Vec<Node>> {
    let s = sizes(node, metas, r)?;
    // Unrolled, each step and direction is about a dozen nodes: a sequence longer than this
    // is a fault (a wrong dimension), not something to build for minutes.
    if s.steps.saturating_mul(s.dirs) > MAX_STEPS {
        return Err(Error::Config(format!(
            "{}: a sequence of {} steps in {} direction(s) would unroll into about {} nodes; at most {MAX_STEPS} \
             steps are written out (is the sequence dimension right?)",
            node.describe(),
            s.steps,
            s.dirs,
            s.steps.saturating_mul(s.dirs).saturating_mul(12)
        )));
    }
    check_lengths(node, consts, s)?;
    if r.kind != RecurrentKind::Lstm && node.output(2).is_some() {
        return Err(err(node, "only LSTM has a third output (Y_c)"));
    }
    let dtype = metas[0].as_ref().expect("checked").dtype;
    let mut w = Writer { g, consts, node, dtype, nodes: vec![], constants: HashMap::new() };
    let xs = w.input(node.input(0).expect("checked"), r.batch_first, s);
    let mut finals = Vec::new();
    let mut states = Vec::new();
    for d in 0..s.dirs {
        let lane = w.lane(r, s, d);
        let steps = w.project(xs, s, d, &lane);
        let (hs, last) = w.run(r, s, d, &lane, steps);
        states.push(hs);
        finals.push(last);
    }
    if let Some(y) = node.output(0) {
        w.write_y(&states, r.batch_first, s, y);
    }
    if let Some(y_h) = node.output(1) {
        let hs: Vec<ValueId> = finals.iter().map(|f| f.h).collect();
        w.write_final("y_h", &hs, r.batch_first, s, y_h);
    }
    if let Some(y_c) = node.output(2) {
        let cs: Vec<ValueId> = finals.iter().map(|f| f.c.expect("LSTM has a cell state")).collect();
        w.write_final("y_c", &cs, r.batch_first, s, y_c);
    }
    Ok(w.nodes)
}

/// Checks every input's shape and element type against X, W and R; returns the sizes.
fn sizes(node: &Node, metas: &[Option<Meta>], r: &Recurrent) -> Result<Sizes> {
    let meta = |k: usize| metas.get(k).and_then(|m| m.as_ref());
    let need = |k: usize, what: &str| meta(k).ok_or_else(|| err(node, format!("{what} (input {k}) is missing")));
    let (x, rr) = (need(0, "X")?, need(2, "R")?);
    need(1, "W")?;
    if !x.dtype.is_float() {
        return Err(err(node, format!("X must be floating-point, not {}", x.dtype)));
    }
    let [a, b, input] = x.shape[..] else { return Err(err(node, format!("X has shape {:?}, not 3-D", x.shape))) };
    let (steps, batch) = if r.batch_first { (b, a) } else { (a, b) };
    let (gates, dirs) = (r.kind.gates(), r.direction.count());
    let hidden = rr.shape.get(2).copied().unwrap_or(0);
    if steps == 0 || batch == 0 || hidden == 0 {
        return Err(err(node, format!("X {:?} and R {:?} leave nothing to compute", x.shape, rr.shape)));
    }
    if r.hidden_size.is_some_and(|h| h != hidden) {
        return Err(err(node, format!("hidden_size {:?} against R of shape {:?}", r.hidden_size, rr.shape)));
    }
    let states = if r.batch_first { [batch, dirs, hidden] } else { [dirs, batch, hidden] };
    let expected: [(usize, &str, Vec<usize>); 6] = [
        (1, "W", vec![dirs, gates * hidden, input]),
        (2, "R", vec![dirs, gates * hidden, hidden]),
        (B_IN, "B", vec![dirs, 2 * gates * hidden]),
        (INITIAL_H, "initial_h", states.to_vec()),
        (INITIAL_C, "initial_c", states.to_vec()),
        (P_IN, "P", vec![dirs, 3 * hidden]),
    ];
    for (k, what, shape) in expected {
        let Some(m) = meta(k) else { continue };
        if m.shape != shape || m.dtype != x.dtype {
            let (d, s, xd, xs) = (m.dtype, &m.shape, x.dtype, &x.shape);
            let why = format!("X {xd}{xs:?}, R {:?} and direction {:?} make it {xd}{shape:?}", rr.shape, r.direction);
            return Err(err(node, format!("{what} (input {k}) is {d}{s:?}; {why}")));
        }
    }
    if r.kind != RecurrentKind::Lstm && (meta(INITIAL_C).is_some() || meta(P_IN).is_some()) {
        return Err(err(node, "only LSTM reads initial_c and P (inputs 6 and 7)"));
    }
    Ok(Sizes { steps, batch, input, hidden, dirs })
}

/// Every sequence must run the full length: the unrolled layer has no way to stop a batch
/// element early (its Y would need zeros after the end, and Y_h the state at the end).
fn check_lengths(node: &Node, consts: &HashMap<ValueId, Tensor>, s: Sizes) -> Result<()> {
    let Some(v) = node.input(SEQUENCE_LENS) else { return Ok(()) };
    let lens = consts.get(&v).and_then(|t| t.to_i64_vec()).ok_or_else(|| {
        Error::Unsupported(format!(
            "{}: sequence_lens (input 4) must be known when the graph is bound; only sequences of the \
             full length (X's, {}) are supported",
            node.describe(),
            s.steps
        ))
    })?;
    if lens.len() != s.batch || lens.iter().any(|&l| l != s.steps as i64) {
        return Err(Error::Unsupported(format!(
            "{}: sequence_lens {lens:?} for a batch of {} sequences of {} steps: only sequences of \
             the full length are supported; pad them to it, or drop sequence_lens",
            node.describe(),
            s.batch,
            s.steps
        )));
    }
    Ok(())
}

/// One direction's operands, cut from the layer's inputs.
struct Lane {
    /// W [G·H, I].
    w: ValueId,
    /// The bias of the input projection [G·H]: Wb + Rb (GRU with linear_before_reset: Rb_h
    /// apart, in `rb_h`).
    bias: Option<ValueId>,
    /// R [G·H, H]; for GRU, z's and r's rows [2H, H], with h's [H, H] in `r_h`.
    r: ValueId,
    r_h: Option<ValueId>,
    rb_h: Option<ValueId>,
    /// LSTM's peepholes p_i, p_o, p_f [H].
    peepholes: Option<[ValueId; 3]>,
    /// The initial states [N, H].
    h0: ValueId,
    c0: Option<ValueId>,
    /// f (, g (, h)).
    activations: Vec<Activation>,
}

/// A direction's state after a step.
#[derive(Clone, Copy)]
struct State {
    h: ValueId,
    c: Option<ValueId>,
}

/// Writes nodes named after the layer's node; each makes one fresh value unless told where to
/// write. Constants (shapes, scalars, zeros) are made once per layer.
struct Writer<'a> {
    g: &'a mut Graph,
    consts: &'a mut HashMap<ValueId, Tensor>,
    node: &'a Node,
    dtype: DType,
    nodes: Vec<Node>,
    constants: HashMap<(String, Vec<u64>), ValueId>,
}

impl Writer<'_> {
    fn name(&self, s: &str) -> String {
        format!("{}:{s}", self.node.name)
    }

    fn op(&mut self, s: &str, op: Op, inputs: &[ValueId]) -> ValueId {
        let out = self.g.fresh(&self.name(s));
        self.nodes.push(node1(self.name(s), op, inputs, out));
        out
    }

    fn op_into(&mut self, s: &str, op: Op, inputs: &[ValueId], out: ValueId) {
        self.nodes.push(node1(self.name(s), op, inputs, out));
    }

    /// A constant, shared by every reader in the layer; `key` tells equal ones apart.
    fn constant(&mut self, what: &str, key: Vec<u64>, t: impl FnOnce() -> Tensor) -> ValueId {
        if let Some(&v) = self.constants.get(&(what.to_string(), key.clone())) {
            return v;
        }
        let v = constant_value(self.g, self.consts, &format!("{}:{what}", self.node.name), t());
        self.constants.insert((what.to_string(), key), v);
        v
    }

    fn scalar(&mut self, x: f32) -> ValueId {
        let dtype = self.dtype;
        self.constant("scalar", vec![x.to_bits() as u64], || Tensor::scalar(x).cast(dtype))
    }

    fn zeros(&mut self, shape: &[usize]) -> ValueId {
        let dtype = self.dtype;
        self.constant("zeros", shape.iter().map(|&d| d as u64).collect(), || Tensor::zeros(dtype, shape))
    }

    /// A target shape for Reshape.
    fn shape(&mut self, dims: &[usize]) -> ValueId {
        let t = || Tensor::from_vec(&[dims.len()], dims.iter().map(|&d| d as i64).collect::<Vec<_>>());
        self.constant("shape", dims.iter().map(|&d| d as u64).collect(), t)
    }

    fn reshape(&mut self, s: &str, x: ValueId, dims: &[usize]) -> ValueId {
        let shape = self.shape(dims);
        self.op(s, Op::Reshape, &[x, shape])
    }

    fn binary(&mut self, s: &str, b: Binary, x: ValueId, y: ValueId) -> ValueId {
        self.op(s, Op::Binary(b), &[x, y])
    }

    /// `x` in `K` parts along `axis`.
    fn split_n<const K: usize>(&mut self, s: &str, x: ValueId, axis: usize, sizes: [usize; K]) -> [ValueId; K] {
        self.split(s, x, axis, &sizes).try_into().expect("one value per part")
    }

    fn split(&mut self, s: &str, x: ValueId, axis: usize, sizes: &[usize]) -> Vec<ValueId> {
        if sizes.len() == 1 {
            return vec![x];
        }
        let outs: Vec<ValueId> = (0..sizes.len()).map(|k| self.g.fresh(&self.name(&format!("{s}{k}")))).collect();
        self.nodes.push(Node {
            name: self.name(s),
            op: Op::Split { axis: axis as i64, sizes: sizes.iter().map(|&n| n as i64).collect(), num_outputs: None },
            inputs: vec![Some(x)],
            outputs: outs.iter().copied().map(Some).collect(),
        });
        outs
    }

    /// Direction `d`'s part of `x` along `axis`, viewed as `dims`.
    fn pick(&mut self, s: &str, x: ValueId, axis: usize, d: usize, dirs: usize, dims: &[usize]) -> ValueId {
        let part = if dirs == 1 {
            x
        } else {
            let (starts, ends) = (vec![d as i64], vec![d as i64 + 1]);
            self.op(&format!("{s}_slice"), Op::Slice { starts, ends, axes: vec![axis as i64], steps: vec![1] }, &[x])
        };
        self.reshape(s, part, dims)
    }

    /// a·bᵀ (+ c).
    fn times_t(&mut self, s: &str, a: ValueId, b: ValueId, c: Option<ValueId>) -> ValueId {
        let gemm = Op::Gemm { alpha: 1.0, beta: 1.0, trans_a: false, trans_b: true };
        match c {
            Some(c) => self.op(s, gemm, &[a, b, c]),
            None => self.op(s, gemm, &[a, b]),
        }
    }

    /// The activation of a gate's input, clipped first when the layer clips.
    fn activate(&mut self, s: &str, act: Activation, x: ValueId, clip: Option<f32>) -> ValueId {
        let x = match clip {
            Some(c) => self.op(&format!("{s}_clip"), Op::Unary(Unary::Clip { min: -c, max: c }), &[x]),
            None => x,
        };
        match act {
            Activation::Unary(u) => self.op(s, Op::Unary(u), &[x]),
            Activation::Affine { alpha, beta } => {
                let (a, b) = (self.scalar(alpha), self.scalar(beta));
                let ax = self.binary(&format!("{s}_scale"), Binary::Mul, x, a);
                self.binary(s, Binary::Add, ax, b)
            }
            Activation::ScaledTanh { alpha, beta } => {
                let (a, b) = (self.scalar(alpha), self.scalar(beta));
                let bx = self.binary(&format!("{s}_scale_in"), Binary::Mul, x, b);
                let t = self.op(&format!("{s}_tanh"), Op::Unary(Unary::Tanh), &[bx]);
                self.binary(s, Binary::Mul, t, a)
            }
        }
    }
}

impl Writer<'_> {
    /// X as [T·N, I], time-major, which every direction's projection reads.
    fn input(&mut self, x: ValueId, batch_first: bool, s: Sizes) -> ValueId {
        let x =
            if batch_first { self.op("x_time_major", Op::Transpose { perm: Some(vec![1, 0, 2]) }, &[x]) } else { x };
        self.reshape("x_rows", x, &[s.steps * s.batch, s.input])
    }

    /// Direction `d`'s weights, biases, peepholes and initial states.
    fn lane(&mut self, r: &Recurrent, s: Sizes, d: usize) -> Lane {
        let node = self.node;
        let (gh, h, dirs) = (r.kind.gates() * s.hidden, s.hidden, s.dirs);
        let tag = |what: &str| format!("d{d}_{what}");
        let w = self.pick(&tag("w"), node.input(1).expect("checked"), 0, d, dirs, &[gh, s.input]);
        let r_all = self.pick(&tag("r"), node.input(2).expect("checked"), 0, d, dirs, &[gh, h]);
        let (r_gates, r_h) = match r.kind {
            RecurrentKind::Gru => {
                let [zr, hh] = self.split_n(&tag("r_parts"), r_all, 0, [2 * h, h]);
                (zr, Some(hh))
            }
            _ => (r_all, None),
        };
        let (bias, rb_h) = match node.input(B_IN) {
            None => (None, None),
            Some(b) => {
                let b = self.pick(&tag("b"), b, 0, d, dirs, &[2 * gh]);
                let [wb, rb] = self.split_n(&tag("b_halves"), b, 0, [gh, gh]);
                self.biases(r, s, d, wb, rb)
            }
        };
        let peepholes = node.input(P_IN).map(|p| {
            let p = self.pick(&tag("p"), p, 0, d, dirs, &[3 * h]);
            self.split_n(&tag("p_parts"), p, 0, [h, h, h])
        });
        let state_axis = if r.batch_first { 1 } else { 0 };
        let initial = |w: &mut Self, k: usize, what: &str| match node.input(k) {
            Some(v) => w.pick(&tag(what), v, state_axis, d, dirs, &[s.batch, h]),
            None => w.zeros(&[s.batch, h]),
        };
        let h0 = initial(self, INITIAL_H, "h0");
        let c0 = (r.kind == RecurrentKind::Lstm).then(|| initial(self, INITIAL_C, "c0"));
        let per = r.kind.default_activations().len();
        let activations = r.activations[d * per..(d + 1) * per].to_vec();
        Lane { w, bias, r: r_gates, r_h, rb_h, peepholes, h0, c0, activations }
    }

    /// The projection's bias from W's and R's halves of B. GRU with linear_before_reset keeps
    /// Rb_h apart: the reset gate scales it with R_h's product.
    fn biases(
        &mut self,
        r: &Recurrent,
        s: Sizes,
        d: usize,
        wb: ValueId,
        rb: ValueId,
    ) -> (Option<ValueId>, Option<ValueId>) {
        let tag = |what: &str| format!("d{d}_{what}");
        if !r.linear_before_reset {
            return (Some(self.binary(&tag("bias"), Binary::Add, wb, rb)), None);
        }
        let h = s.hidden;
        let [rb_zr, rb_h] = self.split_n(&tag("rb_parts"), rb, 0, [2 * h, h]);
        let [wb_zr, wb_h] = self.split_n(&tag("wb_parts"), wb, 0, [2 * h, h]);
        let zr = self.binary(&tag("bias_zr"), Binary::Add, wb_zr, rb_zr);
        let bias = self.op(&tag("bias"), Op::Concat { axis: 0 }, &[zr, wb_h]);
        (Some(bias), Some(rb_h))
    }

    /// Every step's input projection x·Wᵀ + biases, one [N, G·H] per step in time order.
    fn project(&mut self, xs: ValueId, s: Sizes, d: usize, lane: &Lane) -> Vec<ValueId> {
        let all = self.times_t(&format!("d{d}_x_proj"), xs, lane.w, lane.bias);
        self.split(&format!("d{d}_x_step"), all, 0, &vec![s.batch; s.steps])
    }

    /// Runs direction `d` over the steps: the state after each step, in time order, and the last.
    fn run(&mut self, r: &Recurrent, s: Sizes, d: usize, lane: &Lane, steps: Vec<ValueId>) -> (Vec<ValueId>, State) {
        let mut state = State { h: lane.h0, c: lane.c0 };
        let mut hs = vec![state.h; s.steps];
        let order: Vec<usize> =
            if r.direction.reversed(d) { (0..s.steps).rev().collect() } else { (0..s.steps).collect() };
        for t in order {
            let tag = format!("d{d}_t{t}");
            state = match r.kind {
                RecurrentKind::Lstm => self.lstm_step(&tag, r, lane, steps[t], state, s.hidden),
                RecurrentKind::Gru => self.gru_step(&tag, r, lane, steps[t], state, s.hidden),
                RecurrentKind::Rnn => {
                    let pre = self.times_t(&format!("{tag}_pre"), state.h, lane.r, Some(steps[t]));
                    State { h: self.activate(&format!("{tag}_h"), lane.activations[0], pre, r.clip), c: None }
                }
            };
            hs[t] = state.h;
        }
        (hs, state)
    }
}

impl Writer<'_> {
    /// i, o, f, c = x + h·Rᵀ (with peepholes p ⊙ c on i and f, and p ⊙ c' on o);
    /// c' = f(f) ⊙ c + f(i) ⊙ g(c); h' = f(o) ⊙ h(c').
    fn lstm_step(&mut self, tag: &str, r: &Recurrent, lane: &Lane, x: ValueId, prev: State, hidden: usize) -> State {
        let n = |what: &str| format!("{tag}_{what}");
        let c = prev.c.expect("LSTM has a cell state");
        let (f_act, g_act, h_act) = (lane.activations[0], lane.activations[1], lane.activations[2]);
        let gates = self.times_t(&n("gates"), prev.h, lane.r, Some(x));
        let [i, o, f, cand] = self.split_n(&n("gate"), gates, 1, [hidden; 4]);
        let peep = |w: &mut Self, what: &str, gate: ValueId, k: usize, state: ValueId| match lane.peepholes {
            Some(p) => {
                let pc = w.binary(&n(&format!("{what}_peep")), Binary::Mul, p[k], state);
                w.binary(&n(&format!("{what}_pre")), Binary::Add, gate, pc)
            }
            None => gate,
        };
        let i_pre = peep(self, "i", i, 0, c);
        let i = self.activate(&n("i"), f_act, i_pre, r.clip);
        let f = if r.input_forget {
            let one = self.scalar(1.0);
            self.binary(&n("f"), Binary::Sub, one, i)
        } else {
            let f_pre = peep(self, "f", f, 2, c);
            self.activate(&n("f"), f_act, f_pre, r.clip)
        };
        let cand = self.activate(&n("cand"), g_act, cand, r.clip);
        let kept = self.binary(&n("kept"), Binary::Mul, f, c);
        let added = self.binary(&n("added"), Binary::Mul, i, cand);
        let c_new = self.binary(&n("c"), Binary::Add, kept, added);
        let o_pre = peep(self, "o", o, 1, c_new);
        let o = self.activate(&n("o"), f_act, o_pre, r.clip);
        let c_out = self.activate(&n("c_act"), h_act, c_new, None);
        State { h: self.binary(&n("h"), Binary::Mul, o, c_out), c: Some(c_new) }
    }

    /// z, r = f(x_zr + h·R_zrᵀ); h̃ = g(x_h + (r ⊙ h)·R_hᵀ), or with linear_before_reset
    /// g(x_h + r ⊙ (h·R_hᵀ + Rb_h)); h' = h̃ + z ⊙ (h − h̃), which is (1 − z) ⊙ h̃ + z ⊙ h.
    fn gru_step(&mut self, tag: &str, r: &Recurrent, lane: &Lane, x: ValueId, prev: State, hidden: usize) -> State {
        let n = |what: &str| format!("{tag}_{what}");
        let (f_act, g_act) = (lane.activations[0], lane.activations[1]);
        let r_h = lane.r_h.expect("GRU has R_h");
        let [x_zr, x_h] = self.split_n(&n("x"), x, 1, [2 * hidden, hidden]);
        let zr_pre = self.times_t(&n("zr_pre"), prev.h, lane.r, Some(x_zr));
        let zr = self.activate(&n("zr"), f_act, zr_pre, r.clip);
        let [z, reset] = self.split_n(&n("gate"), zr, 1, [hidden, hidden]);
        let pre = if r.linear_before_reset {
            let rec = self.times_t(&n("rec"), prev.h, r_h, lane.rb_h);
            let gated = self.binary(&n("reset"), Binary::Mul, reset, rec);
            self.binary(&n("cand_pre"), Binary::Add, x_h, gated)
        } else {
            let gated = self.binary(&n("reset"), Binary::Mul, reset, prev.h);
            self.times_t(&n("cand_pre"), gated, r_h, Some(x_h))
        };
        let cand = self.activate(&n("cand"), g_act, pre, r.clip);
        let diff = self.binary(&n("diff"), Binary::Sub, prev.h, cand);
        let kept = self.binary(&n("kept"), Binary::Mul, z, diff);
        State { h: self.binary(&n("h"), Binary::Add, cand, kept), c: None }
    }

    /// Y from each direction's states: [T, D, N, H], or [N, T, D, H] batch-first.
    fn write_y(&mut self, states: &[Vec<ValueId>], batch_first: bool, s: Sizes, y: ValueId) {
        let rows: Vec<ValueId> = (0..s.steps).flat_map(|t| states.iter().map(move |hs| hs[t])).collect();
        let all = if rows.len() == 1 { rows[0] } else { self.op("y_rows", Op::Concat { axis: 0 }, &rows) };
        let shape = self.shape(&[s.steps, s.dirs, s.batch, s.hidden]);
        if batch_first {
            let y4 = self.op("y_time_major", Op::Reshape, &[all, shape]);
            self.op_into("y", Op::Transpose { perm: Some(vec![2, 0, 1, 3]) }, &[y4], y);
        } else {
            self.op_into("y", Op::Reshape, &[all, shape], y);
        }
    }

    /// Y_h or Y_c from each direction's last state [N, H]: [D, N, H], or [N, D, H] batch-first.
    fn write_final(&mut self, what: &str, lasts: &[ValueId], batch_first: bool, s: Sizes, out: ValueId) {
        let axis = batch_first as i64;
        let all =
            if lasts.len() == 1 { lasts[0] } else { self.op(&format!("{what}_rows"), Op::Concat { axis }, lasts) };
        let dims = if batch_first { [s.batch, s.dirs, s.hidden] } else { [s.dirs, s.batch, s.hidden] };
        let shape = self.shape(&dims);
        self.op_into(what, Op::Reshape, &[all, shape], out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::exec::Executor;
    use crate::graph::infer::{bind, Bindings};
    use crate::graph::ir::Dim;
    use crate::op::{AttrValue, Attrs, Direction};
    use crate::rng::Rng;
    use std::sync::Arc;

    /// A layer's inputs in f64, shaped as layout 0 has them; c0 and P are read by LSTM only.
    struct Inputs {
        x: Vec<f64>,
        w: Vec<f64>,
        r: Vec<f64>,
        b: Vec<f64>,
        h0: Vec<f64>,
        c0: Vec<f64>,
        p: Vec<f64>,
    }

    impl Inputs {
        fn random(l: &Recurrent, s: Sizes, seed: u64) -> Inputs {
            let mut rng = Rng::new(seed);
            let mut v = |n: usize, scale: f64| (0..n).map(|_| scale * (2.0 * rng.next_f64() - 1.0)).collect();
            let (gh, states) = (l.kind.gates() * s.hidden, s.dirs * s.batch * s.hidden);
            Inputs {
                x: v(s.steps * s.batch * s.input, 1.0),
                w: v(s.dirs * gh * s.input, 0.8),
                r: v(s.dirs * gh * s.hidden, 0.8),
                b: v(s.dirs * 2 * gh, 0.5),
                h0: v(states, 0.8),
                c0: v(states, 0.8),
                p: v(s.dirs * 3 * s.hidden, 0.5),
            }
        }
    }

    fn act(a: Activation, v: f64) -> f64 {
        match a {
            Activation::Unary(Unary::Sigmoid) => 1.0 / (1.0 + (-v).exp()),
            Activation::Unary(Unary::Tanh) => v.tanh(),
            Activation::Unary(Unary::Relu) => v.max(0.0),
            Activation::Unary(Unary::LeakyRelu { alpha }) => v.max(0.0) + alpha as f64 * v.min(0.0),
            Activation::Unary(Unary::HardSigmoid { alpha, beta }) => (alpha as f64 * v + beta as f64).clamp(0.0, 1.0),
            Activation::Affine { alpha, beta } => alpha as f64 * v + beta as f64,
            Activation::ScaledTanh { alpha, beta } => alpha as f64 * (beta as f64 * v).tanh(),
            Activation::Unary(Unary::Softsign) => v / (1.0 + v.abs()),
            Activation::Unary(Unary::Softplus) => v.exp().ln_1p(),
            Activation::Unary(Unary::ThresholdedRelu { alpha }) => {
                if v > alpha as f64 {
                    v
                } else {
                    0.0
                }
            }
            Activation::Unary(Unary::Elu { alpha }) => {
                if v >= 0.0 {
                    v
                } else {
                    alpha as f64 * v.exp_m1()
                }
            }
            Activation::Unary(u) => unreachable!("Activation::parse yields no {u:?}: not one of ONNX's activations"),
        }
    }

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// ONNX's equations, one batch element and step at a time: Y [T, D, N, H], Y_h and Y_c
    /// [D, N, H] (layout 0).
    fn reference(l: &Recurrent, s: Sizes, v: &Inputs) -> [Vec<f64>; 3] {
        let (hn, gh, per) = (s.hidden, l.kind.gates() * s.hidden, l.kind.default_activations().len());
        let mut y = vec![0.0; s.steps * s.dirs * s.batch * hn];
        let (mut yh, mut yc) = (vec![0.0; s.dirs * s.batch * hn], vec![0.0; s.dirs * s.batch * hn]);
        for (d, n) in (0..s.dirs).flat_map(|d| (0..s.batch).map(move |n| (d, n))) {
            let f =
                |k: usize, x: f64| act(l.activations[d * per + k], l.clip.map_or(x, |c| x.clamp(-c as f64, c as f64)));
            let at = (d * s.batch + n) * hn;
            let (mut h, mut c) = (v.h0[at..at + hn].to_vec(), v.c0[at..at + hn].to_vec());
            let order: Vec<usize> =
                if l.direction.reversed(d) { (0..s.steps).rev().collect() } else { (0..s.steps).collect() };
            for t in order {
                let x = &v.x[(t * s.batch + n) * s.input..][..s.input];
                let lin = |row: usize| dot(&v.w[(d * gh + row) * s.input..][..s.input], x) + v.b[d * 2 * gh + row];
                let rec =
                    |row: usize, st: &[f64]| dot(&v.r[(d * gh + row) * hn..][..hn], st) + v.b[d * 2 * gh + gh + row];
                let p = |gate: usize, k: usize| v.p[d * 3 * hn + gate * hn + k];
                let pre = |gate: usize, k: usize, st: &[f64]| lin(gate * hn + k) + rec(gate * hn + k, st);
                match l.kind {
                    RecurrentKind::Lstm => {
                        let i: Vec<f64> = (0..hn).map(|k| f(0, pre(0, k, &h) + p(0, k) * c[k])).collect();
                        let fg: Vec<f64> = (0..hn)
                            .map(|k| if l.input_forget { 1.0 - i[k] } else { f(0, pre(2, k, &h) + p(2, k) * c[k]) })
                            .collect();
                        let c_new: Vec<f64> = (0..hn).map(|k| fg[k] * c[k] + i[k] * f(1, pre(3, k, &h))).collect();
                        let o: Vec<f64> = (0..hn).map(|k| f(0, pre(1, k, &h) + p(1, k) * c_new[k])).collect();
                        h = (0..hn).map(|k| o[k] * act(l.activations[d * per + 2], c_new[k])).collect();
                        c = c_new;
                    }
                    RecurrentKind::Gru => {
                        let z: Vec<f64> = (0..hn).map(|k| f(0, pre(0, k, &h))).collect();
                        let r: Vec<f64> = (0..hn).map(|k| f(0, pre(1, k, &h))).collect();
                        let rh: Vec<f64> = (0..hn).map(|k| r[k] * h[k]).collect();
                        let cand: Vec<f64> = (0..hn)
                            .map(|k| match l.linear_before_reset {
                                true => f(1, lin(2 * hn + k) + r[k] * rec(2 * hn + k, &h)),
                                false => f(1, lin(2 * hn + k) + rec(2 * hn + k, &rh)),
                            })
                            .collect();
                        h = (0..hn).map(|k| (1.0 - z[k]) * cand[k] + z[k] * h[k]).collect();
                    }
                    RecurrentKind::Rnn => h = (0..hn).map(|k| f(0, pre(0, k, &h))).collect(),
                }
                y[((t * s.dirs + d) * s.batch + n) * hn..][..hn].copy_from_slice(&h);
            }
            yh[at..at + hn].copy_from_slice(&h);
            yc[at..at + hn].copy_from_slice(&c);
        }
        [y, yh, yc]
    }

    /// `data` of `shape` with its axes reordered: the result's axis k is the input's perm[k].
    fn permute(data: &[f64], shape: &[usize], perm: &[usize]) -> Vec<f64> {
        let to: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
        let stride = |a: usize| shape[a + 1..].iter().product::<usize>();
        let mut idx = vec![0; shape.len()];
        let mut out = Vec::with_capacity(data.len());
        for _ in 0..data.len() {
            out.push(data[idx.iter().zip(perm).map(|(&i, &p)| i * stride(p)).sum::<usize>()]);
            for k in (0..idx.len()).rev() {
                idx[k] += 1;
                if idx[k] < to[k] {
                    break;
                }
                idx[k] = 0;
            }
        }
        out
    }

    fn tensor(shape: &[usize], data: &[f64]) -> Tensor {
        Tensor::from_vec(shape, data.iter().map(|&v| v as f32).collect::<Vec<f32>>())
    }

    /// The layer as one node (X a graph input, the rest initializers; the batch-first layout's
    /// inputs transposed from `v`), bound and run on the CPU: its outputs.
    fn run_layer(l: &Recurrent, s: Sizes, v: &Inputs, sequence_lens: Option<Vec<i64>>) -> Result<Vec<Tensor>> {
        let (gh, h) = (l.kind.gates() * s.hidden, s.hidden);
        let mut g = Graph::new("recurrent", 22);
        let (x_shape, x_data) = match l.batch_first {
            true => (vec![s.batch, s.steps, s.input], permute(&v.x, &[s.steps, s.batch, s.input], &[1, 0, 2])),
            false => (vec![s.steps, s.batch, s.input], v.x.clone()),
        };
        let x = g.add_input("x", DType::F32, x_shape.iter().map(|&d| Dim::Fixed(d)).collect());
        let state = |g: &mut Graph, name: &str, data: &[f64]| match l.batch_first {
            true => g.add_initializer(
                name,
                tensor(&[s.batch, s.dirs, h], &permute(data, &[s.dirs, s.batch, h], &[1, 0, 2])),
            ),
            false => g.add_initializer(name, tensor(&[s.dirs, s.batch, h], data)),
        };
        let mut inputs = vec![
            Some(x),
            Some(g.add_initializer("w", tensor(&[s.dirs, gh, s.input], &v.w))),
            Some(g.add_initializer("r", tensor(&[s.dirs, gh, h], &v.r))),
            Some(g.add_initializer("b", tensor(&[s.dirs, 2 * gh], &v.b))),
            sequence_lens.map(|lens| g.add_initializer("sequence_lens", Tensor::from_vec(&[lens.len()], lens))),
            Some(state(&mut g, "initial_h", &v.h0)),
        ];
        if l.kind == RecurrentKind::Lstm {
            inputs.push(Some(state(&mut g, "initial_c", &v.c0)));
            inputs.push(Some(g.add_initializer("p", tensor(&[s.dirs, 3 * h], &v.p))));
        }
        let count = if l.kind == RecurrentKind::Lstm { 3 } else { 2 };
        g.outputs = (0..count).map(|k| g.fresh(&format!("y{k}"))).collect();
        let outputs = g.outputs.iter().copied().map(Some).collect();
        g.nodes.push(Node { name: "layer".into(), op: Op::Recurrent(l.clone()), inputs, outputs });
        let mut ex = Executor::new(Arc::new(CpuBackend::new()), bind(&g, &Bindings::default(), false)?, &[])?;
        ex.feed(x, &tensor(&x_shape, &x_data))?;
        ex.run(0)?;
        g.outputs.iter().map(|&o| ex.fetch(o)).collect()
    }

    fn layer(kind: RecurrentKind, direction: Direction, activations: Vec<Activation>) -> Recurrent {
        let (clip, input_forget, linear_before_reset, batch_first) = (None, false, false, false);
        Recurrent {
            kind,
            direction,
            hidden_size: Some(3),
            activations,
            clip,
            input_forget,
            linear_before_reset,
            batch_first,
        }
    }

    /// The unrolled graph against the equations, in every direction and layout, with each
    /// option that changes them.
    #[test]
    fn unrolled_layers_follow_the_onnx_equations() {
        use Direction::{Bidirectional, Reverse};
        use RecurrentKind::{Gru, Lstm, Rnn};
        use Unary::{Elu, HardSigmoid, LeakyRelu, Relu, Sigmoid, Softplus, Softsign, Tanh, ThresholdedRelu};
        let u = Activation::Unary;
        let lstm = [u(Sigmoid), u(Tanh), u(Tanh)];
        let odd = vec![
            u(HardSigmoid { alpha: 0.3, beta: 0.4 }),
            u(LeakyRelu { alpha: 0.1 }),
            Activation::ScaledTanh { alpha: 0.9, beta: 1.2 },
        ];
        let cases = [
            (
                "LSTM bidirectional, batch-first, clipped",
                Recurrent { clip: Some(0.8), batch_first: true, ..layer(Lstm, Bidirectional, [lstm, lstm].concat()) },
            ),
            (
                "LSTM reverse, input_forget, other activations",
                Recurrent { input_forget: true, ..layer(Lstm, Reverse, odd) },
            ),
            (
                "GRU reverse, linear_before_reset",
                Recurrent { linear_before_reset: true, ..layer(Gru, Reverse, vec![u(Sigmoid), u(Tanh)]) },
            ),
            (
                "GRU bidirectional, batch-first",
                Recurrent {
                    batch_first: true,
                    ..layer(Gru, Bidirectional, vec![u(Sigmoid), u(Tanh), u(Sigmoid), u(Relu)])
                },
            ),
            (
                "RNN bidirectional",
                layer(Rnn, Bidirectional, vec![u(Relu), Activation::Affine { alpha: 0.5, beta: 0.2 }]),
            ),
            (
                "GRU bidirectional, the remaining activations",
                layer(
                    Gru,
                    Bidirectional,
                    vec![u(Softsign), u(Softplus), u(ThresholdedRelu { alpha: 0.2 }), u(Elu { alpha: 0.7 })],
                ),
            ),
        ];
        for (seed, (name, l)) in cases.into_iter().enumerate() {
            let s = Sizes { steps: 4, batch: 2, input: 3, hidden: 3, dirs: l.direction.count() };
            let v = Inputs::random(&l, s, seed as u64 + 7);
            let [y, yh, yc] = reference(&l, s, &v);
            let (y_dims, state_dims) = ([s.steps, s.dirs, s.batch, s.hidden], [s.dirs, s.batch, s.hidden]);
            let want = match l.batch_first {
                true => [
                    permute(&y, &y_dims, &[2, 0, 1, 3]),
                    permute(&yh, &state_dims, &[1, 0, 2]),
                    permute(&yc, &state_dims, &[1, 0, 2]),
                ],
                false => [y, yh, yc],
            };
            let got = run_layer(&l, s, &v, Some(vec![4, 4])).unwrap_or_else(|e| panic!("{name}: {e}"));
            for (k, (got, want)) in got.iter().zip(&want).enumerate() {
                let far = got.to_f64_vec().iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                assert!(far < 1e-5, "{name}: output {k} is off the equations by up to {far}");
            }
        }
    }

    /// Lengths that vary, and activations no op stands for, are refused with the node named.
    #[test]
    fn refuses_what_it_cannot_unroll() {
        let l = layer(
            RecurrentKind::Gru,
            Direction::Forward,
            vec![Activation::Unary(Unary::Sigmoid), Activation::Unary(Unary::Tanh)],
        );
        let s = Sizes { steps: 4, batch: 2, input: 3, hidden: 3, dirs: 1 };
        let e = run_layer(&l, s, &Inputs::random(&l, s, 1), Some(vec![4, 3])).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains("node 'layer' (GRU)"), "{e}");
        let names = AttrValue::Strings(["Sigmoid", "Gelu", "Tanh"].map(String::from).to_vec());
        let attrs = Attrs { map: [("activations".to_string(), names)].into(), origin: "node 'lstm' (LSTM)".into() };
        let e = Op::from_onnx("LSTM", "", &attrs, 22).unwrap_err();
        assert!(
            matches!(e, Error::Unsupported(_)) && e.to_string().contains("node 'lstm' (LSTM): activation 'Gelu'"),
            "{e}"
        );
    }
}
