//! The safetensors format: an 8-byte little-endian header length, a JSON header mapping each
//! name to {dtype, shape, data_offsets}, then the tensors' bytes back to back.

use crate::tensor::{DType, Tensor};
use std::collections::BTreeMap;

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "F32",
        DType::F64 => "F64",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::I64 => "I64",
        DType::I32 => "I32",
        DType::I16 => "I16",
        DType::I8 => "I8",
        DType::U8 => "U8",
        DType::U16 => "U16",
        DType::U32 => "U32",
        DType::U64 => "U64",
        DType::Bool => "BOOL",
    }
}

fn dtype_of(s: &str) -> Option<DType> {
    [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::Bool,
    ]
    .into_iter()
    .find(|d| dtype_name(*d) == s)
}

pub fn encode(tensors: &BTreeMap<String, Tensor>) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for (name, t) in tensors {
        let end = offset + t.byte_len();
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype_name(t.dtype()), "shape": t.shape(), "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut h = serde_json::to_vec(&header).expect("a JSON map serializes");
    // Pad the header so the data starts 8-byte aligned, as the format recommends.
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + offset);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for t in tensors.values() {
        out.extend_from_slice(t.bytes());
    }
    out
}

pub fn decode(bytes: &[u8]) -> Result<BTreeMap<String, Tensor>, String> {
    let n =
        u64::from_le_bytes(bytes.get(..8).ok_or("shorter than the 8-byte header length")?.try_into().expect("8 bytes"))
            as usize;
    let header = bytes.get(8..8 + n).ok_or("the header runs past the end of the file")?;
    let data = &bytes[8 + n..];
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(header).map_err(|e| format!("header: {e}"))?;
    let mut out = BTreeMap::new();
    for (name, v) in map {
        if name == "__metadata__" {
            continue;
        }
        let dtype = v["dtype"].as_str().and_then(dtype_of).ok_or_else(|| format!("tensor '{name}': unknown dtype"))?;
        let shape: Vec<usize> = v["shape"]
            .as_array()
            .ok_or_else(|| format!("tensor '{name}': no shape"))?
            .iter()
            .map(|d| d.as_u64().unwrap_or(0) as usize)
            .collect();
        let offs = v["data_offsets"]
            .as_array()
            .filter(|o| o.len() == 2)
            .ok_or_else(|| format!("tensor '{name}': no data_offsets"))?;
        let (a, b) = (offs[0].as_u64().unwrap_or(u64::MAX) as usize, offs[1].as_u64().unwrap_or(0) as usize);
        let slice =
            data.get(a..b).ok_or_else(|| format!("tensor '{name}': data_offsets [{a}, {b}] are outside the data"))?;
        let t = Tensor::from_bytes(dtype, &shape, slice)
            .ok_or_else(|| format!("tensor '{name}': {} bytes do not fill shape {shape:?}", slice.len()))?;
        out.insert(name, t);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let mut m = BTreeMap::new();
        m.insert("w".to_string(), Tensor::from_vec(&[2, 2], vec![1.0f32, 2.0, 3.0, 4.0]));
        m.insert("step".to_string(), Tensor::from_vec(&[1], vec![7i64]));
        let b = encode(&m);
        assert_eq!(decode(&b).unwrap(), m);
        assert!(decode(&b[..b.len() - 1]).is_err());
    }
}
