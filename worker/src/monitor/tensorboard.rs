//! TensorBoard event files: `events.out.tfevents.<unix time>.<host>`, a sequence of records
//! (u64 LE length, masked CRC-32C of the length, an `Event` protobuf, masked CRC-32C of it),
//! the first carrying `file_version: "brain.Event:2"`, then one Event per logged step with its
//! scalars, and one per step with the histograms (`HistogramProto`) of the watched weights.

use crate::error::{Error, Result};
use prost::Message;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Clone, PartialEq, Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
    #[prost(message, optional, tag = "5")]
    pub histo: Option<HistogramProto>,
}

/// TensorBoard's histogram: bucket `i` counts the values in (bucket_limit[i-1], bucket_limit[i]].
#[derive(Clone, PartialEq, Message)]
pub struct HistogramProto {
    #[prost(double, tag = "1")]
    pub min: f64,
    #[prost(double, tag = "2")]
    pub max: f64,
    #[prost(double, tag = "3")]
    pub num: f64,
    #[prost(double, tag = "4")]
    pub sum: f64,
    #[prost(double, tag = "5")]
    pub sum_squares: f64,
    #[prost(double, repeated, tag = "6")]
    pub bucket_limit: Vec<f64>,
    #[prost(double, repeated, tag = "7")]
    pub bucket: Vec<f64>,
}

/// Equal-width buckets between the smallest and the largest value: enough to see a weight's
/// spread drift over training, and the same number for every tensor whatever its scale.
pub const HISTOGRAM_BUCKETS: usize = 30;

impl HistogramProto {
    pub fn of(values: &[f32]) -> HistogramProto {
        let (mut min, mut max, mut sum, mut sum_squares) = (f64::INFINITY, f64::NEG_INFINITY, 0.0, 0.0);
        for &v in values {
            let v = v as f64;
            min = min.min(v);
            max = max.max(v);
            sum += v;
            sum_squares += v * v;
        }
        if values.is_empty() {
            (min, max) = (0.0, 0.0);
        }
        let width = (max - min) / HISTOGRAM_BUCKETS as f64;
        // A constant tensor gets one bucket at its value.
        let n = if width > 0.0 { HISTOGRAM_BUCKETS } else { 1 };
        let bucket_limit: Vec<f64> = (1..=n).map(|i| if i == n { max } else { min + width * i as f64 }).collect();
        let mut bucket = vec![0.0; n];
        for &v in values {
            let i = if width > 0.0 { (((v as f64 - min) / width).ceil() as usize).saturating_sub(1) } else { 0 };
            bucket[i.min(n - 1)] += 1.0;
        }
        HistogramProto { min, max, num: values.len() as f64, sum, sum_squares, bucket_limit, bucket }
    }
}

/// TensorFlow's masked CRC of a record's parts: CRC-32C (Castagnoli), rotated right by 15 and
/// a constant added.
pub fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

pub struct EventWriter {
    path: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
}

impl EventWriter {
    /// Creates a new event file in `dir`.
    pub fn create(dir: &Path) -> Result<EventWriter> {
        std::fs::create_dir_all(dir).map_err(|e| Error::Runtime(format!("{}: {e}", dir.display())))?;
        let path = dir.join(format!("events.out.tfevents.{:010}.{}", now() as u64, crate::files::hostname()));
        let file = std::fs::File::create(&path).map_err(|e| Error::Runtime(format!("{}: {e}", path.display())))?;
        let mut w = EventWriter { path, file: std::io::BufWriter::new(file) };
        w.write(&Event { wall_time: now(), step: 0, file_version: Some("brain.Event:2".into()), summary: None })?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write(&mut self, e: &Event) -> Result<()> {
        let data = e.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        let mut rec = Vec::with_capacity(data.len() + 16);
        rec.extend_from_slice(&len);
        rec.extend_from_slice(&masked_crc(&len).to_le_bytes());
        rec.extend_from_slice(&data);
        rec.extend_from_slice(&masked_crc(&data).to_le_bytes());
        self.file.write_all(&rec).map_err(|err| Error::Runtime(format!("{}: {err}", self.path.display())))
    }

    /// Logs scalars (tag, value) at `step`, and flushes so TensorBoard sees them live.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        let value = values
            .iter()
            .map(|(tag, v)| SummaryValue { tag: tag.to_string(), simple_value: Some(*v as f32), histo: None })
            .collect();
        self.summary(step, value)
    }

