//! ZeRO's partition of the training state among the data-parallel ranks (Rajbhandari et al.,
//! stages 1 and 2, as DeepSpeed lays them out).
//!
//! The weights, in the session's order, are laid end to end as one flat f32 vector of `total`
//! elements, padded to `ranks · shard` so that every rank owns an equal, contiguous `shard`:
//!
//! ```text
//!   flat:  | w0 ........ | w1 .... | w2 ............... |pad|
//!   owner: |   rank 0        |   rank 1       |  rank 2    |
//! ```
//!
//! A rank's shard cuts across weights, so what it owns is a list of pieces (a weight, a range of
//! its elements, and where that range sits in the shard). Updates are element-wise (SGD, Adam,
//! AdamW), so a piece updates like the whole weight would; LAMB, whose trust ratio needs a
//! whole weight's norms, is refused with ZeRO (as DeepSpeed's ZeRO refuses it).

/// A contiguous range of one weight's (flattened) elements inside a rank's shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index of the weight in the session's order.
    pub weight: usize,
    /// First element of the range within the weight.
    pub start: usize,
    pub len: usize,
    /// Where the range starts within the shard.
    pub at: usize,
}

/// Where every weight sits in the flat vector, and each rank's shard of it.
#[derive(Clone, Debug)]
pub struct FlatLayout {
    /// Element offset of each weight in the flat vector.
    pub offsets: Vec<usize>,
    /// Elements of each weight.
    pub lens: Vec<usize>,
    /// Elements of all weights, unpadded.
    pub total: usize,
    /// Elements each rank owns (the last rank's shard ends in padding).
    pub shard: usize,
    pub ranks: usize,
}

impl FlatLayout {
    pub fn new(lens: &[usize], ranks: usize) -> FlatLayout {
        let mut offsets = Vec::with_capacity(lens.len());
        let mut total = 0;
        for &n in lens {
            offsets.push(total);
            total += n;
        }
        FlatLayout { offsets, lens: lens.to_vec(), total, shard: total.div_ceil(ranks.max(1)), ranks: ranks.max(1) }
    }

    /// Elements of the padded flat vector: what reduce-scatter and all-gather move.
    pub fn padded(&self) -> usize {
        self.shard * self.ranks
    }

    /// The pieces of `rank`'s shard, in flat order.
    pub fn pieces(&self, rank: usize) -> Vec<Piece> {
        let (lo, hi) = (rank * self.shard, ((rank + 1) * self.shard).min(self.total));
        let mut out = Vec::new();
        for (w, (&off, &n)) in self.offsets.iter().zip(&self.lens).enumerate() {
            let (a, b) = (off.max(lo), (off + n).min(hi));
            if a < b {
                out.push(Piece { weight: w, start: a - off, len: b - a, at: a - lo });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of every weight is owned by exactly one rank, at the place the flat
    /// layout says, for many weight sizes and rank counts.
    #[test]
    fn shards_cover_every_element_once() {
        let cases: &[&[usize]] = &[&[1], &[7, 3, 12], &[5, 5, 5, 5], &[100], &[1, 1, 1], &[64, 1, 33, 2, 9]];
        for lens in cases {
            for ranks in 1..=5 {
                let l = FlatLayout::new(lens, ranks);
                assert!(l.padded() >= l.total && l.padded() - l.total < ranks);
                let mut seen: Vec<Vec<usize>> = lens.iter().map(|&n| vec![0; n]).collect();
                for r in 0..ranks {
                    let mut at = 0;
                    for p in l.pieces(r) {
                        assert_eq!(p.at, at, "pieces of rank {r} are contiguous in its shard");
                        at += p.len;
                        assert_eq!(l.offsets[p.weight] + p.start, r * l.shard + p.at);
                        for count in &mut seen[p.weight][p.start..p.start + p.len] {
                            *count += 1;
                        }
                    }
                    assert!(at <= l.shard);
                }
                assert!(seen.iter().flatten().all(|&c| c == 1), "{lens:?} over {ranks} ranks");
            }
        }
    }
}
