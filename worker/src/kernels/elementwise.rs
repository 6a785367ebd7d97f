//! Pointwise ops: unary activations and their gradients, broadcasting binary ops, Where, the
//! rotary embedding.

use super::{KResult, PAR_MIN};
use crate::error::BackendError;
use crate::op::{Binary, Unary};
use crate::refused;
use crate::tensor::{strides, DType, Element, Tensor, TensorView, TensorViewMut};
use half::{bf16, f16};
use rayon::prelude::*;
use std::borrow::Cow;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044715;

/// erf with |error| < 1.2e-7 (Numerical Recipes' erfc Chebyshev fit), in f64 for accuracy.
pub fn erf(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    if x >= 0.0 {
        1.0 - r
    } else {
        r - 1.0
    }
}

pub(super) fn unary_f64(u: Unary, x: f64) -> f64 {
    match u {
        Unary::Neg => -x,
        Unary::Exp => x.exp(),
        Unary::Log => x.ln(),
        Unary::Sqrt => x.sqrt(),
        Unary::Tanh => x.tanh(),
        Unary::Erf => erf(x),
        Unary::Relu => x.max(0.0),
        Unary::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        Unary::Silu => x / (1.0 + (-x).exp()),
        Unary::Abs => x.abs(),
        Unary::Reciprocal => 1.0 / x,
        Unary::Floor => x.floor(),
        Unary::Ceil => x.ceil(),
        Unary::Not => (x == 0.0) as u8 as f64,
        Unary::Gelu => 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2)),
        Unary::GeluTanh => {
            let z = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            x / (1.0 + (-2.0 * z).exp())
        }
        Unary::Sin => x.sin(),
        Unary::Cos => x.cos(),
        Unary::Tan => x.tan(),
        Unary::Asin => x.asin(),
        Unary::Acos => x.acos(),
        Unary::Atan => x.atan(),
        Unary::Sinh => x.sinh(),
        Unary::Cosh => x.cosh(),
        Unary::Asinh => x.asinh(),
        Unary::Acosh => x.acosh(),
        Unary::Atanh => x.atanh(),
        Unary::Sign => sign(x),
        Unary::Round => x.round_ties_even(),
        Unary::Softplus => softplus(x),
        Unary::Softsign => x / (1.0 + x.abs()),
        Unary::Mish => x * softplus(x).tanh(),
        Unary::HardSwish => x * hard_sigmoid(x, 1.0 / 6.0, 0.5),
        Unary::HardSigmoid { alpha, beta } => hard_sigmoid(x, alpha as f64, beta as f64),
        Unary::LeakyRelu { alpha } => {
            if x >= 0.0 {
                x
            } else {
                alpha as f64 * x
            }
        }
        Unary::Elu { alpha } => {
            if x > 0.0 {
                x
            } else {
                alpha as f64 * x.exp_m1()
            }
        }
        Unary::Selu { alpha, gamma } => gamma as f64 * if x > 0.0 { x } else { alpha as f64 * x.exp_m1() },
        Unary::Celu { alpha } => {
            let a = alpha as f64;
            x.max(0.0) + (a * (x / a).exp_m1()).min(0.0)
        }
        Unary::ThresholdedRelu { alpha } => {
            if x > alpha as f64 {
                x
            } else {
                0.0
            }
        }
        Unary::Clip { min, max } => clip(x, min as f64, max as f64),
        Unary::IsNaN => x.is_nan() as u8 as f64,
        Unary::IsInf { negative, positive } => {
            ((x == f64::INFINITY && positive) || (x == f64::NEG_INFINITY && negative)) as u8 as f64
        }
    }
}

/// −1, 0 or 1 (NaN stays NaN, as numpy's sign).
fn sign(x: f64) -> f64 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        x
    }
}

/// ln(1 + eˣ) without overflow for large x.
fn softplus(x: f64) -> f64 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

fn hard_sigmoid(x: f64, alpha: f64, beta: f64) -> f64 {
    (alpha * x + beta).clamp(0.0, 1.0)
}

/// min(max(x, lo), hi), NaN passing through (numpy's clip, PyTorch's clamp).
fn clip(x: f64, lo: f64, hi: f64) -> f64 {
    if x < lo {
        lo
    } else if x > hi {
        hi
    } else {
        x
    }
}

/// The f32 forms of the hot activations (the rest go through f64).
/// 0.5·x·(1 + tanh(z)) written as x·σ(2z): the same function, without the cancellation in
/// 1 + tanh(z) that loses the small tail for large negative x.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    let z = SQRT_2_OVER_PI * (x + GELU_C * x * x * x);
    x / (1.0 + (-2.0 * z).exp())
}

