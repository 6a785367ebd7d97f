//! Host tensors: an element type, a static shape and 8-byte aligned storage.
//!
//! Every backend uploads from and downloads to this type; the CPU backend's kernels work on
//! [`TensorView`]s that borrow either a `Tensor` or a slice of the execution arena.

pub mod cast;

use half::{bf16, f16};
use std::fmt;

/// Element types, numbered as ONNX's `TensorProto.DataType`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    F32,
    U8,
    I8,
    U16,
    I16,
    I32,
    I64,
    Bool,
    F16,
    F64,
    U32,
    U64,
    BF16,
}

impl DType {
    pub fn from_onnx(code: i32) -> Option<DType> {
        Some(match code {
            1 => DType::F32,
            2 => DType::U8,
            3 => DType::I8,
            4 => DType::U16,
            5 => DType::I16,
            6 => DType::I32,
            7 => DType::I64,
            9 => DType::Bool,
            10 => DType::F16,
            11 => DType::F64,
            12 => DType::U32,
            13 => DType::U64,
            16 => DType::BF16,
            _ => return None,
        })
    }

    pub fn onnx_code(self) -> i32 {
        match self {
            DType::F32 => 1,
            DType::U8 => 2,
            DType::I8 => 3,
            DType::U16 => 4,
            DType::I16 => 5,
            DType::I32 => 6,
            DType::I64 => 7,
            DType::Bool => 9,
            DType::F16 => 10,
            DType::F64 => 11,
            DType::U32 => 12,
            DType::U64 => 13,
            DType::BF16 => 16,
        }
    }

    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 | DType::Bool => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::U16 => "uint16",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::Bool => "bool",
            DType::F16 => "float16",
            DType::F64 => "float64",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::BF16 => "bfloat16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Rust element types that may live in a tensor.
pub trait Element: bytemuck::Pod + Default + Send + Sync + 'static {
    const DTYPE: DType;
}
macro_rules! element {
    ($($t:ty => $d:ident),*) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(f32 => F32, f64 => F64, i64 => I64, i32 => I32, u8 => U8, i8 => I8, u16 => U16,
         i16 => I16, u32 => U32, u64 => U64, f16 => F16, bf16 => BF16);

/// Panics when a tensor of `dtype` is viewed as `T`: a bug in the caller, never something a
/// user's input can reach (types are checked at plan time). Bool is stored as u8.
#[inline]
fn check_type<T: Element>(dtype: DType) {
    assert!(
        T::DTYPE == dtype || (T::DTYPE == DType::U8 && dtype == DType::Bool),
        "a {dtype} tensor viewed as {}",
        T::DTYPE
    );
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// The elements of `shape`, or None where their count overflows (a shape read from a file or
/// computed from one, before it is trusted).
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// Row-major strides of a shape, in elements.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// A host tensor. Storage is a `Vec<u64>` so every element type can be viewed in place.
#[derive(Clone, PartialEq)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    words: Vec<u64>,
}

impl Tensor {
    pub fn zeros(dtype: DType, shape: &[usize]) -> Tensor {
        let bytes = numel(shape) * dtype.size();
        Tensor { dtype, shape: shape.to_vec(), words: vec![0; bytes.div_ceil(8)] }
    }

    pub fn from_vec<T: Element>(shape: &[usize], data: Vec<T>) -> Tensor {
        assert_eq!(numel(shape), data.len(), "tensor data does not fill shape {shape:?}");
        let mut t = Tensor::zeros(T::DTYPE, shape);
        t.as_mut_slice::<T>().copy_from_slice(&data);
        t
    }

    pub fn scalar<T: Element>(v: T) -> Tensor {
        Tensor::from_vec(&[], vec![v])
    }

    /// Builds a tensor from little-endian bytes (ONNX `raw_data`); `None` when the length is wrong.
    pub fn from_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Option<Tensor> {
        let mut t = Tensor::zeros(dtype, shape);
        if bytes.len() != t.byte_len() {
            return None;
        }
        t.bytes_mut().copy_from_slice(bytes);
        Some(t)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }
    pub fn byte_len(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    pub fn bytes(&self) -> &[u8] {
        let n = self.byte_len();
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..n]
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.byte_len();
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..n]
    }

    /// The elements as `T` (see `check_type`).
    pub fn as_slice<T: Element>(&self) -> &[T] {
        check_type::<T>(self.dtype);
        bytemuck::cast_slice(self.bytes())
    }
    pub fn as_mut_slice<T: Element>(&mut self) -> &mut [T] {
        check_type::<T>(self.dtype);
        bytemuck::cast_slice_mut(self.bytes_mut())
    }

    /// Same elements, another shape with the same element count.
    pub fn reshaped(mut self, shape: &[usize]) -> Tensor {
        assert_eq!(numel(shape), self.numel());
        self.shape = shape.to_vec();
        self
    }

    pub fn view(&self) -> TensorView<'_> {
        TensorView { dtype: self.dtype, shape: &self.shape, bytes: self.bytes() }
    }
    pub fn view_mut(&mut self) -> TensorViewMut<'_> {
        let n = self.byte_len();
        TensorViewMut {
            dtype: self.dtype,
            shape: &self.shape,
            bytes: &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..n],
        }
    }

    /// Every element converted to f64 (for tests, reports and integer shape operands).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        self.view().to_f64_vec()
    }

    /// Integer elements as i64 (shape operands such as Reshape's `shape`).
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        self.view().to_i64_vec()
    }

    /// The first NaN or infinity of a floating-point tensor, with its index; `None` for a finite
    /// one and for other element types.
    pub fn first_non_finite(&self) -> Option<(usize, f64)> {
        fn first<T: Element + Into<f64>>(t: &Tensor, finite: fn(&T) -> bool) -> Option<(usize, f64)> {
            t.as_slice::<T>().iter().position(|v| !finite(v)).map(|i| (i, t.as_slice::<T>()[i].into()))
        }
        match self.dtype {
            DType::F32 => first::<f32>(self, |v| v.is_finite()),
            DType::F64 => first::<f64>(self, |v| v.is_finite()),
            DType::F16 => first::<f16>(self, |v| v.is_finite()),
            DType::BF16 => first::<bf16>(self, |v| v.is_finite()),
            _ => None,
        }
    }

    /// Converts every element to another type (ONNX `Cast` semantics: floats to ints truncate).
    pub fn cast(&self, to: DType) -> Tensor {
        let mut out = Tensor::zeros(to, &self.shape);
        cast::cast_into(&self.view(), &mut out.view_mut());
        out
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = self.to_f64_vec();
        let head: Vec<f64> = v.iter().take(8).copied().collect();
        write!(f, "Tensor<{}>{:?} {:?}{}", self.dtype, self.shape, head, if v.len() > 8 { "…" } else { "" })
    }
}

