//! The progress contract between rank 0 and the operator: the worker serves a `Report` at
//! `/progress` (monitor::endpoint), the operator reads it into a TrainingJob's status.progress.
//! Feature-free, so the operator shares the type instead of restating it.

use serde::{Deserialize, Serialize};

/// What rank 0 reports at `/progress`, as JSON with these (camelCase) field names.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub step: u64,
    pub total_steps: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub learning_rate: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// Tokens per second for token data, samples per second otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<f64>,
    /// Model FLOPs per second (forward and backward GEMMs and convolutions, counted on the graph).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flops_per_second: Option<f64>,
    /// Model FLOPs utilization: flopsPerSecond over the device's peak (when the peak is known).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eta_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latest_checkpoint: Option<String>,
}