#[inline]
pub fn gelu_tanh_grad(x: f32) -> f32 {
    let inner = SQRT_2_OVER_PI * (x + GELU_C * x * x * x);
    let t = inner.tanh();
    let sech2 = 1.0 - t * t;
    0.5 * (1.0 + t) + 0.5 * x * sech2 * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x)
}

fn unary_f32(u: Unary, x: f32) -> f32 {
    match u {
        Unary::Relu => x.max(0.0),
        Unary::GeluTanh => gelu_tanh(x),
        Unary::Neg => -x,
        Unary::Exp => x.exp(),
        Unary::Tanh => x.tanh(),
        Unary::Sqrt => x.sqrt(),
        Unary::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        Unary::Silu => x / (1.0 + (-x).exp()),
        _ => unary_f64(u, x as f64) as f32,
    }
}

/// d/dx of each activation, given x.
fn unary_grad_f64(u: Unary, x: f64) -> f64 {
    match u {
        Unary::Neg => -1.0,
        Unary::Exp => x.exp(),
        Unary::Log => 1.0 / x,
        Unary::Sqrt => 0.5 / x.sqrt(),
        Unary::Tanh => 1.0 - x.tanh().powi(2),
        Unary::Erf => 2.0 / std::f64::consts::PI.sqrt() * (-x * x).exp(),
        Unary::Relu => (x > 0.0) as u8 as f64,
        Unary::Sigmoid => {
            let s = 1.0 / (1.0 + (-x).exp());
            s * (1.0 - s)
        }
        Unary::Silu => {
            let s = 1.0 / (1.0 + (-x).exp());
            s * (1.0 + x * (1.0 - s))
        }
        Unary::Abs => x.signum() * (x != 0.0) as u8 as f64,
        Unary::Reciprocal => -1.0 / (x * x),
        Unary::Floor | Unary::Ceil | Unary::Not | Unary::Sign | Unary::Round | Unary::IsNaN | Unary::IsInf { .. } => {
            0.0
        }
        Unary::Gelu => {
            let cdf = 0.5 * (1.0 + erf(x / std::f64::consts::SQRT_2));
            let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            cdf + x * pdf
        }
        Unary::GeluTanh => gelu_tanh_grad(x as f32) as f64,
        Unary::Sin => x.cos(),
        Unary::Cos => -x.sin(),
        Unary::Tan => 1.0 / x.cos().powi(2),
        Unary::Asin => 1.0 / (1.0 - x * x).sqrt(),
        Unary::Acos => -1.0 / (1.0 - x * x).sqrt(),
        Unary::Atan => 1.0 / (1.0 + x * x),
        Unary::Sinh => x.cosh(),
        Unary::Cosh => x.sinh(),
        Unary::Asinh => 1.0 / (x * x + 1.0).sqrt(),
        Unary::Acosh => 1.0 / (x * x - 1.0).sqrt(),
        Unary::Atanh => 1.0 / (1.0 - x * x),
        Unary::Softplus => 1.0 / (1.0 + (-x).exp()),
        Unary::Softsign => 1.0 / (1.0 + x.abs()).powi(2),
        Unary::Mish => {
            let (t, s) = (softplus(x).tanh(), 1.0 / (1.0 + (-x).exp()));
            t + x * s * (1.0 - t * t)
        }
        // PyTorch's hardswish_backward: 0 below −3, x/3 + 1/2 up to 3, 1 above.
        Unary::HardSwish => {
            if x < -3.0 {
                0.0
            } else if x <= 3.0 {
                x / 3.0 + 0.5
            } else {
                1.0
            }
        }
        Unary::HardSigmoid { alpha, beta } => {
            let z = alpha as f64 * x + beta as f64;
            if z > 0.0 && z < 1.0 {
                alpha as f64
            } else {
                0.0
            }
        }
        Unary::LeakyRelu { alpha } => {
            if x > 0.0 {
                1.0
            } else {
                alpha as f64
            }
        }
        Unary::Elu { alpha } => {
            if x > 0.0 {
                1.0
            } else {
                alpha as f64 * x.exp()
            }
        }
        Unary::Selu { alpha, gamma } => gamma as f64 * if x > 0.0 { 1.0 } else { alpha as f64 * x.exp() },
        Unary::Celu { alpha } => {
            if x > 0.0 {
                1.0
            } else {
                (x / alpha as f64).exp()
            }
        }
        Unary::ThresholdedRelu { alpha } => (x > alpha as f64) as u8 as f64,
        Unary::Clip { min, max } => (x >= min as f64 && x <= max as f64) as u8 as f64,
    }
}

