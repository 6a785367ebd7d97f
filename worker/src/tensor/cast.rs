//! Element type conversion (ONNX `Cast`; also how f16/bf16 storage meets f32 compute).

use crate::tensor::{DType, TensorView, TensorViewMut};
use half::{bf16, f16};
use num_traits::{NumCast, ToPrimitive};

/// Reads every element of `src` as `T` (floats to integers truncate toward zero, as ONNX says).
fn read<T: NumCast + Copy + Default>(src: &TensorView) -> Vec<T> {
    macro_rules! conv {
        ($t:ty) => {
            src.as_slice::<$t>().iter().map(|x| T::from(*x).unwrap_or_default()).collect()
        };
    }
    match src.dtype {
        DType::F32 => conv!(f32),
        DType::F64 => conv!(f64),
        DType::F16 => {
            src.as_slice::<f16>().iter().map(|x| T::from(<f32 as From<_>>::from(*x)).unwrap_or_default()).collect()
        }
        DType::BF16 => {
            src.as_slice::<bf16>().iter().map(|x| T::from(<f32 as From<_>>::from(*x)).unwrap_or_default()).collect()
        }
        DType::I64 => conv!(i64),
        DType::I32 => conv!(i32),
        DType::I16 => conv!(i16),
        DType::I8 => conv!(i8),
        DType::U8 | DType::Bool => conv!(u8),
        DType::U16 => conv!(u16),
        DType::U32 => conv!(u32),
        DType::U64 => conv!(u64),
    }
}

/// Every element of `src` as f32: the half types exactly, the others through f64.
fn read_f32(src: &TensorView) -> Vec<f32> {
    match src.dtype {
        DType::F32 => src.as_slice::<f32>().to_vec(),
        DType::F16 => src.as_slice::<f16>().iter().map(|x| <f32 as From<_>>::from(*x)).collect(),
        DType::BF16 => src.as_slice::<bf16>().iter().map(|x| <f32 as From<_>>::from(*x)).collect(),
        _ => read::<f64>(src).into_iter().map(|x| x as f32).collect(),
    }
}

/// Converts `src` into `dst` (same element count).
pub fn cast_into(src: &TensorView, dst: &mut TensorViewMut) {
    if src.dtype == dst.dtype {
        dst.bytes.copy_from_slice(src.bytes);
        return;
    }
    match dst.dtype {
        DType::F32 => dst.as_mut_slice::<f32>().copy_from_slice(&read_f32(src)),
        DType::F64 => dst.as_mut_slice::<f64>().copy_from_slice(&read::<f64>(src)),
        // The half types are rounded from f32 (to nearest even; from f64 and wide integers that
        // is two roundings, as PyTorch's conversions and the CUDA kernels do): half's own
        // bf16::from_f64 drops the low 32 bits of the f64 before rounding, and its f16::from_f64
        // rounds once or twice depending on the CPU's features.
        DType::F16 => {
            let v = read_f32(src);
            for (d, s) in dst.as_mut_slice::<f16>().iter_mut().zip(v) {
                *d = f16::from_f32(s);
            }
        }
        DType::BF16 => {
            let v = read_f32(src);
            for (d, s) in dst.as_mut_slice::<bf16>().iter_mut().zip(v) {
                *d = bf16::from_f32(s);
            }
        }
        DType::Bool => {
            let v = read::<f64>(src);
            for (d, s) in dst.as_mut_slice::<u8>().iter_mut().zip(v) {
                *d = (s != 0.0) as u8;
            }
        }
        _ => {
            // Integers: through f64 for floats (truncating), through i64 otherwise, so large
            // int64 values survive exactly.
            let v: Vec<i64> = if src.dtype.is_float() {
                read::<f64>(src).into_iter().map(|x| x.trunc().to_i64().unwrap_or(0)).collect()
            } else {
                read::<i64>(src)
            };
            macro_rules! put {
                ($t:ty) => {
                    for (d, s) in dst.as_mut_slice::<$t>().iter_mut().zip(v) {
                        *d = s as $t;
                    }
                };
            }
            match dst.dtype {
                DType::I64 => put!(i64),
                DType::I32 => put!(i32),
                DType::I16 => put!(i16),
                DType::I8 => put!(i8),
                DType::U8 => put!(u8),
                DType::U16 => put!(u16),
                DType::U32 => put!(u32),
                DType::U64 => put!(u64),
                _ => unreachable!("float and bool destinations are handled above"),
            }
        }
    }
}
