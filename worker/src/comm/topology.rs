//! Where each rank sits in the parallel layout. Ranks are numbered with tensor parallelism
//! innermost, then data, then pipeline (DESIGN.md):
//!
//! ```text
//! rank = tp + tensor · (dp + data · pp)
//! ```
//!
//! so the ranks of one TP group are neighbours (on one node, when a node has at least `tensor`
//! slots, which is where TP's per-layer all-reduces need the fastest links), the DP replicas of
//! a stage come next, and pipeline stages, which only exchange activations, are furthest apart.
//! Pure arithmetic: nothing here talks to MPI.

use crate::error::{Error, Result};

/// The three parallel axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    Data,
    Tensor,
    Pipeline,
}

impl Axis {
    pub const ALL: [Axis; 3] = [Axis::Data, Axis::Tensor, Axis::Pipeline];

    /// The group's name in logs and errors; the configuration key is `parallelism.<name>`.
    pub fn name(self) -> &'static str {
        match self {
            Axis::Data => "data",
            Axis::Tensor => "tensor",
            Axis::Pipeline => "pipeline",
        }
    }
}

/// A rank's position on each axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Coords {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
}

impl Coords {
    pub fn on(self, axis: Axis) -> usize {
        match axis {
            Axis::Data => self.dp,
            Axis::Tensor => self.tp,
            Axis::Pipeline => self.pp,
        }
    }
}

/// The sizes of the three axes, whose product is the world size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub data: usize,
    pub tensor: usize,
    pub pipeline: usize,
}

impl Layout {
    /// Checks that the layout covers exactly the world: every rank has one place and every place
    /// one rank. Checked before anything starts, since a wrong layout would otherwise show as a
    /// hang in the first collective.
    pub fn new(data: usize, tensor: usize, pipeline: usize, world_size: usize) -> Result<Layout> {
        let product = data.checked_mul(tensor).and_then(|n| n.checked_mul(pipeline));
        if data == 0 || tensor == 0 || pipeline == 0 || product != Some(world_size) {
            let product = product.map_or_else(|| "overflows".to_string(), |n| n.to_string());
            return Err(Error::Config(format!(
                "parallelism.data ({data}) × parallelism.tensor ({tensor}) × parallelism.pipeline ({pipeline}) \
                 = {product}, but the world has {world_size} rank(s) (mpirun -np): they must be equal"
            )));
        }
        Ok(Layout { data, tensor, pipeline })
    }

    pub fn world_size(&self) -> usize {
        self.data * self.tensor * self.pipeline
    }

    pub fn size(&self, axis: Axis) -> usize {
        match axis {
            Axis::Data => self.data,
            Axis::Tensor => self.tensor,
            Axis::Pipeline => self.pipeline,
        }
    }

    /// The coordinates of a world rank; `rank` must be below the world size.
    pub fn coords(&self, rank: usize) -> Coords {
        assert!(rank < self.world_size(), "rank {rank} is outside a world of {}", self.world_size());
        Coords { tp: rank % self.tensor, dp: (rank / self.tensor) % self.data, pp: rank / (self.tensor * self.data) }
    }

    /// The world rank at some coordinates.
    pub fn rank(&self, c: Coords) -> usize {
        assert!(c.dp < self.data && c.tp < self.tensor && c.pp < self.pipeline, "{c:?} is outside {self:?}");
        c.tp + self.tensor * (c.dp + self.data * c.pp)
    }

    /// The world ranks of `rank`'s group along `axis`: the ranks that share its other two
    /// coordinates, ordered by their coordinate on `axis` (which is their rank in the group).
    pub fn group(&self, axis: Axis, rank: usize) -> Vec<usize> {
        let c = self.coords(rank);
        (0..self.size(axis))
            .map(|i| {
                let mut m = c;
                match axis {
                    Axis::Data => m.dp = i,
                    Axis::Tensor => m.tp = i,
                    Axis::Pipeline => m.pp = i,
                }
                self.rank(m)
            })
            .collect()
    }

