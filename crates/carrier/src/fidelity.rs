//! Fidelity of a substituted carrier to the native one: mean cosine of key
//! (or value, or residual) vectors over layers, heads and sites.

use crate::error::Result;
use candle_core::{DType, Tensor, D};

/// Mean over vectors of cos(a_i, b_i), where vectors run along the last
/// axis of two equal-shape tensors, restricted to `positions` on
/// `position_axis` (`None` = all). Vectors of zero norm count as cosine 1
/// when both are zero, 0 otherwise.
pub fn mean_vector_cosine(
    a: &Tensor,
    b: &Tensor,
    position_axis: usize,
    positions: Option<&[usize]>,
) -> Result<f64> {
    let (a, b) = match positions {
        Some(p) => {
            let idx = Tensor::from_vec(
                p.iter().map(|&x| x as u32).collect::<Vec<_>>(),
                p.len(),
                a.device(),
            )?;
            (
                a.index_select(&idx, position_axis)?,
                b.index_select(&idx, position_axis)?,
            )
        }
        None => (a.clone(), b.clone()),
    };
    if a.elem_count() == 0 {
        return Ok(1.0);
    }
    let a = a.to_dtype(DType::F64)?;
    let b = b.to_dtype(DType::F64)?;
    let dot: Vec<f64> = (&a * &b)?.sum(D::Minus1)?.flatten_all()?.to_vec1()?;
    let na: Vec<f64> = a.sqr()?.sum(D::Minus1)?.flatten_all()?.to_vec1()?;
    let nb: Vec<f64> = b.sqr()?.sum(D::Minus1)?.flatten_all()?.to_vec1()?;
    let n = dot.len();
    let total: f64 = (0..n)
        .map(|i| {
            let d = (na[i] * nb[i]).sqrt();
            if d > 0.0 {
                dot[i] / d
            } else if na[i] == nb[i] {
                1.0
            } else {
                0.0
            }
        })
        .sum();
    Ok(total / n as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn cosine_of_a_tensor_with_itself_is_one_and_opposite_is_minus_one() {
        let a = Tensor::from_vec(
            (1..=24).map(|x| x as f32).collect::<Vec<_>>(),
            (1, 2, 3, 4),
            &Device::Cpu,
        )
        .unwrap();
        assert!((mean_vector_cosine(&a, &a, 2, None).unwrap() - 1.0).abs() < 1e-12);
        let neg = a.neg().unwrap();
        assert!((mean_vector_cosine(&a, &neg, 2, Some(&[0, 2])).unwrap() + 1.0).abs() < 1e-12);
    }
}
