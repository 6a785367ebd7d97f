//! llm.c token shards (`*.bin`): a header of 256 little-endian i32 (magic 20240520, version 1,
//! token count), then u16 tokens; or magic 20240801, version 7, with u32 tokens.
//!
//! A batch of B sequences of length T takes a window of B·T+1 consecutive tokens of one
//! shard: input ids are its first B·T tokens, labels the same window shifted by one. Windows
//! start every B·T tokens; an epoch visits every window of every shard once, in order or in a
//! seeded permutation. With D data-parallel ranks the windows are global batches of D·B·T
//! tokens, and rank r reads rows r·B..(r+1)·B of each.

use super::{shard_files, Batch, Batching, Feeds, Loader, Position};
use crate::error::{Error, Result};
use crate::rng::Rng;
use crate::tensor::Tensor;
use std::path::{Path, PathBuf};

pub const MAGIC_U16: i32 = 20240520;
pub const MAGIC_U32: i32 = 20240801;
pub const HEADER_BYTES: usize = 256 * 4;

/// A shard's header, checked against the file's length.
#[derive(Clone, Debug)]
pub struct ShardInfo {
    pub path: PathBuf,
    pub tokens: usize,
    pub token_bytes: usize,
}

pub fn read_header(path: &Path) -> Result<ShardInfo> {
    use std::io::Read;
    let corrupt = |what: String| Error::Corrupt(format!("token shard {}: {what}", path.display()));
    let mut f =
        crate::files::open_input(path).map_err(|e| Error::Config(format!("token shard {}: {e}", path.display())))?;
    let len = f.metadata().map_err(|e| corrupt(e.to_string()))?.len() as usize;
    let mut h = [0u8; HEADER_BYTES];
    f.read_exact(&mut h)
        .map_err(|_| corrupt(format!("{len} bytes is shorter than the {HEADER_BYTES}-byte header (offset 0)")))?;
    let word = |i: usize| i32::from_le_bytes([h[4 * i], h[4 * i + 1], h[4 * i + 2], h[4 * i + 3]]);
    let token_bytes = match (word(0), word(1)) {
        (MAGIC_U16, 1) => 2,
        (MAGIC_U32, 7) => 4,
        (m, v) => {
            return Err(corrupt(format!(
                "header at offset 0: magic {m} version {v} is not llm.c's ({MAGIC_U16} v1 or {MAGIC_U32} v7)"
            )))
        }
    };
    let tokens = usize::try_from(word(2))
        .map_err(|_| corrupt(format!("header at offset 8: negative token count {}", word(2))))?;
    let want = HEADER_BYTES + tokens * token_bytes;
    if len != want {
        return Err(corrupt(format!(
            "the header (offset 8) promises {tokens} tokens = {want} bytes, the file has {len}"
        )));
    }
    Ok(ShardInfo { path: path.to_path_buf(), tokens, token_bytes })
}

/// Reads `count` tokens of a shard from token `start` on, as u32 (as llm.c's loader does: a
/// positioned read per batch, so a shuffled order costs no more than a sequential one).
pub fn read_window(file: &std::fs::File, info: &ShardInfo, start: usize, count: usize) -> Result<Vec<u32>> {
    use std::os::unix::fs::FileExt;
    let offset = HEADER_BYTES + start * info.token_bytes;
    let mut bytes = vec![0u8; count * info.token_bytes];
    file.read_exact_at(&mut bytes, offset as u64).map_err(|e| {
        Error::Corrupt(format!(
            "token shard {}: reading {} bytes at offset {offset}: {e}",
            info.path.display(),
            bytes.len()
        ))
    })?;
    Ok(match info.token_bytes {
        2 => bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32).collect(),
        _ => bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
    })
}

/// A token as a shard stores it: u16 (llm.c's GPT-2 shards, vocabularies up to 65,536) or u32.
pub trait ShardToken: Copy {
    const MAGIC: i32;
    const VERSION: i32;
    fn put(self, out: &mut Vec<u8>);
}

