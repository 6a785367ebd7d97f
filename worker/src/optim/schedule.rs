//! Learning-rate schedules, each with linear warmup. `step` counts weight updates from 0.

use crate::config::{LrSchedule, ScheduleName};

/// The learning rate of update `step` (0-based) out of `total`, for base rate `lr`.
pub fn learning_rate(s: &LrSchedule, lr: f64, step: u64, total: u64) -> f64 {
    let warm = s.warmup_steps;
    if step < warm {
        return lr * (step + 1) as f64 / warm as f64;
    }
    let min = s.min_lr.unwrap_or(0.0);
    let span = total.saturating_sub(warm).max(1) as f64;
    let progress = ((step - warm) as f64 / span).min(1.0);
    match s.name {
        ScheduleName::Constant => lr,
        ScheduleName::Linear => min + (lr - min) * (1.0 - progress),
        ScheduleName::Polynomial => min + (lr - min) * (1.0 - progress).powf(s.power),
        ScheduleName::Cosine => min + 0.5 * (lr - min) * (1.0 + (std::f64::consts::PI * progress).cos()),
        ScheduleName::WarmupStableDecay => {
            // Hold `lr`, then decay linearly to `min` over the last `decay_fraction` of steps.
            let decay_start = 1.0 - s.decay_fraction;
            if progress < decay_start {
                lr
            } else {
                min + (lr - min) * (1.0 - (progress - decay_start) / s.decay_fraction.max(1e-12))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(name: ScheduleName, warmup: u64) -> LrSchedule {
        LrSchedule { name, warmup_steps: warmup, min_lr: Some(0.1), power: 1.0, decay_fraction: 0.2 }
    }

    #[test]
    fn warmup_then_shapes() {
        let c = sched(ScheduleName::Cosine, 10);
        assert!((learning_rate(&c, 1.0, 0, 110) - 0.1).abs() < 1e-12);
        assert!((learning_rate(&c, 1.0, 9, 110) - 1.0).abs() < 1e-12);
        assert!((learning_rate(&c, 1.0, 10, 110) - 1.0).abs() < 1e-12);
        assert!((learning_rate(&c, 1.0, 60, 110) - 0.55).abs() < 1e-12);
        assert!((learning_rate(&c, 1.0, 110, 110) - 0.1).abs() < 1e-12);
        let l = sched(ScheduleName::Linear, 0);
        assert!((learning_rate(&l, 1.0, 50, 100) - 0.55).abs() < 1e-12);
        let w = sched(ScheduleName::WarmupStableDecay, 0);
        assert_eq!(learning_rate(&w, 1.0, 70, 100), 1.0);
        assert!((learning_rate(&w, 1.0, 90, 100) - 0.55).abs() < 1e-9);
        assert_eq!(learning_rate(&sched(ScheduleName::Constant, 0), 0.5, 99, 100), 0.5);
    }
}