/// Unary ops on integers: exact where the op is (Neg and Abs wrap at the type's minimum),
/// through f64 otherwise.
fn unary_int<T: num_traits::PrimInt + num_traits::WrappingNeg>(u: Unary, v: T) -> T {
    let zero = T::zero();
    match u {
        Unary::Neg => v.wrapping_neg(),
        Unary::Abs if v < zero => v.wrapping_neg(),
        Unary::Abs | Unary::Floor | Unary::Ceil | Unary::Round => v,
        Unary::Relu => v.max(zero),
        Unary::Sign => T::from(v.cmp(&zero) as i8).unwrap_or(zero),
        // Bounds compared in f64 (exact for every bound an integer tensor can reach but i64's
        // and u64's extremes), so that ±∞ (no bound) works too.
        Unary::Clip { min, max } => {
            let f = v.to_f64().unwrap_or(0.0);
            if f < min as f64 {
                T::from(min.ceil()).unwrap_or(v)
            } else if f > max as f64 {
                T::from(max.floor()).unwrap_or(v)
            } else {
                v
            }
        }
        _ => T::from(unary_f64(u, v.to_f64().unwrap_or(0.0))).unwrap_or(zero),
    }
}

fn map_par<T: Element, U: Element>(x: &[T], y: &mut [U], f: impl Fn(T) -> U + Sync) {
    if y.len() >= PAR_MIN {
        y.par_chunks_mut(4096).zip(x.par_chunks(4096)).for_each(|(yc, xc)| {
            for (o, &i) in yc.iter_mut().zip(xc) {
                *o = f(i);
            }
        });
    } else {
        for (o, &i) in y.iter_mut().zip(x) {
            *o = f(i);
        }
    }
}

/// `binary` folded over two or more inputs (variadic Max and Min): ((x0 ∘ x1) ∘ x2) ∘ ...
pub fn binary_fold(op: Binary, inputs: &[TensorView], out: &mut TensorViewMut) -> KResult {
    let [first, second, rest @ ..] = inputs else {
        return refused!("{op:?} needs at least two inputs here");
    };
    binary(op, first, second, out)?;
    for x in rest {
        let acc = out.as_view().to_tensor();
        binary(op, &acc.view(), x, out)?;
    }
    Ok(())
}

pub fn unary(u: Unary, x: &TensorView, y: &mut TensorViewMut) -> KResult {
    match (x.dtype, y.dtype) {
        (DType::F32, DType::F32) => map_par(x.as_slice::<f32>(), y.as_mut_slice::<f32>(), |v| unary_f32(u, v)),
        (DType::F64, DType::F64) => map_par(x.as_slice::<f64>(), y.as_mut_slice::<f64>(), |v| unary_f64(u, v)),
        (DType::Bool, DType::Bool) if u == Unary::Not => {
            map_par(x.as_slice::<u8>(), y.as_mut_slice::<u8>(), |v| (v == 0) as u8)
        }
        (DType::F32, DType::Bool) if u.is_predicate() => {
            map_par(x.as_slice::<f32>(), y.as_mut_slice::<u8>(), |v| unary_f64(u, v as f64) as u8)
        }
        (DType::F64, DType::Bool) if u.is_predicate() => {
            map_par(x.as_slice::<f64>(), y.as_mut_slice::<u8>(), |v| unary_f64(u, v) as u8)
        }
        (DType::I64, DType::I64) => map_par(x.as_slice::<i64>(), y.as_mut_slice::<i64>(), |v| unary_int(u, v)),
        (DType::I32, DType::I32) => map_par(x.as_slice::<i32>(), y.as_mut_slice::<i32>(), |v| unary_int(u, v)),
        (DType::I16, DType::I16) => map_par(x.as_slice::<i16>(), y.as_mut_slice::<i16>(), |v| unary_int(u, v)),
        (DType::I8, DType::I8) => map_par(x.as_slice::<i8>(), y.as_mut_slice::<i8>(), |v| unary_int(u, v)),
        (DType::U64, DType::U64) => map_par(x.as_slice::<u64>(), y.as_mut_slice::<u64>(), |v| unary_int(u, v)),
        (DType::U32, DType::U32) => map_par(x.as_slice::<u32>(), y.as_mut_slice::<u32>(), |v| unary_int(u, v)),
        (DType::U16, DType::U16) => map_par(x.as_slice::<u16>(), y.as_mut_slice::<u16>(), |v| unary_int(u, v)),
        (DType::U8, DType::U8) => map_par(x.as_slice::<u8>(), y.as_mut_slice::<u8>(), |v| unary_int(u, v)),
        (d, _) => return refused!("{u:?} is not implemented for {d}"),
    }
    Ok(())
}

