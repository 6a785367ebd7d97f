//! How the ranks of a layout share one model's training (DESIGN.md, "Parallelism"):
//!
//! - `adasum`: Adasum's combination of data-parallel gradients (instead of their mean).
//! - `zero`: ZeRO's flat partition of gradients and optimizer state among data-parallel ranks.
//! - `pipeline`: the forward graph cut into pipeline stages (balanced cuts, or the user's).
//! - `tensor`: Megatron's tensor parallelism as a pass over the bound forward graph (column- and
//!   row-parallel pairs, vocab-parallel embedding and cross-entropy) and `TensorSplit`, how a
//!   weight is divided among the tensor-parallel ranks.
//! - `schedule`: the order of a stage's forward and backward passes and its messages (1F1B,
//!   GPipe).
//!
//! The session (`crate::session`) runs them: it owns the executors and calls the collectives.

pub mod adasum;
pub mod pipeline;
pub mod schedule;
pub mod tensor;
pub mod zero;
