//! `prepare-data --images`: a folder in torchvision's ImageFolder layout (a subfolder of images
//! per class) → onnxSamples shards of `[3, size, size]` float32 images and their int64 class
//! labels, split into `train/` and `val/`, with `classes.json` naming the labels.
//!
//! Each image becomes what `datasets.ImageFolder(dir, transform=Compose([Resize(size),
//! CenterCrop(size), ToTensor(), Normalize(mean, std)]))` yields for it: the classes, the files
//! taken and skipped, the decoding to RGB and the resize follow torchvision and Pillow, so a
//! model trained on these shards sees the tensors it would see in PyTorch
//! (tests/prepare_images.rs compares them). Where they differ: JPEG files, decoded by zune-jpeg
//! rather than libjpeg-turbo, are off by a few levels in places (its chroma upsampling and IDCT
//! round differently); 16-bit grayscale PNGs keep their high byte where Pillow saturates every
//! value above 255; TIFF, PPM and PGM files are skipped with a warning.

mod resample;

use crate::data::samples::write_shard;
use crate::error::{Error, Result};
use crate::onnx::tensor::tensor_to_proto;
use crate::rng::{mix, Rng};
use crate::tensor::Tensor;
use image::DynamicImage;
use prost::Message;
use rayon::prelude::*;
use resample::Window;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

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

/// Bytes of samples per shard file at most (a shard holds at least one sample).
pub const SHARD_BYTES: usize = 64 << 20;

/// The extensions of ImageFolder's IMG_EXTENSIONS that this build decodes (case-insensitive).
const EXTENSIONS: [&str; 5] = ["jpg", "jpeg", "png", "bmp", "webp"];
/// The rest of IMG_EXTENSIONS: torchvision would load these, we skip them and say so.
const UNDECODED: [&str; 4] = ["ppm", "pgm", "tif", "tiff"];

/// Streams of the seeded shuffles: which images of a class go to val, and the samples' order.
const SPLIT_STREAM: u64 = 0x5911;
const ORDER_STREAM: u64 = 0x04DE;

fn extension_in(path: &Path, list: &[&str]) -> bool {
    path.extension().and_then(|e| e.to_str()).is_some_and(|e| list.iter().any(|x| e.eq_ignore_ascii_case(x)))
}

/// What ImageFolder finds in a folder.
struct Folder {
    /// The subfolders' names, sorted; a class's label is its index.
    classes: Vec<String>,
    /// Per class, its images in ImageFolder's order.
    images: Vec<Vec<PathBuf>>,
    /// Files that are not images by their extension, in the same order.
    skipped: Vec<PathBuf>,
}

fn read_dir_sorted(dir: &Path) -> Result<Vec<(OsString, PathBuf)>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::Config(format!("{}: {e}", dir.display())))?;
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::Config(format!("{}: {e}", dir.display())))?;
        out.push((entry.file_name(), entry.path()));
    }
    out.sort();
    Ok(out)
}

/// The files under `dir` in the order of ImageFolder's make_dataset: `sorted(os.walk(dir,
/// followlinks=True))`, which sorts the folders by their path as a string (not depth first),
/// and each folder's files by name.
fn walk(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut folders: Vec<(PathBuf, Vec<PathBuf>)> = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let mut files = Vec::new();
        for (_, path) in read_dir_sorted(&d)? {
            // is_dir follows symbolic links, as os.walk(followlinks=True) does.
            if path.is_dir() {
                pending.push(path);
            } else {
                files.push(path);
            }
        }
        folders.push((d, files));
    }
    folders.sort_by(|a, b| a.0.as_os_str().cmp(b.0.as_os_str()));
    Ok(folders.into_iter().flat_map(|(_, files)| files).collect())
}

