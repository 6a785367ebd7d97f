//! `prepare-data --images` against torchvision: the binary turns the ImageFolder under
//! tests/data/torch_images/folder/ into sample shards, and each sample must be the tensor
//! torchvision's `Compose([Resize(12), CenterCrop(12), ToTensor(), Normalize(mean, std)])`
//! made of its image (tests/data/torch_images/export.py wrote both). Then the train/val split,
//! and the errors that name what is wrong.

mod common;

use common::scratch;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use tensorfleet_worker::data::samples::read_shard;
use tensorfleet_worker::tensor::DType;

const MEAN: &str = "0.485,0.456,0.406";
const STD: &str = "0.229,0.224,0.225";
/// zune-jpeg (the image crate's JPEG decoder) rounds its IDCT and chroma upsampling unlike
/// libjpeg-turbo (Pillow's), so JPEG pixels may differ by a few 8-bit levels; every other
/// format must come out bit for bit.
const JPEG_LEVELS: f32 = 3.0;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/torch_images")
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(data().join("expected.json")).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// `prepare-data --images folder --output out` with the test's size, mean and std.
fn prepare(folder: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tensorfleet-worker"));
    cmd.args(["prepare-data", "--images", folder.to_str().unwrap(), "--output", out.to_str().unwrap()])
        .args(["--image-size", "12", "--mean", MEAN, "--std", STD])
        .args(extra);
    cmd
}

/// Every sample of a split's shards: (label, image [3, 12, 12]).
fn samples(dir: &Path) -> Vec<(i64, Vec<f32>)> {
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    shards.sort();
    let mut out = Vec::new();
    for shard in shards {
        for sample in read_shard(&shard).unwrap() {
            let names: Vec<&str> = sample.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, ["input", "labels"], "{}", shard.display());
            let (image, label) = (&sample[0].1, &sample[1].1);
            assert_eq!((image.dtype(), image.shape()), (DType::F32, &[3, 12, 12][..]));
            assert_eq!((label.dtype(), label.shape()), (DType::I64, &[][..]));
            out.push((label.as_slice::<i64>()[0], image.as_slice::<f32>().to_vec()));
        }
    }
    out
}

