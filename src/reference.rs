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
    sums_f32(inputs).map(T::from_f32).collect()
}

/// `sum over r of inputs[r][i]` for every `i`, as the kernels accumulate it: in f32, in input
/// order, starting from `inputs[0][i]`.
fn sums_f32<'a, T: Element>(inputs: &'a [&'a [T]]) -> impl Iterator<Item = f32> + 'a {
    let n = inputs.first().map_or(0, |x| x.len());
    (0..n).map(|i| {
        let mut acc = inputs[0][i].to_f32();
        for x in &inputs[1..] {
            acc += x[i].to_f32();
        }
        acc
    })
}

/// `v` widened to f64.
fn to_f64<T: Element>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
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

/// The element-wise part of the fused all-reduce, exactly as the kernels compute it: the
/// rank-ordered f32 sum rounded to `T` (the all-reduce's result), then
/// `h = (s + bias[col]) + residual` in f32, rounded once to `T` — the same bits as the
/// all-reduce followed by the standalone bias/residual kernel. `partials` are the ranks'
/// `[rows, hidden]` inputs; `bias` is `[hidden]`.
pub fn all_reduce_epilogue_exact<T: Element>(
    partials: &[&[T]],
    bias: Option<&[T]>,
    residual: Option<&[T]>,
    hidden: usize,
) -> Vec<T> {
    sums_f32(partials)
        .enumerate()
        .map(|(i, acc)| {
            let mut h = T::from_f32(acc).to_f32();
            if let Some(b) = bias {
                h += b[i % hidden].to_f32();
            }
            if let Some(r) = residual {
                h += r[i].to_f32();
            }
            T::from_f32(h)
        })
        .collect()
}

/// The fused all-reduce in f64: `h = sum + bias + residual`, then, with `gamma`,
/// `out = h * rsqrt(mean(h^2) + eps) * gamma` per row of `hidden`; without, `out = h`.
/// Returns `(h, out)`.
pub fn all_reduce_fused_f64<T: Element>(
    partials: &[&[T]],
    bias: Option<&[T]>,
    residual: Option<&[T]>,
    gamma: Option<&[T]>,
    eps: f64,
    hidden: usize,
) -> (Vec<f64>, Vec<f64>) {
    let h: Vec<f64> = reduce_ranks_f64(partials)
        .into_iter()
        .enumerate()
        .map(|(i, sum)| {
            sum + bias.map_or(0.0, |b| b[i % hidden].to_f64())
                + residual.map_or(0.0, |r| r[i].to_f64())
        })
        .collect();
    let Some(gamma) = gamma else {
        return (h.clone(), h);
    };
    let out = h
        .chunks(hidden.max(1))
        .flat_map(|row| rms_norm_row(row, gamma, eps))
        .collect();
    (h, out)
}

/// RMSNorm in f64 of one row: `row · (mean(row²) + eps)^-1/2 · gamma`.
fn rms_norm_row<'a, T: Element>(
    row: &'a [f64],
    gamma: &'a [T],
    eps: f64,
) -> impl Iterator<Item = f64> + 'a {
    let ms = row.iter().map(|x| x * x).sum::<f64>() / row.len() as f64;
    let rstd = 1.0 / (ms + eps).sqrt();
    row.iter()
        .zip(gamma)
        .map(move |(x, g)| x * rstd * g.to_f64())
}

/// `C = A · Bᵀ (+ bias) (+ residual)` in f64: `a` is `[m, k]`, `b` is `[n, k]` (a weight
/// `[out, in]`), `bias` `[n]`, `residual` `[m, n]`, all row-major; returns `C` `[m, n]` with
/// `c[i*n + j] = Σ_l a[i*k + l]·b[j*k + l] + bias[j] + residual[i*n + j]`.
///
/// # Panics
///
/// When a slice's length does not match the shape.
pub fn gemm_f64<T: Element>(
    a: &[T],
    b: &[T],
    bias: Option<&[T]>,
    residual: Option<&[T]>,
    m: usize,
    n: usize,
    k: usize,
) -> Vec<f64> {
    check_gemm_lens(a.len(), b.len(), bias.map(|b| b.len()), m, n, k);
    if let Some(residual) = residual {
        assert_eq!(residual.len(), m * n, "residual must hold m * n elements");
    }
    let bias = bias.map(to_f64);
    let mut c = gemm_f64_wide(&to_f64(a), &to_f64(b), bias.as_deref(), m, n, k);
    for (i, c) in c.iter_mut().enumerate() {
        *c += residual.map_or(0.0, |r| r[i].to_f64());
    }
    c
}

