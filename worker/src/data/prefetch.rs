//! A loader read on a thread of its own, so that the next batches are read and stacked while
//! the device runs the step instead of between steps (PyTorch's DataLoader with a worker and a
//! prefetch factor of 2). A batch of 128 ResNet images is 77 MB to stack, which the step waited
//! for with the device idle.
//!
//! Nothing about the data changes: the batches come in the loader's own order, an error comes
//! where the batch it stopped would have come, and the position is the one after the last batch
//! handed out, so a checkpoint resumes where training was, not where reading was.

use super::{Batch, LabelRange, Loader, Position};
use crate::error::{Error, Result};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// Batches read ahead of the one the step uses: the channel holds one less, and the reader the
/// last, waiting to send it.
const AHEAD: usize = 2;

/// What the reader sends: a batch and the loader's position after it, or the loader's error.
type Read = Result<(Batch, Position)>;

pub struct Prefetched {
    /// Shared with the reader, which holds the lock only while it reads a batch, so that a
    /// caller can check the labels or seek in between.
    loader: Arc<Mutex<Box<dyn Loader>>>,
    /// Started at the first batch asked for, and again at the next one after a seek or after
    /// the loader's error (which ends it).
    reader: Option<Reader>,
    /// After the last batch handed out.
    pos: Position,
    items: usize,
    /// The configuration key of the source, for messages.
    key: String,
}

struct Reader {
    batches: Receiver<Read>,
    thread: JoinHandle<()>,
}

impl Prefetched {
    pub fn new(loader: Box<dyn Loader>, key: &str) -> Prefetched {
        let (pos, items) = (loader.position(), loader.items_per_batch());
        Prefetched { loader: Arc::new(Mutex::new(loader)), reader: None, pos, items, key: key.to_string() }
    }

    fn start(&self) -> Result<Reader> {
        let (send, batches) = sync_channel(AHEAD - 1);
        let loader = Arc::clone(&self.loader);
        let thread = std::thread::Builder::new()
            .name(format!("{} reader", self.key))
            .spawn(move || loop {
                let read: Read = {
                    let mut loader = locked(&loader);
                    loader.next_batch().map(|b| (b, loader.position()))
                };
                let failed = read.is_err();
                // A closed channel: the loader seeks, or is dropped.
                if send.send(read).is_err() || failed {
                    return;
                }
            })
            .map_err(|e| Error::Runtime(format!("{}: starting its reader thread: {e}", self.key)))?;
        Ok(Reader { batches, thread })
    }

    /// Stops the reader, dropping what it read ahead; an error if it had panicked.
    fn stop(&mut self) -> Result<()> {
        let Some(Reader { batches, thread }) = self.reader.take() else { return Ok(()) };
        // Its next send fails, which ends it; a read in progress finishes first.
        drop(batches);
        thread.join().map_err(|panic| {
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            Error::Runtime(format!("{}: the reader thread panicked: {why}", self.key))
        })
    }
}

/// The loader, also after a panic in the reader (whose error `stop` reports).
fn locked(loader: &Mutex<Box<dyn Loader>>) -> MutexGuard<'_, Box<dyn Loader>> {
    loader.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Loader for Prefetched {
    fn next_batch(&mut self) -> Result<Batch> {
        if self.reader.is_none() {
            self.reader = Some(self.start()?);
        }
        let received = self.reader.as_ref().map(|r| r.batches.recv());
        match received {
            Some(Ok(Ok((batch, pos)))) => {
                self.pos = pos;
                Ok(batch)
            }
            // The reader has returned; the next call starts another, as the loader would retry.
            Some(Ok(Err(e))) => {
                self.stop()?;
                Err(e)
            }
            // It ended without sending: it panicked.
            _ => Err(self.stop().err().unwrap_or_else(|| Error::Runtime(format!("{}: the reader stopped", self.key)))),
        }
    }

    fn position(&self) -> Position {
        self.pos.clone()
    }

    fn seek(&mut self, p: &Position) -> Result<()> {
        self.stop()?;
        locked(&self.loader).seek(p)?;
        self.pos = p.clone();
        Ok(())
    }

    fn items_per_batch(&self) -> usize {
        self.items
    }

    fn check_labels(&self, range: &LabelRange) -> Result<()> {
        locked(&self.loader).check_labels(range)
    }
}

