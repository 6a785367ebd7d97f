//! `TensorProto` <-> [`Tensor`]: the element layouts ONNX allows (raw little-endian bytes or one
//! typed field per element type) and the checks that keep a damaged file from reaching the
//! engine as a wrongly sized tensor.

use super::proto::tensor_proto::DataLocation;
use super::proto::TensorProto;
use crate::corrupt_err;
use crate::error::Error;
use crate::tensor::{DType, Tensor};
use half::{bf16, f16};
use std::fmt::Write as _;

/// Converts a tensor of a model (an initializer, a `Constant`'s value) or of a sample shard into
/// a host tensor. `origin` names the file it came from. Fails, naming the tensor, on element
/// types the engine does not compute with (strings, complex, 8- and 4-bit floats and ints), on
/// data that does not fill `dims`, and on data still in an external file.
pub fn tensor_from_proto(t: &TensorProto, origin: &str) -> Result<Tensor, Error> {
    let fail = |detail: String| corrupt_err!("{origin}: {}: {detail}", describe(t));
    if t.data_location() == DataLocation::External {
        let location = t.external_data.iter().find(|e| e.key() == "location");
        return Err(fail(format!(
            "its data is in the external file {:?}; read the model with onnx::load_model, which \
             loads external data",
            location.map(|e| e.value()).unwrap_or("")
        )));
    }
    check_payload(t).map_err(&fail)?;
    let code = t.data_type();
    let Some(dtype) = DType::from_onnx(code) else {
        return Err(fail(format!("{} tensors are not supported", data_type_name(code))));
    };
    // check_payload has verified the dims and that the data fills them.
    let shape: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
    if let Some(raw) = &t.raw_data {
        return Tensor::from_bytes(dtype, &shape, raw)
            .ok_or_else(|| fail(format!("raw_data holds {} bytes", raw.len())));
    }
    let mut out = Tensor::zeros(dtype, &shape);
    let bytes = out.bytes_mut();
    // Typed fields hold one value per element (checked above); little-endian like raw_data.
    macro_rules! fill {
        ($values:expr, $conv:expr) => {
            for (dst, &v) in bytes.chunks_exact_mut(dtype.size()).zip($values.iter()) {
                dst.copy_from_slice(&$conv(v).to_le_bytes());
            }
        };
    }
    // int32_data carries the narrow integer types and the bit patterns of the 16-bit floats;
    // `as` keeps the low bits, which is the encoding.
    match dtype {
        DType::F32 => fill!(t.float_data, |v: f32| v),
        DType::F64 => fill!(t.double_data, |v: f64| v),
        DType::I64 => fill!(t.int64_data, |v: i64| v),
        DType::I32 => fill!(t.int32_data, |v: i32| v),
        DType::I16 => fill!(t.int32_data, |v: i32| v as i16),
        DType::I8 => fill!(t.int32_data, |v: i32| v as i8),
        DType::U16 => fill!(t.int32_data, |v: i32| v as u16),
        DType::U8 => fill!(t.int32_data, |v: i32| v as u8),
        DType::Bool => fill!(t.int32_data, |v: i32| u8::from(v != 0)),
        DType::F16 => fill!(t.int32_data, |v: i32| f16::from_bits(v as u16)),
        DType::BF16 => fill!(t.int32_data, |v: i32| bf16::from_bits(v as u16)),
        DType::U64 => fill!(t.uint64_data, |v: u64| v),
        DType::U32 => {
            for (dst, &v) in bytes.chunks_exact_mut(4).zip(&t.uint64_data) {
                let v = u32::try_from(v).map_err(|_| fail(format!("uint64_data value {v} does not fit uint32")))?;
                dst.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
    Ok(out)
}

/// A `TensorProto` holding `t` in `raw_data`, the compact form every ONNX reader accepts.
pub fn tensor_to_proto(name: &str, t: &Tensor) -> TensorProto {
    TensorProto {
        name: Some(name.to_owned()),
        dims: t.shape().iter().map(|&d| d as i64).collect(),
        data_type: Some(t.dtype().onnx_code()),
        raw_data: Some(t.bytes().to_vec()),
        ..Default::default()
    }
}

/// The name of an ONNX element type code, in the words `DType::name` uses ("float32", "int4").
pub fn data_type_name(code: i32) -> &'static str {
    storage(code).map_or("undefined", |s| s.name)
}

/// Checks that a tensor's dims are valid and its data, wherever ONNX put it, holds exactly the
/// elements they call for, for every element type (also those the engine does not compute
/// with). Returns what is wrong, for the caller to prefix with where the tensor sits. Tensors
/// whose data is external are the caller's to skip or resolve first.
pub(crate) fn check_payload(t: &TensorProto) -> Result<(), String> {
    if t.segment.is_some() {
        return Err("is a segment of a larger tensor (TensorProto.segment), which is not \
                    supported"
            .into());
    }
    let code = t.data_type();
    let Some(storage) = storage(code).filter(|_| code != 0) else {
        return Err(if code == 0 {
            "data_type is not set".into()
        } else {
            format!("data_type {code} is not an ONNX element type")
        });
    };
    let numel = element_count(&t.dims)?;
    let need = |what: &str, n: Option<usize>| match n {
        Some(n) => Ok(n),
        None => Err(format!(
            "dims {} of {} need more {what} than this machine can address",
            fmt_dims(&t.dims),
            storage.name
        )),
    };
    if let Some(raw) = &t.raw_data {
        if storage.typed == Typed::String {
            return Err("string elements cannot be in raw_data; ONNX keeps them in string_data".into());
        }
        let need = need("bytes", storage.raw_len(numel))?;
        if raw.len() != need {
            return Err(format!(
                "raw_data holds {} bytes, dims {} of {} need {need}",
                raw.len(),
                fmt_dims(&t.dims),
                storage.name
            ));
        }
        return Ok(());
    }
    let (field, have) = match storage.typed {
        Typed::Float => ("float_data", t.float_data.len()),
        Typed::Int32 => ("int32_data", t.int32_data.len()),
        Typed::String => ("string_data", t.string_data.len()),
        Typed::Int64 => ("int64_data", t.int64_data.len()),
        Typed::Double => ("double_data", t.double_data.len()),
        Typed::Uint64 => ("uint64_data", t.uint64_data.len()),
    };
    let need = need("values", storage.typed_len(numel))?;
    if have != need {
        let holds = if have == 0 {
            format!("has no data (neither raw_data nor {field})")
        } else {
            format!("{field} holds {have} values")
        };
        return Err(format!("{holds}, dims {} of {} need {need}", fmt_dims(&t.dims), storage.name));
    }
    Ok(())
}

/// `tensor "name"`, or `unnamed tensor` (a `Constant`'s value often has no name).
pub(crate) fn describe(t: &TensorProto) -> String {
    match t.name() {
        "" => "unnamed tensor".into(),
        name => format!("tensor {name:?}"),
    }
}

/// Dims as `[64,192]`, the way error messages print shapes.
pub(crate) fn fmt_dims(dims: &[i64]) -> String {
    let mut s = String::from("[");
    for (i, d) in dims.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{d}");
    }
    s.push(']');
    s
}

/// The number of elements `dims` call for; fails on negative dims and on overflow, which only
/// a damaged file produces.
fn element_count(dims: &[i64]) -> Result<usize, String> {
    dims.iter().try_fold(1usize, |n, &d| {
        let d = usize::try_from(d).map_err(|_| format!("dims {} has a negative dimension", fmt_dims(dims)))?;
        n.checked_mul(d).ok_or_else(|| format!("dims {} hold more elements than fit in memory", fmt_dims(dims)))
    })
}

/// Which typed field holds an element type outside `raw_data`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Typed {
    Float,
    Int32,
    String,
    Int64,
    Double,
    Uint64,
}

