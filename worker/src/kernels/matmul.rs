//! Matrix products on `gemm-f32`, the `gemm` crate's f32 kernels (blocked, SIMD,
//! multithreaded): MatMul with numpy batch broadcasting, Gemm, and the fused MatMul + bias
//! (+ GELU) the fusion pass emits.

use super::elementwise::gelu_tanh;
use super::KResult;
use crate::error::BackendError;
use crate::op::Unary;
use crate::refused;
use crate::tensor::cast::cast_into;
use crate::tensor::{strides, DType, Tensor, TensorView, TensorViewMut};
use gemm_common::Parallelism;
use rayon::prelude::*;

/// A strided matrix operand: element offset, row stride, column stride.
#[derive(Clone, Copy)]
pub struct Mat {
    pub offset: usize,
    pub rs: isize,
    pub cs: isize,
}

/// dst[m×n] = (accumulate ? dst : 0) + scale · a[m×k] · b[k×n], in f32.
///
/// # Safety
/// The operands must address valid memory for their shapes and strides, and `dst` must not
/// overlap `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: isize,
    a: *const f32,
    am: Mat,
    b: *const f32,
    bm: Mat,
    accumulate: bool,
    scale: f32,
    par: Parallelism,
) {
    let (a, b) = (a.add(am.offset), b.add(bm.offset));
    let kernel = gemm_f32::gemm::f32::get_gemm_fn();
    // gemm's microkernels want a column-major destination, and the `gemm` facade turns a
    // row-major one into the transposed product (dstᵀ = bᵀ·aᵀ, column-major) before calling
    // them; called directly, the kernels must be given that form (without it, every CPU
    // product ran at about half its rate: a 1024² product 23.0 ms against 11.1).
    if dst_rs.abs() > 1 {
        kernel(
            n, m, k, dst, dst_rs, 1, accumulate, b, bm.rs, bm.cs, a, am.rs, am.cs, 1.0, scale, false, false, false, par,
        );
    } else {
        kernel(
            m, n, k, dst, 1, dst_rs, accumulate, a, am.cs, am.rs, b, bm.cs, bm.rs, 1.0, scale, false, false, false, par,
        );
    }
}

/// Threads for one GEMM of this size: small products run on one thread.
pub fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    if m * n * k < 48 * 48 * 48 {
        Parallelism::None
    } else {
        Parallelism::Rayon(rayon::current_num_threads())
    }
}

fn as_2d(shape: &[usize], transposed: bool) -> (Vec<usize>, usize, usize, bool) {
    // 1-D operands act as a row (A) or a column (B) vector; the caller passes which.
    let r = shape.len();
    let (rows, cols) = (shape[r - 2], shape[r - 1]);
    let (m, k) = if transposed { (cols, rows) } else { (rows, cols) };
    (shape[..r - 2].to_vec(), m, k, transposed)
}

/// FusedMatMul: the product (+ bias), then the activation; `pre`, when given, keeps the
/// pre-activation for the activation's gradient to read.
#[allow(clippy::too_many_arguments)]
pub fn matmul_activation(
    a: &TensorView,
    b: &TensorView,
    bias: Option<TensorView>,
    trans_a: bool,
    trans_b: bool,
    act: Option<Unary>,
    y: &mut TensorViewMut,
    pre: Option<&mut TensorViewMut>,
) -> KResult {
    let Some(pre) = pre else { return matmul(a, b, bias, trans_a, trans_b, act, y) };
    let act = act.ok_or_else(|| BackendError::refused("a pre-activation output without an activation"))?;
    matmul(a, b, bias, trans_a, trans_b, None, pre)?;
    super::elementwise::unary(act, &pre.as_view(), y)
}

