//! The host reference ops: every op on host tensor views, one file per family. [`run`]
//! dispatches a static [`Op`] to them. The CPU backend runs its steps with them, binding folds
//! constants with them, and the CUDA dispatch shares their plans (slices, windows, resize taps).
//! Below `graph` and `backend`: they import the op vocabulary, shapes and tensors only.
//!
//! Kernels take views over tensors whose shapes were fixed at plan time, so they check nothing a
//! planner already checked; what they return as `Err` are data-dependent faults (an index out of
//! range, say), phrased for the node that ran them.

pub mod adasum;
pub mod attention;
pub mod conv;
pub mod elementwise;
pub mod fastmath;
pub mod index;
pub mod loss;
pub mod matmul;
pub mod norm;
pub mod random;
pub mod resize;
pub mod shape;
pub mod shard;

use crate::error::BackendError;
use crate::op::{Op, Unary};
use crate::refused;
use crate::tensor::cast;
use crate::tensor::{DType, Tensor, TensorView, TensorViewMut};

/// Elements below which a kernel stays on one thread (rayon's fork/join costs more).
pub const PAR_MIN: usize = 1 << 14;

pub type KResult = Result<(), BackendError>;

/// A mutable slice that parallel workers write through at disjoint indices (lanes of a
/// softmax, say) where the disjointness is not a contiguous split `par_chunks_mut` could show.
#[derive(Clone, Copy)]
pub struct SharedSlice<T> {
    ptr: *mut T,
    len: usize,
}
unsafe impl<T: Send> Send for SharedSlice<T> {}
unsafe impl<T: Send> Sync for SharedSlice<T> {}
impl<T> SharedSlice<T> {
    pub fn new(s: &mut [T]) -> SharedSlice<T> {
        SharedSlice { ptr: s.as_mut_ptr(), len: s.len() }
    }
    /// # Safety
    /// No other worker writes or reads index `i` while this runs, and the slice outlives it.
    pub unsafe fn write(self, i: usize, v: T) {
        assert!(i < self.len, "SharedSlice index out of bounds");
        *self.ptr.add(i) = v;
    }
}

