//! A full host weight with the shape its checkpoint gives it, and the check of that shape
//! against a layer's.

use crate::error::{Error, Result};

/// A host weight as a checkpoint stores it: row-major `[rows, cols]`, its elements in
/// `data`. Every loader of [`crate::shard`] and [`crate::ops::linear`] takes its weights as
/// `HostWeight`s and checks the shape, not only the element count, against the layer's, so a
/// transposed weight (same count) is refused.
///
/// # Layout
///
/// safetensors and Hugging Face (PyTorch `nn.Linear`) store a linear layer's weight as
/// `[out_features, in_features]`: pass the tensor's shape as it is (`shape[0]` rows,
/// `shape[1]` columns) with its data, without transposing anything. For a Hugging Face
/// `o_proj` of Llama-3-8B that is `[4096, 4096]`, for `down_proj` `[4096, 14336]`, for
/// `k_proj` `[1024, 4096]`.
///
/// ```
/// use tpfuse::shard::{HostWeight, RowParallelSpec};
/// # fn main() -> tpfuse::Result<()> {
/// let spec = RowParallelSpec::new("down_proj", 4, 2, 2)?; // [out 2, in 4]
/// let data = [0, 1, 2, 3, 10, 11, 12, 13];
/// assert_eq!(spec.shard_weight(1, HostWeight::new(&data, 2, 4))?, vec![2, 3, 12, 13]);
/// // The same elements given as [4, 2]: refused, naming the layer.
/// let err = spec.shard_weight(1, HostWeight::new(&data, 4, 2)).unwrap_err();
/// assert_eq!(
///     err.to_string(),
///     "invalid argument `row-parallel 'down_proj'`: the host weight: expected \
///      [out_features, in_features] = [2, 4], got [4, 2] (transposed?)"
/// );
/// # Ok(()) }
/// ```
#[derive(PartialEq, Eq, Hash)]
pub struct HostWeight<'a, T> {
    data: &'a [T],
    rows: usize,
    cols: usize,
}

/// The shape and length, not the elements (a weight holds millions).
impl<T> std::fmt::Debug for HostWeight<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostWeight")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("len", &self.data.len())
            .finish()
    }
}

// Derived Clone and Copy would require `T: Clone`; a view is copyable for any `T`.
impl<T> Clone for HostWeight<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for HostWeight<'_, T> {}

impl<'a, T> HostWeight<'a, T> {
    /// A weight `[rows, cols]` (row-major, `rows · cols` elements in `data`). Nothing is
    /// checked here: the loader that takes it checks the shape against its layer and the
    /// length of `data` against the shape, and names the layer in the error.
    pub fn new(data: &'a [T], rows: usize, cols: usize) -> Self {
        HostWeight { data, rows, cols }
    }

    /// The elements, row-major.
    pub fn data(&self) -> &'a [T] {
        self.data
    }

    /// Rows (for a linear layer, `out_features`).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (for a linear layer, `in_features`).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
}

/// Errors (`arg` = `label`) unless `weight` is `[rows, cols]` = `want` and holds that many
/// elements. `what` names the weight (e.g. `the host weight of section 'k'`), `dims` says
/// what its rows and columns are (e.g. `[out_features, in_features]`). A weight whose rows
/// and columns are swapped is called out as `transposed?`.
pub(crate) fn check_weight_shape<T>(
    label: &str,
    what: &str,
    weight: &HostWeight<'_, T>,
    want: (usize, usize),
    dims: &str,
) -> Result<()> {
    let (rows, cols) = weight.shape();
    if (rows, cols) != want {
        let hint = if (cols, rows) == want {
            " (transposed?)"
        } else {
            ""
        };
        return Err(Error::invalid(
            label,
            format!(
                "{what}: expected {dims} = [{}, {}], got [{rows}, {cols}]{hint}",
                want.0, want.1
            ),
        ));
    }
    let got = weight.data.len();
    // `want` is a layer's shape, which its spec checked for overflow.
    let needed = rows * cols;
    if got != needed {
        return Err(Error::invalid(
            label,
            format!("{what} holds {got} elements but its shape [{rows}, {cols}] needs {needed}"),
        ));
    }
    Ok(())
}