/// out = act(A · B + bias) with numpy batch broadcasting; A and B may be transposed on their
/// last two dims. `bias` broadcasts along the last output dim.
pub fn matmul(
    a: &TensorView,
    b: &TensorView,
    bias: Option<TensorView>,
    trans_a: bool,
    trans_b: bool,
    act: Option<Unary>,
    out: &mut TensorViewMut,
) -> KResult {
    if a.dtype != DType::F32 || bias.is_some_and(|b| b.dtype != DType::F32) {
        return matmul_reference(a, b, bias, trans_a, trans_b, act, out);
    }
    let a_shape: Vec<usize> = if a.shape.len() == 1 { vec![1, a.shape[0]] } else { a.shape.to_vec() };
    let b_shape: Vec<usize> = if b.shape.len() == 1 { vec![b.shape[0], 1] } else { b.shape.to_vec() };
    let (a_batch, m, k, _) = as_2d(&a_shape, trans_a);
    let (b_batch, _, n, _) = as_2d(&b_shape, trans_b);
    let batch = crate::shape::broadcast(&a_batch, &b_batch)
        .ok_or_else(|| BackendError::refused("batch dims do not broadcast"))?;
    let offsets = |src_batch: &[usize], mat: usize| batch_offsets(&batch, src_batch, mat);
    let a_off = offsets(&a_batch, m * k);
    let b_off = offsets(&b_batch, k * n);
    let nb = a_off.len();
    if m * n == 0 {
        return Ok(()); // an empty product: nothing to write
    }
    let (a_rows, a_cols) = (a_shape[a_shape.len() - 2], a_shape[a_shape.len() - 1]);
    let (b_rows, b_cols) = (b_shape[b_shape.len() - 2], b_shape[b_shape.len() - 1]);
    let _ = (a_rows, b_rows);
    let am = |off| {
        if trans_a {
            Mat { offset: off, rs: 1, cs: a_cols as isize }
        } else {
            Mat { offset: off, rs: a_cols as isize, cs: 1 }
        }
    };
    let bm = |off| {
        if trans_b {
            Mat { offset: off, rs: 1, cs: b_cols as isize }
        } else {
            Mat { offset: off, rs: b_cols as isize, cs: 1 }
        }
    };
    let ap = a.as_slice::<f32>().as_ptr() as usize;
    let bp = b.as_slice::<f32>().as_ptr() as usize;
    let o = out.as_mut_slice::<f32>();
    let has_bias = if let Some(bias) = bias {
        let bv = bias.as_slice::<f32>();
        if bv.len() != n {
            return refused!("bias of {} elements does not match {n} columns", bv.len());
        }
        for row in o.chunks_mut(n) {
            row.copy_from_slice(bv);
        }
        true
    } else {
        false
    };
    let run = |i: usize, dst: &mut [f32], par: Parallelism| unsafe {
        sgemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            n as isize,
            ap as *const f32,
            am(a_off[i]),
            bp as *const f32,
            bm(b_off[i]),
            has_bias,
            1.0,
            par,
        )
    };
    if nb > 1 && m * n * k < 128 * 128 * 128 {
        // Many small products (attention heads): one thread per product.
        o.par_chunks_mut(m * n).enumerate().for_each(|(i, dst)| run(i, dst, Parallelism::None));
    } else {
        for (i, dst) in o.chunks_mut(m * n).enumerate() {
            run(i, dst, parallelism(m, n, k));
        }
    }
    if let Some(u) = act {
        if u != Unary::GeluTanh {
            return refused!("fused activation {u:?} is not implemented");
        }
        o.par_chunks_mut(4096).for_each(|c| c.iter_mut().for_each(|v| *v = gelu_tanh(*v)));
    }
    Ok(())
}

