//! Pipeline schedules: the order in which one stage runs its micro-batches' forward and backward
//! passes and exchanges activations and their gradients with its neighbours.
//!
//! Sends and receives block (MPI's for large messages), so the order is also what keeps the
//! pipeline from deadlocking: where a stage must both send to and receive from a neighbour, the
//! schedule pairs the two into one `send_recv` exchange, which its neighbour mirrors at the same
//! point (Megatron-LM's non-interleaved 1F1B, PipeDream-Flush). Stage `s` of `S` receives
//! activations from `s - 1` and gradients from `s + 1`; the first stage receives no activations
//! and the last no gradients (its backward starts from the loss).

use crate::config::PipelineSchedule;

/// One thing a stage does; `usize`s are micro-batch indices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Receive micro-batch `mb`'s input activations from the previous stage.
    RecvForward(usize),
    /// Run micro-batch `mb`'s forward pass.
    Forward(usize),
    /// Send micro-batch `mb`'s output activations to the next stage.
    SendForward(usize),
    /// Receive the gradients of micro-batch `mb`'s outputs from the next stage.
    RecvBackward(usize),
    /// Run micro-batch `mb`'s backward pass.
    Backward(usize),
    /// Send the gradients of micro-batch `mb`'s inputs to the previous stage.
    SendBackward(usize),
    /// Send `send`'s output activations to the next stage while receiving the gradients of
    /// `recv`'s outputs from it.
    SendForwardRecvBackward { send: usize, recv: usize },
    /// Send the gradients of `send`'s inputs to the previous stage while receiving `recv`'s
    /// input activations from it.
    SendBackwardRecvForward { send: usize, recv: usize },
}

/// The actions of `stage` (of `stages`) for `micro` micro-batches.
pub fn actions(kind: PipelineSchedule, stage: usize, stages: usize, micro: usize) -> Vec<Action> {
    match kind {
        PipelineSchedule::Gpipe => gpipe(stage, stages, micro),
        PipelineSchedule::OneFOneB => one_f_one_b(stage, stages, micro),
    }
}

/// Every forward (each received, run and sent on), then every backward in the same order.
fn gpipe(stage: usize, stages: usize, micro: usize) -> Vec<Action> {
    let (first, last) = (stage == 0, stage + 1 == stages);
    let mut out = Vec::new();
    for mb in 0..micro {
        if !first {
            out.push(Action::RecvForward(mb));
        }
        out.push(Action::Forward(mb));
        if !last {
            out.push(Action::SendForward(mb));
        }
    }
    for mb in 0..micro {
        if !last {
            out.push(Action::RecvBackward(mb));
        }
        out.push(Action::Backward(mb));
        if !first {
            out.push(Action::SendBackward(mb));
        }
    }
    out
}

