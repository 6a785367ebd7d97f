#!/usr/bin/env python3
"""Write a tiny ImageFolder and the tensors torchvision makes of it, as test data for
`tensorfleet-worker prepare-data --images` (tests/prepare_images.rs).

    python export.py [--out-dir DIR]      # default: this script's directory

Writes
  folder/        3 classes, 8 images, seeded pixels (a smooth pattern plus noise, like a photo):
                 PNGs in RGB, grayscale "L", RGBA (in a nested subfolder) and palette "P", JPEGs
                 (one named .JPG), a BMP and a lossy WebP; one image smaller than the crop (so
                 Resize enlarges it), one more than twice as tall as wide (Pillow 13 resizes it
                 vertically first), sizes whose center crops round halves to even; the class
                 names sort by code point ("Bird" before "ant"); and notes.txt, which ImageFolder
                 skips.
  expected.json  the classes, the skipped files, and per image (in ImageFolder's order) its path,
                 label, and the 8-bit pixels after Resize(12) and CenterCrop(12), channel-major
                 [3, 12, 12]: the compact form of the tensor. The tensor of
                 Compose([Resize(12), CenterCrop(12), ToTensor(), Normalize(MEAN, STD)]) is
                 (pixel / 255 - mean) / std in float32, which this script checks bit for bit
                 against torchvision's before writing; with MEAN, STD and the versions of torch,
                 torchvision and Pillow.

Needs: torch, torchvision 0.29, Pillow 13, numpy (`make test-data` installs them).
"""
import argparse
import os
import shutil
import sys

import numpy as np
import PIL
import torch
import torchvision
from PIL import Image
from torchvision import datasets, transforms

# worker/tests/data/torch_oracle.py: what the export scripts share.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_oracle  # noqa: E402

SEED, SIZE = 0, 12
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # ImageNet's

# (path under folder/, width, height, Pillow mode, format, save options)
IMAGES = [
    ("ant/a_rgb.png", 23, 17, "RGB", "PNG", {}),
    ("ant/b_gray.png", 40, 31, "L", "PNG", {}),  # CenterCrop offset 1.5 -> 2
    ("ant/more/c_rgba.png", 16, 40, "RGBA", "PNG", {}),  # 2.5 times as tall: vertical pass first
    ("Bird/d_palette.png", 24, 34, "P", "PNG", {}),  # resized to 12x17: offset 2.5 -> 2
    ("Bird/e_photo.jpg", 40, 31, "RGB", "JPEG", {"quality": 90}),
    ("cat/f_bitmap.bmp", 12, 13, "RGB", "BMP", {}),  # offset 0.5 -> 0
    ("cat/g_photo.JPG", 31, 23, "RGB", "JPEG", {"quality": 75}),
    ("cat/h_lossy.webp", 10, 8, "RGB", "WEBP", {"quality": 80}),  # smaller than the crop
]
SKIPPED = ["Bird/notes.txt"]


def pixels(rng, width, height):
    """A smooth colour pattern with noise, as uint8 [height, width, 3]."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([128 + 100 * np.sin(x / 4.0 + c) * np.cos(y / 3.0 - c) for c in range(3)], -1)
    return np.clip(base + rng.normal(0, 25, (height, width, 3)), 0, 255).astype(np.uint8)


def write_folder(folder):
    shutil.rmtree(folder, ignore_errors=True)
    rng = np.random.default_rng(SEED)
    for path, width, height, mode, fmt, options in IMAGES:
        image = Image.fromarray(pixels(rng, width, height))
        if mode == "RGBA":
            alpha = rng.integers(0, 256, (height, width), dtype=np.uint8)
            image = Image.fromarray(np.dstack([np.asarray(image), alpha]), "RGBA")
        elif mode == "P":
            image = image.convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
        elif mode != "RGB":
            image = image.convert(mode)
        target = os.path.join(folder, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        image.save(target, fmt, **options)
        assert Image.open(target).mode == mode, (path, Image.open(target).mode)
    for path in SKIPPED:
        with open(os.path.join(folder, path), "w") as f:
            f.write("not an image: ImageFolder skips this file\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    out_dir = parser.parse_args().out_dir
    folder = os.path.join(out_dir, "folder")
    write_folder(folder)

    crop = transforms.Compose([transforms.Resize(SIZE), transforms.CenterCrop(SIZE)])
    full = transforms.Compose([crop, transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    dataset = datasets.ImageFolder(folder, transform=full)
    mean, std = np.float32(MEAN)[:, None, None], np.float32(STD)[:, None, None]
    images = []
    for (path, label), (tensor, label_again) in zip(dataset.samples, dataset):
        assert label == label_again
        with open(path, "rb") as f:
            rgb = Image.open(f).convert("RGB")  # ImageFolder's loader
        levels = np.asarray(crop(rgb)).transpose(2, 0, 1)  # [3, SIZE, SIZE] uint8
        # The compact form is exact: torchvision's tensor is this, in float32, bit for bit.
        again = (levels.astype(np.float32) / np.float32(255) - mean) / std
        assert np.array_equal(again, tensor.numpy()), path
        images.append({"path": os.path.relpath(path, folder), "label": label, "pixels": levels.ravel().tolist()})
    assert sorted(i["path"] for i in images) == sorted(p for p, *_ in IMAGES)

    torch_oracle.write_expected(os.path.join(out_dir, "expected.json"), {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "pillow": PIL.__version__,
        "size": SIZE,
        "mean": MEAN,
        "std": STD,
        "classes": dataset.classes,
        "skipped": SKIPPED,
        "images": images,
    })
    print(f"wrote {folder} ({len(images)} images, classes {dataset.classes}) and expected.json")


if __name__ == "__main__":
    main()