impl ShardToken for u16 {
    const MAGIC: i32 = MAGIC_U16;
    const VERSION: i32 = 1;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

impl ShardToken for u32 {
    const MAGIC: i32 = MAGIC_U32;
    const VERSION: i32 = 7;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

/// Writes a shard of `tokens` (the format `prepare-data` produces), u16 or u32 as they are.
pub fn write_shard<T: ShardToken>(path: &Path, tokens: &[T]) -> Result<()> {
    let mut out = Vec::with_capacity(HEADER_BYTES + std::mem::size_of_val(tokens));
    let mut header = [0i32; 256];
    header[0] = T::MAGIC;
    header[1] = T::VERSION;
    header[2] = i32::try_from(tokens.len())
        .map_err(|_| Error::Config(format!("{}: too many tokens for one shard", path.display())))?;
    for w in header {
        out.extend_from_slice(&w.to_le_bytes());
    }
    for &t in tokens {
        t.put(&mut out);
    }
    crate::files::write_atomically(path, &out)
}

pub struct TokenLoader {
    shards: Vec<ShardInfo>,
    /// (shard, window) pairs of one epoch, in visiting order.
    order: Vec<(usize, usize)>,
    batching: Batching,
    pos: Position,
    /// Open shard files, opened on first use.
    files: Vec<Option<std::fs::File>>,
    feeds: Feeds,
}

impl TokenLoader {
    pub fn open(path: &Path, key: &str, batching: Batching, feeds: &Feeds) -> Result<TokenLoader> {
        let shards: Vec<ShardInfo> =
            shard_files(path, "bin", key)?.iter().map(|p| read_header(p)).collect::<Result<_>>()?;
        let (global, seq_len) = (batching.global_batch(), batching.seq_len);
        // A window of global × seqLen tokens, plus the last label: sizes that overflow or are
        // zero leave no window to read.
        let Some(window) = global.checked_mul(seq_len).filter(|&w| w > 0 && w < usize::MAX) else {
            return Err(Error::Config(format!(
                "{key}: a batch of {global} sequences × seqLen {seq_len} tokens is {}; batchSize and \
                 seqLen must be positive and their product a count of tokens a shard can hold",
                if global == 0 || seq_len == 0 { "empty" } else { "too many tokens to address" }
            )));
        };
        if shards.iter().all(|s| s.tokens < window + 1) {
            let ranks = match batching.partition.count {
                1 => String::new(),
                n => format!(" (batchSize {} × {n} data-parallel ranks)", batching.batch),
            };
            return Err(Error::Config(format!(
                "{key}: no shard in {} holds a batch of {global}{ranks}×{seq_len}+1 tokens; use smaller batches or more data",
                path.display()
            )));
        }
        let n_shards = shards.len();
        let mut l = TokenLoader {
            shards,
            order: vec![],
            batching,
            pos: Position::default(),
            files: (0..n_shards).map(|_| None).collect(),
            feeds: feeds.clone(),
        };
        l.order = l.epoch_order(0);
        Ok(l)
    }

    /// Tokens in one global batch window (without the extra label token).
    fn span(&self) -> usize {
        self.batching.global_batch() * self.batching.seq_len
    }