    /// Logs histograms (tag, values) at `step`.
    pub fn histograms(&mut self, step: u64, values: &[(String, &[f32])]) -> Result<()> {
        let value = values
            .iter()
            .map(|(tag, v)| SummaryValue { tag: tag.clone(), simple_value: None, histo: Some(HistogramProto::of(v)) })
            .collect();
        self.summary(step, value)
    }

    fn summary(&mut self, step: u64, value: Vec<SummaryValue>) -> Result<()> {
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            file_version: None,
            summary: Some(Summary { value }),
        })?;
        self.file.flush().map_err(|e| Error::Runtime(format!("{}: {e}", self.path.display())))
    }
}

/// Reads every event of a file back, checking both CRCs of each record.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let bytes = std::fs::read(path).map_err(|e| Error::Corrupt(format!("{}: {e}", path.display())))?;
    let bad = |at: usize, what: &str| Error::Corrupt(format!("{} at offset {at}: {what}", path.display()));
    let mut events = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let head = bytes.get(at..at + 12).ok_or_else(|| bad(at, "truncated record header"))?;
        let len = u64::from_le_bytes(head[..8].try_into().expect("8 bytes")) as usize;
        if u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) != masked_crc(&head[..8]) {
            return Err(bad(at, "length CRC mismatch"));
        }
        let data = bytes.get(at + 12..at + 12 + len).ok_or_else(|| bad(at, "truncated record"))?;
        let crc = bytes.get(at + 12 + len..at + 16 + len).ok_or_else(|| bad(at, "truncated record CRC"))?;
        if u32::from_le_bytes(crc.try_into().expect("4 bytes")) != masked_crc(data) {
            return Err(bad(at, "data CRC mismatch"));
        }
        events.push(Event::decode(data).map_err(|e| bad(at, &e.to_string()))?);
        at += 16 + len;
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The records' CRC is Castagnoli's (its standard check value 0xE3069283), masked as
    /// TensorFlow masks it.
    #[test]
    fn records_are_framed_with_masked_castagnoli_crcs() {
        assert_eq!(masked_crc(b"123456789"), 0xE306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8));
        assert_eq!(masked_crc(b""), 0xa282_ead8);
    }

    #[test]
    fn events_round_trip() {
        let dir = std::env::temp_dir().join(format!("tf-events-{}", std::process::id()));
        let mut w = EventWriter::create(&dir).unwrap();
        w.scalars(1, &[("train/loss", 2.5), ("train/lr", 1e-3)]).unwrap();
        w.scalars(2, &[("train/loss", 2.0)]).unwrap();
        let path = w.path().to_path_buf();
        drop(w);
        assert!(path.file_name().unwrap().to_str().unwrap().starts_with("events.out.tfevents."));
        let ev = read_events(&path).unwrap();
        assert_eq!(ev[0].file_version.as_deref(), Some("brain.Event:2"));
        let s = ev[1].summary.as_ref().unwrap();
        assert_eq!((ev[1].step, s.value[0].tag.as_str(), s.value[0].simple_value), (1, "train/loss", Some(2.5)));
        assert_eq!(ev.len(), 3);
        let h = HistogramProto::of(&[-1.0, 0.0, 0.5, 2.0]);
        assert_eq!((h.min, h.max, h.num, h.sum, h.sum_squares), (-1.0, 2.0, 4.0, 1.5, 5.25));
        assert_eq!(h.bucket.len(), HISTOGRAM_BUCKETS);
        assert_eq!(h.bucket.iter().sum::<f64>(), 4.0);
        assert_eq!((h.bucket[0], h.bucket[HISTOGRAM_BUCKETS - 1]), (1.0, 1.0), "the ends land in the end buckets");
        assert_eq!(*h.bucket_limit.last().unwrap(), 2.0);
        let flat = HistogramProto::of(&[3.0; 5]);
        assert_eq!((flat.bucket.clone(), flat.bucket_limit.clone()), (vec![5.0], vec![3.0]));
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(read_events(&path).is_err(), "a flipped bit fails the CRC");
        std::fs::remove_dir_all(&dir).ok();
    }
}
