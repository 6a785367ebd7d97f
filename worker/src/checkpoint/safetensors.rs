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

/// The most header bytes a file may declare (the `safetensors` crate's limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor's entry in the header.
#[derive(serde::Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// The header's entries in file order, a repeated name kept (a JSON object read into a map
/// keeps only the last of two).
struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Entries, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object of tensors")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    entries.push(entry);
                }
                Ok(Entries(entries))
            }
        }
        d.deserialize_map(Visit)
    }
}

/// Reads a safetensors file with the checks of the `safetensors` crate's reader, whose errors do
/// not name the tensor, and one it lacks (a repeated name, which it keeps the last of): the
/// header fits the file and the format's 100 MB; every tensor has a known dtype, a shape whose
/// element count and byte size do not overflow, and `data_offsets` exactly that many bytes long;
/// in offset order the tensors tile the data exactly, with no gap, no overlap and nothing past
/// the end or left over. A file that passes decodes to what was written, never shifted bytes.
pub fn decode(bytes: &[u8]) -> Result<BTreeMap<String, Tensor>, String> {
    let n = u64::from_le_bytes(bytes.get(..8).ok_or("shorter than the 8-byte header length")?.try_into().expect("8"));
    if n > MAX_HEADER_BYTES {
        return Err(format!("a header of {n} bytes, over the format's {MAX_HEADER_BYTES}"));
    }
    let header = bytes.get(8..8 + n as usize).ok_or("the header runs past the end of the file")?;
    let data = &bytes[8 + n as usize..];
    let Entries(entries) = serde_json::from_slice(header).map_err(|e| format!("header: {e}"))?;
    let mut seen = std::collections::BTreeSet::new();
    // (begin, end, name, dtype, shape), to tile in offset order.
    let mut spans = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        if name == "__metadata__" {
            continue;
        }
        if !seen.insert(name.clone()) {
            return Err(format!("tensor '{name}' appears twice in the header"));
        }
        let e: Entry = serde_json::from_value(value).map_err(|e| format!("tensor '{name}': {e}"))?;
        let dtype = dtype_of(&e.dtype).ok_or_else(|| format!("tensor '{name}': unknown dtype '{}'", e.dtype))?;
        let shape: Option<Vec<usize>> = e.shape.iter().map(|&d| usize::try_from(d).ok()).collect();
        let need = shape
            .as_ref()
            .and_then(|s| crate::tensor::checked_numel(s))
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| format!("tensor '{name}': shape {:?} has more bytes than memory can address", e.shape))?;
        let (begin, end) = e.data_offsets;
        if begin > end || end > data.len() as u64 {
            return Err(format!(
                "tensor '{name}': data_offsets [{begin}, {end}] are outside the data ({} bytes)",
                data.len()
            ));
        }
        if end - begin != need as u64 {
            return Err(format!(
                "tensor '{name}': data_offsets [{begin}, {end}] hold {} bytes; {} {:?} needs {need}",
                end - begin,
                e.dtype,
                e.shape
            ));
        }
        spans.push((begin as usize, end as usize, name, dtype, shape.expect("checked above")));
    }
    spans.sort_by_key(|s| (s.0, s.1));
    let mut tiled = 0;
    let mut previous: Option<&str> = None;
    for (begin, end, name, ..) in &spans {
        if *begin < tiled {
            let before = previous.expect("a tensor ends after 0");
            return Err(format!(
                "tensor '{name}': data_offsets [{begin}, {end}] overlap tensor '{before}', which ends at {tiled}"
            ));
        }
        if *begin > tiled {
            return Err(format!("tensor '{name}': data_offsets [{begin}, {end}] leave bytes {tiled}..{begin} unused"));
        }
        tiled = *end;
        previous = Some(name);
    }
    if tiled != data.len() {
        let after = previous.map(|p| format!(", after tensor '{p}'")).unwrap_or_default();
        return Err(format!("bytes {tiled}..{} of the data belong to no tensor{after}", data.len()));
    }
    Ok(spans
        .into_iter()
        .map(|(begin, end, name, dtype, shape)| {
            let t = Tensor::from_bytes(dtype, &shape, &data[begin..end]).expect("sized above");
            (name, t)
        })
        .collect())
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

    #[test]
    fn empty_and_zero_sized_tensors_tile() {
        let mut m = BTreeMap::new();
        assert_eq!(decode(&encode(&m)).unwrap(), m);
        m.insert("a".to_string(), Tensor::from_vec(&[0], Vec::<f32>::new()));
        m.insert("b".to_string(), Tensor::from_vec(&[2], vec![1.0f32, 2.0]));
        m.insert("c".to_string(), Tensor::from_vec(&[0, 3], Vec::<f32>::new()));
        assert_eq!(decode(&encode(&m)).unwrap(), m);
    }
}
