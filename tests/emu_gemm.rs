//! The sm80 GEMM on the CPU emulator (feature `emulator`), through the C ABI: every tile
//! configuration (small-m 16x16, 16x32, 16x64; tiled 64x64, 128x128), f16 and bf16,
//! m in {1, 3, 16, 17, 130}, n and k with tails, with and without bias and residual (also in
//! place, residual == c). Fresh random inputs per case (seeded; `TPFUSE_TEST_SEED` changes
//! them), outputs poisoned first.
//!
//! PTX leaves the arithmetic inside one mma unspecified (the emulator's model is in
//! docs/emulator.md), so results are checked against the f64 reference within the DESIGN.md
//! tolerance, and bitwise only between tpfuse's own paths: every configuration gives the same
//! bits, and a row has the same bits whatever m is (batch invariance).
#![cfg(feature = "emulator")]

mod common;
use common::assert_same_bits;
use common::emu::{launched, session, SESSION_SMS};
use common::gpu::{assert_close, base_seed, mix_seed, random_vec, TestElement};
use half::{bf16, f16};
use tpfuse::emulator::{abi, DeviceBuffer, Stream};
use tpfuse::ops::gemm::split_parts;
use tpfuse::reference::gemm_f64;

const CONFIGS: [u32; 5] = [
    abi::TPFUSE_GEMM_CONFIG_SMALL_16X16,
    abi::TPFUSE_GEMM_CONFIG_SMALL_16X32,
    abi::TPFUSE_GEMM_CONFIG_SMALL_16X64,
    abi::TPFUSE_GEMM_CONFIG_TILE_64X64,
    abi::TPFUSE_GEMM_CONFIG_TILE_128X128,
];
const MS: [usize; 5] = [1, 3, 16, 17, 130];
/// (n, k): tails past every tile width and k-slice (BK 32 and 64), one exact fit; k = 456 is
/// 7.1 64-deep slices, more than a 6-stage ring holds (it wraps), and splits into parts on
/// the session's SMs (tile-128x128, which runs no split, sits that shape out).
const NKS: [(usize, usize); 3] = [(24, 40), (136, 456), (64, 128)];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Epilogue {
    None,
    Bias,
    BiasResidual,
    /// c += a · bᵀ + bias, with the residual in c itself.
    InPlace,
}

struct Problem<T> {
    a: Vec<T>,
    b: Vec<T>,
    bias: Vec<T>,
    residual: Vec<T>,
    m: usize,
    n: usize,
    k: usize,
}

fn problem<T: TestElement>(m: usize, n: usize, k: usize, seed: u64) -> Problem<T> {
    Problem {
        a: random_vec(mix_seed(seed, &[1]), m * k, -1.0, 1.0),
        b: random_vec(mix_seed(seed, &[2]), n * k, -1.0, 1.0),
        bias: random_vec(mix_seed(seed, &[3]), n, -1.0, 1.0),
        residual: random_vec(mix_seed(seed, &[4]), m * n, -2.0, 2.0),
        m,
        n,
        k,
    }
}

/// The device buffers of one launch, kept until it is checked.
struct Run<T: Copy> {
    c: DeviceBuffer<T>,
    _inputs: Vec<DeviceBuffer<T>>,
}

fn enqueue<T: TestElement>(
    stream: &Stream,
    p: &Problem<T>,
    config: u32,
    epi: Epilogue,
    rows: usize,
) -> Run<T> {
    let a = DeviceBuffer::from_slice(&p.a[..rows * p.k]);
    let b = DeviceBuffer::from_slice(&p.b);
    let bias = DeviceBuffer::from_slice(&p.bias);
    let residual = DeviceBuffer::from_slice(&p.residual[..rows * p.n]);
    let c = if epi == Epilogue::InPlace {
        DeviceBuffer::from_slice(&p.residual[..rows * p.n])
    } else {
        DeviceBuffer::<T>::new(rows * p.n)
    };
    let bias_ptr = if epi == Epilogue::None {
        std::ptr::null()
    } else {
        bias.ptr().cast_const().cast()
    };
    let residual_ptr = match epi {
        Epilogue::BiasResidual => residual.ptr().cast_const().cast(),
        Epilogue::InPlace => c.ptr().cast_const().cast(),
        _ => std::ptr::null(),
    };
    // SAFETY: buffers of the documented shapes, alive until checked.
    let code = unsafe {
        abi::tpfuse_gemm(
            T::DTYPE,
            config as i32,
            a.ptr().cast(),
            b.ptr().cast(),
            bias_ptr,
            residual_ptr,
            c.ptr().cast(),
            rows,
            p.n,
            p.k,
            stream.raw(),
        )
    };
    launched(
        &format!("gemm config {config} {epi:?} m {rows} n {} k {}", p.n, p.k),
        code,
    );
    Run {
        c,
        _inputs: vec![a, b, bias, residual],
    }
}

