//! Ops that address elements by index tensors of the data's rank: GatherElements and its
//! gradient (the scatter-add that ScatterElements with reduction "add" is).

use super::KResult;
use crate::tensor::{strides, DType, TensorView, TensorViewMut};

/// For each position of `idx` (row-major), the element offset in `data_shape` that it addresses:
/// the position's own coordinates, the one along `axis` replaced by the index there (negative
/// indices count from the end).
fn element_offsets(axis: usize, data_shape: &[usize], idx: &TensorView) -> Result<Vec<usize>, String> {
    let ids = idx.to_i64_vec().ok_or("indices must be integers")?;
    let (ds, dim) = (strides(data_shape), data_shape[axis]);
    let mut coord = vec![0usize; idx.shape.len()];
    let mut out = Vec::with_capacity(ids.len());
    for &raw in &ids {
        let id = if raw < 0 { raw + dim as i64 } else { raw };
        if !(0..dim as i64).contains(&id) {
            return Err(format!("index {raw} is out of range for axis {axis} of size {dim}"));
        }
        let at: usize =
            coord.iter().zip(&ds).enumerate().map(|(k, (&c, &s))| if k == axis { id as usize } else { c } * s).sum();
        out.push(at);
        for k in (0..coord.len()).rev() {
            coord[k] += 1;
            if coord[k] < idx.shape[k] {
                break;
            }
            coord[k] = 0;
        }
    }
    Ok(out)
}

/// out[i] = data[offset(i)], for elements of any type.
pub fn gather_elements(axis: usize, data: &TensorView, idx: &TensorView, y: &mut TensorViewMut) -> KResult {
    let size = data.dtype.size();
    for (o, at) in y.bytes.chunks_mut(size).zip(element_offsets(axis, data.shape, idx)?) {
        o.copy_from_slice(&data.bytes[at * size..(at + 1) * size]);
    }
    Ok(())
}

/// dData = zeros; dData[offset(i)] += dY[i] (indices that repeat accumulate, in index order).
pub fn gather_elements_grad(axis: usize, dy: &TensorView, idx: &TensorView, dx: &mut TensorViewMut) -> KResult {
    let shape = dx.shape.to_vec();
    let offsets = element_offsets(axis, &shape, idx)?;
    match dy.dtype {
        DType::F32 => scatter_add(dy.as_slice::<f32>(), &offsets, dx.as_mut_slice::<f32>()),
        DType::F64 => scatter_add(dy.as_slice::<f64>(), &offsets, dx.as_mut_slice::<f64>()),
        t => return Err(format!("GatherElementsGrad is not implemented for {t}")),
    }
    Ok(())
}

fn scatter_add<T: Copy + Default + std::ops::AddAssign>(src: &[T], offsets: &[usize], out: &mut [T]) {
    out.fill(T::default());
    for (&v, &at) in src.iter().zip(offsets) {
        out[at] += v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;

    #[test]
    fn gathers_along_an_axis_and_scatters_back() {
        // ONNX's example: data [[1, 2], [3, 4]], indices [[0, 0], [1, 0]] along axis 1.
        let data = Tensor::from_vec(&[2, 2], vec![1.0f32, 2.0, 3.0, 4.0]);
        let idx = Tensor::from_vec(&[2, 2], vec![0i64, 0, 1, -2]);
        let mut y = Tensor::zeros(DType::F32, &[2, 2]);
        gather_elements(1, &data.view(), &idx.view(), &mut y.view_mut()).unwrap();
        assert_eq!(y.as_slice::<f32>(), &[1.0, 1.0, 4.0, 3.0]);
        let dy = Tensor::from_vec(&[2, 2], vec![1.0f32, 10.0, 100.0, 1000.0]);
        let mut dx = Tensor::zeros(DType::F32, &[2, 2]);
        gather_elements_grad(1, &dy.view(), &idx.view(), &mut dx.view_mut()).unwrap();
        assert_eq!(dx.as_slice::<f32>(), &[11.0, 0.0, 1000.0, 100.0]);
        let bad = Tensor::from_vec(&[2, 2], vec![0i64, 2, 0, 0]);
        let e = gather_elements(1, &data.view(), &bad.view(), &mut y.view_mut()).unwrap_err();
        assert!(e.contains("index 2 is out of range for axis 1 of size 2"), "{e}");
    }
}
