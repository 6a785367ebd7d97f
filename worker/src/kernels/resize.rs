//! Resize as a separable resampling: along each resized axis, every output coordinate reads a
//! few input coordinates with weights (its taps: one for nearest, two for linear, four for
//! cubic), and an output element is the sum, over every combination of its axes' taps, of the
//! weights' product times the input element there. Resize's gradient is the same sum with each
//! axis's taps transposed (input coordinate → the outputs that read it), so both are gathers
//! with a fixed order of terms. The CUDA backend builds the same taps here and uploads them.

use super::KResult;
use crate::error::BackendError;
use crate::op::resize::{Coordinates, Interpolation, NearestMode, Resize};
use crate::refused;
use crate::tensor::{DType, TensorView, TensorViewMut};
use rayon::prelude::*;

/// One axis's taps in compressed rows: output coordinate `o` reads the input coordinates
/// `src[start[o]..start[o + 1]]` with the weights beside them. A source of −1 marks an output
/// mapped outside the input, which takes tf_crop_and_resize's extrapolation value.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AxisTaps {
    pub start: Vec<i64>,
    pub src: Vec<i64>,
    pub weight: Vec<f32>,
}

impl AxisTaps {
    /// Appends `(src, weight)` to the row being built, adding the weight to the previous tap
    /// when it reads the same element (taps clamped at an edge).
    fn push(&mut self, src: i64, weight: f64) {
        let row_start = *self.start.last().unwrap_or(&0) as usize;
        if self.src.len() > row_start && self.src.last() == Some(&src) {
            *self.weight.last_mut().expect("a tap") += weight as f32;
        } else if weight != 0.0 || src < 0 {
            self.src.push(src);
            self.weight.push(weight as f32);
        }
    }

    fn end_row(&mut self) {
        self.start.push(self.src.len() as i64);
    }
}

/// Per axis: its taps, or None where the axis keeps its size and coordinates.
pub type Taps = Vec<Option<AxisTaps>>;

/// The taps of `r` from an input of shape `input` to the output `output`.
pub fn taps(r: &Resize, input: &[usize], output: &[usize]) -> Result<Taps, BackendError> {
    let g = r.geometry(input).map_err(BackendError::refused)?;
    if g.output != output {
        return refused!("Resize of {input:?} gives {:?}, not {output:?}", g.output);
    }
    Ok((0..input.len()).map(|a| axis_taps(r, input[a], output[a], g.scales[a], g.roi[a])).collect())
}

/// The taps of the gradient: per input coordinate, the outputs that read it, in increasing
/// order, with the same weights.
pub fn transposed(taps: &Taps, input: &[usize]) -> Taps {
    taps.iter()
        .zip(input)
        .map(|(t, &n_in)| {
            let t = t.as_ref()?;
            let mut start = vec![0i64; n_in + 1];
            for &s in t.src.iter().filter(|&&s| s >= 0) {
                start[s as usize + 1] += 1;
            }
            for k in 0..n_in {
                start[k + 1] += start[k];
            }
            let mut next: Vec<usize> = start[..n_in].iter().map(|&s| s as usize).collect();
            let (mut src, mut weight) = (vec![0i64; start[n_in] as usize], vec![0f32; start[n_in] as usize]);
            for o in 0..t.start.len() - 1 {
                for k in t.start[o] as usize..t.start[o + 1] as usize {
                    if let Ok(s) = usize::try_from(t.src[k]) {
                        (src[next[s]], weight[next[s]]) = (o as i64, t.weight[k]);
                        next[s] += 1;
                    }
                }
            }
            Some(AxisTaps { start, src, weight })
        })
        .collect()
}

/// The input coordinate output coordinate `o` of `n_out` maps to (ONNX's coordinate
/// transformations, with the output's width taken as scale × input, as the reference takes it).
fn source(r: &Resize, o: usize, (n_in, n_out): (usize, usize), scale: f64, roi: (f64, f64)) -> f64 {
    let (o, n_in, width) = (o as f64, n_in as f64, scale * n_in as f64);
    match r.coordinates {
        Coordinates::HalfPixel => (o + 0.5) / scale - 0.5,
        Coordinates::HalfPixelSymmetric => {
            // The centre of the input maps to the centre of the output, whose width is whole.
            let offset = n_in / 2.0 * (1.0 - n_out as f64 / width);
            offset + (o + 0.5) / scale - 0.5
        }
        Coordinates::PytorchHalfPixel if width == 1.0 => -0.5,
        Coordinates::PytorchHalfPixel => (o + 0.5) / scale - 0.5,
        Coordinates::AlignCorners if width == 1.0 => 0.0,
        Coordinates::AlignCorners => o * (n_in - 1.0) / (width - 1.0),
        Coordinates::Asymmetric => o / scale,
        Coordinates::TfCropAndResize if width == 1.0 => (roi.1 - roi.0) * (n_in - 1.0) / 2.0 + roi.0 * (n_in - 1.0),
        Coordinates::TfCropAndResize => o * (roi.1 - roi.0) * (n_in - 1.0) / (width - 1.0) + roi.0 * (n_in - 1.0),
    }
}

