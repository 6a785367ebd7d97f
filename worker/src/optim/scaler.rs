//! fp16's loss scaling: the loss's gradient is multiplied by a scale before the backward pass,
//! so that small gradients survive in fp16, and the update divides it out again. A step whose
//! gradients overflowed (an inf or NaN anywhere) is skipped. The dynamic scale halves on an
//! overflow and doubles after `growth_interval` clean steps, within [1, 2^24] — ONNX Runtime's
//! and PyTorch GradScaler's rule.

use crate::config::DynamicLossScale;
use crate::tensor::Tensor;

pub const MIN_SCALE: f64 = 1.0;
pub const MAX_SCALE: f64 = 16_777_216.0; // 2^24

#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    /// The scale of the next step.
    pub scale: f64,
    /// None: a fixed scale.
    growth_interval: Option<u64>,
    /// Steps without an overflow since the scale last changed.
    clean_steps: u64,
    /// Steps skipped for an overflow, over the whole run (resumes included).
    pub skipped: u64,
}

impl LossScaler {
    /// `fixed` > 0: that scale for every step; 0: dynamic, as `dynamic` says.
    pub fn new(fixed: f64, dynamic: DynamicLossScale) -> LossScaler {
        if fixed > 0.0 {
            LossScaler { scale: fixed, growth_interval: None, clean_steps: 0, skipped: 0 }
        } else {
            LossScaler {
                scale: dynamic.initial.clamp(MIN_SCALE, MAX_SCALE),
                growth_interval: Some(dynamic.growth_interval),
                clean_steps: 0,
                skipped: 0,
            }
        }
    }

    /// Called once per step with whether its gradients are finite; says whether to apply them.
    pub fn update(&mut self, finite: bool) -> bool {
        self.skipped += !finite as u64;
        let Some(interval) = self.growth_interval else { return finite };
        if finite {
            self.clean_steps += 1;
            if self.clean_steps >= interval {
                self.scale = (self.scale * 2.0).min(MAX_SCALE);
                self.clean_steps = 0;
            }
        } else {
            self.scale = (self.scale / 2.0).max(MIN_SCALE);
            self.clean_steps = 0;
        }
        finite
    }

    /// The state a checkpoint keeps: [scale, clean steps, skipped steps].
    pub fn state(&self) -> Tensor {
        Tensor::from_vec(&[3], vec![self.scale, self.clean_steps as f64, self.skipped as f64])
    }

    pub fn load_state(&mut self, t: &Tensor) -> Result<(), String> {
        match t.to_f64_vec().as_slice() {
            &[scale, clean, skipped] if scale.is_finite() && scale > 0.0 && clean >= 0.0 && skipped >= 0.0 => {
                // A fixed scale stays the configured one; a dynamic one continues.
                if self.growth_interval.is_some() {
                    self.scale = scale;
                    self.clean_steps = clean as u64;
                }
                self.skipped = skipped as u64;
                Ok(())
            }
            other => Err(format!(
                "the loss-scaler state must be [scale > 0, clean steps ≥ 0, skipped steps ≥ 0], not {other:?}"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dynamic_scale_halves_on_overflow_and_doubles_after_the_interval_within_its_bounds() {
        let mut s = LossScaler::new(0.0, DynamicLossScale { initial: 4.0, growth_interval: 2 });
        assert!(!s.update(false));
        assert_eq!(s.scale, 2.0);
        assert!(s.update(true));
        assert_eq!(s.scale, 2.0);
        assert!(s.update(true));
        assert_eq!(s.scale, 4.0, "two clean steps double it");
        s.update(true);
        assert!(!s.update(false));
        assert_eq!(s.scale, 2.0, "an overflow restarts the count");
        s.update(true);
        assert_eq!(s.scale, 2.0);
        for _ in 0..4 {
            s.update(false);
        }
        assert_eq!(s.scale, MIN_SCALE);
        assert_eq!(s.skipped, 6);
        let mut top = LossScaler::new(0.0, DynamicLossScale { initial: MAX_SCALE, growth_interval: 1 });
        top.update(true);
        assert_eq!(top.scale, MAX_SCALE);
        let mut fixed = LossScaler::new(128.0, DynamicLossScale::default());
        assert!(!fixed.update(false), "a fixed scale still skips an overflowing step");
        assert_eq!(fixed.scale, 128.0);
        let mut resumed = LossScaler::new(0.0, DynamicLossScale::default());
        resumed.load_state(&s.state()).unwrap();
        assert_eq!(resumed, LossScaler { growth_interval: Some(2000), ..s.clone() });
        assert!(resumed.load_state(&Tensor::from_vec(&[1], vec![1.0])).is_err());
    }
}