/// f'(x) in f32 (the common activations without a detour through f64).
fn derivative_f32(u: Unary, v: f32) -> f32 {
    match u {
        Unary::Relu => (v > 0.0) as u8 as f32,
        Unary::GeluTanh => gelu_tanh_grad(v),
        Unary::Silu => {
            let s = 1.0 / (1.0 + (-v).exp());
            s * (1.0 + v * (1.0 - s))
        }
        Unary::Tanh => {
            let t = v.tanh();
            1.0 - t * t
        }
        _ => unary_grad_f64(u, v as f64) as f32,
    }
}

/// dX = dY · f'(X).
pub fn unary_grad(u: Unary, dy: &TensorView, x: &TensorView, dx: &mut TensorViewMut) -> KResult {
    times_derivative(u, Some(dy), x, dx)
}

/// y ← f(y), each element as `unary` computes it (a fused op's last step: BatchNormRelu's
/// ReLU). Half types round f's f32 result once, as `unary` on a widened half input does.
pub fn unary_in_place(u: Unary, y: &mut TensorViewMut) -> KResult {
    fn each<T: Element>(y: &mut [T], f: impl Fn(T) -> T + Sync) {
        y.par_chunks_mut(4096).for_each(|c| c.iter_mut().for_each(|v| *v = f(*v)));
    }
    match y.dtype {
        DType::F32 => each(y.as_mut_slice::<f32>(), |v| unary_f32(u, v)),
        DType::F64 => each(y.as_mut_slice::<f64>(), |v| unary_f64(u, v)),
        DType::BF16 => each(y.as_mut_slice::<bf16>(), |v| bf16::from_f32(unary_f32(u, v.to_f32()))),
        DType::F16 => each(y.as_mut_slice::<f16>(), |v| f16::from_f32(unary_f32(u, v.to_f32()))),
        t => return refused!("{u:?} in place over {t}: a float op's output is f32, f64, bf16 or f16"),
    }
    Ok(())
}

/// d ← d · f'(X): `d` holds dY and becomes dX (a fused product's epilogue).
pub fn unary_grad_in_place(u: Unary, x: &TensorView, d: &mut TensorViewMut) -> KResult {
    times_derivative(u, None, x, d)
}

/// d = dY · f'(X), dY read from `dy`, or (None) from `d` itself.
fn times_derivative(u: Unary, dy: Option<&TensorView>, x: &TensorView, d: &mut TensorViewMut) -> KResult {
    match x.dtype {
        DType::F32 => {
            let (dy, x) = (dy.map(|t| t.as_slice::<f32>()), x.as_slice::<f32>());
            let f = |i: usize, o: &mut f32| *o = dy.map_or(*o, |dy| dy[i]) * derivative_f32(u, x[i]);
            let out = d.as_mut_slice::<f32>();
            if out.len() >= PAR_MIN {
                out.par_iter_mut().enumerate().for_each(|(i, o)| f(i, o));
            } else {
                out.iter_mut().enumerate().for_each(|(i, o)| f(i, o));
            }
        }
        DType::F64 => {
            let (dy, x) = (dy.map(|t| t.as_slice::<f64>()), x.as_slice::<f64>());
            for (i, o) in d.as_mut_slice::<f64>().iter_mut().enumerate() {
                *o = dy.map_or(*o, |dy| dy[i]) * unary_grad_f64(u, x[i]);
            }
        }
        // Half types reach the CPU's kernels widened to f32 (`run_half_in_f32`).
        t => return refused!("the gradient of {u:?} is not implemented for {t}"),
    }
    Ok(())
}

/// For each output row (all dims but the last), the element offsets of each input, and the
/// inner stride (0 when broadcast along the last dim). Broadcasting is resolved once per row.
struct Broadcast {
    out_rows: usize,
    inner: usize,
    row_offsets: Vec<Vec<usize>>,
    inner_strides: Vec<usize>,
}