impl Drop for Prefetched {
    fn drop(&mut self) {
        // A panic was reported where a batch was asked for, if one was.
        self.stop().ok();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::samples::write_shard;
    use crate::data::{samples::SampleLoader, Batching, Partition};
    use crate::tensor::Tensor;

    fn shard(dir: &std::path::Path, count: usize) {
        let samples: Vec<_> = (0..count)
            .map(|i| {
                let image = Tensor::from_vec(&[2, 3], (0..6).map(|k| (i * 6 + k) as f32).collect());
                vec![("x".to_string(), image), ("labels".to_string(), Tensor::from_vec(&[], vec![i as i64 % 5]))]
            })
            .collect();
        write_shard(&dir.join("part.pb"), &samples).unwrap();
    }

    fn open(dir: &std::path::Path) -> Box<dyn Loader> {
        let batching = Batching { batch: 3, seq_len: 0, shuffle: true, seed: 4, partition: Partition::WHOLE };
        Box::new(SampleLoader::open(dir, "data.train", batching).unwrap())
    }

    /// The same batches and positions as the loader read inline, across epochs and seeks back
    /// and forth, with the reader ahead of the consumer each time.
    #[test]
    fn batches_and_positions_are_the_loaders_own() {
        let dir = std::env::temp_dir().join(format!("tf-prefetch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        shard(&dir, 10);
        let (mut inline, mut ahead) = (open(&dir), Prefetched::new(open(&dir), "data.train"));
        assert_eq!(ahead.items_per_batch(), 3);
        fn compare(inline: &mut Box<dyn Loader>, ahead: &mut Prefetched, batches: usize) {
            for _ in 0..batches {
                assert_eq!(ahead.next_batch().unwrap(), inline.next_batch().unwrap());
                assert_eq!(ahead.position(), inline.position());
            }
        }
        // 10 samples make 3 batches an epoch: 7 reach the third epoch.
        compare(&mut inline, &mut ahead, 7);
        assert_eq!(ahead.position(), Position { epoch: 2, batch: 1 });
        let back = Position { epoch: 1, batch: 2 };
        inline.seek(&back).unwrap();
        ahead.seek(&back).unwrap();
        assert_eq!(ahead.position(), back);
        compare(&mut inline, &mut ahead, 4);
        let range = LabelRange { input: "labels".into(), classes: 4, ignore: None };
        let msg = ahead.check_labels(&range).unwrap_err().to_string();
        assert!(msg.contains("label 4"), "{msg}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A loader that fails at its third batch.
    struct Failing(u64);

    impl Loader for Failing {
        fn next_batch(&mut self) -> Result<Batch> {
            self.0 += 1;
            match self.0 {
                3 => Err(Error::Corrupt("data.train: shard x.bin at offset 12: token 9 past the vocabulary".into())),
                4 => panic!("read past the failure"),
                _ => Ok(Batch::from([("n".to_string(), Tensor::scalar(self.0 as i64))])),
            }
        }
        fn position(&self) -> Position {
            Position { epoch: 0, batch: self.0 }
        }
        fn seek(&mut self, p: &Position) -> Result<()> {
            self.0 = p.batch;
            Ok(())
        }
        fn items_per_batch(&self) -> usize {
            1
        }
    }

    /// The loader's error comes at the batch it stopped, after the batches before it, and the
    /// reader reads no further (it would panic); a panic is an error naming the source.
    #[test]
    fn an_error_comes_where_its_batch_would_and_a_panic_is_an_error() {
        let mut ahead = Prefetched::new(Box::new(Failing(0)), "data.train");
        for n in 1..=2 {
            assert_eq!(ahead.next_batch().unwrap()["n"], Tensor::scalar(n as i64));
        }
        let e = ahead.next_batch().unwrap_err();
        assert_eq!(e.exit_code(), 3, "{e}");
        assert!(e.to_string().contains("offset 12"), "{e}");
        assert_eq!(ahead.position(), Position { epoch: 0, batch: 2 });
        let e = ahead.next_batch().unwrap_err();
        assert!(e.to_string().contains("data.train: the reader thread panicked: read past the failure"), "{e}");
        // A seek starts a new reader from there.
        ahead.seek(&Position { epoch: 0, batch: 0 }).unwrap();
        assert_eq!(ahead.next_batch().unwrap()["n"], Tensor::scalar(1i64));
    }
}
