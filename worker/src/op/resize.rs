//! Resize (and Upsample, its form before opset 10): its attributes, read once when the model
//! is loaded, and its geometry, resolved when the graph is bound: each axis's output size and
//! the scale its coordinates are mapped with. The kernels' interpolation taps are computed from
//! these in `kernels/resize.rs`, for the CPU and the CUDA backends alike.

use super::{AttrValue, Attrs};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interpolation {
    Nearest,
    Linear,
    Cubic,
}

/// How an output coordinate maps to an input coordinate (ONNX's coordinate_transformation_mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coordinates {
    HalfPixel,
    HalfPixelSymmetric,
    PytorchHalfPixel,
    AlignCorners,
    Asymmetric,
    /// The region `roi` of the input, resized; outputs mapped outside the input take
    /// `extrapolation_value`.
    TfCropAndResize,
}

/// Which input element nearest interpolation takes for a fractional coordinate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NearestMode {
    RoundPreferFloor,
    RoundPreferCeil,
    Floor,
    Ceil,
}

/// How `sizes` are read when they do not keep the input's aspect ratio.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AspectPolicy {
    Stretch,
    NotLarger,
    NotSmaller,
}

/// What the output is sized by: a scale or a size per axis of `axes`, as the model gives them.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    Scales(Vec<f32>),
    Sizes(Vec<i64>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Resize {
    pub mode: Interpolation,
    pub coordinates: Coordinates,
    pub nearest: NearestMode,
    pub cubic_coeff_a: f32,
    /// Cubic taps outside the input get no weight (the others renormalized).
    pub exclude_outside: bool,
    pub extrapolation_value: f32,
    /// The axes `target` and `roi` are given for (opset 18); None: all of them.
    pub axes: Option<Vec<i64>>,
    pub policy: AspectPolicy,
    /// Upsample and opset 10's Resize: the inputs are X and scales only.
    pub legacy: bool,
    /// Folded in from the operands when the graph is bound (Upsample 7's from its attribute).
    pub target: Option<Target>,
    /// tf_crop_and_resize's region: the starts, then the ends, per axis of `axes`.
    pub roi: Vec<f32>,
}

/// Per axis of the input: the output's size, the scale coordinates are mapped with, and
/// tf_crop_and_resize's region (start, end) as fractions of the input.
#[derive(Clone, Debug, PartialEq)]
pub struct Geometry {
    pub output: Vec<usize>,
    pub scales: Vec<f64>,
    pub roi: Vec<(f64, f64)>,
}

fn unsupported(a: &Attrs, what: &str) -> Error {
    Error::Unsupported(format!("{}: {what} is not supported", a.origin))
}

impl Resize {
    /// A resize by `target` with ONNX's defaults for the rest (nearest rounds halves down,
    /// cubic's a is −0.75, no axes, roi or extrapolation): how tests and model builders make one.
    pub fn new(mode: Interpolation, coordinates: Coordinates, target: Target) -> Resize {
        Resize {
            mode,
            coordinates,
            nearest: NearestMode::RoundPreferFloor,
            cubic_coeff_a: -0.75,
            exclude_outside: false,
            extrapolation_value: 0.0,
            axes: None,
            policy: AspectPolicy::Stretch,
            legacy: false,
            target: Some(target),
            roi: vec![],
        }
    }

    /// Reads Resize (opset 10 on) or Upsample (7 to 9). Before opset 11 the coordinates are
    /// asymmetric and nearest takes the floor, as Upsample's were.
    pub fn from_onnx(op_type: &str, a: &Attrs, opset: i64) -> Result<Resize> {
        let legacy = op_type == "Upsample" || opset < 11;
        let choose = |name: &str, default: &str, options: &[&str]| -> Result<usize> {
            let v = a.string(name, default)?;
            options.iter().position(|&o| o == v).ok_or_else(|| a.bad(name, &format!("one of {options:?}, not '{v}'")))
        };
        let mode = match a.string("mode", "nearest")?.as_str() {
            "nearest" => Interpolation::Nearest,
            // Upsample's first version called it bilinear.
            "linear" | "bilinear" => Interpolation::Linear,
            "cubic" if !legacy => Interpolation::Cubic,
            other => return Err(a.bad("mode", &format!("nearest, linear or cubic, not '{other}'"))),
        };
        if a.int("antialias", 0)? != 0 {
            return Err(unsupported(a, "antialias=1 (an antialiasing filter when downsampling)"));
        }
        let modes = ["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric"];
        let coordinates = match a.string("coordinate_transformation_mode", "half_pixel")?.as_str() {
            _ if legacy => Coordinates::Asymmetric,
            "tf_crop_and_resize" => Coordinates::TfCropAndResize,
            "tf_half_pixel_for_nn" => {
                return Err(unsupported(a, "coordinate_transformation_mode tf_half_pixel_for_nn"))
            }
            _ => [
                Coordinates::HalfPixel,
                Coordinates::HalfPixelSymmetric,
                Coordinates::PytorchHalfPixel,
                Coordinates::AlignCorners,
                Coordinates::Asymmetric,
            ][choose("coordinate_transformation_mode", "half_pixel", &modes)?],
        };
        let nearest = if legacy {
            NearestMode::Floor
        } else {
            let modes = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"];
            [NearestMode::RoundPreferFloor, NearestMode::RoundPreferCeil, NearestMode::Floor, NearestMode::Ceil]
                [choose("nearest_mode", "round_prefer_floor", &modes)?]
        };
        let policy = [AspectPolicy::Stretch, AspectPolicy::NotLarger, AspectPolicy::NotSmaller]
            [choose("keep_aspect_ratio_policy", "stretch", &["stretch", "not_larger", "not_smaller"])?];
        Ok(Resize {
            mode,
            coordinates,
            nearest,
            cubic_coeff_a: a.float("cubic_coeff_a", -0.75)?,
            exclude_outside: a.int("exclude_outside", 0)? != 0,
            extrapolation_value: a.float("extrapolation_value", 0.0)?,
            axes: a.ints("axes")?,
            policy,
            legacy,
            // Upsample 7 gives its scales as an attribute; later versions as an input.
            target: a.floats("scales")?.map(Target::Scales),
            roi: vec![],
        })
    }

    /// This resize with its operands folded in: roi, scales and sizes (each None when omitted
    /// or empty; exactly one of scales and sizes must remain). A resize already bound keeps
    /// what it has.
    pub fn with_operands(
        &self,
        roi: Option<Vec<f32>>,
        scales: Option<Vec<f32>>,
        sizes: Option<Vec<i64>>,
    ) -> Result<Resize, String> {
        let mut r = self.clone();
        match (scales, sizes) {
            (Some(_), Some(_)) => return Err("both scales and sizes are given; one of them is expected".into()),
            (Some(s), None) => r.target = Some(Target::Scales(s)),
            (None, Some(s)) => r.target = Some(Target::Sizes(s)),
            (None, None) if r.target.is_some() => {}
            (None, None) => return Err("neither scales nor sizes is given".into()),
        }
        if let Some(roi) = roi {
            r.roi = roi;
        }
        Ok(r)
    }

    /// Each axis's output size, coordinate scale and region for an input of shape `input`.
    pub fn geometry(&self, input: &[usize]) -> Result<Geometry, String> {
        let rank = input.len();
        let axes: Vec<usize> = match &self.axes {
            None => (0..rank).collect(),
            Some(given) => {
                let mut axes = Vec::with_capacity(given.len());
                for &a in given {
                    let axis = if a < 0 { a + rank as i64 } else { a };
                    if !(0..rank as i64).contains(&axis) || axes.contains(&(axis as usize)) {
                        return Err(format!("axes {given:?} are not distinct axes of a rank-{rank} input"));
                    }
                    axes.push(axis as usize);
                }
                axes
            }
        };
        let (mut output, mut scales) = (input.to_vec(), vec![1.0f64; rank]);
        let given = |n: usize, what: &str| -> Result<(), String> {
            match n == axes.len() {
                true => Ok(()),
                false => Err(format!("{n} {what} given for {} axes", axes.len())),
            }
        };
        match self.target.as_ref().ok_or("neither scales nor sizes is given")? {
            Target::Scales(s) => {
                given(s.len(), "scales")?;
                for (&a, &scale) in axes.iter().zip(s) {
                    if !(scale > 0.0 && scale.is_finite()) {
                        return Err(format!("scale {scale} of axis {a} is not a positive number"));
                    }
                    scales[a] = scale as f64;
                    output[a] = (input[a] as f64 * scale as f64).floor() as usize;
                }
            }
            Target::Sizes(s) => {
                given(s.len(), "sizes")?;
                if let Some((&a, _)) = axes.iter().zip(s).find(|(&a, &size)| size < 0 || input[a] == 0) {
                    return Err(format!("sizes {s:?}: axis {a} of {input:?} cannot be resized to that"));
                }
                let ratios: Vec<f64> = axes.iter().zip(s).map(|(&a, &size)| size as f64 / input[a] as f64).collect();
                let common = match self.policy {
                    AspectPolicy::Stretch => None,
                    AspectPolicy::NotLarger => ratios.iter().copied().reduce(f64::min),
                    AspectPolicy::NotSmaller => ratios.iter().copied().reduce(f64::max),
                };
                for (k, &a) in axes.iter().enumerate() {
                    scales[a] = common.unwrap_or(ratios[k]);
                    // Sizes kept to the aspect ratio round half up, as the reference does.
                    output[a] = match common {
                        None => s[k] as usize,
                        Some(scale) => (scale * input[a] as f64 + 0.5).floor() as usize,
                    };
                }
            }
        }
        let mut roi = vec![(0.0, 1.0); rank];
        if self.coordinates == Coordinates::TfCropAndResize {
            if self.roi.len() != 2 * axes.len() {
                return Err(format!("roi has {} values; tf_crop_and_resize needs {}", self.roi.len(), 2 * axes.len()));
            }
            for (k, &a) in axes.iter().enumerate() {
                roi[a] = (self.roi[k] as f64, self.roi[k + axes.len()] as f64);
            }
        }
        Ok(Geometry { output, scales, roi })
    }

    /// The attributes `from_onnx` reads back into this, for Resize of opset 13 and later (a
    /// legacy node's semantics spelled out in them).
    pub fn onnx_attrs(&self) -> Vec<(String, AttrValue)> {
        let s = |k: &str, v: &str| (k.to_string(), AttrValue::Str(v.to_string()));
        let mode = match self.mode {
            Interpolation::Nearest => "nearest",
            Interpolation::Linear => "linear",
            Interpolation::Cubic => "cubic",
        };
        let coordinates = match self.coordinates {
            Coordinates::HalfPixel => "half_pixel",
            Coordinates::HalfPixelSymmetric => "half_pixel_symmetric",
            Coordinates::PytorchHalfPixel => "pytorch_half_pixel",
            Coordinates::AlignCorners => "align_corners",
            Coordinates::Asymmetric => "asymmetric",
            Coordinates::TfCropAndResize => "tf_crop_and_resize",
        };
        let nearest = match self.nearest {
            NearestMode::RoundPreferFloor => "round_prefer_floor",
            NearestMode::RoundPreferCeil => "round_prefer_ceil",
            NearestMode::Floor => "floor",
            NearestMode::Ceil => "ceil",
        };
        let mut v = vec![
            s("mode", mode),
            s("coordinate_transformation_mode", coordinates),
            s("nearest_mode", nearest),
            ("cubic_coeff_a".into(), AttrValue::Float(self.cubic_coeff_a)),
            ("exclude_outside".into(), AttrValue::Int(self.exclude_outside as i64)),
            ("extrapolation_value".into(), AttrValue::Float(self.extrapolation_value)),
        ];
        // Opset 18's attributes, written only when set.
        if let Some(axes) = &self.axes {
            v.push(("axes".into(), AttrValue::Ints(axes.clone())));
        }
        match self.policy {
            AspectPolicy::Stretch => {}
            AspectPolicy::NotLarger => v.push(s("keep_aspect_ratio_policy", "not_larger")),
            AspectPolicy::NotSmaller => v.push(s("keep_aspect_ratio_policy", "not_smaller")),
        }
        v
    }

    /// The operand inputs a saved node takes after X: roi, scales and (when sized by them)
    /// sizes, an omitted one as an empty tensor.
    pub fn operands(&self) -> Vec<Tensor> {
        let floats = |v: &[f32]| Tensor::from_vec(&[v.len()], v.to_vec());
        let mut v = vec![floats(&self.roi)];
        match &self.target {
            Some(Target::Scales(s)) => v.push(floats(s)),
            Some(Target::Sizes(s)) => v.extend([floats(&[]), Tensor::from_vec(&[s.len()], s.clone())]),
            None => {}
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resize(mode: &str, extra: &[(&str, AttrValue)], opset: i64) -> Resize {
        let mut a = Attrs { origin: "node 'r' (Resize)".into(), ..Default::default() };
        a.map.insert("mode".into(), AttrValue::Str(mode.into()));
        for (k, v) in extra {
            a.map.insert(k.to_string(), v.clone());
        }
        Resize::from_onnx("Resize", &a, opset).unwrap()
    }

    #[test]
    fn sizes_kept_to_the_aspect_ratio_scale_every_axis_alike() {
        let policy = AttrValue::Str("not_larger".into());
        let r = resize("nearest", &[("keep_aspect_ratio_policy", policy), ("axes", AttrValue::Ints(vec![2, 3]))], 18)
            .with_operands(None, None, Some(vec![7, 8]))
            .unwrap();
        let g = r.geometry(&[1, 1, 2, 2]).unwrap();
        assert_eq!(g.output, [1, 1, 7, 7]);
        assert_eq!(g.scales, [1.0, 1.0, 3.5, 3.5]);
    }

    #[test]
    fn scales_floor_the_output_and_legacy_nodes_read_as_upsample() {
        let r = resize("linear", &[], 10).with_operands(None, Some(vec![1.0, 1.0, 0.6, 2.5]), None).unwrap();
        assert_eq!(r.geometry(&[1, 2, 4, 3]).unwrap().output, [1, 2, 2, 7]);
        assert_eq!((r.coordinates, r.nearest, r.legacy), (Coordinates::Asymmetric, NearestMode::Floor, true));
        let both = resize("nearest", &[], 13).with_operands(None, Some(vec![2.0]), Some(vec![4]));
        assert!(both.is_err());
    }

    #[test]
    fn antialiasing_is_refused() {
        let mut a = Attrs { origin: "node 'r' (Resize)".into(), ..Default::default() };
        a.map.insert("antialias".into(), AttrValue::Int(1));
        let e = Resize::from_onnx("Resize", &a, 18).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
    }
}