impl Broadcast {
    fn new(out: &[usize], ins: &[&[usize]]) -> Broadcast {
        let r = out.len();
        let inner = if r == 0 { 1 } else { out[r - 1] };
        let out_rows: usize = if r == 0 { 1 } else { out[..r - 1].iter().product() };
        let mut row_offsets = Vec::new();
        let mut inner_strides = Vec::new();
        for shape in ins {
            // Right-align the input's shape against the output's.
            let mut padded = vec![1; r - shape.len()];
            padded.extend_from_slice(shape);
            let st = strides(&padded);
            let eff: Vec<usize> = (0..r).map(|d| if padded[d] == 1 { 0 } else { st[d] }).collect();
            inner_strides.push(if r == 0 { 0 } else { eff[r - 1] });
            let mut offs = Vec::with_capacity(out_rows);
            let outer = if r == 0 { &[][..] } else { &out[..r - 1] };
            let mut idx = vec![0usize; outer.len()];
            for _ in 0..out_rows {
                offs.push(idx.iter().zip(&eff).map(|(i, s)| i * s).sum());
                for d in (0..idx.len()).rev() {
                    idx[d] += 1;
                    if idx[d] < outer[d] {
                        break;
                    }
                    idx[d] = 0;
                }
            }
            row_offsets.push(offs);
        }
        Broadcast { out_rows, inner, row_offsets, inner_strides }
    }
}

/// Applies `f` pointwise over broadcast inputs `a` and `b` into `out`.
fn zip_broadcast<A: Element, B: Element, O: Element>(
    a: &[A],
    a_shape: &[usize],
    b: &[B],
    b_shape: &[usize],
    out: &mut [O],
    out_shape: &[usize],
    f: impl Fn(A, B) -> O + Sync,
) {
    if a_shape == out_shape && b_shape == out_shape {
        let body = |(o, (x, y)): (&mut O, (&A, &B))| *o = f(*x, *y);
        if out.len() >= PAR_MIN {
            out.par_iter_mut().zip(a.par_iter().zip(b.par_iter())).for_each(body);
        } else {
            out.iter_mut().zip(a.iter().zip(b.iter())).for_each(body);
        }
        return;
    }
    if b.len() == 1 && a_shape == out_shape {
        let y = b[0];
        map_par(a, out, |x| f(x, y));
        return;
    }
    let bc = Broadcast::new(out_shape, &[a_shape, b_shape]);
    let inner = bc.inner.max(1);
    let row = |r: usize, orow: &mut [O]| {
        let (oa, ob) = (bc.row_offsets[0][r], bc.row_offsets[1][r]);
        let (sa, sb) = (bc.inner_strides[0], bc.inner_strides[1]);
        for (j, o) in orow.iter_mut().enumerate() {
            *o = f(a[oa + j * sa], b[ob + j * sb]);
        }
    };
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(inner).enumerate().for_each(|(r, orow)| row(r, orow));
    } else {
        out.chunks_mut(inner).enumerate().for_each(|(r, orow)| row(r, orow));
    }
    debug_assert_eq!(bc.out_rows * inner, out.len().max(bc.out_rows * inner));
}

/// The arithmetic of one element type. Integers wrap on overflow and divide by zero to 0
/// (ONNX leaves both undefined; a panic in a kernel is not an option).
trait Arith: Element + PartialOrd {
    fn add(self, y: Self) -> Self;
    fn sub(self, y: Self) -> Self;
    fn mul(self, y: Self) -> Self;
    fn div(self, y: Self) -> Self;
    fn pow(self, y: Self) -> Self;
    /// The truncated remainder (C's fmod, Rust's %).
    fn rem(self, y: Self) -> Self;
    fn is_nan(self) -> bool;
    fn zero() -> Self;
}

macro_rules! float_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            fn add(self, y: Self) -> Self { self + y }
            fn sub(self, y: Self) -> Self { self - y }
            fn mul(self, y: Self) -> Self { self * y }
            fn div(self, y: Self) -> Self { self / y }
            fn pow(self, y: Self) -> Self { if y == 2.0 { self * self } else { self.powf(y) } }
            fn rem(self, y: Self) -> Self { self % y }
            fn is_nan(self) -> bool { self.is_nan() }
            fn zero() -> Self { 0.0 }
        }
    )*};
}
float_arith!(f32, f64);

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            fn add(self, y: Self) -> Self { self.wrapping_add(y) }
            fn sub(self, y: Self) -> Self { self.wrapping_sub(y) }
            fn mul(self, y: Self) -> Self { self.wrapping_mul(y) }
            fn div(self, y: Self) -> Self { self.checked_div(y).unwrap_or(0) }
            fn pow(self, y: Self) -> Self { (self as f64).powf(y as f64) as $t }
            fn rem(self, y: Self) -> Self { self.checked_rem(y).unwrap_or(0) }
            fn is_nan(self) -> bool { false }
            fn zero() -> Self { 0 }
        }
    )*};
}
int_arith!(i64, i32, i16, i8, u64, u32, u16, u8);