/// Element offset of each output batch's matrix in a source whose batch dims are `src_batch`
/// (numpy-broadcast against `batch`; a broadcast dim has stride 0), matrices of `mat` elements.
fn batch_offsets(batch: &[usize], src_batch: &[usize], mat: usize) -> Vec<usize> {
    let nb: usize = batch.iter().product();
    let mut padded = vec![1; batch.len() - src_batch.len()];
    padded.extend_from_slice(src_batch);
    let st = strides(&padded);
    let mut v = Vec::with_capacity(nb);
    let mut idx = vec![0usize; batch.len()];
    for _ in 0..nb {
        let o: usize = (0..batch.len()).map(|d| if padded[d] == 1 { 0 } else { idx[d] * st[d] }).sum();
        v.push(o * mat);
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < batch[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    v
}

/// Plain-loop MatMul for the element types off the f32 GEMM path: floats in f64, integers in
/// wrapping i64 (exact), with numpy batch broadcasting, 1-D operands, transposed operands, a
/// bias along the last dim and (floats) an activation: everything the f32 path does.
fn matmul_reference(
    a: &TensorView,
    b: &TensorView,
    bias: Option<TensorView>,
    trans_a: bool,
    trans_b: bool,
    act: Option<Unary>,
    out: &mut TensorViewMut,
) -> KResult {
    let a_shape: Vec<usize> = if a.shape.len() == 1 { vec![1, a.shape[0]] } else { a.shape.to_vec() };
    let b_shape: Vec<usize> = if b.shape.len() == 1 { vec![b.shape[0], 1] } else { b.shape.to_vec() };
    let (a_batch, m, k, _) = as_2d(&a_shape, trans_a);
    let (b_batch, _, n, _) = as_2d(&b_shape, trans_b);
    let batch = crate::shape::broadcast(&a_batch, &b_batch)
        .ok_or_else(|| BackendError::refused("batch dims do not broadcast"))?;
    let (a_off, b_off) = (batch_offsets(&batch, &a_batch, m * k), batch_offsets(&batch, &b_batch, k * n));
    if m * n == 0 {
        return Ok(());
    }
    // Element (r, p) of A' and (p, c) of B', whichever way each is stored.
    let ai = |r: usize, p: usize| if trans_a { p * m + r } else { r * k + p };
    let bi = |p: usize, c: usize| if trans_b { c * k + p } else { p * n + c };
    if bias.is_some_and(|t| t.numel() != n) {
        return refused!("bias does not match {n} columns");
    }
    if a.dtype.is_float() {
        let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
        let bv = bias.map(|t| t.to_f64_vec());
        let mut o = vec![0f64; a_off.len() * m * n];
        for (i, dst) in o.chunks_mut(m * n).enumerate() {
            let (xa, yb) = (&x[a_off[i]..], &y[b_off[i]..]);
            for r in 0..m {
                for c in 0..n {
                    let v =
                        (0..k).map(|p| xa[ai(r, p)] * yb[bi(p, c)]).sum::<f64>() + bv.as_ref().map_or(0.0, |b| b[c]);
                    dst[r * n + c] = act.map_or(v, |u| super::elementwise::unary_f64(u, v));
                }
            }
        }
        super::write_f64(&o, out);
        return Ok(());
    }
    if let Some(u) = act {
        return refused!("the activation {u:?} needs float operands, not {}", a.dtype);
    }
    let need = || BackendError::refused("MatMul needs numbers");
    let (x, y) = (a.to_i64_vec().ok_or_else(need)?, b.to_i64_vec().ok_or_else(need)?);
    let bv = bias.map(|t| t.to_i64_vec().ok_or_else(need)).transpose()?;
    let mut o = vec![0i64; a_off.len() * m * n];
    for (i, dst) in o.chunks_mut(m * n).enumerate() {
        let (xa, yb) = (&x[a_off[i]..], &y[b_off[i]..]);
        for r in 0..m {
            for c in 0..n {
                let s = (0..k).fold(0i64, |s, p| s.wrapping_add(xa[ai(r, p)].wrapping_mul(yb[bi(p, c)])));
                dst[r * n + c] = s.wrapping_add(bv.as_ref().map_or(0, |b| b[c]));
            }
        }
    }
    cast_into(&Tensor::from_vec(out.shape, o).view(), out);
    Ok(())
}

/// Gemm for the element types off the f32 GEMM path, computed in f64.
#[allow(clippy::too_many_arguments)]
fn gemm_reference(
    alpha: f32,
    beta: f32,
    trans_a: bool,
    trans_b: bool,
    a: &TensorView,
    b: &TensorView,
    c: Option<TensorView>,
    out: &mut TensorViewMut,
) -> KResult {
    let (m, n) = (out.shape[0], out.shape[1]);
    let k = if trans_a { a.shape[0] } else { a.shape[1] };
    let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
    let at = |i: usize, p: usize| if trans_a { x[p * m + i] } else { x[i * k + p] };
    let bt = |p: usize, j: usize| if trans_b { y[j * k + p] } else { y[p * n + j] };
    let cv = c.map(|c| (c.to_f64_vec(), c.shape.to_vec()));
    let mut o = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut v = alpha as f64 * (0..k).map(|p| at(i, p) * bt(p, j)).sum::<f64>();
            if let Some((cv, cs)) = &cv {
                let (cr, cc) = match cs.len() {
                    0 => (1, 1),
                    1 => (1, cs[0]),
                    _ => (cs[0], cs[1]),
                };
                v += beta as f64 * cv[(i % cr) * cc + (j % cc)];
            }
            o[i * n + j] = v;
        }
    }
    super::write_f64(&o, out);
    Ok(())
}

