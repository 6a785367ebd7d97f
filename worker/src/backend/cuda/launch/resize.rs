//! Resize and its gradient on the CUDA backend (kernels/resize.cu): the CPU backend's taps
//! (`crate::kernels::resize`), transposed for the gradient, written to scratch memory at each
//! launch (a few values per output coordinate of each resized axis), and one gather kernel
//! over them, in f32, f16, bf16 or f64.

use super::{dims, elementwise, float_kernel, scratch_parts, Dev, MAX_DIMS, V};
use crate::backend::BackendError;
use crate::kernels::resize as cpu;
use crate::op::Resize;
use crate::refused;
use crate::tensor::DType;

/// `Taps` of kernels/resize.cu, by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Taps {
    rows: [i64; MAX_DIMS],
    first: [i64; MAX_DIMS],
}

pub fn resize(dev: Dev, r: &Resize, x: V, y: V) -> Result<(), BackendError> {
    resample(dev, &cpu::taps(r, x.shape(), y.shape())?, r.extrapolation_value, x, y)
}

/// dY → dX: dY gathered back over the transposed taps.
pub fn resize_grad(dev: Dev, r: &Resize, dy: V, dx: V) -> Result<(), BackendError> {
    let taps = cpu::transposed(&cpu::taps(r, dx.shape(), dy.shape())?, dx.shape());
    resample(dev, &taps, 0.0, dy, dx)
}

fn resample(dev: Dev, taps: &cpu::Taps, fill: f32, x: V, y: V) -> Result<(), BackendError> {
    let t = x.dtype();
    if y.dtype() != t || !matches!(t, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
        return refused!("Resize of {t} into {}: the CUDA kernels take one float type", y.dtype());
    }
    let mut axes = Taps { rows: [-1; MAX_DIMS], first: [0; MAX_DIMS] };
    let (mut starts, mut srcs, mut weights) = (Vec::new(), Vec::new(), Vec::new());
    for (d, axis) in taps.iter().enumerate() {
        if let Some(a) = axis {
            (axes.rows[d], axes.first[d]) = (starts.len() as i64, srcs.len() as i64);
            starts.extend_from_slice(&a.start);
            srcs.extend_from_slice(&a.src);
            weights.extend_from_slice(&a.weight);
        }
    }
    let (out, input) = (dims(y.shape())?, dims(x.shape())?);
    // One scratch for the three tables (each at least one element, so that each has an address).
    let bytes = [8 * starts.len().max(1), 8 * srcs.len().max(1), 4 * weights.len().max(1)];
    let [starts_at, srcs_at, weights_at] = scratch_parts(dev, &bytes)?[..] else { unreachable!("three parts") };
    for (at, table) in [
        (starts_at, bytemuck::cast_slice::<i64, u8>(&starts)),
        (srcs_at, bytemuck::cast_slice(&srcs)),
        (weights_at, bytemuck::cast_slice(&weights)),
    ] {
        if !table.is_empty() {
            dev.write(at, table)?;
        }
    }
    let n = y.n();
    dev.kernel(
        &float_kernel("resample", t)?,
        elementwise(n),
        &mut params![n as i64, out, input, axes, starts_at, srcs_at, weights_at, fill, x.at, y.at],
    )
}
