//! The execution plan and its memory planner.
//!
//! Every value of a bound graph gets a place: initializers and graph inputs own persistent
//! buffers; everything else lives at an offset of one arena, reused by liveness (a value's
//! bytes are free again after its last reader ran). Reshape and Identity outputs alias their
//! input, so they cost neither memory nor a copy. A step whose kernels need temporary memory
//! (the backend says how much) gets it in the arena too, for that step alone, so that the
//! planned peak counts it.

use crate::graph::ir::{Graph, ValueId};
use crate::op::Op;

/// Arena offsets are aligned for SIMD loads (and for CUDA's 256-byte preference later).
pub const ALIGN: usize = 64;
/// A step's scratch starts at a multiple of this, as a device allocation of its own would (the
/// dispatch cuts it into 256-byte aligned parts for cuBLASLt's staged operands).
const SCRATCH_ALIGN: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// Not materialized (an unused optional output, or a value of no node).
    Nowhere,
    /// Its own buffer, alive as long as the executor.
    Persistent,
    /// At this byte offset of the arena.
    Arena(usize),
}

#[derive(Clone, Debug)]
pub struct Plan {
    /// Where each value lives; aliases report their root's place.
    pub places: Vec<Place>,
    /// The value each value shares its bytes with (itself when it owns them).
    pub root: Vec<ValueId>,
    /// Nodes (indices into the graph) that run; aliasing nodes are left out.
    pub steps: Vec<usize>,
    /// Each node's scratch: its arena offset and bytes (None for none, and for nodes that do
    /// not run).
    pub scratch: Vec<Option<(usize, usize)>>,
    /// Bytes of the arena: the planned peak of transient memory, scratch included.
    pub arena_bytes: usize,
    /// Bytes of persistent buffers (weights, inputs).
    pub persistent_bytes: usize,
}

impl Plan {
    /// The largest scratch any one step was given (0 for none).
    pub fn scratch_peak(&self) -> usize {
        self.scratch.iter().flatten().map(|&(_, bytes)| bytes).max().unwrap_or(0)
    }
}

fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// Free arena blocks, best-fit, coalescing neighbours.
struct FreeList {
    blocks: Vec<(usize, usize)>, // (offset, size), sorted by offset
    end: usize,
}

impl FreeList {
    fn take(&mut self, size: usize) -> usize {
        let best = self.blocks.iter().enumerate().filter(|(_, b)| b.1 >= size).min_by_key(|(_, b)| b.1).map(|(i, _)| i);
        if let Some(i) = best {
            let (off, sz) = self.blocks[i];
            if sz == size {
                self.blocks.remove(i);
            } else {
                self.blocks[i] = (off + size, sz - size);
            }
            return off;
        }
        // Grow: reuse a free block touching the end if there is one.
        if let Some(&(off, sz)) = self.blocks.last() {
            if off + sz == self.end {
                self.blocks.pop();
                self.end = off + size;
                return off;
            }
        }
        let off = self.end;
        self.end += size;
        off
    }

    fn give(&mut self, off: usize, size: usize) {
        let i = self.blocks.partition_point(|b| b.0 < off);
        self.blocks.insert(i, (off, size));
        // Merge with the next, then with the previous block.
        if i + 1 < self.blocks.len() && self.blocks[i].0 + self.blocks[i].1 == self.blocks[i + 1].0 {
            self.blocks[i].1 += self.blocks[i + 1].1;
            self.blocks.remove(i + 1);
        }
        if i > 0 && self.blocks[i - 1].0 + self.blocks[i - 1].1 == self.blocks[i].0 {
            self.blocks[i - 1].1 += self.blocks[i].1;
            self.blocks.remove(i);
        }
    }
}

