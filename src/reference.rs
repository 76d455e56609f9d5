//! CPU references of every op, for tests and `tpfuse selftest`.
//!
//! Two kinds: an f64 reference (the "true" result, for error bounds) and, where the kernel's
//! arithmetic is fully specified, an exact emulation of it (for bitwise checks).

use crate::dtype::Element;

/// `sum over r of inputs[r][i]` in f64. All inputs must have the same length.
pub fn reduce_ranks_f64<T: Element>(inputs: &[&[T]]) -> Vec<f64> {
    let n = inputs.first().map_or(0, |x| x.len());
    (0..n)
        .map(|i| inputs.iter().map(|x| x[i].to_f64()).sum())
        .collect()
}

/// The exact result of the `reduce_ranks` kernel: f32 accumulation in input order starting
/// from `inputs[0][i]`, rounded once to `T`.
pub fn reduce_ranks_exact<T: Element>(inputs: &[&[T]]) -> Vec<T> {
    let n = inputs.first().map_or(0, |x| x.len());
    (0..n)
        .map(|i| {
            let mut acc = inputs[0][i].to_f32();
            for x in &inputs[1..] {
                acc += x[i].to_f32();
            }
            T::from_f32(acc)
        })
        .collect()
}

/// Relative Frobenius error `||got - want|| / ||want||` (absolute when `want` is zero;
/// infinite when the lengths differ).
pub fn relative_error<T: Element>(got: &[T], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        diff += (g.to_f64() - w).powi(2);
        norm += w * w;
    }
    if norm == 0.0 {
        diff.sqrt()
    } else {
        (diff / norm).sqrt()
    }
}