fn scan(folder: &Path) -> Result<Folder> {
    let entries = read_dir_sorted(folder).map_err(|e| Error::Config(format!("--images {e}")))?;
    let class_dirs: Vec<(String, PathBuf)> = entries
        .into_iter()
        .filter(|(_, path)| path.is_dir())
        .map(|(name, path)| (name.to_string_lossy().into_owned(), path))
        .collect();
    if class_dirs.is_empty() {
        return Err(Error::Config(format!(
            "--images {}: no class folders; ImageFolder's layout is one subfolder of images per class \
             (DIR/cat/1.jpg, DIR/dog/2.png, ...)",
            folder.display()
        )));
    }
    let (mut images, mut skipped, mut empty) = (Vec::new(), Vec::new(), Vec::new());
    for (_, dir) in &class_dirs {
        let (taken, rest): (Vec<PathBuf>, Vec<PathBuf>) =
            walk(dir)?.into_iter().partition(|p| extension_in(p, &EXTENSIONS));
        if taken.is_empty() {
            empty.push(dir.display().to_string());
        }
        images.push(taken);
        skipped.extend(rest);
    }
    if !empty.is_empty() {
        return Err(Error::Config(format!(
            "--images {}: class folder(s) {} hold no image (.{}); remove them or add images \
             (torchvision's ImageFolder refuses them too)",
            folder.display(),
            empty.join(", "),
            EXTENSIONS.join(" .")
        )));
    }
    Ok(Folder { classes: class_dirs.into_iter().map(|(name, _)| name).collect(), images, skipped })
}

/// One image of the folder and its class.
struct Item<'a> {
    path: &'a Path,
    label: usize,
}

/// Per class, a seeded shuffle, then `round(count × val_fraction)` of its images to val and
/// the rest to train; each split then in a seeded order.
fn split(images: &[Vec<PathBuf>], val_fraction: f64, seed: u64) -> (Vec<Item<'_>>, Vec<Item<'_>>) {
    let (mut train, mut val) = (Vec::new(), Vec::new());
    let mut rng = Rng::new(mix(seed ^ SPLIT_STREAM));
    for (label, files) in images.iter().enumerate() {
        let mut order: Vec<&PathBuf> = files.iter().collect();
        rng.shuffle(&mut order);
        let n_val = ((files.len() as f64) * val_fraction).round() as usize;
        val.extend(order[..n_val].iter().map(|p| Item { path: p.as_path(), label }));
        train.extend(order[n_val..].iter().map(|p| Item { path: p.as_path(), label }));
    }
    let mut rng = Rng::new(mix(seed ^ ORDER_STREAM));
    rng.shuffle(&mut train);
    rng.shuffle(&mut val);
    (train, val)
}

/// An image as Pillow's `convert("RGB")` sees it: gray replicated, alpha dropped, a palette
/// looked up (the decoder expands it). 16-bit samples keep their high byte, as Pillow reads
/// 16-bit RGB, RGBA and gray+alpha PNGs (the image crate would round v / 257 instead).
fn to_rgb8(image: DynamicImage) -> image::RgbImage {
    match image {
        DynamicImage::ImageLuma16(_)
        | DynamicImage::ImageLumaA16(_)
        | DynamicImage::ImageRgb16(_)
        | DynamicImage::ImageRgba16(_) => {
            let wide = image.to_rgb16();
            let bytes = wide.as_raw().iter().map(|&v| (v >> 8) as u8).collect();
            image::RgbImage::from_raw(wide.width(), wide.height(), bytes).expect("same dimensions")
        }
        other => other.to_rgb8(),
    }
}

fn decode(path: &Path) -> Result<image::RgbImage> {
    // The content decides the format, as with Pillow; the extension only where it cannot.
    let reader = image::ImageReader::open(path)
        .and_then(|r| r.with_guessed_format())
        .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
    let image = reader.decode().map_err(|e| {
        Error::Corrupt(format!(
            "{}: cannot decode the image ({e}): the file is damaged, truncated or not an image; \
             replace or remove it",
            path.display()
        ))
    })?;
    if image.width() == 0 || image.height() == 0 {
        return Err(Error::Corrupt(format!("{}: the image has no pixels", path.display())));
    }
    Ok(to_rgb8(image))
}

/// `Resize(size)`'s output (width, height): the shorter side to `size`, the longer to
/// `int(size * long / short)` as torchvision computes it (a float division, truncated).
fn resized((width, height): (usize, usize), size: usize) -> (usize, usize) {
    let (short, long) = if width <= height { (width, height) } else { (height, width) };
    let long_to = ((size * long) as f64 / short as f64) as usize;
    if width <= height {
        (size, long_to)
    } else {
        (long_to, size)
    }
}

/// `CenterCrop(size)`'s window of a (width, height) image at least `size` on each side: offsets
/// `int(round((length - size) / 2.0))`, where Python's round takes halves to even.
fn center_crop((width, height): (usize, usize), size: usize) -> Window {
    let offset = |length: usize| ((length - size) as f64 / 2.0).round_ties_even() as usize;
    Window { left: offset(width), top: offset(height), width: size, height: size }
}