/// Keys' cubic convolution weights of the four neighbours floor(x) − 1 ..= floor(x) + 2 at
/// `ratio` = x − floor(x), with coefficient `a`.
fn cubic_weights(ratio: f64, a: f64) -> [f64; 4] {
    let near = |t: f64| ((a + 2.0) * t - (a + 3.0)) * t * t + 1.0;
    let far = |t: f64| ((a * t - 5.0 * a) * t + 8.0 * a) * t - 4.0 * a;
    [far(ratio + 1.0), near(ratio), near(1.0 - ratio), far(2.0 - ratio)]
}

/// One axis's taps; None when it keeps its size and coordinates.
fn axis_taps(r: &Resize, n_in: usize, n_out: usize, scale: f64, roi: (f64, f64)) -> Option<AxisTaps> {
    let kept = n_in == n_out && scale == 1.0 && roi == (0.0, 1.0);
    if kept {
        return None;
    }
    let mut t = AxisTaps { start: vec![0], ..Default::default() };
    let last = n_in as i64 - 1;
    for o in 0..n_out {
        let x = source(r, o, (n_in, n_out), scale, roi);
        if r.coordinates == Coordinates::TfCropAndResize && !(0.0..=last as f64).contains(&x) {
            t.push(-1, 0.0);
            t.end_row();
            continue;
        }
        let (base, ratio) = (x.floor() as i64, x - x.floor());
        let neighbours: Vec<(i64, f64)> = match r.mode {
            Interpolation::Nearest => {
                let right = match r.nearest {
                    NearestMode::RoundPreferFloor => ratio > 0.5,
                    NearestMode::RoundPreferCeil => ratio >= 0.5,
                    NearestMode::Floor => false,
                    NearestMode::Ceil => ratio > 0.0,
                };
                vec![(base + right as i64, 1.0)]
            }
            Interpolation::Linear => vec![(base, 1.0 - ratio), (base + 1, ratio)],
            Interpolation::Cubic => {
                let w = cubic_weights(ratio, r.cubic_coeff_a as f64);
                (0..4).map(|k| (base - 1 + k as i64, w[k])).collect()
            }
        };
        // Taps off the input read its edge element, or with exclude_outside get no weight
        // (the others renormalized).
        let inside: f64 = neighbours.iter().filter(|(s, _)| (0..=last).contains(s)).map(|(_, w)| w).sum();
        for (s, w) in neighbours {
            match (r.exclude_outside, (0..=last).contains(&s)) {
                (false, _) => t.push(s.clamp(0, last), w),
                (true, true) => t.push(s, w / inside),
                (true, false) => {}
            }
        }
        t.end_row();
    }
    Some(t)
}

/// y = the resampling of x by `taps` (`fill` where a tap marks the outside); x and y of one
/// element type, computed in f32 for f32 and in f64 for the others.
pub fn resample(taps: &Taps, fill: f32, x: &TensorView, y: &mut TensorViewMut) -> KResult {
    let (x_shape, y_shape) = (x.shape.to_vec(), y.shape.to_vec());
    match x.dtype {
        DType::F32 => resample_typed(taps, fill, &x_shape, &y_shape, x.as_slice::<f32>(), y.as_mut_slice::<f32>()),
        DType::F64 => {
            resample_typed(taps, fill as f64, &x_shape, &y_shape, x.as_slice::<f64>(), y.as_mut_slice::<f64>())
        }
        _ => {
            let mut wide = vec![0f64; y.numel()];
            resample_typed(taps, fill as f64, &x_shape, &y_shape, &x.to_f64_vec(), &mut wide)?;
            super::write_f64(&wide, y);
            Ok(())
        }
    }
}

/// Outputs per parallel piece: enough to amortise a piece's buffers.
const PIECE: usize = 4096;

