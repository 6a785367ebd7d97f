//! The operator's Prometheus metrics: reconciles, failures, durations, gang restarts and jobs
//! by phase (served on /metrics by `server`).

use crate::crd::{JobPhase, TrainingJob};
use kube::ResourceExt;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

pub struct Metrics {
    registry: Registry,
    reconciles: Counter,
    failures: Counter,
    restarts: Counter,
    api_requests: Family<Vec<(String, String)>, Counter>,
    duration: Histogram,
    jobs_by_phase: Family<Vec<(String, String)>, Gauge>,
    /// The last phase seen per job (namespace/name), from which the gauge is computed.
    phases: Mutex<HashMap<String, &'static str>>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tensorfleet_operator");
        let reconciles = Counter::default();
        let failures = Counter::default();
        let restarts = Counter::default();
        let duration = Histogram::new([0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]);
        let jobs_by_phase = Family::<Vec<(String, String)>, Gauge>::default();
        let api_requests = Family::<Vec<(String, String)>, Counter>::default();
        registry.register("reconciles", "Reconcile passes", reconciles.clone());
        registry.register("reconcile_failures", "Reconcile passes that returned an error", failures.clone());
        registry.register("gang_restarts", "Whole-gang restarts after a failed rank", restarts.clone());
        registry.register("reconcile_duration_seconds", "Time of one reconcile pass", duration.clone());
        registry.register("jobs", "TrainingJobs by phase", jobs_by_phase.clone());
        registry.register("api_requests", "Requests to the Kubernetes API by HTTP method", api_requests.clone());
        Metrics {
            registry,
            reconciles,
            failures,
            restarts,
            api_requests,
            duration,
            jobs_by_phase,
            phases: Mutex::default(),
        }
    }
}

impl Metrics {
    pub fn reconciled(&self, job: &TrainingJob, took: Duration, failed: bool) {
        self.reconciles.inc();
        if failed {
            self.failures.inc();
        }
        self.duration.observe(took.as_secs_f64());
        let key = format!("{}/{}", job.namespace().unwrap_or_default(), job.name_any());
        // "Pending": a job the operator has not given a phase yet.
        let phase = job.status.as_ref().and_then(|s| s.phase).map_or("Pending", JobPhase::as_str);
        let mut phases = self.phases.lock().expect("metrics lock");
        if job.metadata.deletion_timestamp.is_some() {
            phases.remove(&key);
        } else {
            phases.insert(key, phase);
        }
        for p in JobPhase::ALL.map(JobPhase::as_str).into_iter().chain(["Pending"]) {
            let n = phases.values().filter(|&&v| v == p).count() as i64;
            self.jobs_by_phase.get_or_create(&vec![("phase".to_string(), p.to_string())]).set(n);
        }
    }

    /// Counts one request to the API server (watches count once, when they open).
    pub fn api_request(&self, method: &str) {
        self.api_requests.get_or_create(&vec![("method".to_string(), method.to_string())]).inc();
    }

    pub fn restarted(&self) {
        self.restarts.inc();
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}