/// Plans a bound graph (every value has a meta). `keep` lists values that must stay readable
/// after a run besides the graph outputs; `scratch_of(node)` is the scratch bytes that node's
/// step needs (`Backend::scratch_bytes`).
pub fn plan(g: &Graph, keep: &[ValueId], scratch_of: impl Fn(usize) -> usize) -> Plan {
    let n = g.values.len();
    let mut root: Vec<ValueId> = (0..n).collect();
    let mut steps = Vec::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let aliasing = matches!(node.op, Op::Reshape | Op::Identity);
        match (aliasing, node.input(0), node.output(0)) {
            (true, Some(x), Some(y)) => root[y] = root[x],
            _ => steps.push(i),
        }
    }
    let mut places = vec![Place::Nowhere; n];
    let mut persistent_bytes = 0;
    for v in g.initializers.keys().copied().chain(g.inputs.iter().map(|d| d.value)) {
        places[v] = Place::Persistent;
        persistent_bytes += g.meta(v).map_or(0, |m| m.bytes());
    }
    // Liveness per root, in step positions: defined at `def`, last read at `last`.
    const FOREVER: usize = usize::MAX;
    let mut def = vec![FOREVER; n];
    let mut last = vec![0usize; n];
    for (pos, &i) in steps.iter().enumerate() {
        let node = &g.nodes[i];
        for o in node.outputs.iter().flatten() {
            def[root[*o]] = def[root[*o]].min(pos);
            last[root[*o]] = last[root[*o]].max(pos);
        }
        for x in node.inputs.iter().flatten() {
            last[root[*x]] = last[root[*x]].max(pos);
        }
    }
    // Aliases read after their alias node keep the root alive: account reads of every alias.
    for (pos, &i) in steps.iter().enumerate() {
        for x in g.nodes[i].inputs.iter().flatten() {
            let r = root[*x];
            last[r] = last[r].max(pos);
        }
    }
    for &v in g.outputs.iter().chain(keep) {
        last[root[v]] = FOREVER;
    }
    let mut births: Vec<Vec<ValueId>> = vec![Vec::new(); steps.len()];
    let mut deaths: Vec<Vec<ValueId>> = vec![Vec::new(); steps.len()];
    for r in 0..n {
        if root[r] != r || places[r] == Place::Persistent || def[r] == FOREVER {
            continue;
        }
        births[def[r]].push(r);
        if last[r] != FOREVER {
            deaths[last[r]].push(r);
        }
    }
    let mut free = FreeList { blocks: Vec::new(), end: 0 };
    let mut scratch = vec![None; g.nodes.len()];
    for (pos, &i) in steps.iter().enumerate() {
        // Outputs and scratch are placed before this step's dying inputs are freed: a kernel
        // never writes over what it reads.
        for &r in &births[pos] {
            let size = align(g.meta(r).map_or(0, |m| m.bytes()).max(1));
            places[r] = Place::Arena(free.take(size));
        }
        let bytes = scratch_of(i);
        // Taken with room to start it at SCRATCH_ALIGN, and given back whole.
        let taken = (bytes > 0).then(|| {
            let size = align(bytes) + SCRATCH_ALIGN - ALIGN;
            (free.take(size), size)
        });
        if let Some((off, _)) = taken {
            scratch[i] = Some((off.next_multiple_of(SCRATCH_ALIGN), bytes));
        }
        for &r in &deaths[pos] {
            if let Place::Arena(off) = places[r] {
                free.give(off, align(g.meta(r).map_or(0, |m| m.bytes()).max(1)));
            }
        }
        if let Some((off, size)) = taken {
            free.give(off, size);
        }
    }
    for v in 0..n {
        if root[v] != v {
            places[v] = places[root[v]];
        }
    }
    Plan { places, root, steps, scratch, arena_bytes: free.end, persistent_bytes }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ir::Meta;
    use crate::op::{Op, Unary};
    use crate::tensor::DType;

    #[test]
    fn reuses_dead_buffers_and_aliases_reshapes() {
        // x → relu → a → relu → b → relu → c (output): a is dead once b exists, so c reuses it.
        let mut g = Graph::new("t", 17);
        let x = g.add_input("x", DType::F32, vec![]);
        g.values[x].meta = Some(Meta::new(DType::F32, &[1000]));
        let a = g.op1("a", Op::Unary(Unary::Relu), &[x]);
        let b = g.op1("b", Op::Unary(Unary::Relu), &[a]);
        let r = g.op1("r", Op::Reshape, &[b]);
        let c = g.op1("c", Op::Unary(Unary::Relu), &[r]);
        for v in [a, b, r, c] {
            g.values[v].meta = Some(Meta::new(DType::F32, &[1000]));
        }
        g.outputs.push(c);
        let p = plan(&g, &[], |_| 0);
        assert_eq!(p.steps.len(), 3, "the reshape is an alias, not a step");
        assert_eq!(p.places[r], p.places[b]);
        assert_eq!(p.places[c], p.places[a], "c reuses a's bytes");
        assert_ne!(p.places[b], p.places[a]);
        assert_eq!(p.arena_bytes, 2 * align(4000));
    }

    #[test]
    fn a_steps_scratch_is_apart_from_its_values_and_free_after_it() {
        // x → relu → a → relu → b → relu → c → relu → d (output), b's step with 8000 bytes of
        // scratch: apart from a (its input) and b (its output), and free again after it.
        let mut g = Graph::new("t", 17);
        let x = g.add_input("x", DType::F32, vec![]);
        g.values[x].meta = Some(Meta::new(DType::F32, &[1000]));
        let a = g.op1("a", Op::Unary(Unary::Relu), &[x]);
        let b = g.op1("b", Op::Unary(Unary::Relu), &[a]);
        let c = g.op1("c", Op::Unary(Unary::Relu), &[b]);
        let d = g.op1("d", Op::Unary(Unary::Relu), &[c]);
        for v in [a, b, c, d] {
            g.values[v].meta = Some(Meta::new(DType::F32, &[if v == c { 3000 } else { 1000 }]));
        }
        g.outputs.push(d);
        let p = plan(&g, &[], |node| if node == 1 { 8000 } else { 0 });
        let (off, bytes) = p.scratch[1].expect("b's step has scratch");
        assert_eq!((bytes, off % SCRATCH_ALIGN), (8000, 0));
        assert!(p.scratch.iter().enumerate().all(|(i, s)| s.is_none() || i == 1));
        let at = |v| match p.places[v] {
            Place::Arena(o) => o..o + align(g.meta(v).unwrap().bytes()),
            other => panic!("{other:?}"),
        };
        for v in [a, b] {
            let r = at(v);
            assert!(r.end <= off || off + align(bytes) <= r.start, "scratch overlaps a live value");
        }
        // c (12,000 bytes) takes the freed scratch at the arena's end and grows it by 4,000;
        // had the scratch stayed taken, c would have gone past it.
        assert!(at(c).start <= off && off < at(c).end, "c reuses the freed scratch");
        assert_eq!(p.arena_bytes, 2 * align(4000) + align(12000));
    }
}