    /// Which of the axis's groups `rank` belongs to, numbered 0.. in the order of their lowest
    /// rank: the colour that splits the world into these groups.
    pub fn group_index(&self, axis: Axis, rank: usize) -> usize {
        let c = self.coords(rank);
        match axis {
            Axis::Tensor => c.dp + self.data * c.pp,
            Axis::Data => c.tp + self.tensor * c.pp,
            Axis::Pipeline => c.tp + self.tensor * c.dp,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn tensor_is_innermost_then_data_then_pipeline() {
        // 8 ranks, dp=2 × tp=2 × pp=2: ranks 0,1 form a TP pair, 0,2 a DP pair, 0,4 a PP pair.
        let l = Layout::new(2, 2, 2, 8).unwrap();
        assert_eq!(l.coords(0), Coords { dp: 0, tp: 0, pp: 0 });
        assert_eq!(l.coords(1), Coords { dp: 0, tp: 1, pp: 0 });
        assert_eq!(l.coords(2), Coords { dp: 1, tp: 0, pp: 0 });
        assert_eq!(l.coords(5), Coords { dp: 0, tp: 1, pp: 1 });
        assert_eq!(l.coords(7), Coords { dp: 1, tp: 1, pp: 1 });
        assert_eq!(l.group(Axis::Tensor, 5), vec![4, 5]);
        assert_eq!(l.group(Axis::Data, 5), vec![5, 7]);
        assert_eq!(l.group(Axis::Pipeline, 5), vec![1, 5]);
    }

    #[test]
    fn four_ranks_data_two_tensor_two() {
        let l = Layout::new(2, 2, 1, 4).unwrap();
        assert_eq!(l.group(Axis::Tensor, 0), vec![0, 1]);
        assert_eq!(l.group(Axis::Tensor, 3), vec![2, 3]);
        assert_eq!(l.group(Axis::Data, 0), vec![0, 2]);
        assert_eq!(l.group(Axis::Data, 3), vec![1, 3]);
        assert_eq!(l.group(Axis::Pipeline, 2), vec![2]);
    }

    /// For every layout of up to 24 ranks: coordinates and ranks are inverse, each axis's groups
    /// partition the world, a rank's position in its group is its coordinate, and the group
    /// index is shared by exactly the group's members.
    #[test]
    fn groups_partition_the_world_on_every_axis() {
        for world in 1..=24 {
            for data in (1..=world).filter(|d| world % d == 0) {
                for tensor in (1..=world / data).filter(|t| (world / data) % t == 0) {
                    let pipeline = world / data / tensor;
                    let l = Layout::new(data, tensor, pipeline, world).unwrap();
                    for rank in 0..world {
                        assert_eq!(l.rank(l.coords(rank)), rank);
                    }
                    for axis in Axis::ALL {
                        let mut seen = BTreeSet::new();
                        for rank in 0..world {
                            let g = l.group(axis, rank);
                            assert_eq!(g.len(), l.size(axis));
                            assert_eq!(g[l.coords(rank).on(axis)], rank, "{l:?} {axis:?} rank {rank}");
                            for &m in &g {
                                assert_eq!(l.group(axis, m), g);
                                assert_eq!(l.group_index(axis, m), l.group_index(axis, rank));
                            }
                            seen.insert(l.group_index(axis, rank));
                        }
                        // Group indices are dense: 0 .. world / axis size.
                        assert_eq!(seen, (0..world / l.size(axis)).collect());
                    }
                }
            }
        }
    }

    #[test]
    fn a_layout_that_does_not_cover_the_world_names_the_keys_and_the_world() {
        let e = Layout::new(2, 2, 1, 3).unwrap_err();
        let msg = e.to_string();
        for needle in ["parallelism.data (2)", "parallelism.tensor (2)", "parallelism.pipeline (1)", "= 4", "3 rank"] {
            assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
        }
        assert_eq!(e.exit_code(), 2);
        assert!(Layout::new(0, 1, 1, 1).is_err());
        assert!(Layout::new(usize::MAX, 2, 1, 4).unwrap_err().to_string().contains("overflows"));
    }
}