fn arith<T: Arith>(b: Binary, x: T, y: T) -> T {
    match b {
        Binary::Add => x.add(y),
        Binary::Sub => x.sub(y),
        Binary::Mul => x.mul(y),
        Binary::Div => x.div(y),
        Binary::Pow => x.pow(y),
        // NaN propagates, as numpy's maximum and minimum do.
        Binary::Max => {
            if x >= y || x.is_nan() {
                x
            } else {
                y
            }
        }
        Binary::Min => {
            if x <= y || x.is_nan() {
                x
            } else {
                y
            }
        }
        Binary::Fmod => x.rem(y),
        Binary::Mod => {
            // The truncated remainder moved to the divisor's sign.
            let r = x.rem(y);
            if r != T::zero() && ((r < T::zero()) != (y < T::zero())) {
                r.add(y)
            } else {
                r
            }
        }
        Binary::PRelu => {
            if x < T::zero() {
                x.mul(y)
            } else {
                x
            }
        }
        _ => unreachable!("predicates are dispatched separately"),
    }
}

fn compare<T: PartialOrd + PartialEq>(b: Binary, x: T, y: T) -> u8 {
    (match b {
        Binary::Equal => x == y,
        Binary::Less => x < y,
        Binary::Greater => x > y,
        Binary::LessOrEqual => x <= y,
        Binary::GreaterOrEqual => x >= y,
        _ => unreachable!("logic ops are dispatched separately"),
    }) as u8
}

pub fn binary(op: Binary, a: &TensorView, b: &TensorView, out: &mut TensorViewMut) -> KResult {
    let (ash, bsh) = (a.shape, b.shape);
    let osh: Vec<usize> = out.shape.to_vec();
    macro_rules! arith_t {
        ($t:ty) => {
            zip_broadcast(a.as_slice::<$t>(), ash, b.as_slice::<$t>(), bsh, out.as_mut_slice::<$t>(), &osh, |x, y| {
                arith::<$t>(op, x, y)
            })
        };
    }
    macro_rules! cmp_t {
        ($t:ty) => {
            zip_broadcast(a.as_slice::<$t>(), ash, b.as_slice::<$t>(), bsh, out.as_mut_slice::<u8>(), &osh, |x, y| {
                compare(op, x, y)
            })
        };
    }
    if op.is_logic() {
        zip_broadcast(a.as_slice::<u8>(), ash, b.as_slice::<u8>(), bsh, out.as_mut_slice::<u8>(), &osh, |x, y| {
            let (x, y) = (x != 0, y != 0);
            (match op {
                Binary::And => x && y,
                Binary::Or => x || y,
                _ => x != y,
            }) as u8
        });
        return Ok(());
    }
    if op == Binary::Pow && a.dtype != b.dtype {
        // Pow's exponent may have its own type: compute in f64.
        let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
        let mut tmp = vec![0f64; out.numel()];
        zip_broadcast(&x, ash, &y, bsh, &mut tmp, &osh, |x, y| x.powf(y));
        super::write_f64(&tmp, out);
        return Ok(());
    }

    if op.is_predicate() {
        match a.dtype {
            DType::F32 => cmp_t!(f32),
            DType::F64 => cmp_t!(f64),
            DType::I64 => cmp_t!(i64),
            DType::I32 => cmp_t!(i32),
            DType::U8 | DType::Bool => cmp_t!(u8),
            DType::I8 => cmp_t!(i8),
            DType::I16 => cmp_t!(i16),
            DType::U16 => cmp_t!(u16),
            DType::U32 => cmp_t!(u32),
            DType::U64 => cmp_t!(u64),
            d => return refused!("{op:?} is not implemented for {d}"),
        }
        return Ok(());
    }
    match a.dtype {
        DType::F32 => arith_t!(f32),
        DType::F64 => arith_t!(f64),
        DType::I64 => arith_t!(i64),
        DType::I32 => arith_t!(i32),
        DType::U8 => arith_t!(u8),
        DType::I8 => arith_t!(i8),
        DType::I16 => arith_t!(i16),
        DType::U16 => arith_t!(u16),
        DType::U32 => arith_t!(u32),
        DType::U64 => arith_t!(u64),
        d => return refused!("{op:?} is not implemented for {d}"),
    }
    Ok(())
}

