//! Pillow's antialiased bilinear resize of an 8-bit RGB image (`Image.resize(size, BILINEAR)`,
//! what torchvision's `Resize` runs on PIL images), followed by a crop, to the same bytes.
//!
//! Pillow's `ImagingResample` is separable: one pass along each axis, the second over the
//! 8-bit result of the first. Each output pixel reads the input pixels within the triangle
//! filter's support around its center; when shrinking, the support widens by the shrink factor,
//! which is what makes it antialiased. The weights are normalized to sum to 1, then turned into
//! fixed point with 22 fraction bits, and each pass rounds its sums back to u8. Matching those
//! steps, the rounding between the passes and their order included, gives the same bytes as
//! Pillow. The `image` crate's `resize` does not (f32 throughout, no rounding between passes,
//! its filter centered half a pixel off): measured against Pillow 13 it is off by one level
//! here and there, where this module is exact.
//!
//! Every output pixel depends only on its own taps, so resizing only the crop's rows and
//! columns gives the crop of the whole resize.

use std::ops::Range;

/// Fraction bits of the fixed-point weights: Pillow's 32 less 8 for the pixel and 2 for sums
/// that overshoot.
const PRECISION_BITS: u32 = 22;

/// The input pixels one output pixel reads along an axis: `first..first + weights.len()`.
struct Taps {
    first: usize,
    weights: Vec<i32>,
}

fn triangle(x: f64) -> f64 {
    let x = x.abs();
    if x < 1.0 {
        1.0 - x
    } else {
        0.0
    }
}

/// The taps of output pixels `outputs` of an axis resized from `in_size` to `out_size`, as
/// Pillow's `precompute_coeffs` and `normalize_coeffs_8bpc` compute them (the same f64
/// operations in the same order, so the same fixed-point weights).
fn axis_taps(in_size: usize, out_size: usize, outputs: Range<usize>) -> Vec<Taps> {
    let scale = in_size as f64 / out_size as f64;
    let filter_scale = scale.max(1.0);
    let support = filter_scale; // the triangle's support is 1
    let inverse = 1.0 / filter_scale;
    outputs
        .map(|out| {
            let center = (out as f64 + 0.5) * scale;
            // C's (int) truncates toward zero; the clamps then keep the window in the image.
            let first = ((center - support + 0.5) as i64).max(0) as usize;
            let end = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let raw: Vec<f64> = (first..end).map(|x| triangle((x as f64 - center + 0.5) * inverse)).collect();
            let total: f64 = raw.iter().sum();
            let weights = raw
                .iter()
                .map(|w| {
                    let w = if total != 0.0 { w / total } else { *w };
                    let fixed = w * f64::from(1u32 << PRECISION_BITS);
                    (if w < 0.0 { fixed - 0.5 } else { fixed + 0.5 }) as i32
                })
                .collect();
            Taps { first, weights }
        })
        .collect()
}

/// A fixed-point sum back to u8, rounded (the sums start at one half) and clamped.
fn clip8(sum: i32) -> u8 {
    (sum >> PRECISION_BITS).clamp(0, 255) as u8
}

/// A window of an image: its top-left corner and size, in pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub left: usize,
    pub top: usize,
    pub width: usize,
    pub height: usize,
}

/// Whether Pillow runs the vertical pass first: since Pillow 13 (python-pillow/Pillow#9549),
/// when the height shrinks by more than twice as many pixels as the width does; Pillow 12 and
/// earlier always ran the horizontal pass first. The two orders differ by at most one level
/// here and there; torchvision's Resize reaches this only for images more than twice as tall
/// as wide. Measured against Pillow 13.0.0 on ~4,000 random sizes, scaling up and down.
fn vertical_first((width, height): (usize, usize), (to_width, to_height): (usize, usize)) -> bool {
    to_height < height && (height - to_height) as i64 > 2 * (width as i64 - to_width as i64)
}

/// The input indices a set of taps reads: [min first, max end).
fn span(taps: &[Taps]) -> Range<usize> {
    let start = taps.iter().map(|t| t.first).min().unwrap_or(0);
    let end = taps.iter().map(|t| t.first + t.weights.len()).max().unwrap_or(start);
    start..end
}

/// One tap-weighted sum of 8-bit values `at(i)`, `i` over the taps' inputs, back to u8.
fn weighted(t: &Taps, at: impl Fn(usize) -> u8) -> u8 {
    let half = 1i32 << (PRECISION_BITS - 1);
    let sum = t.weights.iter().enumerate().fold(half, |s, (i, &k)| s + i32::from(at(t.first + i)) * k);
    clip8(sum)
}

/// The horizontal pass over `rows` of `src` (interleaved RGB, `width` wide, whose first column
/// is input column `x0`): [rows.len(), cols.len(), 3].
fn horizontal(src: &[u8], width: usize, x0: usize, rows: Range<usize>, cols: &[Taps]) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows.len() * cols.len() * 3);
    for y in rows {
        let row = &src[y * width * 3..(y + 1) * width * 3];
        for t in cols {
            for c in 0..3 {
                out.push(weighted(t, |x| row[(x - x0) * 3 + c]));
            }
        }
    }
    out
}

/// The vertical pass over columns `cols` of `src` (interleaved RGB, `width` wide, whose first
/// row is input row `y0`): [rows.len(), cols.len(), 3].
fn vertical(src: &[u8], width: usize, y0: usize, cols: Range<usize>, rows: &[Taps]) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows.len() * cols.len() * 3);
    for t in rows {
        for x in cols.clone() {
            for c in 0..3 {
                out.push(weighted(t, |y| src[((y - y0) * width + x) * 3 + c]));
            }
        }
    }
    out
}