/// Runs `op` on `inputs` (omitted optional inputs are `None`) into `outputs`, whose shapes and
/// types are the ones inference gave.
pub fn run(op: &Op, inputs: &[Option<TensorView>], outputs: &mut [TensorViewMut]) -> KResult {
    let half_in = inputs.iter().flatten().any(|x| is_half(x.dtype));
    // A half value computed from f32 ones (a fused op that took a cast's place: LayerNorm's
    // output, the loss's gradient) is computed in f32 and rounded once, as the cast did.
    let half_from_f32 =
        outputs.iter().any(|y| is_half(y.dtype)) && inputs.iter().flatten().any(|x| x.dtype == DType::F32);
    if computes(op) && (half_in || half_from_f32) {
        return run_half_in_f32(op, inputs, outputs);
    }
    let x = |i: usize| {
        inputs.get(i).copied().flatten().ok_or_else(|| BackendError::refused(format!("input {i} is missing")))
    };
    match op {
        Op::Unary(u) => elementwise::unary(*u, &x(0)?, &mut outputs[0]),
        Op::UnaryGrad(u) => elementwise::unary_grad(*u, &x(0)?, &x(1)?, &mut outputs[0]),
        Op::Binary(b) if inputs.len() > 2 => {
            let ins: Vec<TensorView> = (0..inputs.len()).map(x).collect::<Result<_, _>>()?;
            elementwise::binary_fold(*b, &ins, &mut outputs[0])
        }
        Op::Binary(b) => elementwise::binary(*b, &x(0)?, &x(1)?, &mut outputs[0]),
        Op::Where => elementwise::where_(&x(0)?, &x(1)?, &x(2)?, &mut outputs[0]),
        Op::Cast { .. } => {
            cast::cast_into(&x(0)?, &mut outputs[0]);
            Ok(())
        }
        Op::Identity | Op::Reshape => {
            outputs[0].bytes.copy_from_slice(x(0)?.bytes);
            Ok(())
        }
        Op::Dropout { ratio, training, seed } => random::dropout(*ratio, *training, *seed, &x(0)?, outputs),
        Op::DropoutGrad { ratio } => random::dropout_grad(*ratio, &x(0)?, &x(1)?, &mut outputs[0]),
        Op::MatMul => matmul::matmul(&x(0)?, &x(1)?, None, false, false, None, &mut outputs[0]),
        Op::Attention { scale, causal, layout } => {
            let ins = (0..layout.operands()).map(x).collect::<Result<Vec<_>, _>>()?;
            attention::forward(*scale, *causal, *layout, &ins, outputs)
        }
        Op::AttentionGrad { scale, causal, layout } => {
            let ins = (0..layout.operands() + 3).map(x).collect::<Result<Vec<_>, _>>()?;
            attention::backward(*scale, *causal, *layout, &ins, outputs)
        }
        Op::Swiglu => elementwise::swiglu(&x(0)?, &x(1)?, &mut outputs[0]),
        Op::SwigluGrad => elementwise::swiglu_grad(&x(0)?, &x(1)?, &x(2)?, outputs),
        Op::Rotary | Op::RotaryGrad => {
            elementwise::rotary(matches!(op, Op::RotaryGrad), &x(0)?, &x(1)?, &x(2)?, &mut outputs[0])
        }
        Op::FusedMatMul { trans_a, trans_b, activation } => {
            let (y, pre) = match outputs {
                [y, pre] => (y, Some(pre)),
                [y, ..] => (y, None),
                [] => return refused!("FusedMatMul has no output"),
            };
            let bias = inputs.get(2).copied().flatten();
            matmul::matmul_activation(&x(0)?, &x(1)?, bias, *trans_a, *trans_b, *activation, y, pre)
        }
        Op::MatMulUnaryGrad { trans_a, trans_b, activation } => {
            matmul::matmul(&x(0)?, &x(1)?, None, *trans_a, *trans_b, None, &mut outputs[0])?;
            elementwise::unary_grad_in_place(*activation, &x(2)?, &mut outputs[0])
        }
        Op::Gemm { alpha, beta, trans_a, trans_b } => matmul::gemm(
            *alpha,
            *beta,
            *trans_a,
            *trans_b,
            &x(0)?,
            &x(1)?,
            inputs.get(2).copied().flatten(),
            &mut outputs[0],
        ),
        Op::Softmax { axis } => norm::softmax(*axis, false, &x(0)?, &mut outputs[0]),
        Op::LogSoftmax { axis } => norm::softmax(*axis, true, &x(0)?, &mut outputs[0]),
        Op::SoftmaxGrad { axis } => norm::softmax_grad(*axis, false, &x(0)?, &x(1)?, &mut outputs[0]),
        Op::LogSoftmaxGrad { axis } => norm::softmax_grad(*axis, true, &x(0)?, &x(1)?, &mut outputs[0]),
        Op::LayerNorm { axis, epsilon, rms } => {
            norm::layer_norm(*axis, *epsilon, *rms, &x(0)?, &x(1)?, inputs.get(2).copied().flatten(), outputs)
        }
        Op::ResidualLayerNorm { axis, epsilon, rms } => {
            let bias = inputs.get(3).copied().flatten();
            norm::residual_layer_norm(*axis, *epsilon, *rms, &x(0)?, &x(1)?, &x(2)?, bias, outputs)
        }
        Op::LayerNormGrad { axis, rms } => {
            let dx_in = inputs.get(5).copied().flatten();
            norm::layer_norm_grad(*axis, *rms, &x(0)?, &x(1)?, &x(2)?, &x(3)?, &x(4)?, dx_in, outputs)
        }
        Op::Transpose { perm } => shape::transpose(perm.as_deref().unwrap_or(&[]), &x(0)?, &mut outputs[0]),
        Op::Concat { axis } => {
            let ins: Vec<TensorView> = inputs.iter().flatten().copied().collect();
            shape::concat(*axis as usize, &ins, &mut outputs[0])
        }
        Op::Split { axis, .. } => shape::split(*axis as usize, &x(0)?, outputs),
        Op::Slice { starts, ends, axes, steps } => shape::slice(starts, ends, axes, steps, &x(0)?, &mut outputs[0]),
        Op::SliceGrad { starts, ends, axes, steps, .. } => {
            shape::slice_grad(starts, ends, axes, steps, &x(0)?, &mut outputs[0])
        }
        Op::Gather { axis, .. } => shape::gather(*axis as usize, &x(0)?, &x(1)?, &mut outputs[0]),
        Op::GatherGrad { axis, .. } => shape::gather_grad(*axis as usize, &x(0)?, &x(1)?, &mut outputs[0]),
        Op::ArgExtreme { max, axis, select_last_index, .. } => {
            index::arg_extreme(*max, *select_last_index, *axis as usize, &x(0)?, &mut outputs[0])
        }
        Op::TopKIndices { axis, largest, .. } => {
            index::top_k_indices(*largest, *axis as usize, &x(0)?, &mut outputs[0])
        }
        Op::GatherND { batch_dims } => index::gather_nd(*batch_dims, &x(0)?, &x(1)?, &mut outputs[0]),
        Op::GatherNDGrad { batch_dims, .. } => index::gather_nd_grad(*batch_dims, &x(0)?, &x(1)?, &mut outputs[0]),
        Op::ScatterElements { axis, reduction } => {
            index::scatter_elements(*reduction, *axis as usize, &x(0)?, &x(1)?, &x(2)?, &mut outputs[0])
        }
        Op::ScatterND { reduction } => index::scatter_nd(*reduction, &x(0)?, &x(1)?, &x(2)?, &mut outputs[0]),
        Op::GatherElements { axis } => index::gather_elements(*axis as usize, &x(0)?, &x(1)?, &mut outputs[0]),
        Op::GatherElementsGrad { axis, .. } => {
            index::gather_elements_grad(*axis as usize, &x(0)?, &x(1)?, &mut outputs[0])
        }
        Op::Expand => shape::expand(&x(0)?, &mut outputs[0]),
        Op::CumSum { axis, exclusive, reverse } => {
            shape::cumsum(*axis as usize, *exclusive, *reverse, &x(0)?, &mut outputs[0])
        }
        Op::Pad { mode, pads, value } => shape::pad(*mode, pads, *value, &x(0)?, &mut outputs[0]),
        Op::PadGrad { mode, pads, .. } => shape::pad_grad(*mode, pads, &x(0)?, &mut outputs[0]),
        Op::Trilu { upper, k } => shape::trilu(*upper, *k, &x(0)?, &mut outputs[0]),
        Op::ReduceOp { kind, axes, .. } => {
            shape::reduce(*kind, axes.as_deref().unwrap_or(&[]), &x(0)?, &mut outputs[0])
        }
        Op::ReduceSumTo { .. } => shape::reduce_sum_to(&x(0)?, &mut outputs[0]),
        Op::NegativeLogLikelihoodLoss { reduction, ignore_index } => {
            let w = inputs.get(2).copied().flatten();
            loss::negative_log_likelihood(*reduction, *ignore_index, &x(0)?, &x(1)?, w, &mut outputs[0])
        }
        Op::NegativeLogLikelihoodLossGrad { reduction, ignore_index, .. } => {
            let w = inputs.get(2).copied().flatten();
            loss::negative_log_likelihood_grad(*reduction, *ignore_index, &x(0)?, &x(1)?, w, &mut outputs[0])
        }
        Op::SoftmaxCrossEntropyLoss { reduction, ignore_index } => loss::softmax_cross_entropy(
            *reduction,
            *ignore_index,
            &x(0)?,
            &x(1)?,
            inputs.get(2).copied().flatten(),
            outputs,
        ),
        Op::SoftmaxCrossEntropyLossGrad { reduction, ignore_index } => loss::softmax_cross_entropy_grad(
            *reduction,
            *ignore_index,
            &x(0)?,
            &x(1)?,
            &x(2)?,
            inputs.get(3).copied().flatten(),
            &mut outputs[0],
        ),
        Op::SoftmaxCrossEntropyLse { reduction, ignore_index } => loss::softmax_cross_entropy_lse(
            *reduction,
            *ignore_index,
            &x(0)?,
            &x(1)?,
            inputs.get(2).copied().flatten(),
            outputs,
        ),
        Op::SoftmaxCrossEntropyLseGrad { reduction, ignore_index } => loss::softmax_cross_entropy_lse_grad(
            *reduction,
            *ignore_index,
            &x(0)?,
            &x(1)?,
            &x(2)?,
            &x(3)?,
            inputs.get(4).copied().flatten(),
            &mut outputs[0],
        ),
        Op::Conv { window, group } => {
            conv::conv(window, *group, &x(0)?, &x(1)?, inputs.get(2).copied().flatten(), &mut outputs[0])
        }
        Op::ConvGrad { window, group } => conv::conv_grad(window, *group, &x(0)?, &x(1)?, &x(2)?, outputs),
        Op::ConvTranspose { window, group, .. } => {
            conv::conv_transpose(window, *group, &x(0)?, &x(1)?, inputs.get(2).copied().flatten(), &mut outputs[0])
        }
        Op::ConvTransposeGrad { window, group } => {
            conv::conv_transpose_grad(window, *group, &x(0)?, &x(1)?, &x(2)?, outputs)
        }
        Op::Resize(r) => {
            let taps = resize::taps(r, x(0)?.shape, outputs[0].shape)?;
            resize::resample(&taps, r.extrapolation_value, &x(0)?, &mut outputs[0])
        }
        Op::ResizeGrad { resize: r, input_shape } => {
            let taps = resize::transposed(&resize::taps(r, input_shape, x(0)?.shape)?, input_shape);
            resize::resample(&taps, 0.0, &x(0)?, &mut outputs[0])
        }
        Op::Pool { kind, window } => conv::pool(*kind, window, &x(0)?, outputs),
        Op::PoolGrad { kind, window } => conv::pool_grad(*kind, window, &x(0)?, &x(1)?, &mut outputs[0]),
        Op::GlobalAveragePool => conv::global_average_pool(&x(0)?, &mut outputs[0]),
        Op::BatchNorm { epsilon, momentum, training } => {
            conv::batch_norm(*epsilon, *momentum, *training, &x(0)?, &x(1)?, &x(2)?, &x(3)?, &x(4)?, outputs)
        }
        Op::BatchNormGrad { epsilon } => conv::batch_norm_grad(*epsilon, &x(0)?, &x(1)?, &x(2)?, outputs),
        Op::BatchNormRelu { epsilon, momentum } => {
            conv::batch_norm(*epsilon, *momentum, true, &x(0)?, &x(1)?, &x(2)?, &x(3)?, &x(4)?, outputs)?;
            elementwise::unary_in_place(Unary::Relu, &mut outputs[0])
        }
        Op::BatchNormReluGrad { epsilon } => {
            // dY = dZ · ReLU'(Z), as the ReLU's gradient computed it unfused.
            let mut dy = x(0)?.to_tensor();
            elementwise::unary_grad_in_place(Unary::Relu, &x(3)?, &mut dy.view_mut())?;
            conv::batch_norm_grad(*epsilon, &dy.view(), &x(1)?, &x(2)?, outputs)
        }
        Op::ShardGather { start } => shard::gather(*start, &x(0)?, &x(1)?, &mut outputs[0]),
        Op::ShardGatherGrad { start, .. } => shard::gather_grad(*start, &x(0)?, &x(1)?, &mut outputs[0]),
        Op::VocabShardCrossEntropy { start, ignore_index, .. } => {
            shard::cross_entropy(*start, *ignore_index, &x(0)?, &x(1)?, &x(2)?, outputs)
        }
        Op::VocabShardCrossEntropyGrad { start, ignore_index } => {
            shard::cross_entropy_grad(*start, *ignore_index, [&x(0)?, &x(1)?, &x(2)?, &x(3)?, &x(4)?], &mut outputs[0])
        }
        Op::VocabParallelLoss { reduction, ignore_index } => {
            shard::loss(*reduction, *ignore_index, &x(0)?, &x(1)?, &x(2)?, &mut outputs[0])
        }
        Op::VocabParallelLossGrad { reduction, ignore_index } => {
            shard::loss_grad(*reduction, *ignore_index, &x(0)?, &x(1)?, &x(2)?, outputs)
        }
        // The executor runs these: a copy here, the collective around it.
        Op::AllReduce { .. } | Op::TensorParallelCopy => {
            outputs[0].bytes.copy_from_slice(x(0)?.bytes);
            Ok(())
        }
        Op::Constant { .. }
        | Op::Shape { .. }
        | Op::ConstantOfShape { .. }
        | Op::Range
        | Op::Squeeze { .. }
        | Op::Unsqueeze { .. }
        | Op::Flatten { .. }
        | Op::CastLike
        | Op::Sequence(_)
        | Op::Tile
        | Op::Sum { .. }
        | Op::OneHot { .. }
        | Op::Normalization { .. }
        | Op::Recurrent(_)
        | Op::TopK { .. }
        | Op::Einsum { .. }
        | Op::Size
        | Op::ReshapeAllowZero => refused!("{} must be resolved when the graph is planned", op.onnx_name().0),
    }
}