/// out = cond ? x : y, all three broadcast.
pub fn where_(cond: &TensorView, x: &TensorView, y: &TensorView, out: &mut TensorViewMut) -> KResult {
    let osh = out.shape.to_vec();
    let bc = Broadcast::new(&osh, &[cond.shape, x.shape, y.shape]);
    let c = cond.as_slice::<u8>();
    let size = x.dtype.size();
    let (xb, yb) = (x.bytes, y.bytes);
    let inner = bc.inner.max(1);
    // Byte-wise selection works for every element type.
    for (r, orow) in out.bytes.chunks_mut(inner * size).enumerate() {
        let (oc, ox, oy) = (bc.row_offsets[0][r], bc.row_offsets[1][r], bc.row_offsets[2][r]);
        let (sc, sx, sy) = (bc.inner_strides[0], bc.inner_strides[1], bc.inner_strides[2]);
        for j in 0..orow.len() / size {
            let src = if c[oc + j * sc] != 0 {
                &xb[(ox + j * sx) * size..][..size]
            } else {
                &yb[(oy + j * sy) * size..][..size]
            };
            orow[j * size..(j + 1) * size].copy_from_slice(src);
        }
    }
    Ok(())
}

/// SwiGLU's SiLU(a)·b (`Op::Swiglu`), a and b of one shape.
pub fn swiglu(a: &TensorView, b: &TensorView, out: &mut TensorViewMut) -> KResult {
    swiglu_both(None, a, b, std::slice::from_mut(out))
}

/// SwiGLU's gradient: dA = dY·b·SiLU'(a) into `outs[0]`, dB = dY·SiLU(a) into `outs[1]`.
pub fn swiglu_grad(dy: &TensorView, a: &TensorView, b: &TensorView, outs: &mut [TensorViewMut]) -> KResult {
    swiglu_both(Some(dy), a, b, outs)
}

/// SwiGLU forward (no `dy`) or backward, elementwise over a and b.
fn swiglu_both(dy: Option<&TensorView>, a: &TensorView, b: &TensorView, outs: &mut [TensorViewMut]) -> KResult {
    let wanted = if dy.is_some() { 2 } else { 1 };
    let alike = [Some(a), Some(b), dy].iter().flatten().all(|t| t.dtype == a.dtype && t.shape == a.shape);
    if !alike || outs.len() < wanted || outs.iter().any(|o| o.shape != a.shape) {
        return refused!(
            "SwiGLU of {} {:?} and {} {:?}: one type and shape expected",
            a.dtype,
            a.shape,
            b.dtype,
            b.shape
        );
    }
    match a.dtype {
        DType::F32 => swiglu_t::<f32>(dy.map(|t| t.as_slice()), a.as_slice(), b.as_slice(), outs),
        DType::F64 => swiglu_t::<f64>(dy.map(|t| t.as_slice()), a.as_slice(), b.as_slice(), outs),
        t => return refused!("SwiGLU of {t} on the CPU"),
    }
    Ok(())
}

fn swiglu_t<T: num_traits::Float + Element>(dy: Option<&[T]>, a: &[T], b: &[T], outs: &mut [TensorViewMut]) {
    // SiLU as `Unary::Silu` computes it, so that the fused op rounds as the ops it replaces.
    let silu = |x: T| x / (T::one() + (-x).exp());
    match (dy, outs) {
        (None, [y, ..]) => {
            let y = y.as_mut_slice::<T>();
            y.par_iter_mut().zip(a.par_iter().zip(b)).for_each(|(y, (&a, &b))| *y = silu(a) * b);
        }
        (Some(dy), [da, db, ..]) => {
            let (da, db) = (da.as_mut_slice::<T>(), db.as_mut_slice::<T>());
            let grads = da.par_iter_mut().zip(db.par_iter_mut());
            grads.zip(dy.par_iter().zip(a.par_iter().zip(b))).for_each(|((da, db), (&g, (&a, &b)))| {
                let s = T::one() / (T::one() + (-a).exp());
                *da = g * b * (s * (T::one() + a * (T::one() - s)));
                *db = g * silu(a);
            });
        }
        _ => {} // swiglu_both checked the outputs' count
    }
}