/// `rgb` (interleaved RGB, `width` × `height`) resized to `to` = (width, height) as Pillow
/// resizes it, then cropped to `crop` (inside `to`): interleaved RGB, `crop.width` ×
/// `crop.height`.
pub fn resize_crop(rgb: &[u8], (width, height): (usize, usize), to: (usize, usize), crop: Window) -> Vec<u8> {
    assert_eq!(rgb.len(), width * height * 3, "an RGB image of {width}x{height}");
    assert!(crop.left + crop.width <= to.0 && crop.top + crop.height <= to.1, "{crop:?} inside {to:?}");
    let cols = axis_taps(width, to.0, crop.left..crop.left + crop.width);
    let rows = axis_taps(height, to.1, crop.top..crop.top + crop.height);
    // The first pass covers only the band of lines the second one reads (Pillow's ybox).
    if vertical_first((width, height), to) {
        let band = span(&cols);
        let tall = vertical(rgb, width, 0, band.clone(), &rows);
        horizontal(&tall, band.len(), band.start, 0..rows.len(), &cols)
    } else {
        let band = span(&rows);
        let wide = horizontal(rgb, width, 0, band.clone(), &cols);
        vertical(&wide, cols.len(), band.start, 0..cols.len(), &rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(w: usize, h: usize) -> Window {
        Window { left: 0, top: 0, width: w, height: h }
    }

    #[test]
    fn an_unchanged_axis_is_kept() {
        let rgb: Vec<u8> = (0..5 * 4 * 3).map(|i| (i * 37 % 256) as u8).collect();
        assert_eq!(resize_crop(&rgb, (5, 4), (5, 4), whole(5, 4)), rgb);
        // One axis kept: that pass is the identity (weights 1 and 0), so each column of the
        // result is that column resized alone.
        let shrunk = resize_crop(&rgb, (5, 4), (5, 2), whole(5, 2));
        for x in 0..5 {
            let column: Vec<u8> = (0..4).flat_map(|y| rgb[(y * 5 + x) * 3..(y * 5 + x + 1) * 3].to_vec()).collect();
            let alone = resize_crop(&column, (1, 4), (1, 2), whole(1, 2));
            assert_eq!(alone, [&shrunk[x * 3..x * 3 + 3], &shrunk[(5 + x) * 3..(5 + x + 1) * 3]].concat());
        }
    }

    fn gray(values: &[u8]) -> Vec<u8> {
        values.iter().flat_map(|&v| [v, v, v]).collect()
    }

    /// Values from Pillow 13.0.0's `Image.resize(size, Image.BILINEAR)` of the same pixels.
    #[test]
    fn matches_pillow() {
        // Halving: each output reads 3 inputs with weights 3:3:1 (the support widens to 2).
        assert_eq!(resize_crop(&gray(&[10, 21, 30, 40]), (4, 1), (2, 1), whole(2, 1)), gray(&[18, 33]));
        // 3x9 -> 2x3: the height shrinks by 6 pixels, the width by 1, so the vertical pass runs
        // first; horizontal first would give 116 and 67 for the first and fourth pixels.
        let tall = [
            8, 195, 186, 216, 44, 22, 220, 5, 138, 20, 76, 123, 108, 103, 7, 1, 31, 2, 171, 134, 165, 65, 157, 195, 98,
            117, 255,
        ];
        assert!(vertical_first((3, 9), (2, 3)));
        assert_eq!(resize_crop(&gray(&tall), (3, 9), (2, 3), whole(2, 3)), gray(&[117, 94, 80, 68, 105, 159]));
    }

    #[test]
    fn a_crop_is_the_window_of_the_whole_resize() {
        let (w, h) = (23, 17);
        let rgb: Vec<u8> = (0..w * h * 3).map(|i| ((i * 7919) % 251) as u8).collect();
        let to = (16, 11);
        let full = resize_crop(&rgb, (w, h), to, whole(to.0, to.1));
        let crop = Window { left: 3, top: 2, width: 9, height: 7 };
        let part = resize_crop(&rgb, (w, h), to, crop);
        for y in 0..crop.height {
            let start = ((crop.top + y) * to.0 + crop.left) * 3;
            assert_eq!(part[y * crop.width * 3..(y + 1) * crop.width * 3], full[start..start + crop.width * 3]);
        }
    }

    #[test]
    fn taps_widen_when_shrinking_and_sum_to_one() {
        for (input, output) in [(40, 12), (12, 40), (17, 12), (1000, 7)] {
            for t in axis_taps(input, output, 0..output) {
                let sum: i64 = t.weights.iter().map(|&k| i64::from(k)).sum();
                assert!((sum - (1 << PRECISION_BITS)).abs() <= t.weights.len() as i64, "{input}->{output}: {sum}");
                assert!(t.first + t.weights.len() <= input);
            }
        }
        // Shrinking 1000 -> 7 widens the support to ±143 pixels (the image's edges cut the
        // outer outputs' short); enlarging reads at most 3.
        let shrunk = axis_taps(1000, 7, 0..7);
        assert!(shrunk[3].weights.len() >= 285 && shrunk.iter().all(|t| t.weights.len() <= 287));
        assert!(axis_taps(12, 40, 0..40).iter().all(|t| t.weights.len() <= 3));
    }
}