fn is_half(d: DType) -> bool {
    matches!(d, DType::F16 | DType::BF16)
}

/// Ops that compute with their elements, as opposed to moving bytes (which serve every type).
fn computes(op: &Op) -> bool {
    !matches!(
        op,
        Op::Cast { .. }
            | Op::Identity
            | Op::Reshape
            | Op::Transpose { .. }
            | Op::Concat { .. }
            | Op::Split { .. }
            | Op::Slice { .. }
            | Op::Gather { .. }
            | Op::GatherElements { .. }
            | Op::GatherND { .. }
            | Op::Pad { .. }
            | Op::Expand
            | Op::Trilu { .. }
            | Op::Where
    )
}

/// f16 and bf16 are storage types: their ops compute in f32. Half inputs are widened, the op
/// runs in f32, and half outputs are rounded back (other inputs and outputs, such as labels,
/// masks and indices, pass as they are).
fn run_half_in_f32(op: &Op, inputs: &[Option<TensorView>], outputs: &mut [TensorViewMut]) -> KResult {
    let widen = |t: &TensorView| is_half(t.dtype).then(|| t.to_tensor().cast(DType::F32));
    let wide: Vec<Option<Tensor>> = inputs.iter().map(|x| x.as_ref().and_then(widen)).collect();
    let views: Vec<Option<TensorView>> =
        inputs.iter().zip(&wide).map(|(x, w)| w.as_ref().map(|w| w.view()).or(*x)).collect();
    let mut outs: Vec<Tensor> =
        outputs.iter().map(|y| Tensor::zeros(if is_half(y.dtype) { DType::F32 } else { y.dtype }, y.shape)).collect();
    run_on_views(op, &views, &mut outs)?;
    for (y, t) in outputs.iter_mut().zip(&outs) {
        cast::cast_into(&t.view(), y);
    }
    Ok(())
}