fn resample_typed<T>(taps: &Taps, fill: T, x_shape: &[usize], y_shape: &[usize], xs: &[T], ys: &mut [T]) -> KResult
where
    T: num_traits::Float + Send + Sync,
{
    let rank = y_shape.len();
    if taps.len() != rank || x_shape.len() != rank {
        return refused!("taps for {} axes, a rank-{} input and a rank-{rank} output", taps.len(), x_shape.len());
    }
    let in_strides = crate::tensor::strides(x_shape);
    ys.par_chunks_mut(PIECE).enumerate().for_each(|(piece, out)| {
        // Per resized axis, innermost first: its taps, its input stride, and the range of taps
        // of this output and the one being summed.
        let mut axes: Vec<(&AxisTaps, usize, usize, usize, usize)> = Vec::with_capacity(rank);
        for (k, y) in out.iter_mut().enumerate() {
            let (mut rest, mut base) = (piece * PIECE + k, 0usize);
            axes.clear();
            let mut outside = false;
            for d in (0..rank).rev() {
                let o = rest % y_shape[d];
                rest /= y_shape[d];
                match &taps[d] {
                    None => base += o * in_strides[d],
                    Some(t) => {
                        let (lo, hi) = (t.start[o] as usize, t.start[o + 1] as usize);
                        outside |= lo < hi && t.src[lo] < 0;
                        axes.push((t, in_strides[d], lo, hi, lo));
                    }
                }
            }
            if outside {
                *y = fill;
                continue;
            }
            let mut sum = T::zero();
            if axes.iter().all(|a| a.2 < a.3) {
                loop {
                    let (mut w, mut at) = (T::one(), base);
                    for &(t, stride, _, _, k) in &axes {
                        w = w * T::from(t.weight[k]).unwrap_or_else(T::zero);
                        at += t.src[k] as usize * stride;
                    }
                    sum = sum + w * xs[at];
                    // The next combination: the innermost axis's taps turn fastest.
                    let mut a = 0;
                    while a < axes.len() {
                        axes[a].4 += 1;
                        if axes[a].4 < axes[a].3 {
                            break;
                        }
                        axes[a].4 = axes[a].2;
                        a += 1;
                    }
                    if a == axes.len() {
                        break;
                    }
                }
            }
            *y = sum;
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::resize::Target;
    use crate::tensor::Tensor;

    fn run(r: &Resize, x: &Tensor) -> Tensor {
        let out = r.geometry(x.shape()).unwrap().output;
        let t = taps(r, x.shape(), &out).unwrap();
        let mut y = Tensor::zeros(DType::F32, &out);
        resample(&t, r.extrapolation_value, &x.view(), &mut y.view_mut()).unwrap();
        y
    }

    #[test]
    fn bilinear_with_aligned_corners_keeps_the_corners_and_interpolates_between() {
        let x = Tensor::from_vec(&[1, 1, 2, 2], vec![1.0f32, 2.0, 3.0, 4.0]);
        let r = Resize::new(Interpolation::Linear, Coordinates::AlignCorners, Target::Scales(vec![1.0, 1.0, 2.0, 1.5]));
        let y = run(&r, &x);
        assert_eq!(y.shape(), &[1, 1, 4, 3]);
        let v = y.as_slice::<f32>();
        assert_eq!((v[0], v[2], v[9], v[11]), (1.0, 2.0, 3.0, 4.0));
        // Row 1 lies a third of the way from row 0 to row 1 of x, column 1 halfway.
        assert!((v[1] - 1.5).abs() < 1e-6 && (v[4] - (1.5 + 2.0 / 3.0)).abs() < 1e-6, "{v:?}");
    }

    /// The gradient's taps are the forward's transposed: ⟨resample(x), dy⟩ = ⟨x, resample'(dy)⟩.
    #[test]
    fn transposed_taps_are_the_adjoint() {
        let x = Tensor::from_vec(&[2, 5, 3], (0..30).map(|i| (i as f32 * 0.37).sin()).collect());
        let modes = [
            (Interpolation::Nearest, Coordinates::HalfPixel),
            (Interpolation::Linear, Coordinates::HalfPixel),
            (Interpolation::Cubic, Coordinates::Asymmetric),
        ];
        for (mode, coordinates) in modes {
            let r = Resize::new(mode, coordinates, Target::Scales(vec![1.0, 1.7, 0.7]));
            let out = r.geometry(x.shape()).unwrap().output;
            let t = taps(&r, x.shape(), &out).unwrap();
            let dy = Tensor::from_vec(&out, (0..out.iter().product()).map(|i| (i as f32 * 0.91).cos()).collect());
            let mut y = Tensor::zeros(DType::F32, &out);
            resample(&t, 0.0, &x.view(), &mut y.view_mut()).unwrap();
            let mut dx = Tensor::zeros(DType::F32, x.shape());
            resample(&transposed(&t, x.shape()), 0.0, &dy.view(), &mut dx.view_mut()).unwrap();
            let dot =
                |a: &Tensor, b: &Tensor| a.to_f64_vec().iter().zip(b.to_f64_vec()).map(|(p, q)| p * q).sum::<f64>();
            let (lhs, rhs) = (dot(&y, &dy), dot(&x, &dx));
            assert!((lhs - rhs).abs() < 1e-4 * lhs.abs().max(1.0), "{mode:?}: {lhs} vs {rhs}");
        }
    }
}
