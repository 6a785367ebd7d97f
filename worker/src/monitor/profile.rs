//! Per-op profiles as Chrome trace JSON (the Trace Event Format that chrome://tracing and
//! Perfetto read): one complete event ("ph": "X") per op launch, grouped under a span per step,
//! and one per data-parallel all-reduce on a track of its own.

use crate::error::{Error, Result};
use crate::exec::OpTiming;
use crate::graph::ir::Graph;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

pub struct Trace {
    origin: Instant,
    rank: usize,
    events: Vec<Value>,
}

impl Trace {
    pub fn new(rank: usize) -> Trace {
        Trace { origin: Instant::now(), rank, events: Vec::new() }
    }

    fn micros(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.origin).as_secs_f64() * 1e6
    }

    /// A span covering one whole weight update (forward, backward, optimizer).
    pub fn step(&mut self, step: u64, start: Instant, duration: Duration) {
        let ts = self.micros(start);
        self.events.push(json!({
            "name": format!("step {step}"), "cat": "step", "ph": "X", "ts": ts,
            "dur": duration.as_secs_f64() * 1e6, "pid": self.rank, "tid": 0, "args": {"step": step},
        }));
    }

    /// The ops of `graph` as they ran during `step`.
    pub fn ops(&mut self, step: u64, graph: &Graph, timings: &[OpTiming]) {
        for t in timings {
            let node = &graph.nodes[t.node];
            let op = node.op.onnx_name().0;
            let ts = self.micros(t.start);
            self.events.push(json!({
                "name": op, "cat": "op", "ph": "X", "ts": ts, "dur": t.duration.as_secs_f64() * 1e6,
                "pid": self.rank, "tid": 1, "args": {"step": step, "node": node.name},
            }));
        }
    }

    /// The data-parallel all-reduces of `step`, on their own track: where they overlap the
    /// backward pass's ops.
    pub fn comm(&mut self, step: u64, spans: &[crate::parallel::CommSpan]) {
        for s in spans {
            let ts = self.micros(s.start);
            self.events.push(json!({
                "name": "all_reduce", "cat": "comm", "ph": "X", "ts": ts, "dur": s.duration.as_secs_f64() * 1e6,
                "pid": self.rank, "tid": 2,
                "args": {"step": step, "bucket": s.bucket, "bytes": s.bytes, "queuedTs": self.micros(s.queued)},
            }));
        }
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        let mut events = vec![
            json!({"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": format!("rank {}", self.rank)}}),
            json!({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "steps"}}),
            json!({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 1, "args": {"name": "ops"}}),
            json!({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 2, "args": {"name": "data-parallel all-reduce"}}),
        ];
        events.extend(self.events.iter().cloned());
        let doc = json!({"traceEvents": events, "displayTimeUnit": "ms"});
        let text = serde_json::to_string(&doc).map_err(|e| Error::Runtime(format!("profile: {e}")))?;
        crate::files::write_atomically(path, text.as_bytes())
    }
}
