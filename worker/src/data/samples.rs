//! ONNX Runtime sample shards (`*.pb`): each sample is a u32 LE byte count of the rest, then
//! per tensor a u32 LE length and a serialized `TensorProto` named after the graph input it
//! feeds. Tensors hold one sample; batches stack them on a new leading axis. With D
//! data-parallel ranks a global batch is D·B consecutive samples of the epoch's order, and
//! rank r takes samples r·B..(r+1)·B of it.

use super::{shard_files, Batch, Batching, LabelRange, Loader, Position};
use crate::error::{Error, Result};
use crate::onnx::proto::TensorProto;
use crate::onnx::tensor::{tensor_from_proto, tensor_to_proto};
use crate::rng::Rng;
use crate::tensor::{DType, Tensor};
use prost::Message;
use std::path::{Path, PathBuf};

type Sample = Vec<(String, Tensor)>;
/// What a sample's tensors must agree on across a data set: names, element types, shapes.
type Signature = Vec<(String, DType, Vec<usize>)>;

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// Parses every sample of one shard; errors name the file and byte offset.
pub fn read_shard(path: &Path) -> Result<Vec<Sample>> {
    let bytes =
        crate::files::read_input(path).map_err(|e| Error::Config(format!("sample shard {}: {e}", path.display())))?;
    let corrupt =
        |at: usize, what: String| Error::Corrupt(format!("sample shard {} at offset {at}: {what}", path.display()));
    let mut samples = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let size = u32_at(&bytes, at).ok_or_else(|| corrupt(at, "truncated sample size".into()))? as usize;
        let end = at + 4 + size;
        if end > bytes.len() {
            return Err(corrupt(
                at,
                format!("a sample of {size} bytes runs past the end of the file ({} bytes)", bytes.len()),
            ));
        }
        let mut p = at + 4;
        let mut sample = Vec::new();
        while p < end {
            let len = u32_at(&bytes, p)
                .filter(|_| p + 4 <= end)
                .ok_or_else(|| corrupt(p, "truncated tensor length".into()))? as usize;
            if p + 4 + len > end {
                return Err(corrupt(p, format!("a tensor of {len} bytes runs past its sample")));
            }
            let proto = TensorProto::decode(&bytes[p + 4..p + 4 + len])
                .map_err(|e| corrupt(p + 4, format!("not a TensorProto: {e}")))?;
            let name = proto.name().to_string();
            let t = tensor_from_proto(&proto, &format!("sample shard {} at offset {}", path.display(), p + 4))?;
            if let Some((i, v)) = t.first_non_finite() {
                let what = format!("tensor '{name}' of sample {} holds {v} at element {i}", samples.len());
                return Err(corrupt(p + 4, format!("{what}; input data must be finite")));
            }
            sample.push((name, t));
            p += 4 + len;
        }
        samples.push(sample);
        at = end;
    }
    Ok(samples)
}

/// Writes samples in the same format (test data, conversions).
pub fn write_shard(path: &Path, samples: &[Sample]) -> Result<()> {
    let mut out = Vec::new();
    for s in samples {
        let mut body = Vec::new();
        for (name, t) in s {
            let enc = tensor_to_proto(name, t).encode_to_vec();
            body.extend_from_slice(&(enc.len() as u32).to_le_bytes());
            body.extend_from_slice(&enc);
        }
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
    }
    crate::files::write_atomically(path, &out)
}

/// A sample's tensors as `name: dtype[shape]`, for messages.
fn describe(tensors: &Signature) -> String {
    let parts: Vec<String> = tensors.iter().map(|(n, t, s)| format!("{n}: {t}{s:?}")).collect();
    format!("[{}]", parts.join(", "))
}

pub struct SampleLoader {
    samples: Vec<Sample>,
    /// Where each sample came from: its shard (an index into `shards`) and its place there.
    origins: Vec<(usize, usize)>,
    shards: Vec<PathBuf>,
    /// The configuration key of the source, for messages.
    key: String,
    order: Vec<usize>,
    batching: Batching,
    pos: Position,
}

