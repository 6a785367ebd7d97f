//! A step's loss and reported scalars, summed over its micro-batches. An f32 loss is summed on
//! the device and read once, at the end of the step, so that a micro-batch does not wait for
//! the device before the next is enqueued.

use crate::backend::{Arg, Backend};
use crate::error::Result;
use crate::exec::Executor;
use crate::graph::ir::ValueId;
use crate::tensor::{DType, Tensor};

pub(super) struct Losses<B: Backend> {
    /// The training graph's loss (a stage's stand-in before the last stage).
    loss: ValueId,
    /// The scalar values a step reports beside the loss (SessionOptions::scalars).
    pub scalars: Vec<(String, ValueId)>,
    /// The micro-batch losses summed on the device (an f32 loss), and how many so far.
    sum: Option<B::Buffer>,
    summed: usize,
}

/// The first element of a fetched value (NaN if it has none).
pub(super) fn scalar(t: &Tensor) -> f64 {
    t.to_f64_vec().first().copied().unwrap_or(f64::NAN)
}

impl<B: Backend> Losses<B> {
    pub fn new(ex: &Executor<B>, loss: ValueId, scalars: Vec<(String, ValueId)>) -> Result<Losses<B>> {
        let sum = match ex.graph.meta(loss) {
            Some(m) if m.dtype == DType::F32 && !ex.graph.initializers.contains_key(&loss) => {
                Some(ex.backend.alloc(m.bytes())?)
            }
            _ => None,
        };
        Ok(Losses { loss, scalars, sum, summed: 0 })
    }

    /// Adds the run's loss (where it computes the model's: `has_loss`) to `sums[0]` and each
    /// scalar to the place after it.
    pub fn collect(&mut self, ex: &Executor<B>, has_loss: bool, sums: &mut [f64]) -> Result<()> {
        if has_loss {
            match &self.sum {
                Some(buf) => {
                    let loss = ex.arg(self.loss);
                    let sum = Arg { buf, offset: 0, meta: loss.meta };
                    let keep = if self.summed == 0 { 0.0 } else { 1.0 };
                    ex.backend.accumulate(sum, keep, loss, 1.0)?;
                    self.summed += 1;
                }
                None => sums[0] += scalar(&ex.fetch(self.loss)?),
            }
        }
        for (i, &(_, v)) in self.scalars.iter().enumerate() {
            sums[1 + i] += scalar(&ex.fetch(v)?);
        }
        Ok(())
    }

    /// Adds the losses summed on the device this step to `sums[0]` (one wait for the device).
    pub fn read(&mut self, ex: &Executor<B>, sums: &mut [f64]) -> Result<()> {
        if let (Some(buf), true) = (&self.sum, self.summed > 0) {
            let meta = ex.graph.meta(self.loss).expect("bound");
            sums[0] += scalar(&ex.backend.download(Arg { buf, offset: 0, meta })?);
        }
        self.summed = 0;
        Ok(())
    }
}