fn run_on_views(op: &Op, inputs: &[Option<TensorView>], outputs: &mut [Tensor]) -> KResult {
    let mut outs: Vec<TensorViewMut> = outputs.iter_mut().map(|t| t.view_mut()).collect();
    run(op, inputs, &mut outs)
}

/// `run` over owned tensors (constant folding and tests).
pub fn run_on_tensors(op: &Op, inputs: &[Option<&Tensor>], outputs: &mut [Tensor]) -> KResult {
    let views: Vec<Option<TensorView>> = inputs.iter().map(|t| t.map(|t| t.view())).collect();
    let mut outs: Vec<TensorViewMut> = outputs.iter_mut().map(|t| t.view_mut()).collect();
    run(op, &views, &mut outs)
}

/// Writes values computed in f64 into `y`, converted to its element type as `Cast` converts.
/// dX = zeros, then dX[target] += dY[i] for each element i of dY that has a target, in order:
/// the gradient of every op that reads elements by index (GatherElements, GatherND, Pad). f32 and
/// f64 add in their own type; other element types (none reaches here in a training graph, halves
/// arrive widened) add in f64.
pub fn scatter_add(dy: &TensorView, targets: impl Iterator<Item = Option<usize>>, dx: &mut TensorViewMut) {
    fn add<T: Copy + Default + std::ops::AddAssign>(
        dy: &[T],
        targets: impl Iterator<Item = Option<usize>>,
        dx: &mut [T],
    ) {
        dx.fill(T::default());
        for (&g, at) in dy.iter().zip(targets) {
            if let Some(at) = at {
                dx[at] += g;
            }
        }
    }
    match dy.dtype {
        DType::F32 => add(dy.as_slice::<f32>(), targets, dx.as_mut_slice::<f32>()),
        DType::F64 => add(dy.as_slice::<f64>(), targets, dx.as_mut_slice::<f64>()),
        _ => {
            let mut wide = vec![0f64; dx.numel()];
            add(&dy.to_f64_vec(), targets, &mut wide);
            write_f64(&wide, dx);
        }
    }
}