/// torchvision's `Resize(size)`, `CenterCrop(size)`, `ToTensor()` and `Normalize(mean, std)`
/// of an RGB image: [3, size, size], in the same f32 operations (x / 255, then (x - mean) / std).
fn to_tensor(rgb: &image::RgbImage, opts: &ImageOptions) -> Vec<f32> {
    let size = opts.size as usize;
    let from = (rgb.width() as usize, rgb.height() as usize);
    let to = resized(from, size);
    let pixels = resample::resize_crop(rgb.as_raw(), from, to, center_crop(to, size));
    let plane = size * size;
    let mut chw = vec![0f32; 3 * plane];
    for (i, px) in pixels.chunks_exact(3).enumerate() {
        for c in 0..3 {
            chw[c * plane + i] = (f32::from(px[c]) / 255.0 - opts.mean[c]) / opts.std[c];
        }
    }
    chw
}

fn sample(item: &Item, opts: &ImageOptions) -> Result<Vec<(String, Tensor)>> {
    let size = opts.size as usize;
    let image = to_tensor(&decode(item.path)?, opts);
    Ok(vec![
        (opts.input_name.clone(), Tensor::from_vec(&[3, size, size], image)),
        (opts.label_name.clone(), Tensor::from_vec(&[], vec![item.label as i64])),
    ])
}

/// Bytes one sample takes in a shard: its tensors' length prefixes and TensorProtos (all
/// samples alike: the values are raw bytes of fixed shapes), and the sample's own prefix.
fn sample_bytes(opts: &ImageOptions) -> usize {
    let size = opts.size as usize;
    let image = Tensor::from_vec(&[3, size, size], vec![0f32; 3 * size * size]);
    let label = Tensor::from_vec(&[], vec![0i64]);
    4 + [(&opts.input_name, &image), (&opts.label_name, &label)]
        .iter()
        .map(|(name, t)| 4 + tensor_to_proto(name, t).encoded_len())
        .sum::<usize>()
}

/// Decodes `items` shard by shard (in parallel within a shard; the order is the items', whatever
/// the thread count) and writes `dir/prefix_NNNNNN.pb`. Returns the number of shards.
fn write_split(
    dir: &Path,
    prefix: &str,
    items: &[Item],
    opts: &ImageOptions,
    bar: &indicatif::ProgressBar,
) -> Result<usize> {
    std::fs::create_dir_all(dir).map_err(|e| Error::Runtime(format!("{}: {e}", dir.display())))?;
    let per_shard = (SHARD_BYTES / sample_bytes(opts)).max(1);
    let mut shards = 0;
    for chunk in items.chunks(per_shard) {
        let decoded: Vec<Result<_>> = chunk
            .par_iter()
            .map(|item| {
                let s = sample(item, opts);
                bar.inc(1);
                s
            })
            .collect();
        let samples = decoded.into_iter().collect::<Result<Vec<_>>>()?;
        write_shard(&dir.join(format!("{prefix}_{shards:06}.pb")), &samples)?;
        shards += 1;
    }
    super::remove_stale_shards(dir, prefix, "pb", shards)?;
    Ok(shards)
}