/// A borrowed tensor: element type, shape and bytes (8-byte aligned).
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

pub struct TensorViewMut<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a mut [u8],
}

impl<'a> TensorView<'a> {
    pub fn numel(&self) -> usize {
        numel(self.shape)
    }
    pub fn as_slice<T: Element>(&self) -> &'a [T] {
        check_type::<T>(self.dtype);
        bytemuck::cast_slice(self.bytes)
    }
    pub fn to_tensor(&self) -> Tensor {
        Tensor::from_bytes(self.dtype, self.shape, self.bytes).expect("view length matches its shape")
    }
    pub fn to_f64_vec(&self) -> Vec<f64> {
        use num_traits::ToPrimitive;
        macro_rules! conv {
            ($t:ty) => {
                self.as_slice::<$t>().iter().map(|x| x.to_f64().unwrap_or(f64::NAN)).collect()
            };
        }
        match self.dtype {
            DType::F32 => conv!(f32),
            DType::F64 => conv!(f64),
            DType::F16 => conv!(f16),
            DType::BF16 => conv!(bf16),
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
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        Some(match self.dtype {
            DType::I64 => self.as_slice::<i64>().to_vec(),
            DType::I32 => self.as_slice::<i32>().iter().map(|&x| x as i64).collect(),
            DType::I16 => self.as_slice::<i16>().iter().map(|&x| x as i64).collect(),
            DType::I8 => self.as_slice::<i8>().iter().map(|&x| x as i64).collect(),
            DType::U8 | DType::Bool => self.as_slice::<u8>().iter().map(|&x| x as i64).collect(),
            DType::U16 => self.as_slice::<u16>().iter().map(|&x| x as i64).collect(),
            DType::U32 => self.as_slice::<u32>().iter().map(|&x| x as i64).collect(),
            DType::U64 => self.as_slice::<u64>().iter().map(|&x| x as i64).collect(),
            _ => return None,
        })
    }
}

impl<'a> TensorViewMut<'a> {
    pub fn numel(&self) -> usize {
        numel(self.shape)
    }
    pub fn as_mut_slice<T: Element>(&mut self) -> &mut [T] {
        check_type::<T>(self.dtype);
        bytemuck::cast_slice_mut(self.bytes)
    }
    pub fn as_view(&self) -> TensorView<'_> {
        TensorView { dtype: self.dtype, shape: self.shape, bytes: self.bytes }
    }
    /// The same view for a shorter while (to pass on with others in a new slice).
    pub fn reborrow(&mut self) -> TensorViewMut<'_> {
        TensorViewMut { dtype: self.dtype, shape: self.shape, bytes: self.bytes }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_bytes_and_types() {
        let t = Tensor::from_vec(&[2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(t.byte_len(), 24);
        let u = Tensor::from_bytes(DType::F32, &[3, 2], t.bytes()).unwrap();
        assert_eq!(u.as_slice::<f32>(), t.as_slice::<f32>());
        assert!(Tensor::from_bytes(DType::F32, &[3, 3], t.bytes()).is_none());
        assert_eq!(strides(&[2, 3, 4]), vec![12, 4, 1]);
        for code in 0..20 {
            if let Some(d) = DType::from_onnx(code) {
                assert_eq!(d.onnx_code(), code);
            }
        }
    }
}
