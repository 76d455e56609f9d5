//! Pieces the GPU tests share whatever op they test: the element types' seeds and
//! tolerances, seeded random data, host references spread over threads, GPU 0, transfers on
//! a stream, and the checks of results and errors.
#![allow(dead_code)]

use super::Bits;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::fmt::Debug;
use std::ops::Range;
use std::sync::Arc;
use tpfuse::reference::{reduce_ranks_exact, reduce_ranks_f64, relative_error};
use tpfuse::{Element, Error};

/// Host work on this many elements or more is spread over threads.
pub const PARALLEL_FROM: usize = 1 << 16;

// ---------------------------------------------------------------------------------------
// Element types.
// ---------------------------------------------------------------------------------------

/// What every GPU test needs of an element type beyond [`Element`]. A test that needs more
/// (another bound, another tolerance) declares its own trait on top of this one.
pub trait TestElement: Element + Bits {
    /// Distinguishes the dtypes in seeds.
    const ID: u64;
    /// Bound on the relative Frobenius error of one op against the f64 reference.
    const TOLERANCE: f64;
    /// The same bound for an RMSNorm output (one more rounding, and `rsqrtf`, accurate to 2
    /// ulp in f32).
    const NORM_TOLERANCE: f64;
}

impl TestElement for f32 {
    const ID: u64 = 1;
    const TOLERANCE: f64 = 1e-6;
    const NORM_TOLERANCE: f64 = 2e-6;
}

impl TestElement for f16 {
    const ID: u64 = 2;
    const TOLERANCE: f64 = 2e-3;
    const NORM_TOLERANCE: f64 = 2e-3;
}

impl TestElement for bf16 {
    const ID: u64 = 3;
    const TOLERANCE: f64 = 1e-2;
    const NORM_TOLERANCE: f64 = 1e-2;
}

// ---------------------------------------------------------------------------------------
// Seeds and random data.
// ---------------------------------------------------------------------------------------

pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The run's base seed: `TPFUSE_TEST_SEED` if set, else `default` (one per test file, so
/// that two files never see the same data).
pub fn base_seed(default: u64) -> u64 {
    match std::env::var("TPFUSE_TEST_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("TPFUSE_TEST_SEED={s:?} is not a u64")),
        Err(_) => default,
    }
}

/// `seed` with every one of `parts` mixed in, in order.
pub fn mix_seed(seed: u64, parts: &[u64]) -> u64 {
    let mut s = seed;
    for &p in parts {
        s = splitmix64(s ^ p);
    }
    s
}

/// `n` values uniform in `[lo, hi)`.
pub fn random_vec<T: Element>(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<T> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| T::from_f32(rng.random_range(lo..hi)))
        .collect()
}

/// `world` buffers of `n` values uniform in (-4, 4), rank r's from `rank_seed(r)`; one
/// thread per rank from [`PARALLEL_FROM`] elements on.
pub fn random_ranks<T: Element>(
    world: usize,
    n: usize,
    rank_seed: impl Fn(usize) -> u64 + Sync,
) -> Vec<Vec<T>> {
    let one = |r: usize| -> Vec<T> { random_vec(rank_seed(r), n, -4.0, 4.0) };
    if n < PARALLEL_FROM {
        return (0..world).map(one).collect();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world).map(|r| s.spawn(move || one(r))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("input generator thread panicked"))
            .collect()
    })
}

// ---------------------------------------------------------------------------------------
// Host references.
// ---------------------------------------------------------------------------------------

/// `f` over `0..n` in contiguous chunks, the results concatenated in order; spread over
/// threads when the work (`n` items of `weight` elements each) reaches [`PARALLEL_FROM`].
pub fn par_chunks<O: Send>(
    n: usize,
    weight: usize,
    f: impl Fn(Range<usize>) -> Vec<O> + Sync,
) -> Vec<O> {
    if n.saturating_mul(weight) < PARALLEL_FROM || n < 2 {
        return f(0..n);
    }
    let threads = std::thread::available_parallelism().map_or(4, |t| t.get());
    let chunk = n.div_ceil(threads);
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (0..threads)
            .map(|t| s.spawn(move || f((t * chunk).min(n)..((t + 1) * chunk).min(n))))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("reference thread panicked"))
            .collect()
    })
}

/// `inputs[i][r]` for every i.
pub fn slices<'a, T>(inputs: &'a [Vec<T>], r: &Range<usize>) -> Vec<&'a [T]> {
    inputs.iter().map(|x| &x[r.clone()]).collect()
}