pub fn prepare_images(folder: &Path, output: &Path, opts: &ImageOptions) -> Result<()> {
    if opts.input_name == opts.label_name {
        return Err(Error::Config(format!(
            "--image-input and --label-input are both {:?}: each tensor of a sample needs its own name",
            opts.input_name
        )));
    }
    let found = scan(folder)?;
    let total: usize = found.images.iter().map(Vec::len).sum();
    let (train, val) = split(&found.images, opts.val_fraction, opts.seed);
    if train.is_empty() {
        return Err(Error::Config(format!(
            "--val-fraction {} leaves no image for training ({total} images in {} classes)",
            opts.val_fraction,
            found.classes.len()
        )));
    }

    let bar = super::progress(total as u64, "images");
    let train_dir = output.join("train");
    let train_shards = write_split(&train_dir, "train", &train, opts, &bar)?;
    let val_dir = output.join("val");
    let val_shards = if val.is_empty() {
        super::remove_stale_shards(&val_dir, "val", "pb", 0)?;
        0
    } else {
        write_split(&val_dir, "val", &val, opts, &bar)?
    };
    bar.finish_and_clear();

    let classes_path = output.join("classes.json");
    let classes = serde_json::to_string_pretty(&found.classes).expect("strings serialize");
    crate::files::write_atomically(&classes_path, (classes + "\n").as_bytes())?;

    println!("classes: {} (names by label in {})", found.classes.len(), classes_path.display());
    println!("train: {} images in {train_shards} shard(s) under {}", train.len(), train_dir.display());
    if val_shards > 0 {
        println!("val:   {} images in {val_shards} shard(s) under {}", val.len(), val_dir.display());
    }
    if let Some(first) = found.skipped.first() {
        println!(
            "skipped {} file(s) that are not .{} images, as ImageFolder skips them; the first: {}",
            found.skipped.len(),
            EXTENSIONS.join(" ."),
            first.display()
        );
    }
    let undecoded: Vec<&PathBuf> = found.skipped.iter().filter(|p| extension_in(p, &UNDECODED)).collect();
    if let Some(first) = undecoded.first() {
        eprintln!(
            "warning: {} of the skipped files are images torchvision's ImageFolder would load (.{}), \
             which this build does not decode; convert them to PNG to keep them. The first: {}",
            undecoded.len(),
            UNDECODED.join(" ."),
            first.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resize_and_crop_sizes_follow_torchvision() {
        // int(12 * 23 / 17) = 16; int(12 * 40 / 31) = 15.
        assert_eq!(resized((23, 17), 12), (16, 12));
        assert_eq!(resized((31, 40), 12), (12, 15));
        assert_eq!(resized((5, 5), 12), (12, 12));
        // round(0.5) = 0, round(1.5) = 2, round(2.5) = 2 in Python.
        assert_eq!(center_crop((13, 12), 12).left, 0);
        assert_eq!(center_crop((12, 15), 12).top, 2);
        assert_eq!(center_crop((17, 12), 12).left, 2);
        assert_eq!(center_crop((12, 12), 12), Window { left: 0, top: 0, width: 12, height: 12 });
    }

    #[test]
    fn sixteen_bit_samples_keep_their_high_byte() {
        let wide = image::ImageBuffer::from_raw(1, 1, vec![0x12ffu16, 0x00ff, 0xff00]).unwrap();
        let rgb = to_rgb8(DynamicImage::ImageRgb16(wide));
        assert_eq!(rgb.as_raw(), &[0x12, 0x00, 0xff]);
        let gray = image::ImageBuffer::from_raw(1, 1, vec![0x8081u16]).unwrap();
        assert_eq!(to_rgb8(DynamicImage::ImageLuma16(gray)).as_raw(), &[0x80, 0x80, 0x80]);
    }

    #[test]
    fn sample_bytes_is_what_a_shard_of_one_sample_takes() {
        let opts = ImageOptions {
            size: 5,
            input_name: "pixel_values".into(),
            label_name: "labels".into(),
            mean: [0.0; 3],
            std: [1.0; 3],
            val_fraction: 0.0,
            seed: 0,
        };
        let dir = std::env::temp_dir().join(format!("tf-images-bytes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("one.pb");
        let one = vec![
            ("pixel_values".to_string(), Tensor::from_vec(&[3, 5, 5], vec![0.5f32; 75])),
            ("labels".to_string(), Tensor::from_vec(&[], vec![1234567i64])),
        ];
        write_shard(&path, &[one]).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, sample_bytes(&opts));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn each_class_splits_by_its_own_count_and_the_order_is_seeded() {
        let images: Vec<Vec<PathBuf>> =
            [4, 1, 7].iter().map(|&n| (0..n).map(|i| PathBuf::from(format!("{n}/{i}.png"))).collect()).collect();
        let (train, val) = split(&images, 0.25, 3);
        let per_class = |items: &[Item], label| items.iter().filter(|i| i.label == label).count();
        // round(4 × 0.25) = 1, round(0.25) = 0, round(1.75) = 2.
        assert_eq!([0, 1, 2].map(|l| per_class(&val, l)), [1, 0, 2]);
        assert_eq!([0, 1, 2].map(|l| per_class(&train, l)), [3, 1, 5]);
        let names = |items: &[Item]| items.iter().map(|i| i.path.to_path_buf()).collect::<Vec<_>>();
        let (again, _) = split(&images, 0.25, 3);
        assert_eq!(names(&train), names(&again));
        let (other, _) = split(&images, 0.25, 4);
        assert_ne!(names(&train), names(&other));
    }
}
