//! GPU tests of [`tpfuse::ops::gemm`] (feature `gpu-tests`, or `emulator` on the CPU with
//! the shapes of [`common::shape`]'s reduced side; with neither every test here is listed as
//! ignored; the cuBLASLt comparison needs a GPU).
//!
//! Every case uploads fresh random inputs (seeded per case from `TPFUSE_TEST_SEED`, a fixed
//! default when unset, so a failure names the seed that reproduces it), poisons the output
//! with NaN (plus a poisoned guard after its end) so that an element the kernel never writes,
//! or one it writes out of bounds, fails the check, and asserts
//!
//! - relative Frobenius error against the f64 reference [`gemm_f64`] below 1e-2 (bf16) or
//!   2e-3 (f16), on every row for small m and on a random subset of rows (first and last
//!   included) for large m, where the host reference would cost minutes;
//! - batch invariance, bitwise: rows of m = 1 runs equal the same rows of an m = 4096 run (1024 emulated),
//!   m = 16 (small-m path) and m = 17 (tiled path) agree on their common rows, and every tile
//!   configuration gives the same bits;
//! - agreement with cuBLASLt (when libcublasLt can be loaded) within the same tolerance.

mod common;
use common::gpu::{
    self, assert_close, base_seed, download, expect_invalid, gpu_stream, mix_seed, random_vec,
    splitmix64, upload,
};
use common::{assert_same_bits, reduced_copy, shape};

use cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, ValidAsZeroBits};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use tpfuse::ops::gemm::{
    gemm, gemm_accumulate, gemm_with_config, gemm_with_config_and_scratch, gemm_with_scratch,
    split_parts_on, split_scratch_bytes, GemmConfig, GemmElement, GemmPath, GemmShape,
};
use tpfuse::reference::{gemm_f64, relative_error};

/// The DESIGN reference shapes, Llama-3-70B at TP = 8: (name, n, k); on the emulator each
/// dimension divided by 8 (the tile edges and the k loop's stages are still crossed).
const REFERENCE_SHAPES: [(&str, usize, usize); 4] = [
    ("qkv", shape(1280, 160), shape(8192, 1024)),
    ("o_proj", shape(8192, 1024), shape(1024, 128)),
    ("gate_up", shape(7168, 896), shape(8192, 1024)),
    ("down", shape(8192, 1024), shape(3584, 448)),
];
const REFERENCE_MS: [usize; 5] = [1, 16, 64, 256, shape(1024, 384)];
/// Awkward shapes: m below, at and across tile edges; n and k at 8 and off every tile size.
const AWKWARD_MS: [usize; 5] = [1, 3, 17, 129, shape(1000, 200)];
const AWKWARD_NK: [(usize, usize); 7] = [
    (8, 8),
    (8, 1000),
    (24, 8),
    (136, 40),
    (1288, 72),
    (200, shape(8200, 2056)),
    (shape(4104, 1032), 264),
];
/// The m of the batch the invariance tests slice rows from (at least 768).
const BIG_M: usize = shape(4096, 1024);
/// Rows checked against the host reference when m is larger than this.
const CHECKED_ROWS: usize = 16;
/// Poisoned elements after the end of every output.
const GUARD: usize = 64;

/// The GEMM's element types (f16 and bf16) with the tests' seeds and tolerances.
trait TestElement: gpu::TestElement + GemmElement + ValidAsZeroBits {}

impl TestElement for f16 {}
impl TestElement for bf16 {}

/// One seed per case: the dtype and the given parts.
fn case_seed<T: TestElement>(parts: &[u64]) -> u64 {
    mix_seed(splitmix64(base_seed(0x7470_6675_7365_0005) ^ T::ID), parts)
}

/// `len` values uniform in (-scale, scale), generated in parallel chunks for large `len`.
fn random<T: TestElement>(seed: u64, len: usize, scale: f32) -> Vec<T> {
    const CHUNK: usize = 1 << 20;
    let chunk = |c: usize| -> Vec<T> {
        let seed = splitmix64(seed ^ (c as u64).wrapping_mul(0x9e37));
        random_vec(seed, CHUNK.min(len - c * CHUNK), -scale, scale)
    };
    let chunks = len.div_ceil(CHUNK);
    if chunks <= 1 {
        return if len == 0 { Vec::new() } else { chunk(0) };
    }
    let threads = std::thread::available_parallelism().map_or(4, |t| t.get());
    let per = chunks.div_ceil(threads);
    let parts: Vec<Vec<Vec<T>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| s.spawn(move || (t * per..((t + 1) * per).min(chunks)).map(chunk).collect()))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("generator thread"))
            .collect()
    });
    parts.into_iter().flatten().flatten().collect()
}

