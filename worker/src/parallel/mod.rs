//! How the ranks of a layout share one model's training (DESIGN.md, "Parallelism"):
//!
//! - `adasum`: Adasum's combination of data-parallel gradients (instead of their mean).
//! - `zero`: ZeRO's flat partition of gradients and optimizer state among data-parallel ranks.
//! - `pipeline`: the forward graph cut into pipeline stages (balanced cuts, or the user's).
//! - `schedule`: the order of a stage's forward and backward passes and its messages (1F1B,
//!   GPipe).
//!
//! The session (`crate::session`) runs them: it owns the executors and calls the collectives.

pub mod adasum;
pub mod pipeline;
pub mod schedule;
pub mod zero;