#[test]
fn samples_are_torchvisions_tensors() {
    let want = expected();
    let dir = scratch("images-torchvision");
    let o = prepare(&data().join("folder"), &dir, &["--val-fraction", "0"]).output().unwrap();
    assert!(o.status.success(), "prepare-data: {}", text(&o.stderr));
    let stdout = text(&o.stdout);
    assert!(stdout.contains("train: 8 images in 1 shard(s)"), "{stdout}");
    assert!(stdout.contains("skipped 1 file(s)") && stdout.contains("notes.txt"), "{stdout}");
    assert!(!dir.join("val").exists(), "--val-fraction 0 writes no val/");
    let classes: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("classes.json")).unwrap()).unwrap();
    assert_eq!(classes, want["classes"]);

    let (mean, std) = (floats(&want["mean"]), floats(&want["std"]));
    let mut got = samples(&dir.join("train"));
    let images = want["images"].as_array().unwrap();
    assert_eq!(got.len(), images.len());
    let (mut worst_exact, mut worst_jpeg) = (0f32, 0f32);
    for image in images {
        let path = image["path"].as_str().unwrap();
        let label = image["label"].as_i64().unwrap();
        // torchvision's tensor, rebuilt from its 8-bit pixels in the float32 operations
        // export.py checked bit for bit: (pixel / 255 - mean) / std.
        let tensor: Vec<f32> = image["pixels"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, v)| (v.as_u64().unwrap() as f32 / 255.0 - mean[i / 144]) / std[i / 144])
            .collect();
        // The shards are shuffled: this image's sample is the closest one of its class, in
        // 8-bit levels (a difference times std times 255).
        let levels = |values: &[f32]| {
            values
                .iter()
                .zip(&tensor)
                .enumerate()
                .map(|(i, (a, b))| (a - b).abs() * std[i / 144] * 255.0)
                .fold(0f32, f32::max)
        };
        let (at, diff) = got
            .iter()
            .enumerate()
            .filter(|(_, (l, _))| *l == label)
            .map(|(at, (_, values))| (at, levels(values)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or_else(|| panic!("{path}: no sample left with label {label}"));
        let values = got.remove(at).1;
        let is_jpeg = path.to_lowercase().ends_with(".jpg");
        println!("{path}: label {label}, max difference {diff:.3} levels of 255");
        if is_jpeg {
            assert!(diff <= JPEG_LEVELS, "{path}: {diff} levels from torchvision's");
            worst_jpeg = worst_jpeg.max(diff);
        } else {
            assert!(values == tensor, "{path}: not torchvision's tensor bit for bit ({diff} levels off)");
            worst_exact = worst_exact.max(diff);
        }
    }
    println!(
        "worst difference from torchvision {}: {worst_exact} levels (PNG, BMP, WebP), {worst_jpeg} levels (JPEG)",
        want["torchvision"]
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn val_takes_its_share_of_each_class_and_the_output_is_seeded() {
    let dir = scratch("images-split");
    let all = dir.join("all");
    assert!(prepare(&data().join("folder"), &all, &["--val-fraction", "0"]).output().unwrap().status.success());
    let half = dir.join("half");
    let o = prepare(&data().join("folder"), &half, &["--val-fraction", "0.5", "--seed", "7"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let (train, val) = (samples(&half.join("train")), samples(&half.join("val")));
    // Bird has 2 images, ant 3, cat 3: round(n × 0.5) = 1, 2, 2 of them in val.
    for (label, n) in [(0, 2.0f64), (1, 3.0), (2, 3.0)] {
        let in_val = val.iter().filter(|(l, _)| *l == label).count();
        assert_eq!(in_val, (n * 0.5).round() as usize, "class {label}");
    }
    let mut union: Vec<(i64, Vec<u32>)> =
        train.iter().chain(&val).map(|(l, v)| (*l, v.iter().map(|x| x.to_bits()).collect())).collect();
    let mut whole: Vec<(i64, Vec<u32>)> =
        samples(&all.join("train")).iter().map(|(l, v)| (*l, v.iter().map(|x| x.to_bits()).collect())).collect();
    union.sort();
    whole.sort();
    assert_eq!(union, whole, "train and val together hold every image once");

    // The same seed gives the same bytes on one thread as on all of them.
    let again = dir.join("again");
    let o = prepare(&data().join("folder"), &again, &["--val-fraction", "0.5", "--seed", "7"])
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    for shard in ["train/train_000000.pb", "val/val_000000.pb"] {
        assert_eq!(std::fs::read(half.join(shard)).unwrap(), std::fs::read(again.join(shard)).unwrap(), "{shard}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A copy of the test folder to damage.
fn copy_folder(to: &Path) {
    for entry in walk(&data().join("folder")) {
        let target = to.join(entry.strip_prefix(data().join("folder")).unwrap());
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(&entry, &target).unwrap();
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

#[test]
fn bad_folders_exit_2_and_undecodable_images_exit_3_naming_them() {
    let dir = scratch("images-errors");
    let out = dir.join("out");

    let missing = dir.join("no-such-folder");
    let o = prepare(&missing, &out, &[]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("no-such-folder"), "{}", text(&o.stderr));

    let flat = dir.join("flat");
    std::fs::create_dir_all(&flat).unwrap();
    std::fs::copy(data().join("folder/ant/a_rgb.png"), flat.join("a.png")).unwrap();
    let o = prepare(&flat, &out, &[]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("no class folders"), "{}", text(&o.stderr));

    let empty = dir.join("empty");
    copy_folder(&empty);
    std::fs::create_dir_all(empty.join("dog")).unwrap();
    std::fs::write(empty.join("dog/readme.md"), "no images yet\n").unwrap();
    let o = prepare(&empty, &out, &[]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains(&empty.join("dog").display().to_string()), "{}", text(&o.stderr));

    let corrupt = dir.join("corrupt");
    copy_folder(&corrupt);
    let png = corrupt.join("ant/a_rgb.png");
    let bytes = std::fs::read(&png).unwrap();
    std::fs::write(&png, &bytes[..bytes.len() / 2]).unwrap();
    let o = prepare(&corrupt, &out, &[]).output().unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains(&png.display().to_string()), "{}", text(&o.stderr));
    std::fs::remove_dir_all(&dir).ok();
}