/// The exact result of the kernels' sum of `inputs[i][range]` (rank order, f32, rounded
/// once) and the f64 sum, computed in chunks spread over threads for large inputs.
pub fn sum_references_of<T: Element>(inputs: &[Vec<T>], range: Range<usize>) -> (Vec<T>, Vec<f64>) {
    let at = |r: Range<usize>| range.start + r.start..range.start + r.end;
    let n = range.len();
    let exact = par_chunks(n, 1, |r| reduce_ranks_exact(&slices(inputs, &at(r))));
    let wide = par_chunks(n, 1, |r| reduce_ranks_f64(&slices(inputs, &at(r))));
    (exact, wide)
}

/// [`sum_references_of`] the whole inputs.
pub fn sum_references<T: Element>(inputs: &[Vec<T>]) -> (Vec<T>, Vec<f64>) {
    sum_references_of(inputs, 0..inputs[0].len())
}

// ---------------------------------------------------------------------------------------
// GPU 0 and transfers on a stream.
// ---------------------------------------------------------------------------------------

/// GPU 0. A missing driver or GPU fails the test (it never skips).
pub fn open_gpu0() -> Arc<CudaContext> {
    tpfuse::device::open(0).unwrap_or_else(|e| panic!("this test needs a CUDA GPU and driver: {e}"))
}

/// A stream on GPU 0. A missing driver or GPU fails the test (it never skips).
pub fn gpu_stream() -> Arc<CudaStream> {
    open_gpu0().new_stream().expect("creating a CUDA stream")
}

pub fn upload<T: DeviceRepr>(stream: &Arc<CudaStream>, host: &[T]) -> CudaSlice<T> {
    stream.clone_htod(host).expect("uploading to the GPU")
}

/// `n` elements holding [`Bits::poison`].
pub fn poisoned<T: Bits + DeviceRepr>(stream: &Arc<CudaStream>, n: usize) -> CudaSlice<T> {
    upload(stream, &vec![T::poison(); n])
}

/// Overwrites `buf` with `host`.
pub fn refill<T: DeviceRepr>(stream: &Arc<CudaStream>, buf: &mut CudaSlice<T>, host: &[T]) {
    stream.memcpy_htod(host, buf).expect("uploading to the GPU");
}

/// Waits for the stream, then copies `buf` to the host.
pub fn download<T: DeviceRepr>(stream: &Arc<CudaStream>, buf: &CudaSlice<T>) -> Vec<T> {
    stream.synchronize().expect("synchronizing the stream");
    stream.clone_dtoh(buf).expect("downloading from the GPU")
}

// ---------------------------------------------------------------------------------------
// Checks.
// ---------------------------------------------------------------------------------------

/// The relative Frobenius error of `got` against the f64 reference `want` is below
/// `tolerance`.
pub fn assert_close<T: Element>(label: &str, got: &[T], want: &[f64], tolerance: f64) {
    let err = relative_error(got, want);
    assert!(
        err < tolerance,
        "{label}: relative error {err:e} vs the f64 reference exceeds {tolerance:e}"
    );
}

/// Every element of `got` still holds the poison: nothing was written.
pub fn assert_poisoned<T: Bits>(label: &str, got: &[T]) {
    if let Some(i) = got.iter().position(|x| x.bits() != T::poison().bits()) {
        panic!(
            "{label}: element {i} of {} was written ({:?}) although nothing should have run",
            got.len(),
            got[i]
        );
    }
}

/// Asserts every element of `got` holds the bits a failed custom collective leaves
/// (`Element::failed_output`), not a result and not the test's own poison.
pub fn assert_failed<T: Element + std::fmt::Debug>(label: &str, got: &[T]) {
    if let Some(i) = got.iter().position(|x| !x.is_failed_output()) {
        panic!(
            "{label}: element {i} of {} is {:?}, not the failed-launch marker",
            got.len(),
            got[i]
        );
    }
}

/// Asserts `result` is `Error::InvalidArgument` naming `arg`.
pub fn expect_invalid(label: &str, result: tpfuse::Result<()>, arg: &str) {
    match result {
        Err(Error::InvalidArgument { arg: got, reason }) => assert_eq!(
            got, arg,
            "{label}: InvalidArgument names `{got}` ({reason}), expected `{arg}`"
        ),
        Err(e) => panic!("{label}: expected InvalidArgument for `{arg}`, got {e:?}"),
        Ok(()) => panic!("{label}: expected InvalidArgument for `{arg}`, got Ok"),
    }
}

/// Asserts `result` is `Error::InvalidArgument` naming `arg`, with every one of `words` in
/// its reason.
pub fn expect_invalid_saying<R: Debug>(
    label: &str,
    result: tpfuse::Result<R>,
    arg: &str,
    words: &[&str],
) {
    match result {
        Err(Error::InvalidArgument { arg: got, reason }) => {
            assert_eq!(got, arg, "{label}: wrong argument named ({reason})");
            for w in words {
                assert!(reason.contains(w), "{label}: `{w}` missing from: {reason}");
            }
        }
        other => panic!("{label}: expected InvalidArgument({arg}), got {other:?}"),
    }
}