/// How ONNX stores one element type.
#[derive(Clone, Copy, Debug)]
struct Storage {
    name: &'static str,
    /// Bits per element in `raw_data` (4-bit types pack two per byte).
    bits: usize,
    typed: Typed,
    /// complex64/128 take two typed values (real, imaginary) per element.
    complex: bool,
}

impl Storage {
    fn raw_len(&self, numel: usize) -> Option<usize> {
        match self.bits {
            4 => Some(numel.div_ceil(2)),
            bits => numel.checked_mul(bits / 8),
        }
    }

    fn typed_len(&self, numel: usize) -> Option<usize> {
        match (self.bits, self.complex) {
            (4, _) => Some(numel.div_ceil(2)),
            (_, true) => numel.checked_mul(2),
            _ => Some(numel),
        }
    }
}

/// The storage of every `TensorProto.DataType` through IR version 11 (0 is UNDEFINED).
fn storage(code: i32) -> Option<Storage> {
    use Typed::*;
    let (name, bits, typed) = match code {
        0 => ("undefined", 0, Int32),
        1 => ("float32", 32, Float),
        2 => ("uint8", 8, Int32),
        3 => ("int8", 8, Int32),
        4 => ("uint16", 16, Int32),
        5 => ("int16", 16, Int32),
        6 => ("int32", 32, Int32),
        7 => ("int64", 64, Int64),
        8 => ("string", 0, String),
        9 => ("bool", 8, Int32),
        10 => ("float16", 16, Int32),
        11 => ("float64", 64, Double),
        12 => ("uint32", 32, Uint64),
        13 => ("uint64", 64, Uint64),
        14 => ("complex64", 64, Float),
        15 => ("complex128", 128, Double),
        16 => ("bfloat16", 16, Int32),
        17 => ("float8e4m3fn", 8, Int32),
        18 => ("float8e4m3fnuz", 8, Int32),
        19 => ("float8e5m2", 8, Int32),
        20 => ("float8e5m2fnuz", 8, Int32),
        21 => ("uint4", 4, Int32),
        22 => ("int4", 4, Int32),
        23 => ("float4e2m1", 4, Int32),
        _ => return None,
    };
    Some(Storage { name, bits, typed, complex: matches!(code, 14 | 15) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proto(data_type: i32, dims: &[i64]) -> TensorProto {
        TensorProto { name: Some("w".into()), dims: dims.to_vec(), data_type: Some(data_type), ..Default::default() }
    }

    #[test]
    fn raw_round_trip_keeps_every_dtype() {
        let f = [1.5f32, -2.0, 3.25, 0.0, 7.0, -0.5];
        let tensors = vec![
            Tensor::from_vec(&[2, 3], f.to_vec()),
            Tensor::from_vec(&[3], vec![1.0f64, -2.0, 1e300]),
            Tensor::from_vec(&[2], vec![i64::MIN, i64::MAX]),
            Tensor::from_vec(&[2], vec![-5i32, 9]),
            Tensor::from_vec(&[2], vec![-5i8, 9]),
            Tensor::from_vec(&[2], vec![u16::MAX, 1]),
            Tensor::from_vec(&[2], vec![u32::MAX, 1]),
            Tensor::from_vec(&[2], vec![f16::from_f32(0.5), f16::from_f32(-3.0)]),
            Tensor::from_vec(&[2], vec![bf16::from_f32(0.5), bf16::from_f32(-3.0)]),
            Tensor::from_bytes(DType::Bool, &[3], &[1, 0, 1]).unwrap(),
            Tensor::from_vec(&[0, 4], Vec::<f32>::new()),
            Tensor::scalar(42i64),
        ];
        for t in tensors {
            let p = tensor_to_proto("x", &t);
            assert_eq!(p.name(), "x");
            let back = tensor_from_proto(&p, "m.onnx").unwrap();
            assert_eq!(back, t, "{}", t.dtype());
        }
    }

    #[test]
    fn reads_every_typed_field() {
        let mut t = proto(1, &[2]);
        t.float_data = vec![1.0, -2.0];
        assert_eq!(tensor_from_proto(&t, "m").unwrap().as_slice::<f32>(), &[1.0, -2.0]);

        let mut t = proto(11, &[1]);
        t.double_data = vec![0.25];
        assert_eq!(tensor_from_proto(&t, "m").unwrap().as_slice::<f64>(), &[0.25]);

        let mut t = proto(7, &[2]);
        t.int64_data = vec![-1, 1 << 40];
        assert_eq!(tensor_from_proto(&t, "m").unwrap().as_slice::<i64>(), &[-1, 1 << 40]);

        let mut t = proto(13, &[1]);
        t.uint64_data = vec![u64::MAX];
        assert_eq!(tensor_from_proto(&t, "m").unwrap().as_slice::<u64>(), &[u64::MAX]);

        let mut t = proto(12, &[1]);
        t.uint64_data = vec![7];
        assert_eq!(tensor_from_proto(&t, "m").unwrap().as_slice::<u32>(), &[7]);

        // Narrow types sit in int32_data, 16-bit floats as their bit patterns.
        let mut t = proto(3, &[2]);
        t.int32_data = vec![-128, 127];
        assert_eq!(tensor_from_proto(&t, "m").unwrap().as_slice::<i8>(), &[-128, 127]);
        let mut t = proto(5, &[1]);
        t.int32_data = vec![-300];
        assert_eq!(tensor_from_proto(&t, "m").unwrap().as_slice::<i16>(), &[-300]);
        let mut t = proto(4, &[1]);
        t.int32_data = vec![65535];
        assert_eq!(tensor_from_proto(&t, "m").unwrap().as_slice::<u16>(), &[65535]);
        let mut t = proto(2, &[1]);
        t.int32_data = vec![255];
        assert_eq!(tensor_from_proto(&t, "m").unwrap().as_slice::<u8>(), &[255]);
        let mut t = proto(6, &[1]);
        t.int32_data = vec![i32::MIN];
        assert_eq!(tensor_from_proto(&t, "m").unwrap().as_slice::<i32>(), &[i32::MIN]);
        let mut t = proto(9, &[3]);
        t.int32_data = vec![1, 0, 1];
        let b = tensor_from_proto(&t, "m").unwrap();
        assert_eq!((b.dtype(), b.bytes()), (DType::Bool, &[1u8, 0, 1][..]));
        let mut t = proto(10, &[1]);
        t.int32_data = vec![i32::from(f16::from_f32(-1.5).to_bits())];
        let h = tensor_from_proto(&t, "m").unwrap();
        assert_eq!(h.as_slice::<f16>(), &[f16::from_f32(-1.5)]);
        let mut t = proto(16, &[1]);
        t.int32_data = vec![i32::from(bf16::from_f32(2.0).to_bits())];
        assert_eq!(tensor_from_proto(&t, "m").unwrap().as_slice::<bf16>(), &[bf16::from_f32(2.0)]);
    }

    #[test]
    fn wrong_sizes_name_the_file_tensor_and_field() {
        let mut t = proto(1, &[64, 192]);
        t.name = Some("h.0.attn.c_attn.weight".into());
        t.raw_data = Some(vec![0; 100]);
        let e = tensor_from_proto(&t, "model.onnx").unwrap_err();
        assert!(matches!(e, Error::Corrupt(_)));
        assert_eq!(
            e.to_string(),
            "model.onnx: tensor \"h.0.attn.c_attn.weight\": raw_data holds 100 bytes, dims \
             [64,192] of float32 need 49152"
        );

        let mut t = proto(1, &[2, 2]);
        t.float_data = vec![1.0; 3];
        let e = tensor_from_proto(&t, "m.onnx").unwrap_err().to_string();
        assert_eq!(e, "m.onnx: tensor \"w\": float_data holds 3 values, dims [2,2] of float32 need 4");

        let t = proto(7, &[3]);
        let e = tensor_from_proto(&t, "m.onnx").unwrap_err().to_string();
        assert!(e.contains("has no data (neither raw_data nor int64_data)"), "{e}");

        let mut t = proto(1, &[2, -1]);
        t.raw_data = Some(vec![]);
        let e = tensor_from_proto(&t, "m.onnx").unwrap_err().to_string();
        assert!(e.contains("dims [2,-1] has a negative dimension"), "{e}");

        let mut t = proto(1, &[i64::MAX, i64::MAX]);
        t.raw_data = Some(vec![]);
        let e = tensor_from_proto(&t, "m.onnx").unwrap_err().to_string();
        assert!(e.contains("more elements than fit"), "{e}");

        let mut t = proto(12, &[1]);
        t.uint64_data = vec![1 << 32];
        let e = tensor_from_proto(&t, "m.onnx").unwrap_err().to_string();
        assert!(e.contains("uint64_data value 4294967296 does not fit uint32"), "{e}");
    }

    #[test]
    fn unsupported_types_and_layouts_are_corrupt_not_panics() {
        let mut s = proto(8, &[1]);
        s.string_data = vec![b"hi".to_vec()];
        check_payload(&s).unwrap();
        let e = tensor_from_proto(&s, "m.onnx").unwrap_err();
        assert!(matches!(e, Error::Corrupt(_)));
        assert_eq!(e.to_string(), "m.onnx: tensor \"w\": string tensors are not supported");

        s.raw_data = Some(b"hi".to_vec());
        assert!(check_payload(&s).unwrap_err().contains("string_data"));

        // Types the engine does not compute with still get their sizes checked.
        let mut c = proto(14, &[2]);
        c.float_data = vec![0.0; 4];
        check_payload(&c).unwrap();
        let mut i4 = proto(22, &[3]);
        i4.raw_data = Some(vec![0; 2]);
        check_payload(&i4).unwrap();
        i4.raw_data = None;
        i4.int32_data = vec![0; 2];
        check_payload(&i4).unwrap();
        assert!(tensor_from_proto(&i4, "m").unwrap_err().to_string().contains("int4 tensors"));

        assert!(check_payload(&proto(0, &[1])).unwrap_err().contains("not set"));
        assert!(check_payload(&proto(99, &[1])).unwrap_err().contains("data_type 99"));
        let mut seg = proto(1, &[0]);
        seg.segment = Some(Default::default());
        assert!(tensor_from_proto(&seg, "m").unwrap_err().to_string().contains("segment"));

        let mut ext = proto(1, &[1]);
        ext.set_data_location(DataLocation::External);
        ext.external_data = vec![super::super::proto::StringStringEntryProto {
            key: Some("location".into()),
            value: Some("w.bin".into()),
        }];
        let e = tensor_from_proto(&ext, "m.onnx").unwrap_err().to_string();
        assert!(e.contains("external file \"w.bin\""), "{e}");
    }

    #[test]
    fn unnamed_tensors_are_described_as_such() {
        let mut t = proto(1, &[1]);
        t.name = None;
        let e = tensor_from_proto(&t, "m.onnx").unwrap_err().to_string();
        assert!(e.starts_with("m.onnx: unnamed tensor: has no data"), "{e}");
    }
}