/// The length checks of the f64 GEMMs: `a` `[m, k]`, `b` `[n, k]`, `bias` `[n]`.
fn check_gemm_lens(a: usize, b: usize, bias: Option<usize>, m: usize, n: usize, k: usize) {
    assert_eq!(a, m * k, "a must hold m * k elements");
    assert_eq!(b, n * k, "b must hold n * k elements");
    if let Some(bias) = bias {
        assert_eq!(bias, n, "bias must hold n elements");
    }
}

/// `C = A · Bᵀ (+ bias)` in f64 on f64 inputs, to chain layers without rounding in between:
/// `a` `[m, k]`, `b` `[n, k]`, `bias` `[n]`, row-major; returns `C` `[m, n]`.
///
/// # Panics
///
/// When a slice's length does not match the shape.
pub fn gemm_f64_wide(
    a: &[f64],
    b: &[f64],
    bias: Option<&[f64]>,
    m: usize,
    n: usize,
    k: usize,
) -> Vec<f64> {
    check_gemm_lens(a.len(), b.len(), bias.map(|b| b.len()), m, n, k);
    let mut c = vec![0.0f64; m * n];
    for i in 0..m {
        let a_row = &a[i * k..(i + 1) * k];
        for j in 0..n {
            let dot: f64 = a_row
                .iter()
                .zip(&b[j * k..(j + 1) * k])
                .map(|(x, y)| x * y)
                .sum();
            c[i * n + j] = dot + bias.map_or(0.0, |bias| bias[j]);
        }
    }
    c
}

/// The activation of a gated MLP, `SiLU(gate) · up` with `SiLU(g) = g / (1 + e^-g)`, per row
/// of a gate_up output: `gate_up` is `[rows, 2·width]`, each row `[gate | up]`; returns
/// `[rows, width]`.
///
/// # Panics
///
/// When `gate_up` is not whole rows of `2·width`.
pub fn silu_mul_f64(gate_up: &[f64], width: usize) -> Vec<f64> {
    assert!(
        width > 0 && gate_up.len() % (2 * width) == 0,
        "gate_up must be whole rows of 2 * width"
    );
    gate_up
        .chunks_exact(2 * width)
        .flat_map(|row| {
            let (gate, up) = row.split_at(width);
            gate.iter()
                .zip(up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// RMSNorm in f64 of every row of `h` (`[rows, hidden]`, `hidden` = `gamma.len()`):
/// `out = h · (mean(h²) + eps)^-1/2 · gamma`.
///
/// # Panics
///
/// When `h` is not whole rows of `gamma.len()`.
pub fn rms_norm_f64<T: Element>(h: &[f64], gamma: &[T], eps: f64) -> Vec<f64> {
    let hidden = gamma.len();
    assert!(
        hidden > 0 && h.len() % hidden == 0,
        "h must be whole rows of gamma.len()"
    );
    h.chunks_exact(hidden)
        .flat_map(|row| rms_norm_row(row, gamma, eps))
        .collect()
}

/// A gated MLP in f64 with no rounding between its layers:
/// `y = (SiLU(x · Wgᵀ) ⊙ (x · Wuᵀ)) · Wdᵀ (+ b)`. `x` is `[m, hidden]`; `gate_up` is
/// `[2·intermediate, hidden]`, the gate rows first (a merged gate_up projection); `down` is
/// `[hidden, intermediate]` and `down_bias` `[hidden]`. Returns `y` `[m, hidden]`.
///
/// # Panics
///
/// When a slice's length does not match the shape.
pub fn gated_mlp_f64<T: Element>(
    x: &[T],
    gate_up: &[T],
    down: &[T],
    down_bias: Option<&[T]>,
    m: usize,
    hidden: usize,
    intermediate: usize,
) -> Vec<f64> {
    assert_eq!(
        down.len(),
        hidden * intermediate,
        "down must hold hidden * intermediate elements"
    );
    let h = gemm_f64(x, gate_up, None, None, m, 2 * intermediate, hidden);
    let act = silu_mul_f64(&h, intermediate);
    let bias = down_bias.map(to_f64);
    gemm_f64_wide(
        &act,
        &to_f64(down),
        bias.as_deref(),
        m,
        hidden,
        intermediate,
    )
}