/// The host side of one problem.
struct Problem<T> {
    shape: GemmShape,
    a: Vec<T>,
    b: Vec<T>,
    bias: Option<Vec<T>>,
    residual: Option<Vec<T>>,
}

impl<T: TestElement> Problem<T> {
    fn new(seed: u64, shape: GemmShape, bias: bool, residual: bool) -> Self {
        let GemmShape { m, n, k } = shape;
        // Weights scaled like a trained layer (outputs of order 1).
        let w = 1.0 / (k as f32).sqrt();
        Problem {
            shape,
            a: random(splitmix64(seed ^ 1), m * k, 1.0),
            b: random(splitmix64(seed ^ 2), n * k, 2.0 * w),
            bias: bias.then(|| random(splitmix64(seed ^ 3), n, 0.5)),
            residual: residual.then(|| random(splitmix64(seed ^ 4), m * n, 1.0)),
        }
    }

    /// The f64 reference of the given rows, in order, computed on several threads.
    fn reference_rows(&self, rows: &[usize]) -> Vec<f64> {
        let GemmShape { n, k, .. } = self.shape;
        let threads = std::thread::available_parallelism()
            .map_or(4, |t| t.get())
            .min(rows.len().max(1));
        let per = rows.len().div_ceil(threads).max(1);
        let parts: Vec<Vec<f64>> = std::thread::scope(|s| {
            let handles: Vec<_> = rows
                .chunks(per)
                .map(|chunk| {
                    s.spawn(move || {
                        let a: Vec<T> = chunk
                            .iter()
                            .flat_map(|&r| self.a[r * k..(r + 1) * k].iter().copied())
                            .collect();
                        let residual: Option<Vec<T>> = self.residual.as_ref().map(|res| {
                            chunk
                                .iter()
                                .flat_map(|&r| res[r * n..(r + 1) * n].iter().copied())
                                .collect()
                        });
                        gemm_f64(
                            &a,
                            &self.b,
                            self.bias.as_deref(),
                            residual.as_deref(),
                            chunk.len(),
                            n,
                            k,
                        )
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("reference thread"))
                .collect()
        });
        parts.concat()
    }
}

/// The problem on the device.
struct Device<T> {
    a: CudaSlice<T>,
    b: CudaSlice<T>,
    bias: Option<CudaSlice<T>>,
    residual: Option<CudaSlice<T>>,
}

impl<T: TestElement> Problem<T> {
    fn upload(&self, stream: &Arc<CudaStream>) -> Device<T> {
        Device {
            a: upload(stream, &self.a),
            b: upload(stream, &self.b),
            bias: self.bias.as_ref().map(|x| upload(stream, x)),
            residual: self.residual.as_ref().map(|x| upload(stream, x)),
        }
    }
}

/// Runs a GEMM on rows `first_row..first_row + m` of the device problem (through [`gemm`], or
/// a forced configuration) into a NaN-poisoned output with a poisoned guard after it; returns
/// the output (the guard checked and dropped).
fn run_rows<T: TestElement>(
    stream: &Arc<CudaStream>,
    label: &str,
    dev: &Device<T>,
    shape: GemmShape,
    first_row: usize,
    config: Option<GemmConfig>,
) -> Vec<T> {
    let how = config.map_or(How::Auto, How::Config);
    run_rows_how(stream, label, dev, shape, first_row, how)
}

/// Which entry point a run takes.
enum How<'s> {
    Auto,
    Config(GemmConfig),
    Scratch(&'s mut CudaSlice<u8>),
    ConfigScratch(GemmConfig, &'s mut CudaSlice<u8>),
}

/// [`run_rows`] through any entry point.
fn run_rows_how<T: TestElement>(
    stream: &Arc<CudaStream>,
    label: &str,
    dev: &Device<T>,
    shape: GemmShape,
    first_row: usize,
    how: How<'_>,
) -> Vec<T> {
    let GemmShape { m, n, k } = shape;
    let a = dev.a.slice(first_row * k..(first_row + m) * k);
    let residual: Option<CudaView<T>> = dev
        .residual
        .as_ref()
        .map(|r| r.slice(first_row * n..(first_row + m) * n));
    let bias: Option<&dyn DevicePtr<T>> = dev.bias.as_ref().map(|x| x as &dyn DevicePtr<T>);
    let residual_ref: Option<&dyn DevicePtr<T>> = residual.as_ref().map(|x| x as &dyn DevicePtr<T>);
    let mut c = upload(stream, &vec![T::poison(); m * n + GUARD]);
    {
        let mut out = c.slice_mut(0..m * n);
        let result = match how {
            How::Auto => gemm(stream, &a, &dev.b, bias, residual_ref, &mut out, m, n, k),
            How::Config(cfg) => {
                gemm_with_config(stream, &a, &dev.b, bias, residual_ref, &mut out, shape, cfg)
            }
            How::Scratch(scratch) => gemm_with_scratch(
                stream,
                &a,
                &dev.b,
                bias,
                residual_ref,
                &mut out,
                shape,
                scratch,
            ),
            How::ConfigScratch(cfg, scratch) => gemm_with_config_and_scratch(
                stream,
                &a,
                &dev.b,
                bias,
                residual_ref,
                &mut out,
                shape,
                cfg,
                scratch,
            ),
        };
        result.unwrap_or_else(|e| panic!("{label}: {e}"));
    }
    let mut got = download(stream, &c);
    assert_same_bits(
        &format!("{label}: the guard after the output (written out of bounds)"),
        &got[m * n..],
        &[T::poison(); GUARD],
    );
    got.truncate(m * n);
    got
}

/// Whether `config` runs `[n, k]` weights on this device: every configuration unless `k`
/// splits and the configuration runs no split.
fn runs(stream: &CudaStream, config: GemmConfig, n: usize, k: usize) -> bool {
    config.splits_k() || split_parts_on(stream, n, k).expect("the SM count") == 1
}

/// A configuration that runs no split of k, forced on a shape whose k splits: refused
/// before anything is launched, naming `config`.
fn refused_for_its_split<T: TestElement>(
    stream: &Arc<CudaStream>,
    label: &str,
    dev: &Device<T>,
    shape: GemmShape,
    config: GemmConfig,
) {
    let GemmShape { m, n, k } = shape;
    let a = dev.a.slice(0..m * k);
    let mut c = upload(stream, &vec![T::poison(); m * n]);
    let result = gemm_with_config(stream, &a, &dev.b, None, None, &mut c, shape, config);
    expect_invalid(label, result, "config");
    assert_same_bits(
        &format!("{label}: a refused call wrote c"),
        &download(stream, &c),
        &vec![T::poison(); m * n],
    );
}

/// Rows to check: all for small m, else the first, the last and a random subset.
fn checked_rows(seed: u64, m: usize) -> Vec<usize> {
    if m <= CHECKED_ROWS {
        return (0..m).collect();
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rows = vec![0, m - 1];
    while rows.len() < CHECKED_ROWS {
        let r = rng.random_range(0..m);
        if !rows.contains(&r) {
            rows.push(r);
        }
    }
    rows.sort_unstable();
    rows
}

/// No element still holds the poison, and the checked rows are within tolerance.
fn check_accuracy<T: TestElement>(label: &str, problem: &Problem<T>, got: &[T], rows: &[usize]) {
    let n = problem.shape.n;
    let unwritten = got
        .iter()
        .filter(|x| x.bits() == T::poison().bits())
        .count();
    assert_eq!(
        unwritten, 0,
        "{label}: {unwritten} outputs were never written"
    );
    let want = problem.reference_rows(rows);
    let picked: Vec<T> = rows
        .iter()
        .flat_map(|&r| got[r * n..(r + 1) * n].iter().copied())
        .collect();
    assert_close(label, &picked, &want, T::TOLERANCE);
}

fn reference_shapes<T: TestElement>() {
    let stream = gpu_stream();
    for (i, &(name, n, k)) in REFERENCE_SHAPES.iter().enumerate() {
        // qkv and gate_up without residual (a column-parallel output), o_proj and down with
        // (row-parallel outputs feed the residual stream); bias on qkv and down.
        let bias = i == 0 || i == 3;
        let residual = i == 1 || i == 3;
        let m_max = REFERENCE_MS[REFERENCE_MS.len() - 1];
        let seed = case_seed::<T>(&[1, i as u64]);
        let problem = Problem::<T>::new(seed, GemmShape { m: m_max, n, k }, bias, residual);
        let dev = problem.upload(&stream);
        for &m in &REFERENCE_MS {
            let shape = GemmShape { m, n, k };
            let label = format!("gemm {} {name} m={m} n={n} k={k} seed={seed:#x}", T::NAME);
            let got = run_rows(&stream, &label, &dev, shape, 0, None);
            // The first m rows of the m_max problem: the reference of a row needs only it.
            let rows = checked_rows(seed ^ m as u64, m);
            check_accuracy(&label, &problem, &got, &rows);
        }
    }
}

/// Awkward shapes: every configuration forced, each checked against the reference, and all
/// of them (and the automatic choice) bitwise equal. On the emulator the f16 copy leaves out
/// the largest m ([`reduced_copy`]: the same edges as bf16's, an element of the same size).
fn awkward_shapes<T: TestElement>() {
    let stream = gpu_stream();
    let ms = if reduced_copy::<T>() {
        &AWKWARD_MS[..AWKWARD_MS.len() - 1]
    } else {
        &AWKWARD_MS[..]
    };
    for &(n, k) in &AWKWARD_NK {
        for &m in ms {
            let shape = GemmShape { m, n, k };
            let seed = case_seed::<T>(&[2, m as u64, n as u64, k as u64]);
            let with = (seed & 1 == 1, seed & 2 == 2);
            let problem = Problem::<T>::new(seed, shape, with.0, with.1);
            let dev = problem.upload(&stream);
            let rows = checked_rows(seed, m);
            let label = format!(
                "gemm {} m={m} n={n} k={k} bias={} residual={} seed={seed:#x}",
                T::NAME,
                with.0,
                with.1
            );
            let auto = run_rows(&stream, &format!("{label} auto"), &dev, shape, 0, None);
            check_accuracy(&format!("{label} auto"), &problem, &auto, &rows);
            for config in GemmConfig::ALL {
                let l = format!("{label} {}", config.name());
                if !runs(&stream, config, n, k) {
                    refused_for_its_split(&stream, &l, &dev, shape, config);
                    continue;
                }
                let got = run_rows(&stream, &l, &dev, shape, 0, Some(config));
                assert_same_bits(&format!("{l} vs auto"), &got, &auto);
            }
        }
    }
}

/// Rows of m = 1 runs, m = 16 and m = 17 runs and every forced configuration equal the same
/// rows of an m = [`BIG_M`] run, bit for bit (bias and residual included).
fn batch_invariance<T: TestElement>() {
    let stream = gpu_stream();
    let big_m = BIG_M;
    for (i, &(name, n, k)) in REFERENCE_SHAPES.iter().enumerate().take(2) {
        let seed = case_seed::<T>(&[3, i as u64]);
        let problem = Problem::<T>::new(seed, GemmShape { m: big_m, n, k }, true, true);
        let dev = problem.upload(&stream);
        let label = format!("gemm {} {name} n={n} k={k} seed={seed:#x}", T::NAME);
        let big = run_rows(
            &stream,
            &format!("{label} m={big_m}"),
            &dev,
            GemmShape { m: big_m, n, k },
            0,
            None,
        );
        check_accuracy(
            &format!("{label} m={big_m}"),
            &problem,
            &big,
            &checked_rows(seed, big_m),
        );
        let row = |r: usize| &big[r * n..(r + 1) * n];

        // Decode: one row at a time, at positions across tile edges.
        let mut rng = StdRng::seed_from_u64(seed);
        let mut rows = vec![
            0,
            1,
            7,
            8,
            15,
            16,
            17,
            63,
            64,
            127,
            128,
            1000,
            big_m / 2 - 1,
        ];
        rows.push(big_m - 1);
        rows.extend((0..6).map(|_| rng.random_range(0..big_m)));
        for &r in &rows {
            let got = run_rows(
                &stream,
                &format!("{label} m=1 row {r}"),
                &dev,
                GemmShape { m: 1, n, k },
                r,
                None,
            );
            assert_same_bits(
                &format!("{label}: row {r} at m=1 vs m={big_m}"),
                &got,
                row(r),
            );
        }

        // Across the small-m boundary: m = 16 (small-m path) and m = 17 (tiled), from row 0
        // and from row 100.
        for first in [0usize, 100] {
            for m in [15usize, 16, 17, 33] {
                let got = run_rows(
                    &stream,
                    &format!("{label} m={m} from row {first}"),
                    &dev,
                    GemmShape { m, n, k },
                    first,
                    None,
                );
                assert_same_bits(
                    &format!("{label}: m={m} from row {first} vs m={big_m}"),
                    &got,
                    &big[first * n..(first + m) * n],
                );
            }
        }

        // Every configuration forced, on 256 rows from row 512.
        for config in GemmConfig::ALL
            .into_iter()
            .filter(|&c| runs(&stream, c, n, k))
        {
            let got = run_rows(
                &stream,
                &format!("{label} {} m=256", config.name()),
                &dev,
                GemmShape { m: 256, n, k },
                512,
                Some(config),
            );
            assert_same_bits(
                &format!("{label}: {} m=256 vs m={big_m}", config.name()),
                &got,
                &big[512 * n..768 * n],
            );
        }
    }
}

/// The automatic choice crosses from the small-m path to the tiled path between m = 16 and
/// m = 17 on this GPU (so the invariance tests above compare two paths).
fn paths_on_this_gpu() {
    let stream = gpu_stream();
    let ctx = stream.context();
    let attr = |a| ctx.attribute(a).expect("device attribute");
    use cudarc::driver::sys::CUdevice_attribute as A;
    let cc = (
        attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) as u32,
        attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) as u32,
    );
    let sms = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) as usize;
    let pick = |m| {
        tpfuse::ops::gemm::select_config(
            GemmShape {
                m,
                n: 1280,
                k: 8192,
            },
            cc,
            sms,
        )
    };
    let small = pick(16).expect("a GEMM path on this GPU");
    let tiled = pick(17).expect("a GEMM path on this GPU");
    println!(
        "compute capability {}.{}, {sms} SMs: m=16 -> {}, m=17 -> {}, m=4096 -> {}",
        cc.0,
        cc.1,
        small.name(),
        tiled.name(),
        pick(4096).map_or("none", |c| c.name())
    );
    assert_eq!(small.path(), GemmPath::Sm80SmallM);
    assert_eq!(tiled.path(), GemmPath::Sm80Tiled);
}

/// gemm_accumulate (c += a·bᵀ + bias) gives the bits of gemm with a separate residual.
fn accumulate_in_place<T: TestElement>() {
    let stream = gpu_stream();
    for &(m, n, k) in &[
        (1usize, shape(1280, 160), shape(8192, 1024)),
        (300, 520, 136),
    ] {
        let shape = GemmShape { m, n, k };
        let seed = case_seed::<T>(&[4, m as u64, n as u64]);
        let problem = Problem::<T>::new(seed, shape, true, true);
        let dev = problem.upload(&stream);
        let label = format!(
            "gemm_accumulate {} m={m} n={n} k={k} seed={seed:#x}",
            T::NAME
        );
        let separate = run_rows(&stream, &label, &dev, shape, 0, None);
        let mut c = upload(&stream, problem.residual.as_ref().expect("residual"));
        let bias: Option<&dyn DevicePtr<T>> = dev.bias.as_ref().map(|x| x as &dyn DevicePtr<T>);
        gemm_accumulate(&stream, &dev.a, &dev.b, bias, &mut c, shape)
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        let got = download(&stream, &c);
        assert_same_bits(
            &format!("{label}: in place vs separate residual"),
            &got,
            &separate,
        );
    }
}

/// Two runs of the same call give the same bits.
fn deterministic<T: TestElement>() {
    let stream = gpu_stream();
    let shape = GemmShape {
        m: 777,
        n: shape(1288, 136),
        k: shape(1032, 264),
    };
    let seed = case_seed::<T>(&[5]);
    let problem = Problem::<T>::new(seed, shape, true, true);
    let dev = problem.upload(&stream);
    let label = format!("gemm {} repeat seed={seed:#x}", T::NAME);
    let first = run_rows(&stream, &label, &dev, shape, 0, None);
    for _ in 0..3 {
        let again = run_rows(&stream, &label, &dev, shape, 0, None);
        assert_same_bits(&label, &again, &first);
    }
}

/// Bad calls on real buffers fail before the launch: the output keeps its poison.
fn validation<T: TestElement>() {
    let stream = gpu_stream();
    let (m, n, k) = (4usize, 64usize, 64usize);
    let seed = case_seed::<T>(&[6]);
    let problem = Problem::<T>::new(seed, GemmShape { m, n, k }, true, false);
    let dev = problem.upload(&stream);
    let a_plus = upload(&stream, &random::<T>(seed, m * k + 8, 1.0));
    let mut c = upload(&stream, &vec![T::poison(); m * n + 8]);
    let name = T::NAME;
    {
        let mut out = c.slice_mut(0..m * n);
        // k not a multiple of 8, n not a multiple of 8.
        expect_invalid(
            &format!("{name} k=60"),
            gemm(&stream, &dev.a, &dev.b, None, None, &mut out, m, n, 60),
            "k",
        );
        expect_invalid(
            &format!("{name} n=60"),
            gemm(&stream, &dev.a, &dev.b, None, None, &mut out, m, 60, k),
            "n",
        );
        // a one row short.
        let short = dev.a.slice(0..(m - 1) * k);
        expect_invalid(
            &format!("{name} short a"),
            gemm(&stream, &short, &dev.b, None, None, &mut out, m, n, k),
            "a",
        );
        // a misaligned by one element (the right length, 2 bytes off).
        let off = a_plus.slice(1..1 + m * k);
        expect_invalid(
            &format!("{name} misaligned a"),
            gemm(&stream, &off, &dev.b, None, None, &mut out, m, n, k),
            "a",
        );
        // A bias of the wrong length.
        let short_bias = dev.b.slice(0..n - 8);
        expect_invalid(
            &format!("{name} short bias"),
            gemm(
                &stream,
                &dev.a,
                &dev.b,
                Some(&short_bias),
                None,
                &mut out,
                m,
                n,
                k,
            ),
            "bias",
        );
    }
    // (Overlapping c with an input takes two views of one allocation, one of them mutable,
    // which safe Rust does not allow; tests/cpu_gemm.rs covers that check.)
    let got = download(&stream, &c);
    assert_same_bits(
        &format!("{name}: output after rejected calls (nothing may be launched)"),
        &got,
        &vec![T::poison(); m * n + 8],
    );
    // The stream is healthy: a valid call works afterwards.
    {
        let mut out = c.slice_mut(0..m * n);
        let bias: Option<&dyn DevicePtr<T>> = dev.bias.as_ref().map(|x| x as &dyn DevicePtr<T>);
        gemm(&stream, &dev.a, &dev.b, bias, None, &mut out, m, n, k)
            .expect("a valid call after the rejected ones");
    }
    let got = download(&stream, &c);
    check_accuracy(
        &format!("{name} after rejected calls"),
        &problem,
        &got[..m * n],
        &(0..m).collect::<Vec<_>>(),
    );
    // m = 0 is a no-op.
    {
        let empty_a = dev.a.slice(0..0);
        let mut empty_c = c.slice_mut(0..0);
        gemm(&stream, &empty_a, &dev.b, None, None, &mut empty_c, 0, n, k).expect("m = 0");
    }
}

/// Row-major C = A·Bᵀ through cuBLASLt (column-major): C_cm[n, m] = op(B_cm[k, n])ᵀ · A_cm[k, m].
fn cublaslt_gemm<T: TestElement>(
    blas: &CudaBlasLT,
    a: &CudaSlice<T>,
    b: &CudaSlice<T>,
    c: &mut CudaSlice<T>,
    shape: GemmShape,
) where
    CudaBlasLT: Matmul<T>,
{
    let GemmShape { m, n, k } = shape;
    let cfg = MatmulConfig {
        transa: true,
        transb: false,
        transc: false,
        m: n as u64,
        n: m as u64,
        k: k as u64,
        alpha: 1.0,
        lda: k as i64,
        ldb: k as i64,
        beta: 0.0,
        ldc: n as i64,
        stride_a: None,
        stride_b: None,
        stride_c: None,
        stride_bias: None,
        batch_size: None,
    };
    // SAFETY: a is [m, k], b is [n, k] and c is [m, n], row-major, on blas's stream.
    unsafe { blas.matmul(cfg, b, a, c, None, None) }.expect("cuBLASLt matmul");
}

/// Our result against cuBLASLt's, both without bias or residual.
fn matches_cublaslt<T: TestElement>()
where
    CudaBlasLT: Matmul<T>,
{
    if !cublaslt_present() {
        println!(
            "libcublasLt could not be loaded (add the nvidia-cublas wheel's lib/ to \
             LD_LIBRARY_PATH): the cuBLASLt comparison did not run"
        );
        return;
    }
    let stream = gpu_stream();
    let blas = CudaBlasLT::new(stream.clone()).expect("creating a cuBLASLt handle");
    for (i, &(name, n, k)) in REFERENCE_SHAPES.iter().enumerate() {
        for &m in &[1usize, 64, REFERENCE_MS[4]] {
            let shape = GemmShape { m, n, k };
            let seed = case_seed::<T>(&[7, i as u64, m as u64]);
            let problem = Problem::<T>::new(seed, shape, false, false);
            let dev = problem.upload(&stream);
            let label = format!("gemm {} {name} m={m} vs cuBLASLt seed={seed:#x}", T::NAME);
            let ours = run_rows(&stream, &label, &dev, shape, 0, None);
            let mut theirs = upload(&stream, &vec![T::poison(); m * n]);
            cublaslt_gemm(&blas, &dev.a, &dev.b, &mut theirs, shape);
            let theirs = download(&stream, &theirs);
            let wide: Vec<f64> = theirs.iter().map(|x| x.to_f64()).collect();
            let diff = relative_error(&ours, &wide);
            assert!(
                diff < T::TOLERANCE,
                "{label}: relative difference {diff:e} exceeds {:e}",
                T::TOLERANCE
            );
        }
    }
}

/// Shapes whose k splits on any device (n, k): one 64-column tile and long k (16 parts at
/// most), a column tail with k off every part boundary, and a k of only two parts.
const SPLIT_NK: [(usize, usize); 3] = [(64, 2048), (136, 1000), (192, 264)];

/// The split of k (the batch-invariance contract with S > 1 parts): rows of every m, with
/// the parts one after another (no scratch) and in parallel (a scratch, m <= 64, twice from
/// the same scratch), and every configuration that runs a split, equal the rows of an m = 130
/// run bit for bit, which is within the tolerance of the f64 reference; a scratch too small
/// runs the parts one after another, a misaligned one is refused.
fn split_k<T: TestElement>() {
    let stream = gpu_stream();
    let big_m = 130;
    for (i, &(n, k)) in SPLIT_NK.iter().enumerate() {
        let parts = split_parts_on(&stream, n, k).expect("the SM count");
        assert!(
            parts > 1,
            "n = {n}, k = {k}: {parts} parts: the test needs a split"
        );
        let seed = case_seed::<T>(&[7, i as u64]);
        let problem = Problem::<T>::new(seed, GemmShape { m: big_m, n, k }, true, true);
        let dev = problem.upload(&stream);
        let label = format!(
            "gemm {} split n={n} k={k} parts={parts} seed={seed:#x}",
            T::NAME
        );
        let big_shape = GemmShape { m: big_m, n, k };
        let big = run_rows(
            &stream,
            &format!("{label} m={big_m}"),
            &dev,
            big_shape,
            0,
            None,
        );
        check_accuracy(
            &format!("{label} m={big_m}"),
            &problem,
            &big,
            &(0..big_m).collect::<Vec<_>>(),
        );
        let mut scratch = stream
            .alloc_zeros::<u8>(
                split_scratch_bytes(GemmShape { m: 64, n, k }, 1 << 20).max(1 << 16) + 256,
            )
            .expect("scratch");
        for (first, m) in [
            (0, 1),
            (5, 1),
            (0, 3),
            (100, 16),
            (64, 17),
            (3, 64),
            (0, 100),
        ] {
            let shape = GemmShape { m, n, k };
            let want = &big[first * n..(first + m) * n];
            let l = format!("{label} m={m} from row {first}");
            let sequential = run_rows(&stream, &l, &dev, shape, first, None);
            assert_same_bits(&format!("{l}: parts one after another"), &sequential, want);
            for round in 0..2 {
                let parallel =
                    run_rows_how(&stream, &l, &dev, shape, first, How::Scratch(&mut scratch));
                assert_same_bits(
                    &format!("{l}: parts in parallel, round {round}"),
                    &parallel,
                    want,
                );
            }
            for config in GemmConfig::ALL.into_iter().filter(|c| c.splits_k()) {
                let got = run_rows(
                    &stream,
                    &format!("{l} {}", config.name()),
                    &dev,
                    shape,
                    first,
                    Some(config),
                );
                assert_same_bits(&format!("{l} {}", config.name()), &got, want);
                // Forced with a scratch: 16x64 and 64x64 run the parts in parallel at any
                // m <= 64 (also the m their automatic choice would not give them).
                let l = format!("{l} {} with a scratch", config.name());
                let got = run_rows_how(
                    &stream,
                    &l,
                    &dev,
                    shape,
                    first,
                    How::ConfigScratch(config, &mut scratch),
                );
                assert_same_bits(&l, &got, want);
            }
            refused_for_its_split(
                &stream,
                &format!("{l} tile-128x128"),
                &dev,
                shape,
                GemmConfig::Tile128x128,
            );
        }
        // On the emulator: which kernel ran, and how many blocks (a block per part of a tile
        // with the scratch, a block per tile without).
        #[cfg(feature = "emulator")]
        {
            let shape = GemmShape { m: 2, n, k };
            let tiles = n.div_ceil(64);
            let ((), with) = tpfuse::emulator::counters::count(|| {
                run_rows_how(&stream, &label, &dev, shape, 0, How::Scratch(&mut scratch));
            });
            assert!(
                with.iter()
                    .any(|r| r.kernel.contains("gemm_split") && r.blocks.len() == tiles * parts),
                "{label}: {with:?}"
            );
            let ((), without) = tpfuse::emulator::counters::count(|| {
                run_rows(&stream, &label, &dev, shape, 0, None);
            });
            assert!(
                without
                    .iter()
                    .any(|r| r.kernel.contains("gemm_sm80") && r.blocks.len() == tiles),
                "{label}: {without:?}"
            );
        }
        // A scratch too small for the parallel parts: one after another, the same bits.
        let shape = GemmShape { m: 8, n, k };
        let mut small = stream.alloc_zeros::<u8>(64).expect("scratch");
        let got = run_rows_how(
            &stream,
            &format!("{label} small scratch"),
            &dev,
            shape,
            0,
            How::Scratch(&mut small),
        );
        assert_same_bits(&format!("{label} small scratch"), &got, &big[..8 * n]);
        // Misaligned: refused, naming the scratch.
        let a = dev.a.slice(0..8 * k);
        let mut c = upload(&stream, &vec![T::poison(); 8 * n]);
        let mut odd = scratch.slice_mut(8..);
        let result = gemm_with_scratch(&stream, &a, &dev.b, None, None, &mut c, shape, &mut odd);
        expect_invalid(&format!("{label} misaligned scratch"), result, "scratch");
    }
}

gpu_tests! {
    split_k_bf16 => split_k::<bf16>();
    split_k_f16 => split_k::<f16>();
    reference_shapes_bf16 => reference_shapes::<bf16>();
    reference_shapes_f16 => reference_shapes::<f16>();
    awkward_shapes_bf16 => awkward_shapes::<bf16>();
    awkward_shapes_f16 => awkward_shapes::<f16>();
    batch_invariance_bf16 => batch_invariance::<bf16>();
    batch_invariance_f16 => batch_invariance::<f16>();
    small_m_and_tiled_paths_meet_at_16 => paths_on_this_gpu();
    accumulate_in_place_bf16 => accumulate_in_place::<bf16>();
    accumulate_in_place_f16 => accumulate_in_place::<f16>();
    deterministic_bf16 => deterministic::<bf16>();
    deterministic_f16 => deterministic::<f16>();
    validation_bf16 => validation::<bf16>();
    validation_f16 => validation::<f16>();
}

gpu_only_tests! { "needs a CUDA GPU: cuBLASLt" => {
    matches_cublaslt_bf16 => matches_cublaslt::<bf16>();
    matches_cublaslt_f16 => matches_cublaslt::<f16>();
} }

/// Whether cuBLASLt can be loaded. With the `candle` feature cudarc links it instead
/// (candle-core asks for `dynamic-linking`): this binary would not have started without it.
fn cublaslt_present() -> bool {
    #[cfg(feature = "candle")]
    return true;
    // SAFETY: only tries to load the library.
    #[cfg(not(feature = "candle"))]
    return unsafe { cudarc::cublaslt::sys::is_culib_present() };
}