fn reference<T: TestElement>(p: &Problem<T>, epi: Epilogue) -> Vec<f64> {
    let bias = (epi != Epilogue::None).then_some(p.bias.as_slice());
    let residual =
        matches!(epi, Epilogue::BiasResidual | Epilogue::InPlace).then_some(p.residual.as_slice());
    gemm_f64(&p.a, &p.b, bias, residual, p.m, p.n, p.k)
}

/// The configurations that take (n, k): every one, but tile-128x128 where k splits on the
/// session's device (it runs no split: gemm_sm80.cuh, and the launcher refuses it).
fn configs(n: usize, k: usize) -> Vec<u32> {
    let splits = split_parts(n, k, SESSION_SMS as usize) > 1;
    CONFIGS
        .into_iter()
        .filter(|&c| !(splits && c == abi::TPFUSE_GEMM_CONFIG_TILE_128X128))
        .collect()
}

/// Every configuration, shape and epilogue of one dtype: within tolerance of f64, the same
/// bits in every configuration, and row 0 alone (m = 1) the same bits as row 0 of the batch.
fn every_config<T: TestElement>(seed: u64) {
    let stream = Stream::new();
    let mut cases = Vec::new();
    for (si, &(n, k)) in NKS.iter().enumerate() {
        for (mi, &m) in MS.iter().enumerate() {
            for (ei, epi) in [
                Epilogue::None,
                Epilogue::Bias,
                Epilogue::BiasResidual,
                Epilogue::InPlace,
            ]
            .into_iter()
            .enumerate()
            {
                // Every epilogue on the first shape; the others alternate, to bound the time.
                if si > 0 && (mi + ei) % 2 == 1 {
                    continue;
                }
                let case_seed = mix_seed(seed, &[T::ID, si as u64, mi as u64, ei as u64]);
                let p = problem::<T>(m, n, k, case_seed);
                let runs: Vec<Run<T>> = configs(n, k)
                    .iter()
                    .map(|&cfg| enqueue(&stream, &p, cfg, epi, m))
                    .collect();
                let single = enqueue(&stream, &p, abi::TPFUSE_GEMM_CONFIG_SMALL_16X16, epi, 1);
                let label = format!("{} m {m} n {n} k {k} {epi:?} seed {case_seed}", T::NAME);
                cases.push((label, p, epi, runs, single));
            }
        }
    }
    stream.synchronize().expect("gemm on the emulator");
    for (label, p, epi, runs, single) in &cases {
        let want = reference(p, *epi);
        let first = runs[0].c.to_vec();
        assert_close(
            &format!("{label} config {}", CONFIGS[0]),
            &first,
            &want,
            T::TOLERANCE,
        );
        for (cfg, run) in configs(p.n, p.k).iter().zip(runs).skip(1) {
            assert_same_bits(
                &format!("{label}: config {cfg} vs {}", CONFIGS[0]),
                &run.c.to_vec(),
                &first,
            );
        }
        assert_same_bits(
            &format!("{label}: row 0 with m = 1 vs in the batch"),
            &single.c.to_vec(),
            &first[..p.n],
        );
    }
}

#[test]
fn gemm_f16_every_config_shape_and_epilogue() {
    let _s = session("emu_gemm", "gemm_f16_every_config_shape_and_epilogue");
    every_config::<f16>(base_seed(0x6e44_0001));
}

#[test]
fn gemm_bf16_every_config_shape_and_epilogue() {
    let _s = session("emu_gemm", "gemm_bf16_every_config_shape_and_epilogue");
    every_config::<bf16>(base_seed(0x6e44_0002));
}

#[test]
fn gemm_auto_picks_a_config_that_gives_the_same_bits() {
    let _s = session(
        "emu_gemm",
        "gemm_auto_picks_a_config_that_gives_the_same_bits",
    );
    let stream = Stream::new();
    let p = problem::<bf16>(17, 72, 96, base_seed(0x6e44_0003));
    let auto = enqueue(
        &stream,
        &p,
        abi::TPFUSE_GEMM_CONFIG_AUTO as u32,
        Epilogue::Bias,
        17,
    );
    let forced = enqueue(
        &stream,
        &p,
        abi::TPFUSE_GEMM_CONFIG_TILE_64X64,
        Epilogue::Bias,
        17,
    );
    stream.synchronize().expect("gemm");
    assert_same_bits("auto vs 64x64", &auto.c.to_vec(), &forced.c.to_vec());
    assert_close(
        "auto",
        &auto.c.to_vec(),
        &reference(&p, Epilogue::Bias),
        bf16::TOLERANCE,
    );
}