impl SampleLoader {
    pub fn open(path: &Path, key: &str, batching: Batching) -> Result<SampleLoader> {
        // Every sample's tensors must match the first's in name, element type and shape: the
        // batches stack them. Checked per shard, so that the message names the file.
        let (mut samples, mut origins) = (Vec::new(), Vec::new());
        let shards = shard_files(path, "pb", key)?;
        let mut first: Option<(PathBuf, Signature)> = None;
        for (s, f) in shards.iter().enumerate() {
            let shard = read_shard(f)?;
            for (i, sample) in shard.iter().enumerate() {
                let these: Signature = sample.iter().map(|(n, t)| (n.clone(), t.dtype(), t.shape().to_vec())).collect();
                match &first {
                    None => first = Some((f.clone(), these)),
                    Some((file, want)) if *want != these => {
                        return Err(Error::Corrupt(format!(
                            "{key}: sample shard {} sample {i} has tensors {}, but {} sample 0 has {}",
                            f.display(),
                            describe(&these),
                            file.display(),
                            describe(want)
                        )));
                    }
                    Some(_) => {}
                }
            }
            origins.extend((0..shard.len()).map(|i| (s, i)));
            samples.extend(shard);
        }
        let global = batching.global_batch();
        if samples.len() < global {
            let ranks = match batching.partition.count {
                1 => String::new(),
                n => format!(" (batchSize {} × {n} data-parallel ranks)", batching.batch),
            };
            return Err(Error::Config(format!(
                "{key}: {} holds {} samples, fewer than one batch of {global}{ranks}",
                path.display(),
                samples.len()
            )));
        }
        let key = key.to_string();
        let mut l = SampleLoader { samples, origins, shards, key, order: vec![], batching, pos: Position::default() };
        l.order = l.epoch_order(0);
        Ok(l)
    }

    fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut o: Vec<usize> = (0..self.samples.len()).collect();
        if self.batching.shuffle {
            Rng::new(crate::rng::mix(self.batching.seed ^ 0x5A3) ^ epoch).shuffle(&mut o);
        }
        o
    }
}

impl Loader for SampleLoader {
    fn next_batch(&mut self) -> Result<Batch> {
        let (mine, global) = (self.batching.batch, self.batching.global_batch());
        let per_epoch = self.samples.len() / global;
        if self.pos.batch as usize >= per_epoch {
            self.pos = Position { epoch: self.pos.epoch + 1, batch: 0 };
            self.order = self.epoch_order(self.pos.epoch);
        }
        let start = self.pos.batch as usize * global + self.batching.partition.index * mine;
        let picked: Vec<&Sample> = self.order[start..start + mine].iter().map(|&i| &self.samples[i]).collect();
        let mut batch = Batch::new();
        for (k, (name, t0)) in picked[0].iter().enumerate() {
            let mut shape = vec![mine];
            shape.extend_from_slice(t0.shape());
            // Each sample copied once, into its place in the batch (samples share shapes,
            // checked on open).
            let mut t = Tensor::zeros(t0.dtype(), &shape);
            for (place, s) in t.bytes_mut().chunks_exact_mut(t0.byte_len().max(1)).zip(&picked) {
                place.copy_from_slice(s[k].1.bytes());
            }
            batch.insert(name.clone(), t);
        }
        self.pos.batch += 1;
        Ok(batch)
    }

    fn position(&self) -> Position {
        self.pos.clone()
    }

    fn seek(&mut self, p: &Position) -> Result<()> {
        self.order = self.epoch_order(p.epoch);
        self.pos = p.clone();
        Ok(())
    }

    fn items_per_batch(&self) -> usize {
        self.batching.batch
    }