/// 1F1B: `stages - stage - 1` warm-up forwards, then alternate one forward and one backward, then
/// drain the backwards. A stage holds at most `stages - stage` micro-batches' activations.
fn one_f_one_b(stage: usize, stages: usize, micro: usize) -> Vec<Action> {
    let (first, last) = (stage == 0, stage + 1 == stages);
    let warmup = (stages - stage - 1).min(micro);
    let steady = micro - warmup;
    let mut out = Vec::new();
    for mb in 0..warmup {
        if !first {
            out.push(Action::RecvForward(mb));
        }
        out.push(Action::Forward(mb));
        if !last {
            out.push(Action::SendForward(mb));
        }
    }
    if steady > 0 && !first {
        out.push(Action::RecvForward(warmup));
    }
    for i in 0..steady {
        let (fwd, bwd) = (warmup + i, i);
        out.push(Action::Forward(fwd));
        if !last {
            out.push(Action::SendForwardRecvBackward { send: fwd, recv: bwd });
        }
        out.push(Action::Backward(bwd));
        if !first {
            if i + 1 == steady {
                out.push(Action::SendBackward(bwd));
            } else {
                out.push(Action::SendBackwardRecvForward { send: bwd, recv: fwd + 1 });
            }
        }
    }
    for bwd in steady..micro {
        if !last {
            out.push(Action::RecvBackward(bwd));
        }
        out.push(Action::Backward(bwd));
        if !first {
            out.push(Action::SendBackward(bwd));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// A message posted by a stage: (from, to, what, micro-batch). `what` is 'a' for
    /// activations and 'g' for gradients.
    type Msg = (usize, usize, char, usize);

    /// What a stage's next action needs from the network: sends that wait for their receive
    /// (a blocking, rendezvous send) and receives that wait for their send.
    fn needs(stage: usize, a: Action) -> (Vec<Msg>, Vec<Msg>) {
        match a {
            Action::RecvForward(mb) => (vec![], vec![(stage - 1, stage, 'a', mb)]),
            Action::SendForward(mb) => (vec![(stage, stage + 1, 'a', mb)], vec![]),
            Action::RecvBackward(mb) => (vec![], vec![(stage + 1, stage, 'g', mb)]),
            Action::SendBackward(mb) => (vec![(stage, stage - 1, 'g', mb)], vec![]),
            Action::SendForwardRecvBackward { send, recv } => {
                (vec![(stage, stage + 1, 'a', send)], vec![(stage + 1, stage, 'g', recv)])
            }
            Action::SendBackwardRecvForward { send, recv } => {
                (vec![(stage, stage - 1, 'g', send)], vec![(stage - 1, stage, 'a', recv)])
            }
            Action::Forward(_) | Action::Backward(_) => (vec![], vec![]),
        }
    }

    /// Runs every stage's actions with rendezvous semantics (the strictest MPI may give): a
    /// message passes once its sender's current action posts the send and its receiver's current
    /// action posts the receive; an action completes once all its messages passed (the two
    /// halves of a `send_recv` may pass at different times). Returns false on deadlock. Also
    /// checks data dependencies: a forward has its activations, a backward its gradients and its
    /// own forward.
    fn completes(kind: PipelineSchedule, stages: usize, micro: usize) -> bool {
        runs_to_completion((0..stages).map(|s| actions(kind, s, stages, micro)).collect(), micro)
    }

    fn runs_to_completion(lists: Vec<Vec<Action>>, micro: usize) -> bool {
        let stages = lists.len();
        let mut queues: Vec<VecDeque<Action>> = lists.into_iter().map(Into::into).collect();
        // The messages each stage's current action still waits for: (sends, receives).
        let mut pending: Vec<Option<(Vec<Msg>, Vec<Msg>)>> = vec![None; stages];
        let mut have: std::collections::HashSet<Msg> = Default::default();
        let mut forwarded: Vec<Vec<bool>> = vec![vec![false; micro]; stages];
        loop {
            for s in 0..stages {
                if pending[s].is_none() {
                    pending[s] = queues[s].front().map(|&a| needs(s, a));
                }
            }
            if pending.iter().all(Option::is_none) {
                return true;
            }
            let mut progressed = false;
            // Messages whose both ends are posted pass.
            for s in 0..stages {
                let sends = pending[s].as_ref().map(|p| p.0.clone()).unwrap_or_default();
                for m in sends {
                    let to = m.1;
                    if pending[to].as_ref().is_some_and(|p| p.1.contains(&m)) {
                        pending[s].as_mut().unwrap().0.retain(|x| *x != m);
                        pending[to].as_mut().unwrap().1.retain(|x| *x != m);
                        have.insert(m);
                        progressed = true;
                    }
                }
            }
            // Actions with nothing left to wait for complete.
            for s in 0..stages {
                if !pending[s].as_ref().is_some_and(|p| p.0.is_empty() && p.1.is_empty()) {
                    continue;
                }
                match queues[s].pop_front().expect("pending comes from the queue") {
                    Action::Forward(mb) => {
                        assert!(s == 0 || have.contains(&(s - 1, s, 'a', mb)), "stage {s} ran F{mb} without input");
                        forwarded[s][mb] = true;
                    }
                    Action::Backward(mb) => {
                        assert!(forwarded[s][mb], "stage {s} ran B{mb} before F{mb}");
                        assert!(s + 1 == stages || have.contains(&(s + 1, s, 'g', mb)), "stage {s} B{mb} lacks grads");
                    }
                    _ => {}
                }
                pending[s] = None;
                progressed = true;
            }
            if !progressed {
                return false;
            }
        }
    }

    #[test]
    fn both_schedules_finish_without_deadlock_under_rendezvous_sends() {
        for kind in [PipelineSchedule::OneFOneB, PipelineSchedule::Gpipe] {
            for stages in 1..=5 {
                for micro in 1..=9 {
                    assert!(completes(kind, stages, micro), "{kind:?} deadlocks with {stages} stages, {micro} micro");
                }
            }
        }
    }

    /// The simulator can fail: 1F1B with each paired exchange split into a blocking send and
    /// then a receive deadlocks, since two neighbours end up sending to each other at once.
    #[test]
    fn unpaired_sends_deadlock_in_the_simulator() {
        let split = |a: Action| match a {
            Action::SendForwardRecvBackward { send, recv } => {
                vec![Action::SendForward(send), Action::RecvBackward(recv)]
            }
            Action::SendBackwardRecvForward { send, recv } => {
                vec![Action::SendBackward(send), Action::RecvForward(recv)]
            }
            a => vec![a],
        };
        let lists = (0..2)
            .map(|s| actions(PipelineSchedule::OneFOneB, s, 2, 4).into_iter().flat_map(split).collect())
            .collect();
        assert!(!runs_to_completion(lists, 4));
    }

    #[test]
    fn every_micro_batch_runs_forward_then_backward_once_per_stage() {
        for kind in [PipelineSchedule::OneFOneB, PipelineSchedule::Gpipe] {
            for stages in 1..=4 {
                for micro in 1..=6 {
                    for s in 0..stages {
                        let a = actions(kind, s, stages, micro);
                        let f = a.iter().filter(|x| matches!(x, Action::Forward(_))).count();
                        let b = a.iter().filter(|x| matches!(x, Action::Backward(_))).count();
                        assert_eq!((f, b), (micro, micro));
                    }
                }
            }
        }
    }

    /// 1F1B's point: stage s never holds more than `stages - s` micro-batches between their
    /// forward and backward; GPipe holds all of them.
    #[test]
    fn one_f_one_b_bounds_the_micro_batches_in_flight() {
        for stages in 1..=4 {
            for micro in 1..=8 {
                for s in 0..stages {
                    let peak = |kind| {
                        let (mut live, mut peak) = (0i32, 0i32);
                        for a in actions(kind, s, stages, micro) {
                            match a {
                                Action::Forward(_) => live += 1,
                                Action::Backward(_) => live -= 1,
                                _ => {}
                            }
                            peak = peak.max(live);
                        }
                        peak as usize
                    };
                    assert_eq!(peak(PipelineSchedule::OneFOneB), (stages - s).min(micro));
                    assert_eq!(peak(PipelineSchedule::Gpipe), micro);
                }
            }
        }
    }
}
