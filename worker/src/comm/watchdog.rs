//! The collective timeout. A rank that dies or hangs leaves its peers blocked inside a collective
//! forever: MPI has no timeouts of its own, and a blocked MPI call cannot be interrupted from
//! the calling thread. So every collective registers itself here on entry and deregisters on
//! return, and a separate thread looks at the oldest registration a few times per timeout. When
//! one has been in flight longer than the timeout, it logs which operation, group and rank are
//! stuck and runs the expiry action, which for MPI aborts the whole job (`MPI_Abort`): mpirun
//! then tears every rank down, the launcher exits non-zero, and the operator restarts the gang
//! from its newest checkpoint. The same scheme serves an NCCL implementation, whose blocked
//! waits are just as uninterruptible.
//!
//! Only time spent inside a collective counts, so a rank that computes, evaluates or writes a
//! checkpoint for a long time between collectives is never flagged; its peers, waiting for it in
//! the next collective, are, which is why the timeout must exceed the longest one-sided work.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// One collective in flight.
struct InFlight {
    id: u64,
    since: Instant,
    op: &'static str,
    /// Which group and which rank, already worded for the message.
    place: Arc<str>,
}

pub struct Watchdog {
    timeout: Duration,
    in_flight: Mutex<Vec<InFlight>>,
    next_id: AtomicU64,
}

/// Registration of one collective; dropping it (the collective returned) deregisters it.
pub struct InCollective<'a> {
    dog: &'a Watchdog,
    id: u64,
}

impl Drop for InCollective<'_> {
    fn drop(&mut self) {
        let mut in_flight = self.dog.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        in_flight.retain(|f| f.id != self.id);
    }
}

impl Watchdog {
    /// Starts the watching thread. `on_expiry` receives the error message after it has been
    /// logged; the thread stops after calling it (the process is expected to end). The thread
    /// also stops once the watchdog is dropped.
    pub fn start(timeout: Duration, on_expiry: impl Fn(&str) + Send + 'static) -> std::io::Result<Arc<Watchdog>> {
        assert!(!timeout.is_zero(), "a zero collective timeout means no watchdog");
        let dog = Arc::new(Watchdog { timeout, in_flight: Mutex::new(Vec::new()), next_id: AtomicU64::new(0) });
        let weak: Weak<Watchdog> = Arc::downgrade(&dog);
        // A few looks per timeout bound the overshoot to a fraction of it; at least every
        // second for long timeouts, so the overshoot stays short in absolute terms too.
        let poll = (timeout / 8).clamp(Duration::from_millis(5), Duration::from_secs(1));
        std::thread::Builder::new().name("collective-watchdog".into()).spawn(move || loop {
            std::thread::sleep(poll);
            let Some(dog) = weak.upgrade() else { return };
            if let Some(message) = dog.overdue() {
                tracing::error!(target: "tensorfleet::comm", "{message}");
                // Without a subscriber (tests, early start-up) the log line would go nowhere,
                // and this message is the one thing the user needs to see.
                if !tracing::dispatcher::has_been_set() {
                    eprintln!("error: {message}");
                }
                on_expiry(&message);
                return;
            }
        })?;
        Ok(dog)
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Registers a collective `op` (e.g. "all_reduce") at `place` (its group and rank).
    pub fn enter(&self, op: &'static str, place: &Arc<str>) -> InCollective<'_> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let f = InFlight { id, since: Instant::now(), op, place: place.clone() };
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner()).push(f);
        InCollective { dog: self, id }
    }

    /// The message for the oldest collective past the timeout, if any.
    fn overdue(&self) -> Option<String> {
        let in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        let oldest = in_flight.iter().min_by_key(|f| f.since)?;
        let waited = oldest.since.elapsed();
        (waited > self.timeout).then(|| {
            format!(
                "collective timeout: {} on {} has not completed after {:.1} s (timeout {} s); \
                 a peer rank has died or hangs; aborting every rank",
                oldest.op,
                oldest.place,
                waited.as_secs_f64(),
                self.timeout.as_secs_f64()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_collective_past_the_timeout_is_reported_with_its_place() {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let dog = Watchdog::start(Duration::from_millis(100), move |m| tx.lock().unwrap().send(m.to_string()).unwrap())
            .unwrap();
        let place: Arc<str> = "group 'data' (rank 1 of 2)".into();
        let started = Instant::now();
        let _stuck = dog.enter("all_reduce", &place);
        let message = rx.recv_timeout(Duration::from_secs(5)).expect("the watchdog did not fire");
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert!(message.contains("all_reduce on group 'data' (rank 1 of 2)"), "{message}");
        assert!(message.contains("timeout 0.1 s"), "{message}");
    }

    #[test]
    fn collectives_that_return_in_time_are_not_reported() {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let dog = Watchdog::start(Duration::from_millis(100), move |m| tx.lock().unwrap().send(m.to_string()).unwrap())
            .unwrap();
        let place: Arc<str> = "group 'world' (rank 0 of 1)".into();
        // Far more total time in collectives than the timeout, but never one long one.
        let started = Instant::now();
        while started.elapsed() < Duration::from_millis(400) {
            let _op = dog.enter("barrier", &place);
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        // Still armed: the next stuck collective is caught.
        let _stuck = dog.enter("broadcast", &place);
        assert!(rx.recv_timeout(Duration::from_secs(5)).unwrap().contains("broadcast"));
    }
}