    fn check_labels(&self, range: &LabelRange) -> Result<()> {
        for (sample, &(s, i)) in self.samples.iter().zip(&self.origins) {
            let Some((_, t)) = sample.iter().find(|(n, _)| *n == range.input) else { continue };
            let Some(labels) = t.to_i64_vec() else { continue };
            if let Some((j, l)) = labels.iter().enumerate().find(|&(_, &l)| !range.admits(l)) {
                let ignored = range.ignore.map_or(String::new(), |v| format!(" nor the ignored {v}"));
                return Err(Error::Corrupt(format!(
                    "{}: sample shard {} sample {i}: label {l} (element {j} of '{}') is not one of the \
                     model's classes 0..{}{ignored}",
                    self.key,
                    self.shards[s].display(),
                    range.input,
                    range.classes
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Partition;

    #[test]
    fn batches_stack_samples_and_damage_names_file_and_offset() {
        let dir = std::env::temp_dir().join(format!("tf-samples-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let samples: Vec<Sample> = (0..5)
            .map(|i| {
                vec![
                    ("x".to_string(), Tensor::from_vec(&[2], vec![i as f32, -(i as f32)])),
                    ("labels".to_string(), Tensor::from_vec(&[], vec![i as i64])),
                ]
            })
            .collect();
        let path = dir.join("part.pb");
        write_shard(&path, &samples).unwrap();
        let batching = Batching { batch: 2, seq_len: 0, shuffle: false, seed: 0, partition: Partition::WHOLE };
        let mut l = SampleLoader::open(&dir, "data.train", batching).unwrap();
        let b = l.next_batch().unwrap();
        assert_eq!(b["x"].shape(), &[2, 2]);
        assert_eq!(b["x"].as_slice::<f32>(), &[0.0, -0.0, 1.0, -1.0]);
        assert_eq!(b["labels"].as_slice::<i64>(), &[0, 1]);
        l.next_batch().unwrap();
        // 5 samples make 2 batches of 2; the third batch starts the next epoch.
        assert_eq!(l.next_batch().unwrap()["labels"].as_slice::<i64>(), &[0, 1]);
        assert_eq!(l.position(), Position { epoch: 1, batch: 1 });

        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        let e = read_shard(&path).unwrap_err();
        assert_eq!(e.exit_code(), 3);
        let msg = e.to_string();
        assert!(msg.contains("part.pb") && msg.contains("offset"), "{msg}");

        // A NaN in the input data is refused where it is, not trained on.
        let mut poisoned = samples.clone();
        poisoned[3][0].1 = Tensor::from_vec(&[2], vec![1.0f32, f32::NAN]);
        write_shard(&path, &poisoned).unwrap();
        let msg = read_shard(&path).unwrap_err().to_string();
        assert!(msg.contains("part.pb") && msg.contains("tensor 'x' of sample 3 holds NaN at element 1"), "{msg}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Three data-parallel ranks with batch B read the thirds of what one rank with batch 3B
    /// reads, through shuffled epochs.
    #[test]
    fn data_parallel_ranks_split_the_global_batch() {
        let dir = std::env::temp_dir().join(format!("tf-samples-dp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let samples: Vec<Sample> =
            (0..20).map(|i| vec![("labels".to_string(), Tensor::from_vec(&[], vec![i as i64]))]).collect();
        write_shard(&dir.join("part.pb"), &samples).unwrap();
        let whole = Batching { batch: 6, seq_len: 0, shuffle: true, seed: 9, partition: Partition::WHOLE };
        let mut single = SampleLoader::open(&dir, "data.train", whole).unwrap();
        let mut ranks: Vec<SampleLoader> = (0..3)
            .map(|index| {
                let b = Batching { batch: 2, partition: Partition { index, count: 3 }, ..whole };
                SampleLoader::open(&dir, "data.train", b).unwrap()
            })
            .collect();
        for _ in 0..10 {
            let want = single.next_batch().unwrap();
            let joined: Vec<i64> =
                ranks.iter_mut().flat_map(|r| r.next_batch().unwrap()["labels"].as_slice::<i64>().to_vec()).collect();
            assert_eq!(joined, want["labels"].as_slice::<i64>());
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
