//! Optimizers and learning-rate schedules, with PyTorch's semantics so that a run here and the
//! same run in PyTorch give the same numbers.
//!
//! The update math for each device lives with the device (`cpu_step` here for the CPU); this
//! module decides what to run: which tensors decay, the learning rate of a step, clipping.

pub mod schedule;

use crate::backend::StepHyper;
use crate::tensor::TensorViewMut;
use rayon::prelude::*;

/// The learning-rate-free parameters of an optimizer update, for one tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Update {
    /// SGD: L2 weight decay added to the gradient, momentum buffer (PyTorch's: the first step
    /// copies the gradient), optional Nesterov.
    Sgd { momentum: f32, nesterov: bool, weight_decay: f32 },
    /// Adam (`decoupled: false`, L2 on the gradient) or AdamW (decoupled weight decay).
    Adam { beta1: f32, beta2: f32, epsilon: f32, weight_decay: f32, decoupled: bool },
}

impl Update {
    /// How many f32 state tensors of the parameter's shape the update keeps.
    pub fn state_count(&self) -> usize {
        match self {
            Update::Sgd { momentum, .. } => (*momentum != 0.0) as usize,
            Update::Adam { .. } => 2,
        }
    }

    /// The same update without weight decay (biases and norms are excluded from decay).
    pub fn without_decay(&self) -> Update {
        match *self {
            Update::Sgd { momentum, nesterov, .. } => Update::Sgd { momentum, nesterov, weight_decay: 0.0 },
            Update::Adam { beta1, beta2, epsilon, decoupled, .. } => {
                Update::Adam { beta1, beta2, epsilon, weight_decay: 0.0, decoupled }
            }
        }
    }
}

/// The CPU implementation of one update (`Backend::optimizer_step`).
pub fn cpu_step(
    update: &Update,
    h: StepHyper,
    p: &mut [f32],
    g: &[f32],
    state: &mut [TensorViewMut],
) -> Result<(), String> {
    let lr = h.lr;
    let gs = h.grad_scale;
    match *update {
        Update::Sgd { momentum, nesterov, weight_decay } => {
            if momentum == 0.0 {
                p.par_iter_mut().zip(g.par_iter()).for_each(|(p, &g)| {
                    let d = g * gs + weight_decay * *p;
                    *p -= lr * d;
                });
            } else {
                let buf = state.get_mut(0).ok_or("SGD with momentum needs its buffer")?.as_mut_slice::<f32>();
                let first = h.step == 1;
                p.par_iter_mut().zip(g.par_iter()).zip(buf.par_iter_mut()).for_each(|((p, &g), b)| {
                    let d = g * gs + weight_decay * *p;
                    *b = if first { d } else { momentum * *b + d };
                    let step = if nesterov { d + momentum * *b } else { *b };
                    *p -= lr * step;
                });
            }
        }
        Update::Adam { beta1, beta2, epsilon, weight_decay, decoupled } => {
            let [m, v] = state else { return Err("Adam needs two state buffers".into()) };
            let (m, v) = (m.as_mut_slice::<f32>(), v.as_mut_slice::<f32>());
            let t = h.step as i32;
            let bc1 = 1.0 - (beta1 as f64).powi(t);
            let bc2 = 1.0 - (beta2 as f64).powi(t);
            // PyTorch's order: step_size = lr / bc1; denom = sqrt(v) / sqrt(bc2) + eps.
            let step_size = (lr as f64 / bc1) as f32;
            let bc2_sqrt = bc2.sqrt() as f32;
            p.par_iter_mut().zip(g.par_iter()).zip(m.par_iter_mut().zip(v.par_iter_mut())).for_each(
                |((p, &g), (m, v))| {
                    let mut g = g * gs;
                    if decoupled {
                        *p *= 1.0 - lr * weight_decay;
                    } else {
                        g += weight_decay * *p;
                    }
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    let denom = v.sqrt() / bc2_sqrt + epsilon;
                    *p -= step_size * *m / denom;
                },
            );
        }
    }
    Ok(())
}
