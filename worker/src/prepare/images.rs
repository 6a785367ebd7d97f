//! ImageFolder → onnxSamples shards (to be written).

use crate::error::Result;
use std::path::Path;

/// How images become tensors (see `prepare_images`).
#[derive(Clone, Debug)]
pub struct ImageOptions {
    /// The side of the square each image is resized (shorter side) and center-cropped to.
    pub size: u32,
    /// The graph input the image tensor feeds, and the one its label feeds.
    pub input_name: String,
    pub label_name: String,
    /// Per-channel normalization after scaling to [0, 1] (torchvision's Normalize).
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub val_fraction: f64,
    pub seed: u64,
}

pub fn prepare_images(_folder: &Path, _output: &Path, _opts: &ImageOptions) -> Result<()> {
    unimplemented!("the helper writes this")
}
