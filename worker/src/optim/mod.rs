//! Optimizers and learning-rate schedules, with PyTorch's semantics so that a run here and the
//! same run in PyTorch give the same numbers.
//!
//! The update math for each device lives with the device (`cpu_step` here for the CPU); this
//! module decides what to run: which tensors decay, the learning rate of a step, clipping.

pub mod scaler;
pub mod schedule;

use crate::config::ParamGroup;
use crate::error::BackendError;
use crate::refused;
use crate::tensor::TensorViewMut;
use rayon::prelude::*;

/// The per-step numbers of an optimizer update.
#[derive(Clone, Copy, Debug)]
pub struct StepHyper {
    pub lr: f32,
    /// 1 for the first update (Adam's bias correction counts from 1).
    pub step: u64,
    /// Multiplies the gradient before use (clipping, loss-scale removal).
    pub grad_scale: f32,
}

/// The learning-rate-free parameters of an optimizer update, for one tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Update {
    /// SGD: L2 weight decay added to the gradient, momentum buffer (PyTorch's: the first step
    /// copies the gradient), optional Nesterov.
    Sgd { momentum: f32, nesterov: bool, weight_decay: f32 },
    /// Adam (`decoupled: false`, L2 on the gradient) or AdamW (decoupled weight decay).
    Adam { beta1: f32, beta2: f32, epsilon: f32, weight_decay: f32, decoupled: bool },
    /// LAMB: the bias-corrected Adam direction plus decoupled decay, u = m̂/(√v̂+ε) + λw, applied
    /// as w −= lr·(‖w‖/‖u‖)·u (trust ratio 1 when either norm is 0), as apex's FusedLAMB does.
    Lamb { beta1: f32, beta2: f32, epsilon: f32, weight_decay: f32 },
}

impl Update {
    /// How many f32 state tensors of the parameter's shape the update keeps.
    pub fn state_count(&self) -> usize {
        match self {
            Update::Sgd { momentum, .. } => (*momentum != 0.0) as usize,
            Update::Adam { .. } | Update::Lamb { .. } => 2,
        }
    }

    /// The update with the keys a parameter group sets replacing this one's; a key the
    /// optimizer does not have (momentum for Adam) is ignored.
    pub fn with_group(&self, g: &ParamGroup) -> Update {
        let or = |v: Option<f64>, d: f32| v.map_or(d, |v| v as f32);
        match *self {
            Update::Sgd { momentum, nesterov, weight_decay } => Update::Sgd {
                momentum: or(g.momentum, momentum),
                nesterov,
                weight_decay: or(g.weight_decay, weight_decay),
            },
            Update::Adam { beta1, beta2, epsilon, weight_decay, decoupled } => Update::Adam {
                beta1: or(g.beta1, beta1),
                beta2: or(g.beta2, beta2),
                epsilon: or(g.epsilon, epsilon),
                weight_decay: or(g.weight_decay, weight_decay),
                decoupled,
            },
            Update::Lamb { beta1, beta2, epsilon, weight_decay } => Update::Lamb {
                beta1: or(g.beta1, beta1),
                beta2: or(g.beta2, beta2),
                epsilon: or(g.epsilon, epsilon),
                weight_decay: or(g.weight_decay, weight_decay),
            },
        }
    }

    /// The same update without weight decay (biases and norms are excluded from decay).
    pub fn without_decay(&self) -> Update {
        match *self {
            Update::Sgd { momentum, nesterov, .. } => Update::Sgd { momentum, nesterov, weight_decay: 0.0 },
            Update::Adam { beta1, beta2, epsilon, decoupled, .. } => {
                Update::Adam { beta1, beta2, epsilon, weight_decay: 0.0, decoupled }
            }
            Update::Lamb { beta1, beta2, epsilon, .. } => Update::Lamb { beta1, beta2, epsilon, weight_decay: 0.0 },
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
) -> Result<(), BackendError> {
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
                let buf = state
                    .get_mut(0)
                    .ok_or_else(|| BackendError::refused("SGD with momentum needs its buffer"))?
                    .as_mut_slice::<f32>();
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
            let [m, v] = state else { return refused!("Adam needs two state buffers") };
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
        Update::Lamb { beta1, beta2, epsilon, weight_decay } => {
            let [m, v] = state else { return refused!("LAMB needs two state buffers") };
            let (m, v) = (m.as_mut_slice::<f32>(), v.as_mut_slice::<f32>());
            let t = h.step as i32;
            let bc1 = (1.0 - (beta1 as f64).powi(t)) as f32;
            let bc2 = (1.0 - (beta2 as f64).powi(t)) as f32;
            let direction = |p: f32, m: f32, v: f32| (m / bc1) / ((v / bc2).sqrt() + epsilon) + weight_decay * p;
            // Pass 1: moments, and the norms of the weight and of the update direction (partial
            // sums collected in order, so the result does not depend on thread timing).
            let norms: Vec<(f64, f64)> = p
                .par_chunks(4096)
                .zip(g.par_chunks(4096))
                .zip(m.par_chunks_mut(4096).zip(v.par_chunks_mut(4096)))
                .map(|((pc, gc), (mc, vc))| {
                    let (mut wn, mut un) = (0f64, 0f64);
                    for k in 0..pc.len() {
                        let g = gc[k] * gs;
                        mc[k] = beta1 * mc[k] + (1.0 - beta1) * g;
                        vc[k] = beta2 * vc[k] + (1.0 - beta2) * g * g;
                        let u = direction(pc[k], mc[k], vc[k]);
                        wn += (pc[k] as f64).powi(2);
                        un += (u as f64).powi(2);
                    }
                    (wn, un)
                })
                .collect();
            let (wn, un) = norms.iter().fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
            let trust = if wn > 0.0 && un > 0.0 { (wn.sqrt() / un.sqrt()) as f32 } else { 1.0 };
            // Pass 2: the step, from the moments pass 1 left.
            p.par_iter_mut().zip(m.par_iter().zip(v.par_iter())).for_each(|(p, (&m, &v))| {
                *p -= lr * trust * direction(*p, m, v);
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;

    #[test]
    fn lamb_scales_the_adam_direction_by_the_trust_ratio() {
        let mut p = vec![0.5f32, -1.0, 2.0];
        let g = [0.1f32, 0.2, -0.3];
        let mut m = Tensor::zeros(crate::tensor::DType::F32, &[3]);
        let mut v = Tensor::zeros(crate::tensor::DType::F32, &[3]);
        let u = Update::Lamb { beta1: 0.9, beta2: 0.999, epsilon: 1e-6, weight_decay: 0.01 };
        let h = StepHyper { lr: 0.1, step: 1, grad_scale: 1.0 };
        cpu_step(&u, h, &mut p, &g, &mut [m.view_mut(), v.view_mut()]).unwrap();
        // Step 1: m̂ = g, v̂ = g², so u_i = g/(|g|+ε) + λw; by hand in f64:
        let w0 = [0.5f64, -1.0, 2.0];
        let dir: Vec<f64> = w0.iter().zip(g).map(|(w, g)| g as f64 / ((g as f64).abs() + 1e-6) + 0.01 * w).collect();
        let wn = w0.iter().map(|w| w * w).sum::<f64>().sqrt();
        let un = dir.iter().map(|d| d * d).sum::<f64>().sqrt();
        for k in 0..3 {
            let want = w0[k] - 0.1 * wn / un * dir[k];
            assert!((p[k] as f64 - want).abs() < 1e-5, "w[{k}] = {} not {want}", p[k]);
        }
    }
}
