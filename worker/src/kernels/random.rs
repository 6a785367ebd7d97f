//! Dropout: a counter-based mask, so the mask of a step depends only on (seed, element).

use super::KResult;
use crate::refused;
use crate::rng::uniform;
use crate::tensor::{DType, TensorView, TensorViewMut};
use rayon::prelude::*;

/// Y = X ⊙ mask / (1 − ratio) in training, X otherwise; output 1 (if present) is the mask.
pub fn dropout(ratio: f32, training: bool, seed: u64, x: &TensorView, outs: &mut [TensorViewMut]) -> KResult {
    let active = training && ratio > 0.0;
    if !active {
        outs[0].bytes.copy_from_slice(x.bytes);
        if let Some(m) = outs.get_mut(1) {
            m.bytes.fill(1);
        }
        return Ok(());
    }
    if x.dtype != DType::F32 {
        return refused!("Dropout in training is not implemented for {}", x.dtype);
    }
    let n = x.numel();
    let mut mask = vec![0u8; n];
    mask.par_iter_mut().enumerate().for_each(|(i, m)| *m = (uniform(seed, i as u64) >= ratio as f64) as u8);
    let scale = 1.0 / (1.0 - ratio);
    let xs = x.as_slice::<f32>();
    outs[0].as_mut_slice::<f32>().par_iter_mut().enumerate().for_each(|(i, y)| *y = xs[i] * mask[i] as f32 * scale);
    if let Some(m) = outs.get_mut(1) {
        m.bytes.copy_from_slice(&mask);
    }
    Ok(())
}

/// dX = dY ⊙ mask / (1 − ratio).
pub fn dropout_grad(ratio: f32, dy: &TensorView, mask: &TensorView, dx: &mut TensorViewMut) -> KResult {
    let scale = if ratio > 0.0 { 1.0 / (1.0 - ratio) } else { 1.0 };
    let (g, m) = (dy.as_slice::<f32>(), mask.as_slice::<u8>());
    dx.as_mut_slice::<f32>().par_iter_mut().enumerate().for_each(|(i, o)| *o = g[i] * m[i] as f32 * scale);
    Ok(())
}