/// Rotary (`grad` false: x·cos + [−x₂, x₁]·sin over the last dim's halves) or RotaryGrad (x
/// the output's gradient: x·cos + [x₂·sin₂, −x₁·sin₁]), cos and sin broadcast to x. In f32
/// and f64 each element is rounded as the written-out ops round it (a product, a product,
/// their sum), so the fused op gives their bits.
pub fn rotary(grad: bool, x: &TensorView, cos: &TensorView, sin: &TensorView, out: &mut TensorViewMut) -> KResult {
    let d = x.shape.last().copied().unwrap_or(0);
    if d % 2 != 0 || out.shape != x.shape {
        return refused!("Rotary of {:?} into {:?} (an even last dim expected)", x.shape, out.shape);
    }
    if cos.dtype != x.dtype || sin.dtype != x.dtype {
        return refused!("Rotary of {} with tables of {} and {}", x.dtype, cos.dtype, sin.dtype);
    }
    macro_rules! rotate_t {
        ($t:ty) => {
            rotate::<$t>(
                grad,
                d,
                x.as_slice(),
                &rotary_table(cos, x.shape)?,
                &rotary_table(sin, x.shape)?,
                out.as_mut_slice(),
            )
        };
    }
    match x.dtype {
        DType::F32 => rotate_t!(f32),
        DType::F64 => rotate_t!(f64),
        t => return refused!("Rotary of {t} on the CPU"),
    }
    Ok(())
}

/// A cos or sin table as `rotate` reads it: repeated along x's leading dims (the table itself,
/// where its dims after leading 1s are x's last ones), else expanded to x's shape.
fn rotary_table<'a, T: Element>(t: &'a TensorView, x_shape: &[usize]) -> Result<Cow<'a, [T]>, BackendError> {
    let own = &t.shape[t.shape.iter().take_while(|&&n| n == 1).count()..];
    if !own.is_empty() && x_shape.ends_with(own) {
        return Ok(Cow::Borrowed(t.as_slice()));
    }
    let mut full = Tensor::zeros(t.dtype, x_shape);
    super::shape::expand(t, &mut full.view_mut())?;
    Ok(Cow::Owned(full.as_slice::<T>().to_vec()))
}

/// Each row of `d` elements of x against the table's row that broadcasts to it (the tables'
/// lengths are multiples of `d`).
fn rotate<T: num_traits::Float + Send + Sync>(grad: bool, d: usize, x: &[T], cos: &[T], sin: &[T], out: &mut [T]) {
    if d == 0 {
        return;
    }
    let h = d / 2;
    let row = |r: usize, o: &mut [T], x: &[T]| {
        let (bc, bs) = (r * d % cos.len(), r * d % sin.len());
        let (c, s) = (&cos[bc..bc + d], &sin[bs..bs + d]);
        for j in 0..h {
            let (x1, x2) = (x[j], x[j + h]);
            if grad {
                o[j] = x1 * c[j] + x2 * s[j + h];
                o[j + h] = x2 * c[j + h] - x1 * s[j];
            } else {
                o[j] = x1 * c[j] - x2 * s[j];
                o[j + h] = x2 * c[j + h] + x1 * s[j + h];
            }
        }
    };
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(d).zip(x.par_chunks(d)).enumerate().for_each(|(r, (o, x))| row(r, o, x));
    } else {
        out.chunks_mut(d).zip(x.chunks(d)).enumerate().for_each(|(r, (o, x))| row(r, o, x));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        for (x, want) in [(0.0, 0.0), (0.5, 0.520_499_877_8), (1.0, 0.842_700_792_9), (-2.0, -0.995_322_265)] {
            assert!((erf(x) - want).abs() < 2e-7, "erf({x}) = {} not {want}", erf(x));
        }
    }

    #[test]
    fn gelu_tanh_keeps_its_negative_tail() {
        for i in 0..=200 {
            let x = -10.0 + i as f32 * 0.1;
            let want = unary_f64(Unary::GeluTanh, x as f64);
            let got = gelu_tanh(x) as f64;
            // f32 carries exp(-2z)'s relative error, about |2z|·2⁻²⁴, into the tail.
            assert!((got - want).abs() <= 2e-5 * want.abs() + 1e-30, "gelu_tanh({x}) = {got}, not {want}");
        }
    }

    #[test]
    fn integer_arithmetic_wraps_and_divides_by_zero_to_zero() {
        let run = |op: Binary, a: Vec<i32>, b: Vec<i32>| {
            let (a, b) = (crate::tensor::Tensor::from_vec(&[a.len()], a), crate::tensor::Tensor::from_vec(&[2], b));
            let mut y = crate::tensor::Tensor::zeros(DType::I32, &[2]);
            binary(op, &a.view(), &b.view(), &mut y.view_mut()).unwrap();
            y.as_slice::<i32>().to_vec()
        };
        assert_eq!(run(Binary::Div, vec![7, -7], vec![0, 2]), vec![0, -3]);
        assert_eq!(run(Binary::Add, vec![i32::MAX, 1], vec![1, 1]), vec![i32::MIN, 2]);
        assert_eq!(run(Binary::Max, vec![3, -4], vec![1, 5]), vec![3, 5]);
    }
}
