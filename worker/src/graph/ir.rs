//! The graph IR: values (named, typed, shaped), nodes (an [`Op`] with input and output values),
//! initializers, and the graph's inputs and outputs.
//!
//! Values are numbered; nodes refer to them by [`ValueId`]. Shapes are static once a graph is
//! bound ([`crate::graph::infer`]); before that a graph input may carry symbolic dimensions.

use crate::op::Op;
use crate::tensor::{DType, Tensor};
use std::collections::{BTreeMap, BTreeSet, HashMap};

pub type ValueId = usize;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    Fixed(usize),
    Named(String),
    Unknown,
}

/// Element type and static shape of a value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Meta {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl Meta {
    pub fn new(dtype: DType, shape: &[usize]) -> Meta {
        Meta { dtype, shape: shape.to_vec() }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}

#[derive(Clone, Debug)]
pub struct Value {
    pub name: String,
    /// Known after inference (or declared by the model for graph inputs).
    pub meta: Option<Meta>,
}

#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    pub op: Op,
    /// `None` marks an omitted optional input.
    pub inputs: Vec<Option<ValueId>>,
    /// `None` marks an output the model does not use.
    pub outputs: Vec<Option<ValueId>>,
}

impl Node {
    pub fn input(&self, i: usize) -> Option<ValueId> {
        self.inputs.get(i).copied().flatten()
    }
    pub fn output(&self, i: usize) -> Option<ValueId> {
        self.outputs.get(i).copied().flatten()
    }
    /// "node 'name' (OpType)" for error messages.
    pub fn describe(&self) -> String {
        format!("node '{}' ({})", self.name, self.op.onnx_name().0)
    }
}

/// A graph input as the model declares it: element type and possibly symbolic dims.
#[derive(Clone, Debug)]
pub struct InputDecl {
    pub value: ValueId,
    pub dtype: DType,
    pub dims: Vec<Dim>,
}

#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub name: String,
    pub values: Vec<Value>,
    pub nodes: Vec<Node>,
    pub inputs: Vec<InputDecl>,
    pub outputs: Vec<ValueId>,
    pub initializers: BTreeMap<ValueId, Tensor>,
    /// The default-domain opset the model was written for.
    pub opset: i64,
    /// Declared element types and dims of graph outputs (from the model file, or worked out
    /// for an export), so a saved model's outputs are typed before any binding.
    pub output_types: BTreeMap<ValueId, (DType, Vec<Dim>)>,
    /// Initializers the exporter declared buffers or constants of the module, not parameters
    /// (the dynamo exporter's `InputSpec.kind` annotation); session::buffers reads it.
    pub declared_buffers: BTreeSet<ValueId>,
    by_name: HashMap<String, ValueId>,
}

impl Graph {
    pub fn new(name: &str, opset: i64) -> Graph {
        Graph { name: name.to_string(), opset, ..Default::default() }
    }

    /// The value of this name, created when new.
    pub fn value(&mut self, name: &str) -> ValueId {
        if let Some(&id) = self.by_name.get(name) {
            return id;
        }
        let id = self.values.len();
        self.values.push(Value { name: name.to_string(), meta: None });
        self.by_name.insert(name.to_string(), id);
        id
    }

    /// A fresh value whose name starts with `hint` and is unique in the graph.
    pub fn fresh(&mut self, hint: &str) -> ValueId {
        let mut name = hint.to_string();
        let mut k = 1;
        while self.by_name.contains_key(&name) {
            name = format!("{hint}_{k}");
            k += 1;
        }
        self.value(&name)
    }

    pub fn find(&self, name: &str) -> Option<ValueId> {
        self.by_name.get(name).copied()
    }

    pub fn name_of(&self, v: ValueId) -> &str {
        &self.values[v].name
    }

    pub fn meta(&self, v: ValueId) -> Option<&Meta> {
        self.values[v].meta.as_ref()
    }

    pub fn add_initializer(&mut self, name: &str, t: Tensor) -> ValueId {
        let v = self.value(name);
        self.values[v].meta = Some(Meta::new(t.dtype(), t.shape()));
        self.initializers.insert(v, t);
        v
    }

    pub fn add_input(&mut self, name: &str, dtype: DType, dims: Vec<Dim>) -> ValueId {
        let v = self.value(name);
        self.inputs.push(InputDecl { value: v, dtype, dims });
        v
    }

    /// Appends a node with a unique name; returns its output values (fresh, named after it).
    pub fn add_node(&mut self, name: &str, op: Op, inputs: &[ValueId], n_outputs: usize) -> Vec<ValueId> {
        let name = self.unique_node_name(name);
        let outputs: Vec<ValueId> = (0..n_outputs)
            .map(|i| if n_outputs == 1 { self.fresh(&name) } else { self.fresh(&format!("{name}:{i}")) })
            .collect();
        self.nodes.push(Node {
            name,
            op,
            inputs: inputs.iter().map(|&v| Some(v)).collect(),
            outputs: outputs.iter().map(|&v| Some(v)).collect(),
        });
        outputs
    }

    /// Shorthand for a node with one output.
    pub fn op1(&mut self, name: &str, op: Op, inputs: &[ValueId]) -> ValueId {
        self.add_node(name, op, inputs, 1)[0]
    }

    fn unique_node_name(&self, name: &str) -> String {
        // Node names only need to be unique for messages and profiles; value names carry the
        // uniqueness that matters, so a counter suffix is enough.
        if self.nodes.iter().all(|n| n.name != name) {
            return name.to_string();
        }
        let mut k = 1;
        loop {
            let candidate = format!("{name}_{k}");
            if self.nodes.iter().all(|n| n.name != candidate) {
                return candidate;
            }
            k += 1;
        }
    }

    /// Which node produces each value (None for inputs and initializers).
    pub fn producers(&self) -> Vec<Option<usize>> {
        let mut p = vec![None; self.values.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for o in n.outputs.iter().flatten() {
                p[*o] = Some(i);
            }
        }
        p
    }

    /// The nodes that read each value, in graph order (a node reading it twice, twice).
    pub fn readers(&self) -> Vec<Vec<usize>> {
        let mut r = vec![Vec::new(); self.values.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            n.inputs.iter().flatten().for_each(|&x| r[x].push(i));
        }
        r
    }

    /// How many node inputs and graph outputs read each value.
    pub fn use_counts(&self) -> Vec<usize> {
        let mut c = vec![0; self.values.len()];
        for n in &self.nodes {
            for i in n.inputs.iter().flatten() {
                c[*i] += 1;
            }
        }
        for o in &self.outputs {
            c[*o] += 1;
        }
        c
    }

    /// Trainable parameters: float initializers, in a stable (name) order.
    pub fn float_initializers(&self) -> Vec<ValueId> {
        let mut v: Vec<ValueId> =
            self.initializers.iter().filter(|(_, t)| t.dtype().is_float()).map(|(&id, _)| id).collect();
        v.sort_by(|a, b| self.values[*a].name.cmp(&self.values[*b].name));
        v
    }

    /// Removes nodes whose outputs nobody reads (repeatedly), and unused initializers.
    pub fn prune(&mut self) {
        loop {
            let uses = self.use_counts();
            let before = self.nodes.len();
            self.nodes.retain(|n| n.outputs.iter().flatten().any(|o| uses[*o] > 0));
            if self.nodes.len() == before {
                break;
            }
        }
        let uses = self.use_counts();
        self.initializers.retain(|v, _| uses[*v] > 0);
    }
}