/// ONNX Gemm: Y = alpha · A' · B' + beta · C.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    alpha: f32,
    beta: f32,
    trans_a: bool,
    trans_b: bool,
    a: &TensorView,
    b: &TensorView,
    c: Option<TensorView>,
    out: &mut TensorViewMut,
) -> KResult {
    if a.dtype != DType::F32 {
        return gemm_reference(alpha, beta, trans_a, trans_b, a, b, c, out);
    }
    let (m, n) = (out.shape[0], out.shape[1]);
    let k = if trans_a { a.shape[0] } else { a.shape[1] };
    let o = out.as_mut_slice::<f32>();
    let accumulate = match c {
        Some(c) if beta != 0.0 => {
            let cv = c.as_slice::<f32>();
            let (cr, cc) = match c.shape.len() {
                0 => (1, 1),
                1 => (1, c.shape[0]),
                _ => (c.shape[0], c.shape[1]),
            };
            for i in 0..m {
                for j in 0..n {
                    o[i * n + j] = beta * cv[(i % cr) * cc + (j % cc)];
                }
            }
            true
        }
        _ => false,
    };
    let (ac, bc) = (a.shape[1] as isize, b.shape[1] as isize);
    let am = if trans_a { Mat { offset: 0, rs: 1, cs: ac } } else { Mat { offset: 0, rs: ac, cs: 1 } };
    let bm = if trans_b { Mat { offset: 0, rs: 1, cs: bc } } else { Mat { offset: 0, rs: bc, cs: 1 } };
    unsafe {
        sgemm(
            m,
            n,
            k,
            o.as_mut_ptr(),
            n as isize,
            a.as_slice::<f32>().as_ptr(),
            am,
            b.as_slice::<f32>().as_ptr(),
            bm,
            accumulate,
            alpha,
            parallelism(m, n, k),
        );
    }
    Ok(())
}

#[cfg(test)]
mod reference_tests {
    use super::*;
    use crate::tensor::Tensor;

    /// The f64 loop agrees with the f32 GEMM for every transpose, bias and GELU combination.
    #[test]
    fn float64_fused_products_match_the_float32_gemm() {
        let mut rng = crate::rng::Rng::new(3);
        let mut rand = |shape: &[usize]| {
            let n = shape.iter().product();
            Tensor::from_vec(shape, (0..n).map(|_| rng.normal() as f32).collect::<Vec<f32>>())
        };
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let a = rand(if ta { &[2, 4, 3] } else { &[2, 3, 4] });
            let b = rand(if tb { &[5, 4] } else { &[4, 5] });
            let bias = rand(&[5]);
            let mut want = Tensor::zeros(DType::F32, &[2, 3, 5]);
            matmul(&a.view(), &b.view(), Some(bias.view()), ta, tb, Some(Unary::GeluTanh), &mut want.view_mut())
                .unwrap();
            let (a64, b64, bias64) = (a.cast(DType::F64), b.cast(DType::F64), bias.cast(DType::F64));
            let mut got = Tensor::zeros(DType::F64, &[2, 3, 5]);
            let act = Some(Unary::GeluTanh);
            matmul(&a64.view(), &b64.view(), Some(bias64.view()), ta, tb, act, &mut got.view_mut()).unwrap();
            for (x, y) in got.to_f64_vec().iter().zip(want.to_f64_vec()) {
                assert!((x - y).abs() < 1e-4, "transA={ta} transB={tb}: {x} vs {y}");
            }
        }
    }
}