    fn epoch_order(&self, epoch: u64) -> Vec<(usize, usize)> {
        let span = self.span();
        let mut order: Vec<(usize, usize)> = self
            .shards
            .iter()
            .enumerate()
            .flat_map(|(s, info)| (0..info.tokens.saturating_sub(1) / span).map(move |w| (s, w)))
            .collect();
        if self.batching.shuffle {
            Rng::new(crate::rng::mix(self.batching.seed ^ 0xDA7A) ^ epoch).shuffle(&mut order);
        }
        order
    }
}

impl Loader for TokenLoader {
    fn next_batch(&mut self) -> Result<Batch> {
        if self.pos.batch as usize >= self.order.len() {
            self.pos = Position { epoch: self.pos.epoch + 1, batch: 0 };
            self.order = self.epoch_order(self.pos.epoch);
        }
        let (shard, window) = self.order[self.pos.batch as usize];
        let info = &self.shards[shard];
        if self.files[shard].is_none() {
            let f = crate::files::open_input(&info.path)
                .map_err(|e| Error::Corrupt(format!("token shard {}: {e}", info.path.display())))?;
            self.files[shard] = Some(f);
        }
        let (batch, seq_len) = (self.batching.batch, self.batching.seq_len);
        let mine = batch * seq_len;
        let start = window * self.span() + self.batching.partition.index * mine;
        let file = self.files[shard].as_ref().expect("opened above");
        let w = read_window(file, info, start, mine + 1)?;
        if let Some(vocab) = self.feeds.vocab {
            if let Some(i) = w.iter().position(|&t| t as usize >= vocab) {
                return Err(Error::Corrupt(format!(
                    "token shard {}: token {} at offset {} (in tokens) is not below the model's vocabulary of {vocab}",
                    info.path.display(),
                    w[i],
                    start + i
                )));
            }
        }
        let shape = [batch, seq_len];
        let ids = Tensor::from_vec(&shape, w[..mine].iter().map(|&t| t as i64).collect());
        let labels = Tensor::from_vec(&shape, w[1..].iter().map(|&t| t as i64).collect());
        self.pos.batch += 1;
        Ok([(self.feeds.token_input.clone(), ids), (self.feeds.token_label.clone(), labels)].into_iter().collect())
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
        self.batching.batch * self.batching.seq_len
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Partition;

    #[test]
    fn windows_follow_llm_c_and_damage_names_the_file() {
        let dir = std::env::temp_dir().join(format!("tf-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let toks: Vec<u16> = (0..50).collect();
        write_shard(&dir.join("a.bin"), &toks).unwrap();
        let feeds = Feeds { token_input: "input_ids".into(), token_label: "labels".into(), vocab: None };
        let batching = Batching { batch: 2, seq_len: 4, shuffle: false, seed: 0, partition: Partition::WHOLE };
        let mut l = TokenLoader::open(&dir, "data.train", batching, &feeds).unwrap();
        let b = l.next_batch().unwrap();
        assert_eq!(b["input_ids"].as_slice::<i64>(), &[0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(b["labels"].as_slice::<i64>(), &[1, 2, 3, 4, 5, 6, 7, 8]);
        let b = l.next_batch().unwrap();
        assert_eq!(b["input_ids"].as_slice::<i64>()[0], 8);
        // 49 / 8 = 6 windows per epoch, then the second epoch starts over.
        for _ in 0..4 {
            l.next_batch().unwrap();
        }
        assert_eq!(l.next_batch().unwrap()["input_ids"].as_slice::<i64>()[0], 0);
        assert_eq!(l.position(), Position { epoch: 1, batch: 1 });

        let mut bytes = std::fs::read(dir.join("a.bin")).unwrap();
        bytes.truncate(bytes.len() - 3);
        std::fs::write(dir.join("a.bin"), &bytes).unwrap();
        let e = TokenLoader::open(&dir, "data.train", batching, &feeds).err().unwrap();
        assert_eq!(e.exit_code(), 3);
        assert!(e.to_string().contains("a.bin"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_token_past_the_vocabulary_names_its_shard_and_offset() {
        let dir = std::env::temp_dir().join(format!("tf-tokens-vocab-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut toks: Vec<u16> = (0..20).map(|t| t % 10).collect();
        toks[13] = 10;
        write_shard(&dir.join("a.bin"), &toks).unwrap();
        let feeds = Feeds { token_input: "ids".into(), token_label: "labels".into(), vocab: Some(10) };
        let batching = Batching { batch: 1, seq_len: 4, shuffle: false, seed: 0, partition: Partition::WHOLE };
        let mut l = TokenLoader::open(&dir, "data.train", batching, &feeds).unwrap();
        for _ in 0..3 {
            l.next_batch().unwrap();
        }
        // The fourth window, tokens 12..=16 (its last is the last label), holds token 13.
        let e = l.next_batch().unwrap_err();
        assert_eq!(e.exit_code(), 3);
        let text = e.to_string();
        assert!(text.contains("a.bin") && text.contains("token 10 at offset 13") && text.contains("of 10"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Two data-parallel ranks with batch B read, step by step, the two halves of what one
    /// rank with batch 2B reads, through shuffled epochs.
    #[test]
    fn data_parallel_ranks_split_the_global_batch() {
        let dir = std::env::temp_dir().join(format!("tf-tokens-dp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let toks: Vec<u16> = (0..200).collect();
        write_shard(&dir.join("a.bin"), &toks).unwrap();
        let feeds = Feeds { token_input: "ids".into(), token_label: "labels".into(), vocab: None };
        let whole = Batching { batch: 4, seq_len: 3, shuffle: true, seed: 5, partition: Partition::WHOLE };
        let mut single = TokenLoader::open(&dir, "data.train", whole, &feeds).unwrap();
        let mut ranks: Vec<TokenLoader> = (0..2)
            .map(|index| {
                let b = Batching { batch: 2, partition: Partition { index, count: 2 }, ..whole };
                TokenLoader::open(&dir, "data.train", b, &feeds).unwrap()
            })
            .collect();
        // 199 / 12 = 16 windows per epoch: 40 steps cross two epoch boundaries.
        for _ in 0..40 {
            let want = single.next_batch().unwrap();
            let got: Vec<Batch> = ranks.iter_mut().map(|r| r.next_batch().unwrap()).collect();
            for name in ["ids", "labels"] {
                let joined: Vec<i64> = got.iter().flat_map(|b| b[name].as_slice::<i64>().to_vec()).collect();
                assert_eq!(joined, want[name].as_slice::<i64>());
            }
            assert_eq!(ranks[1].position(), single.position());
        }
        let too_big = Batching { batch: 40, partition: Partition { index: 0, count: 2 }, ..whole };
        let e = TokenLoader::open(&dir, "data.train", too_big, &feeds).err().unwrap();
        assert!(e.to_string().contains("2 data-parallel ranks"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
