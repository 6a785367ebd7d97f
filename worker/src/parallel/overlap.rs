//! The data-parallel gradient all-reduce, overlapped with the backward pass (as PyTorch DDP's
//! gradient buckets and Horovod's background thread do it).
//!
//! The weights are grouped into buckets of about `bucket_bytes` (parallelism.bucketMb) in the order the backward pass
//! finishes their gradients (the last layer's first). While the executor runs the last
//! micro-batch's backward pass, each bucket whose gradients are all computed is all-reduced
//! while the executor goes on with the next ops. Micro-batches before the last only
//! accumulate: no communication until the update. Two carriers:
//! - host values: the bucket is copied out and handed to a communication thread, which
//!   all-reduces it on its own duplicate of the data-parallel communicator; after the run the
//!   sync waits for every bucket and copies the averages back;
//! - a device with collectives of its own (NCCL): the bucket's all-reduce is enqueued on the
//!   group's communication stream, after the kernels that computed it and beside the ones that
//!   follow; after the run the compute stream joins it, and nothing waits on the host.

use crate::backend::{Arg, Backend, Group};
use crate::comm::{Collective, DetachedHostGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::exec::optimizer::{OptimizerState, Param};
use crate::exec::Executor;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One bucket's all-reduce as the communication thread ran it.
#[derive(Clone, Debug)]
pub struct CommSpan {
    pub bucket: usize,
    pub bytes: usize,
    /// When the backward pass handed the bucket over.
    pub queued: Instant,
    /// When the communication thread began its all-reduce (later, if it had to wait for a core).
    pub start: Instant,
    pub duration: Duration,
}

/// A bucket back from the communication thread: its index, the averaged gradients, the span.
type Reply = (usize, Vec<f32>, Result<CommSpan>);

pub struct Overlap {
    /// Each bucket's weights (indices into the optimizer state), in the order laid out.
    buckets: Vec<Vec<usize>>,
    /// For each node of the training graph, the buckets whose last gradient it computes.
    ready: Vec<Vec<usize>>,
    /// The host carrier; None where the data-parallel group reduces on the device.
    thread: Option<HostThread>,
    /// The last step's all-reduces, for the profile (the host carrier's: the device's run
    /// unobserved on its stream).
    pub spans: Vec<CommSpan>,
}

/// The communication thread of host values and the channels to it.
struct HostThread {
    requests: Option<mpsc::Sender<(usize, Vec<f32>, Instant)>>,
    replies: mpsc::Receiver<Reply>,
    handle: Option<JoinHandle<()>>,
    in_flight: usize,
}

impl HostThread {
    /// The thread that all-reduces buckets on `group`.
    fn start(group: DetachedHostGroup) -> Result<HostThread> {
        let (requests, work) = mpsc::channel::<(usize, Vec<f32>, Instant)>();
        let (done, replies) = mpsc::channel::<Reply>();
        let handle = std::thread::Builder::new()
            .name("dp-allreduce".into())
            .spawn(move || {
                let group = group.into_group();
                for (bucket, mut flat, queued) in work {
                    let start = Instant::now();
                    let r = group.all_reduce(&mut flat[..], ReduceOp::Average);
                    let span = CommSpan { bucket, bytes: flat.len() * 4, queued, start, duration: start.elapsed() };
                    if done.send((bucket, flat, r.map(|_| span))).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| Error::Runtime(format!("cannot start the all-reduce thread: {e}")))?;
        Ok(HostThread { requests: Some(requests), replies, handle: Some(handle), in_flight: 0 })
    }
}

impl Drop for HostThread {
    fn drop(&mut self) {
        // Closing the request channel ends the thread's loop; join it before MPI can go away.
        self.requests.take();
        if let Some(t) = self.handle.take() {
            let _ = t.join();
        }
    }
}

impl Overlap {
    /// Buckets of about `bucket_bytes` for the weights of `optimizer`, all-reduced by a thread on
    /// `host` (a detached duplicate of the data-parallel group), or, without one, on the data
    /// group's device collectives.
    pub fn new<B: Backend>(
        ex: &Executor<B>,
        optimizer: &OptimizerState<B>,
        host: Option<DetachedHostGroup>,
        bucket_bytes: usize,
    ) -> Result<Overlap> {
        let producers = ex.graph.producers();
        let position: std::collections::HashMap<usize, usize> =
            ex.plan.steps.iter().enumerate().map(|(pos, &node)| (node, pos)).collect();
        let last = ex.plan.steps.len().saturating_sub(1);
        // (position of the step that finishes the gradient, its node, weight index)
        let mut order: Vec<(usize, usize, usize)> = optimizer
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let node = producers[ex.plan.root[p.grad]].filter(|n| position.contains_key(n));
                node.map_or((last, ex.plan.steps.last().copied().unwrap_or(0), i), |n| (position[&n], n, i))
            })
            .collect();
        order.sort();
        // A bucket is closed before a weight that would take it past the cap (a weight larger
        // than the cap gets a bucket of its own), and is ready once its last weight's gradient
        // is: the node computing it.
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut ready = vec![Vec::new(); ex.graph.nodes.len()];
        let mut bytes = 0;
        let mut last_node = 0;
        for &(_, node, i) in &order {
            let size = ex.graph.meta(optimizer.params[i].value).expect("bound").bytes();
            if buckets.is_empty() || (bytes > 0 && bytes + size > bucket_bytes) {
                if !buckets.is_empty() {
                    ready[last_node].push(buckets.len() - 1);
                }
                buckets.push(Vec::new());
                bytes = 0;
            }
            buckets.last_mut().expect("pushed").push(i);
            bytes += size;
            last_node = node;
        }
        if !buckets.is_empty() {
            ready[last_node].push(buckets.len() - 1);
        }
        let thread = host.map(HostThread::start).transpose()?;
        Ok(Overlap { buckets, ready, thread, spans: Vec::new() })
    }

    /// Called after each node of the last micro-batch's run: starts the all-reduce over `group`
    /// of every bucket `node` completes. `scale`, when accumulating, adds this micro-batch's
    /// gradient (times `scale`) to the accumulator first.
    pub fn node_done<B: Backend>(
        &mut self,
        ex: &Executor<B>,
        params: &[Param<B>],
        group: &Group<B>,
        node: usize,
        scale: Option<f32>,
    ) -> Result<()> {
        for &b in &self.ready[node] {
            if let Some(scale) = scale {
                for &i in &self.buckets[b] {
                    let p = &params[i];
                    if let Some(acc) = &p.accum {
                        let g = ex.arg(p.grad);
                        let acc = Arg { buf: acc, offset: 0, meta: g.meta };
                        ex.backend.accumulate(acc, 1.0, g, scale)?;
                    }
                }
            }
            let Some(thread) = self.thread.as_mut() else {
                let grads: Vec<Arg<B::Buffer>> = self.buckets[b].iter().map(|&i| params[i].gradient(ex)).collect();
                group.start_all_reduce(&grads, ReduceOp::Average)?;
                continue;
            };
            let mut flat = Vec::new();
            for &i in &self.buckets[b] {
                ex.backend.with_host_f32(params[i].gradient(ex), &mut |g| {
                    flat.extend_from_slice(g);
                    Ok::<_, Error>(())
                })?;
            }
            let requests = thread.requests.as_ref().expect("open until dropped");
            requests
                .send((b, flat, Instant::now()))
                .map_err(|_| Error::Runtime("the all-reduce thread has stopped".into()))?;
            thread.in_flight += 1;
        }
        Ok(())
    }

    /// Waits for every bucket started: the host's are copied back, the device's joined.
    pub fn finish<B: Backend>(&mut self, ex: &Executor<B>, params: &[Param<B>], group: &Group<B>) -> Result<()> {
        self.spans.clear();
        let Some(thread) = self.thread.as_mut() else { return group.join() };
        while thread.in_flight > 0 {
            let (b, flat, span) =
                thread.replies.recv().map_err(|_| Error::Runtime("the all-reduce thread has stopped".into()))?;
            thread.in_flight -= 1;
            self.spans.push(span?);
            let mut at = 0;
            for &i in &self.buckets[b] {
                ex.backend.with_host_f32(params[i].gradient(ex), &mut |g| {
                    g.copy_from_slice(&flat[at..at + g.len()]);
                    at += g.len();
                    Ok::<_, Error>(())
                })?;
            }
        }
        Ok(())
    }

    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }
}