pub fn write_f64(vals: &[f64], y: &mut TensorViewMut) {
    match y.dtype {
        DType::F32 => y.as_mut_slice::<f32>().iter_mut().zip(vals).for_each(|(o, v)| *o = *v as f32),
        DType::F64 => y.as_mut_slice::<f64>().copy_from_slice(vals),
        _ => cast::cast_into(&Tensor::from_vec(y.shape, vals.to_vec()).view(), y),
    }
}

/// Fills `out` with a one-element tensor's value.
pub fn broadcast_fill(value: &Tensor, out: &mut Tensor) {
    let b = value.bytes().to_vec();
    for chunk in out.bytes_mut().chunks_mut(b.len().max(1)) {
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// ONNX Range over scalar start, limit, delta of one type.
pub fn range(start: &Tensor, limit: &Tensor, delta: &Tensor) -> Result<Tensor, String> {
    if [start, limit, delta].iter().any(|t| t.numel() != 1) {
        let shapes = [start, limit, delta].map(|t| t.shape().to_vec());
        return Err(format!("Range's start, limit and delta must be scalars, not {shapes:?}"));
    }
    let (s, l, d) = (start.to_f64_vec()[0], limit.to_f64_vec()[0], delta.to_f64_vec()[0]);
    if d == 0.0 {
        return Err("Range delta is 0".into());
    }
    let count = ((l - s) / d).ceil().max(0.0);
    // A range is an index list: past 2^28 entries (2 GiB built in f64) it is a fault, not a
    // sequence to build.
    if count.is_nan() || count > (1u64 << 28) as f64 {
        return Err(format!("Range from {s} to {l} by {d} would hold {count} values"));
    }
    let n = count as usize;
    let vals: Vec<f64> = (0..n).map(|i| s + i as f64 * d).collect();
    let t = Tensor::from_vec(&[n], vals);
    Ok(t.cast(start.dtype()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_refuses_operands_that_are_not_scalars_and_counts_past_2_28() {
        let scalar = |v: f32| Tensor::from_vec(&[], vec![v]);
        let empty = Tensor::from_vec(&[0], Vec::<f32>::new());
        assert_eq!(range(&scalar(0.0), &scalar(5.0), &scalar(2.0)).unwrap().to_f64_vec(), [0.0, 2.0, 4.0]);
        let err = range(&empty, &scalar(5.0), &scalar(1.0)).unwrap_err();
        assert!(err.contains("must be scalars"), "{err}");
        let err = range(&scalar(0.0), &scalar(1e12), &scalar(1.0)).unwrap_err();
        assert!(err.contains("would hold 999999995904 values"), "{err}"); // 1e12 in f32
        assert!(range(&scalar(0.0), &scalar(f32::INFINITY), &scalar(1.0)).is_err());
    }
}
