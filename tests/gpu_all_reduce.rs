//! GPU tests of the custom all-reduce and its neighbours (feature `gpu-tests`; without it
//! every test here is listed as ignored): [`ops::all_reduce`], [`ops::all_reduce_in_place`],
//! [`ops::all_reduce_residual_rmsnorm`], [`ops::all_reduce_fused`], [`ops::all_gather`] and
//! [`ops::reduce_scatter`] over a [`TpGroup`].
//!
//! Most tests use virtual ranks ([`TpGroup::virtual_ranks`]): W = 2, 4, 8 ranks on GPU 0,
//! each with its own stream. One host thread enqueues the op on rank 0, 1, .., W-1, then calls
//! `check()` on every rank (a bounded wait that turns a kernel's timeout into an error). Every
//! case uploads fresh random data (seeded per case and per rank from `TPFUSE_TEST_SEED`, a
//! fixed default when unset), fills every output with NaN first (an element never written
//! fails the bitwise checks), and asserts
//!
//! - bitwise equality across ranks, between one-shot, two-shot and `Auto`, between in-place
//!   and out-of-place, and with the exact emulations of the kernels' arithmetic
//!   ([`reduce_ranks_exact`], [`all_reduce_epilogue_exact`]);
//! - relative Frobenius error against the f64 references ([`reduce_ranks_f64`],
//!   [`all_reduce_fused_f64`]) below 1e-2 (bf16), 2e-3 (f16), 1e-6 (f32; 2e-6 after RMSNorm,
//!   whose `rsqrtf` is accurate to 2 ulp).
//!
//! The fused epilogue's bias, residual and gamma are the same on every rank (they are
//! replicated in tensor parallelism; two-shot computes slice p with rank p's copy).
//!
//! Fused against unfused: the fused kernels round the reduction to the element type, then
//! add bias and residual in f32 and round once ([`all_reduce_epilogue_exact`]), which is
//! exactly what the unfused sequence (`all_reduce`, then `add_bias_residual`, then
//! `rms_norm`) computes: the two give the same bits, for every dtype.
//!
//! Other tests: CUDA-graph capture and 1000 replays; a peer that never launches (a bounded
//! `PeerTimeout`, then a poisoned group); validation on real buffers (a typed error naming the
//! argument, nothing launched, nothing written); and two processes on one GPU joined by NCCL
//! (distinct `NCCL_HOSTID`, `NCCL_SOCKET_IFNAME=lo`), whose `TpGroup::from_comm` either maps
//! the peer's buffers over CUDA IPC (custom kernels checked bitwise) or reports why not (the
//! NCCL fallback checked instead).
//!
//! # One test at a time, and `CUDA_DEVICE_MAX_CONNECTIONS`
//!
//! Every test holds one process-wide lock while it uses the GPU: the kernels of all W virtual
//! ranks must be resident at once, and a concurrent test's kernels would take the SMs the
//! CTA budget counted on (a deadlock that only the deadline ends).
//!
//! The driver maps streams onto `CUDA_DEVICE_MAX_CONNECTIONS` hardware queues (8 by
//! default). Two ranks whose streams share a queue are serialised: the later rank's kernel
//! waits behind the earlier one, which waits at a barrier for it — a hang until the deadline.
//! The variable is read when the CUDA context is created, so it must be set before the first
//! CUDA call of the process: the bundle's run.sh exports `CUDA_DEVICE_MAX_CONNECTIONS=32`, and
//! the first test of this binary to take the GPU sets it (when unset) before it opens the
//! device. Run these tests as `cargo test --features gpu-tests --release --test
//! gpu_all_reduce`, or from the GPU bundle.
//!
//! [`reduce_ranks_f64`]: tpfuse::reference::reduce_ranks_f64

mod common;
use common::children::{small_int, ChildEnv, Children, Spawn};
use common::gpu::{
    self, assert_close, assert_failed, assert_poisoned, base_seed, expect_invalid_saying, mix_seed,
    par_chunks, random_vec, slices, splitmix64, sum_references, TestElement as _,
};
use common::graphs::{capture_on, launch_all};
use common::ranks::{
    check_all, download, gpu, gpu_lock, poisoned, poisoned_ranks, refill, round, upload,
    upload_ranks,
};
use common::{assert_same_bits, device_clock, reduced_copy, shape, Bits};

use cudarc::driver::{CudaContext, CudaGraph, CudaSlice, DevicePtr, DevicePtrMut};
use half::{bf16, f16};
use std::sync::Arc;
use std::time::Duration;
use tpfuse::ops::{self, Algorithm, Epilogue, RmsNorm};
use tpfuse::reference::{all_reduce_epilogue_exact, all_reduce_fused_f64, reduce_ranks_exact};
use tpfuse::topology::AllReduceAlgo;
use tpfuse::{Error, GroupOptions, NcclType, TpGroup};

/// World sizes of the virtual-rank tests.
const WORLDS: [usize; 3] = [2, 4, 8];
/// Lengths of the all-reduce matrix (plus one close to the capacity, see [`lengths`]): one
/// element, below / at / above one 16-byte vector, around a block's share, a scalar tail
/// after many vectors, and sizes that need many iterations of every block.
const LENGTHS: [usize; 8] = [
    1,
    7,
    8,
    9,
    4095,
    4096 * 3 + 5,
    shape(1 << 16, 1 << 13),
    shape(1 << 20, 1 << 14),
];
/// The algorithms every all-reduce case runs.
const ALGORITHMS: [Algorithm; 3] = [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::Auto];
/// RMSNorm epsilon of the fused tests.
const EPS: f32 = 1e-5;
/// The base seed when `TPFUSE_TEST_SEED` is unset.
const DEFAULT_SEED: u64 = 0x7470_6675_7365_0a11;

// ---------------------------------------------------------------------------------------
// Elements, seeds, random data.
// ---------------------------------------------------------------------------------------

/// The element types of the collectives: [`gpu::TestElement`] (whose `TOLERANCE` bounds the
/// relative Frobenius error of a sum against the f64 reference, `NORM_TOLERANCE` that of an
/// RMSNorm output) that NCCL also takes.
trait TestElement: gpu::TestElement + NcclType {}

impl<T: gpu::TestElement + NcclType> TestElement for T {}

/// Distinguishes the data of the different kinds of case.
#[derive(Clone, Copy)]
enum Variant {
    AllReduce = 1,
    Fused = 2,
    Gather = 3,
    Scatter = 4,
    Graph = 5,
    GraphFused = 6,
    Timeout = 7,
    Validation = 8,
}

/// One seed per (dtype, variant, parts of the case): different for every case.
fn case_seed<T: TestElement>(variant: Variant, parts: &[u64]) -> u64 {
    let s = mix_seed(
        splitmix64(base_seed(DEFAULT_SEED)),
        &[T::ID, variant as u64],
    );
    mix_seed(s, parts)
}

/// The seed of rank `r`'s data in a case.
fn rank_seed(seed: u64, r: usize) -> u64 {
    splitmix64(seed ^ (r as u64 + 1).wrapping_mul(0x51_7cc1_b727_220a))
}

/// `world` buffers of `n` values uniform in (-4, 4), rank r seeded from (seed, r).
fn random_ranks<T: TestElement>(seed: u64, world: usize, n: usize) -> Vec<Vec<T>> {
    gpu::random_ranks(world, n, |r| rank_seed(seed, r))
}

// ---------------------------------------------------------------------------------------
// Groups and algorithms.
// ---------------------------------------------------------------------------------------

fn virtual_group(ctx: &Arc<CudaContext>, world: usize, options: GroupOptions) -> Vec<TpGroup> {
    let groups = common::ranks::virtual_group(ctx, world, options);
    assert_eq!(groups.len(), world);
    groups
}

/// The options of the matrix tests: the default capacity on a GPU, 1 MiB on the emulator
/// (their cases at the capacity move W times the capacity into every rank).
fn matrix_options() -> GroupOptions {
    let default = GroupOptions::default();
    GroupOptions {
        capacity_bytes: shape(default.capacity_bytes, 1 << 20),
        ..default
    }
}

/// What `Algorithm::Auto` runs on a virtual group for a message of `bytes` (that fits):
/// one-shot below the NVLink limit of the group's size, else two-shot.
fn expected_auto(group: &TpGroup, bytes: usize) -> AllReduceAlgo {
    let limit = group
        .rule()
        .nvlink
        .iter()
        .find(|l| group.world() <= l.max_world);
    match limit {
        Some(l) if bytes < l.one_shot_below => AllReduceAlgo::OneShot,
        _ => AllReduceAlgo::TwoShot,
    }
}

fn assert_algorithm(
    label: &str,
    ran: &[AllReduceAlgo],
    asked: Algorithm,
    want_auto: AllReduceAlgo,
) {
    let want = match asked {
        Algorithm::OneShot => AllReduceAlgo::OneShot,
        Algorithm::TwoShot => AllReduceAlgo::TwoShot,
        Algorithm::Auto => want_auto,
        Algorithm::Nccl => AllReduceAlgo::Nccl,
    };
    for (r, got) in ran.iter().enumerate() {
        assert_eq!(*got, want, "{label}: rank {r} ran {got:?} for {asked:?}");
    }
}

// ---------------------------------------------------------------------------------------
// All-reduce: every world size, dtype, length and algorithm; in place.
// ---------------------------------------------------------------------------------------

/// [`LENGTHS`], then one close to (5 elements below) the group's capacity.
fn lengths<T: TestElement>(capacity: usize) -> Vec<usize> {
    let mut v = LENGTHS.to_vec();
    v.push(capacity / std::mem::size_of::<T>() - 5);
    v
}

/// One all-reduce case on `groups`: out-of-place with one-shot, two-shot and Auto, then in
/// place with each, all on the same inputs.
fn all_reduce_case<T: TestElement>(groups: &[TpGroup], n: usize) {
    let world = groups.len();
    let bytes = n * std::mem::size_of::<T>();
    let label = format!("all_reduce {} W={world} n={n}", T::NAME);
    let seed = case_seed::<T>(Variant::AllReduce, &[world as u64, n as u64]);
    let inputs = random_ranks::<T>(seed, world, n);
    let (exact, wide) = sum_references(&inputs);
    let dev_in: Vec<CudaSlice<T>> = upload_ranks(groups, &inputs);
    let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(groups, n);
    let poison = vec![T::poison(); n];
    let want_auto = expected_auto(&groups[0], bytes);

    let mut one_shot: Option<Vec<T>> = None;
    for algo in ALGORITHMS {
        let l = format!("{label} {algo:?}");
        for (g, o) in groups.iter().zip(outs.iter_mut()) {
            refill(g, o, &poison);
        }
        let ran = round(groups, &l, |r| {
            ops::all_reduce(&groups[r], &dev_in[r], &mut outs[r], algo)
        });
        assert_algorithm(&l, &ran, algo, want_auto);
        let rank0 = download(&groups[0], &outs[0]);
        assert_same_bits(
            &format!("{l}: rank 0 vs reduce_ranks_exact"),
            &rank0,
            &exact,
        );
        for r in 1..world {
            let got = download(&groups[r], &outs[r]);
            assert_same_bits(&format!("{l}: rank {r} vs rank 0"), &got, &rank0);
        }
        match &one_shot {
            None => {
                assert_close(&format!("{l}: rank 0"), &rank0, &wide, T::TOLERANCE);
                one_shot = Some(rank0);
            }
            Some(first) => {
                assert_same_bits(&format!("{l}: vs one-shot"), &rank0, first);
            }
        }
    }
    let one_shot = one_shot.expect("one-shot ran");
    // Out of place never writes the input.
    assert_same_bits(
        &format!("{label}: rank 0's input after the calls"),
        &download(&groups[0], &dev_in[0]),
        &inputs[0],
    );
    drop(dev_in);
    drop(outs);

    for algo in ALGORITHMS {
        let l = format!("{label} in place {algo:?}");
        let mut bufs: Vec<CudaSlice<T>> = upload_ranks(groups, &inputs);
        let ran = round(groups, &l, |r| {
            ops::all_reduce_in_place(&groups[r], &mut bufs[r], algo)
        });
        assert_algorithm(&l, &ran, algo, want_auto);
        for r in 0..world {
            let got = download(&groups[r], &bufs[r]);
            assert_same_bits(&format!("{l}: rank {r} vs out of place"), &got, &one_shot);
        }
    }
}

fn all_reduce_matrix<T: TestElement>() {
    let gpu = gpu();
    for world in WORLDS {
        let groups = virtual_group(&gpu.ctx, world, matrix_options());
        for n in lengths::<T>(groups[0].capacity()) {
            all_reduce_case::<T>(&groups, n);
        }
    }
}

gpu_tests! {
    all_reduce_f32_every_world_length_and_algorithm => all_reduce_matrix::<f32>();
    all_reduce_f16_every_world_length_and_algorithm => all_reduce_matrix::<f16>();
    all_reduce_bf16_every_world_length_and_algorithm => all_reduce_matrix::<bf16>();
}

/// A group of 64 MiB capacity (2 MiB on the emulator): a bf16 message of exactly the
/// capacity, and an f32 one of the capacity less 12 bytes (a scalar tail).
#[test]
#[cfg_attr(
    not(any(feature = "gpu-tests", feature = "emulator")),
    ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
)]
fn all_reduce_messages_that_fill_a_large_group() {
    let gpu = gpu();
    let capacity = shape(64 << 20, 2 << 20);
    let options = GroupOptions {
        capacity_bytes: capacity,
        ..GroupOptions::default()
    };
    for world in [2, 8] {
        let groups = virtual_group(&gpu.ctx, world, options.clone());
        assert_eq!(groups[0].capacity(), capacity);
        all_reduce_case::<bf16>(&groups, capacity / 2);
        all_reduce_case::<f32>(&groups, capacity / 4 - 3);
    }
}

// ---------------------------------------------------------------------------------------
// The fused epilogue: bias, residual, RMSNorm.
// ---------------------------------------------------------------------------------------

/// Which parts of the epilogue a case uses.
#[derive(Clone, Copy, Debug)]
struct Parts {
    bias: bool,
    residual: bool,
    norm: bool,
}

const fn parts(bias: bool, residual: bool, norm: bool) -> Parts {
    Parts {
        bias,
        residual,
        norm,
    }
}

/// Every non-empty combination.
const ALL_PARTS: [Parts; 7] = [
    parts(false, true, true), // the decode hot path
    parts(true, true, true),
    parts(true, false, false),
    parts(false, true, false),
    parts(true, true, false),
    parts(false, false, true),
    parts(true, false, true),
];
/// The combinations of the largest row count (keeps the host work bounded).
const BIG_PARTS: [Parts; 3] = [ALL_PARTS[0], ALL_PARTS[1], ALL_PARTS[2]];

const HIDDENS: [usize; 3] = [64, shape(4096, 520), shape(8192, 1024)];
const ROWS: [usize; 5] = [1, 3, 16, shape(64, 17), shape(256, 5)];

/// How a fused case is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// `all_reduce_fused(.., OneShot)`.
    OneShot,
    /// `all_reduce_fused(.., TwoShot)`.
    TwoShot,
    /// `all_reduce_residual_rmsnorm` for residual + RMSNorm, else `all_reduce_fused(.., Auto)`.
    Auto,
    /// `all_reduce`, then `ops::add_bias_residual`, then `ops::rms_norm`.
    Unfused,
}

const PATHS: [Path; 4] = [Path::OneShot, Path::TwoShot, Path::Auto, Path::Unfused];

/// One rank's buffers of a fused case.
struct FusedRank<T> {
    partial: CudaSlice<T>,
    bias: CudaSlice<T>,
    gamma: CudaSlice<T>,
    /// Reset to the case's residual before every path.
    residual: CudaSlice<T>,
    out: CudaSlice<T>,
    /// Unfused: the all-reduce's result.
    tmp: CudaSlice<T>,
    /// Unfused: `h`, the input of the standalone RMSNorm.
    h: CudaSlice<T>,
    /// Unfused without a residual: `add_bias_residual` needs one, and adding -0.0 is the
    /// identity in IEEE arithmetic (x + -0 = x for every x, -0 and +0 included).
    neg_zero: CudaSlice<T>,
}

/// Enqueues one path of a fused case on one rank.
fn run_path<T: TestElement>(
    group: &TpGroup,
    b: &mut FusedRank<T>,
    p: Parts,
    path: Path,
) -> tpfuse::Result<AllReduceAlgo> {
    let algorithm = match path {
        Path::OneShot => Algorithm::OneShot,
        Path::TwoShot => Algorithm::TwoShot,
        Path::Auto => Algorithm::Auto,
        Path::Unfused => return run_unfused(group, b, p),
    };
    if path == Path::Auto && p.residual && p.norm && !p.bias {
        return ops::all_reduce_residual_rmsnorm(
            group,
            &b.partial,
            &mut b.residual,
            &b.gamma,
            EPS,
            &mut b.out,
        );
    }
    let epilogue = Epilogue {
        bias: p.bias.then_some(&b.bias as &dyn DevicePtr<T>),
        residual: if p.residual {
            Some(&mut b.residual as &mut dyn DevicePtrMut<T>)
        } else {
            None
        },
        norm: p.norm.then_some(RmsNorm {
            gamma: &b.gamma as &dyn DevicePtr<T>,
            eps: EPS,
        }),
    };
    ops::all_reduce_fused(group, &b.partial, epilogue, &mut b.out, algorithm)
}

/// The unfused sequence: all-reduce, then bias and residual, then RMSNorm, as separate ops.
fn run_unfused<T: TestElement>(
    group: &TpGroup,
    b: &mut FusedRank<T>,
    p: Parts,
) -> tpfuse::Result<AllReduceAlgo> {
    let algo = ops::all_reduce(group, &b.partial, &mut b.tmp, Algorithm::OneShot)?;
    let stream = group.stream();
    let add = p.bias || p.residual;
    if add {
        let residual = if p.residual {
            &mut b.residual
        } else {
            &mut b.neg_zero
        };
        let target = if p.norm { &mut b.h } else { &mut b.out };
        let bias = p.bias.then_some(&b.bias as &dyn DevicePtr<T>);
        ops::add_bias_residual(stream, &b.tmp, bias, residual, target)?;
    }
    if p.norm {
        let x = if add { &b.h } else { &b.tmp };
        ops::rms_norm(stream, x, &b.gamma, EPS, &mut b.out)?;
    }
    Ok(algo)
}

/// Every combination of `parts` at one (world, hidden, rows), through every path.
fn fused_case<T: TestElement>(groups: &[TpGroup], hidden: usize, rows: usize, combos: &[Parts]) {
    let world = groups.len();
    let n = rows * hidden;
    let bytes = n * std::mem::size_of::<T>();
    let label = format!("fused {} W={world} hidden={hidden} rows={rows}", T::NAME);
    let seed = case_seed::<T>(Variant::Fused, &[world as u64, hidden as u64, rows as u64]);
    let partials = random_ranks::<T>(seed, world, n);
    let bias: Vec<T> = random_vec(splitmix64(seed ^ 0xb1a5), hidden, -1.0, 1.0);
    let gamma: Vec<T> = random_vec(splitmix64(seed ^ 0x6a33), hidden, 0.5, 1.5);
    let residual: Vec<T> = random_vec(splitmix64(seed ^ 0x4e51), n, -4.0, 4.0);
    let poison = vec![T::poison(); n];
    let neg_zero = vec![T::from_f32(-0.0); n];
    let mut bufs: Vec<FusedRank<T>> = groups
        .iter()
        .zip(&partials)
        .map(|(g, x)| FusedRank {
            partial: upload(g, x),
            bias: upload(g, &bias),
            gamma: upload(g, &gamma),
            residual: upload(g, &residual),
            out: poisoned(g, n),
            tmp: poisoned(g, n),
            h: poisoned(g, n),
            neg_zero: upload(g, &neg_zero),
        })
        .collect();
    let want_auto = expected_auto(&groups[0], bytes);

    for &p in combos {
        let lp = format!("{label} {p:?}");
        let bias_ref = p.bias.then_some(&bias[..]);
        let residual_ref = p.residual.then_some(&residual[..]);
        let gamma_ref = p.norm.then_some(&gamma[..]);
        // References, by rows (RMSNorm works on whole rows).
        let h_exact = par_chunks(rows, hidden, |rr| {
            let r = rr.start * hidden..rr.end * hidden;
            all_reduce_epilogue_exact(
                &slices(&partials, &r),
                bias_ref,
                residual_ref.map(|x| &x[r.clone()]),
                hidden,
            )
        });
        let (h_wide, out_wide): (Vec<f64>, Vec<f64>) = {
            let pairs = par_chunks(rows, hidden, |rr| {
                let r = rr.start * hidden..rr.end * hidden;
                let (h, o) = all_reduce_fused_f64(
                    &slices(&partials, &r),
                    bias_ref,
                    residual_ref.map(|x| &x[r.clone()]),
                    gamma_ref,
                    f64::from(EPS),
                    hidden,
                );
                h.into_iter().zip(o).collect::<Vec<(f64, f64)>>()
            });
            pairs.into_iter().unzip()
        };
        assert_close(&format!("{lp}: h"), &h_exact, &h_wide, T::TOLERANCE);
        // The unfused sequence: the all-reduce's rounded output, then bias and residual.
        let sum_exact = par_chunks(n, world, |r| reduce_ranks_exact(&slices(&partials, &r)));
        let h_unfused = par_chunks(rows, hidden, |rr| {
            let r = rr.start * hidden..rr.end * hidden;
            all_reduce_epilogue_exact(
                &[&sum_exact[r.clone()]],
                bias_ref,
                residual_ref.map(|x| &x[r.clone()]),
                hidden,
            )
        });
        assert_same_bits(
            &format!("{lp}: the host emulations of the fused and unfused h"),
            &h_unfused,
            &h_exact,
        );

        // Normed outputs: the same bits on every path, fused or not.
        let mut normed: Option<Vec<T>> = None;
        for path in PATHS {
            let l = format!("{lp} {path:?}");
            for (g, b) in groups.iter().zip(bufs.iter_mut()) {
                refill(g, &mut b.residual, &residual);
                refill(g, &mut b.out, &poison);
                if path == Path::Unfused {
                    refill(g, &mut b.neg_zero, &neg_zero);
                }
            }
            let ran = round(groups, &l, |r| run_path(&groups[r], &mut bufs[r], p, path));
            let asked = match path {
                Path::OneShot | Path::Unfused => Algorithm::OneShot,
                Path::TwoShot => Algorithm::TwoShot,
                Path::Auto => Algorithm::Auto,
            };
            assert_algorithm(&l, &ran, asked, want_auto);
            let (want_h, what) = if path == Path::Unfused {
                (&h_unfused, "the exact unfused sequence")
            } else {
                (&h_exact, "all_reduce_epilogue_exact")
            };
            for r in 0..world {
                let out = download(&groups[r], &bufs[r].out);
                if p.residual {
                    assert_same_bits(
                        &format!("{l}: rank {r}'s residual after vs {what}"),
                        &download(&groups[r], &bufs[r].residual),
                        want_h,
                    );
                }
                if !p.norm {
                    assert_same_bits(&format!("{l}: rank {r}'s out vs {what}"), &out, want_h);
                    continue;
                }
                let slot = &mut normed;
                match slot {
                    Some(first) => assert_same_bits(
                        &format!("{l}: rank {r}'s normed out vs the first path's rank 0"),
                        &out,
                        first,
                    ),
                    None => {
                        assert_close(
                            &format!("{l}: normed out"),
                            &out,
                            &out_wide,
                            T::NORM_TOLERANCE,
                        );
                        *slot = Some(out);
                    }
                }
            }
        }
    }
}

/// Every world, hidden size and row count for bf16 (and on a GPU for every type). On the
/// emulator, f32 and f16 skip the largest hidden size and 16 rows ([`reduced_copy`]): the
/// fused kernels' dtypes are checked bit for bit in tests/emu_all_reduce.rs.
fn fused_matrix<T: TestElement>() {
    let gpu = gpu();
    let reduced = reduced_copy::<T>();
    for world in WORLDS {
        let groups = virtual_group(&gpu.ctx, world, matrix_options());
        for hidden in HIDDENS.into_iter().filter(|&h| !reduced || h != HIDDENS[2]) {
            for rows in ROWS.into_iter().filter(|&r| !reduced || r != 16) {
                let combos: &[Parts] = if rows >= 256 { &BIG_PARTS } else { &ALL_PARTS };
                fused_case::<T>(&groups, hidden, rows, combos);
            }
        }
    }
}

gpu_tests! {
    fused_epilogue_f32 => fused_matrix::<f32>();
    fused_epilogue_f16 => fused_matrix::<f16>();
    fused_epilogue_bf16 => fused_matrix::<bf16>();
}

/// The fused cases on groups whose one-shot all-reduce goes by packets
/// ([`GroupOptions::all_reduce_packets`]): the one-shot, `Auto` and the unfused sequence's
/// all-reduce by packets where they fit (rows of one and of two RMSNorm segments of 16-bit
/// elements, four rows on fewer blocks), the two-shot by flags; every normed output the same
/// bits, the sums and epilogues the exact references.
fn packets_matrix<T: TestElement>() {
    let gpu = gpu();
    for world in WORLDS {
        let options = GroupOptions {
            all_reduce_packets: true,
            ..matrix_options()
        };
        let groups = virtual_group(&gpu.ctx, world, options);
        for (hidden, rows) in [(64, 3), (4096, 4), (8192, 1), (4104, 2)] {
            fused_case::<T>(&groups, hidden, rows, &ALL_PARTS);
        }
    }
}

gpu_tests! {
    fused_epilogue_by_packets_f32 => packets_matrix::<f32>();
    fused_epilogue_by_packets_bf16 => packets_matrix::<bf16>();
}

// ---------------------------------------------------------------------------------------
// All-gather and reduce-scatter.
// ---------------------------------------------------------------------------------------

/// Per-rank lengths (in 16-byte vectors) of the all-gather and reduce-scatter cases.
const COLLECTIVE_VECTORS: [usize; 5] = [1, 3, 257, 4097, shape(1 << 15, 1 << 11)];

fn all_gather_case<T: TestElement>(groups: &[TpGroup], n: usize) {
    let world = groups.len();
    let label = format!("all_gather {} W={world} n={n}", T::NAME);
    let seed = case_seed::<T>(Variant::Gather, &[world as u64, n as u64]);
    let inputs = random_ranks::<T>(seed, world, n);
    let want: Vec<T> = inputs.concat();
    let dev_in: Vec<CudaSlice<T>> = upload_ranks(groups, &inputs);
    let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(groups, world * n);
    round(groups, &label, |r| {
        ops::all_gather(&groups[r], &dev_in[r], &mut outs[r])
    });
    for r in 0..world {
        assert_same_bits(
            &format!("{label}: rank {r}"),
            &download(&groups[r], &outs[r]),
            &want,
        );
    }
}

fn reduce_scatter_case<T: TestElement>(groups: &[TpGroup], n: usize) {
    let world = groups.len();
    let label = format!("reduce_scatter {} W={world} n={n}", T::NAME);
    let seed = case_seed::<T>(Variant::Scatter, &[world as u64, n as u64]);
    let inputs = random_ranks::<T>(seed, world, world * n);
    let (exact, wide) = sum_references(&inputs);
    let dev_in: Vec<CudaSlice<T>> = upload_ranks(groups, &inputs);
    let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(groups, n);
    round(groups, &label, |r| {
        ops::reduce_scatter(&groups[r], &dev_in[r], &mut outs[r])
    });
    for r in 0..world {
        let got = download(&groups[r], &outs[r]);
        let slice = r * n..(r + 1) * n;
        assert_same_bits(
            &format!("{label}: rank {r} vs slice {r} of reduce_ranks_exact"),
            &got,
            &exact[slice.clone()],
        );
        assert_close(
            &format!("{label}: rank {r}"),
            &got,
            &wide[slice],
            T::TOLERANCE,
        );
    }
}

fn collectives_for<T: TestElement>(groups: &[TpGroup]) {
    let world = groups.len();
    let vec = 16 / std::mem::size_of::<T>();
    let capacity = groups[0].capacity() / std::mem::size_of::<T>();
    for v in COLLECTIVE_VECTORS {
        all_gather_case::<T>(groups, v * vec);
        reduce_scatter_case::<T>(groups, v * vec);
    }
    // At the capacity: all-gather stages n elements, reduce-scatter world * n.
    all_gather_case::<T>(groups, capacity);
    reduce_scatter_case::<T>(groups, capacity / world / vec * vec);
}

#[test]
#[cfg_attr(
    not(any(feature = "gpu-tests", feature = "emulator")),
    ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
)]
fn all_gather_and_reduce_scatter_match_the_cpu() {
    let gpu = gpu();
    for world in WORLDS {
        let groups = virtual_group(&gpu.ctx, world, matrix_options());
        collectives_for::<f32>(&groups);
        collectives_for::<f16>(&groups);
        collectives_for::<bf16>(&groups);
    }
}

// ---------------------------------------------------------------------------------------
// CUDA graphs.
// ---------------------------------------------------------------------------------------

/// Replays of every captured round.
const REPLAYS: usize = shape(1000, 100);
/// After this many replays, results are checked and the inputs replaced.
const CHECKPOINTS: [usize; 3] = [1, 10, shape(500, 50)];

/// Captures `enqueue` on `group`'s stream into a graph ([`capture_on`]). `check()` during
/// the capture must refuse to wait (it names the stream) and leave the group healthy.
fn capture<R>(
    group: &TpGroup,
    label: &str,
    enqueue: impl FnOnce() -> tpfuse::Result<R>,
) -> CudaGraph {
    let (graph, (during, enqueued)) = capture_on(group.stream(), label, || {
        let during = group.check();
        (during, enqueue())
    });
    match during {
        Err(Error::InvalidArgument { arg, .. }) if arg == "stream" => {}
        other => panic!(
            "{label}: check() during a capture: expected InvalidArgument(stream), got {other:?}"
        ),
    }
    assert!(
        !group.is_poisoned(),
        "{label}: check() during a capture poisoned the group"
    );
    enqueued.unwrap_or_else(|e| panic!("{label}: enqueue during the capture: {e}"));
    graph
}

/// One all-reduce per rank captured into a graph per rank, replayed [`REPLAYS`] times, with
/// new inputs (and poisoned outputs) after each of [`CHECKPOINTS`].
fn graph_case<T: TestElement>(ctx: &Arc<CudaContext>, world: usize, algo: Algorithm, n: usize) {
    let label = format!("graph all_reduce {} W={world} n={n} {algo:?}", T::NAME);
    let groups = virtual_group(ctx, world, GroupOptions::default());
    let seed = case_seed::<T>(Variant::Graph, &[world as u64, n as u64, algo as u64]);
    let sets: Vec<Vec<Vec<T>>> = (0..=CHECKPOINTS.len() as u64)
        .map(|k| random_ranks::<T>(splitmix64(seed ^ k), world, n))
        .collect();
    let poison = vec![T::poison(); n];
    let mut ins: Vec<CudaSlice<T>> = upload_ranks(&groups, &sets[0]);
    let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, n);
    let verify = |set: &[Vec<T>], outs: &[CudaSlice<T>], when: &str| {
        let (exact, wide) = sum_references(set);
        for r in 0..world {
            let got = download(&groups[r], &outs[r]);
            assert_same_bits(&format!("{label} {when}: rank {r}"), &got, &exact);
            if r == 0 {
                assert_close(&format!("{label} {when}"), &got, &wide, T::TOLERANCE);
            }
        }
    };
    // One eager round first: the kernels are loaded before the capture (lazy module loading
    // has no business inside one), and it checks the inputs.
    let eager = format!("{label}: eager round");
    round(&groups, &eager, |r| {
        ops::all_reduce(&groups[r], &ins[r], &mut outs[r], algo)
    });
    verify(&sets[0][..], &outs[..], "eager");
    for (g, o) in groups.iter().zip(outs.iter_mut()) {
        refill(g, o, &poison);
    }
    let graphs: Vec<CudaGraph> = (0..world)
        .map(|r| {
            let (g, i, o) = (&groups[r], &ins[r], &mut outs[r]);
            capture(g, &format!("{label} rank {r}"), || {
                ops::all_reduce(g, i, o, algo)
            })
        })
        .collect();
    check_all(&groups, &format!("{label}: after the captures"));
    for r in 0..world {
        assert_poisoned(
            &format!("{label}: rank {r}'s output after the capture"),
            &download(&groups[r], &outs[r]),
        );
    }
    let mut set = 0;
    for i in 0..REPLAYS {
        if CHECKPOINTS.contains(&i) {
            let when = format!("after replay {i}");
            check_all(&groups, &format!("{label} {when}"));
            verify(&sets[set][..], &outs[..], &when);
            set += 1;
            for r in 0..world {
                refill(&groups[r], &mut ins[r], &sets[set][r]);
                refill(&groups[r], &mut outs[r], &poison);
            }
        }
        launch_all(&graphs, &label);
    }
    check_all(&groups, &format!("{label} after the last replay"));
    verify(
        &sets[set][..],
        &outs[..],
        &format!("after replay {REPLAYS}"),
    );
}

/// One rank's buffers of a fused graph case.
struct GraphRank<T> {
    partial: CudaSlice<T>,
    bias: CudaSlice<T>,
    gamma: CudaSlice<T>,
    residual: CudaSlice<T>,
    out: CudaSlice<T>,
}

/// `all_reduce_fused` with bias, residual and RMSNorm on one rank of a graph case.
fn enqueue_fused<T: TestElement>(
    group: &TpGroup,
    b: &mut GraphRank<T>,
    algo: Algorithm,
) -> tpfuse::Result<AllReduceAlgo> {
    let epilogue = Epilogue {
        bias: Some(&b.bias as &dyn DevicePtr<T>),
        residual: Some(&mut b.residual as &mut dyn DevicePtrMut<T>),
        norm: Some(RmsNorm {
            gamma: &b.gamma as &dyn DevicePtr<T>,
            eps: EPS,
        }),
    };
    ops::all_reduce_fused(group, &b.partial, epilogue, &mut b.out, algo)
}

/// The fused residual + RMSNorm captured once per rank and replayed [`REPLAYS`] times: the
/// residual stream grows by the reduced sum (and the bias) at every replay, exactly as
/// [`all_reduce_epilogue_exact`] applied as many times on the host.
fn graph_fused_case<T: TestElement>(
    ctx: &Arc<CudaContext>,
    world: usize,
    algo: Algorithm,
    hidden: usize,
    rows: usize,
) {
    let label = format!(
        "graph fused {} W={world} hidden={hidden} rows={rows} {algo:?}",
        T::NAME
    );
    let n = hidden * rows;
    let groups = virtual_group(ctx, world, GroupOptions::default());
    let seed = case_seed::<T>(
        Variant::GraphFused,
        &[world as u64, hidden as u64, rows as u64, algo as u64],
    );
    let partials = random_ranks::<T>(seed, world, n);
    let bias: Vec<T> = random_vec(splitmix64(seed ^ 1), hidden, -1.0, 1.0);
    let gamma: Vec<T> = random_vec(splitmix64(seed ^ 2), hidden, 0.5, 1.5);
    let residual0: Vec<T> = random_vec(splitmix64(seed ^ 3), n, -4.0, 4.0);
    let mut bufs: Vec<GraphRank<T>> = groups
        .iter()
        .zip(&partials)
        .map(|(g, x)| GraphRank {
            partial: upload(g, x),
            bias: upload(g, &bias),
            gamma: upload(g, &gamma),
            residual: upload(g, &residual0),
            out: poisoned(g, n),
        })
        .collect();
    let refs: Vec<&[T]> = partials.iter().map(|x| &x[..]).collect();
    // One eager round first (loads the kernels outside the capture; one step of the
    // residual), then the buffers are reset.
    let eager = format!("{label}: eager round");
    round(&groups, &eager, |r| {
        enqueue_fused(&groups[r], &mut bufs[r], algo)
    });
    let one_step = all_reduce_epilogue_exact(&refs, Some(&bias), Some(&residual0), hidden);
    let poison = vec![T::poison(); n];
    for (r, (g, b)) in groups.iter().zip(bufs.iter_mut()).enumerate() {
        assert_same_bits(
            &format!("{eager}: rank {r}'s residual"),
            &download(g, &b.residual),
            &one_step,
        );
        refill(g, &mut b.residual, &residual0);
        refill(g, &mut b.out, &poison);
    }
    let graphs: Vec<CudaGraph> = (0..world)
        .map(|r| {
            let (g, b) = (&groups[r], &mut bufs[r]);
            capture(g, &format!("{label} rank {r}"), || {
                enqueue_fused(g, b, algo)
            })
        })
        .collect();
    for _ in 0..REPLAYS {
        launch_all(&graphs, &label);
    }
    check_all(&groups, &format!("{label} after the last replay"));

    let mut before = residual0.clone();
    let mut after = residual0;
    for _ in 0..REPLAYS {
        before = after;
        after = all_reduce_epilogue_exact(&refs, Some(&bias), Some(&before), hidden);
    }
    let (_, want_wide) = all_reduce_fused_f64(
        &refs,
        Some(&bias),
        Some(&before),
        Some(&gamma),
        f64::from(EPS),
        hidden,
    );
    let out0 = download(&groups[0], &bufs[0].out);
    assert_close(
        &format!("{label}: normed out"),
        &out0,
        &want_wide,
        T::NORM_TOLERANCE,
    );
    for r in 0..world {
        assert_same_bits(
            &format!("{label}: rank {r}'s residual vs {REPLAYS} host steps"),
            &download(&groups[r], &bufs[r].residual),
            &after,
        );
        assert_same_bits(
            &format!("{label}: rank {r}'s normed out vs rank 0"),
            &download(&groups[r], &bufs[r].out),
            &out0,
        );
    }
    // The standalone RMSNorm of the final residual gives the same bits.
    let g0 = &groups[0];
    let x = upload(g0, &after);
    let mut y = poisoned::<T>(g0, n);
    ops::rms_norm(g0.stream(), &x, &bufs[0].gamma, EPS, &mut y)
        .unwrap_or_else(|e| panic!("{label}: rms_norm: {e}"));
    check_all(&groups, &label);
    assert_same_bits(
        &format!("{label}: normed out vs the standalone rms_norm"),
        &download(g0, &y),
        &out0,
    );
}

#[test]
#[cfg_attr(
    not(any(feature = "gpu-tests", feature = "emulator")),
    ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
)]
fn cuda_graph_replays_give_the_same_bits_as_eager_calls() {
    let gpu = gpu();
    // cudarc's per-buffer events cannot be recorded in one capture and waited on outside
    // it; this test orders everything on each rank's own stream, so it turns them off on
    // its own context object (before any buffer of it exists).
    // SAFETY: every buffer below is allocated, used and freed on its rank's stream only.
    unsafe { gpu.ctx.disable_event_tracking() };
    for world in WORLDS {
        for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
            graph_case::<bf16>(&gpu.ctx, world, algo, shape(4096 * 3 + 5, 1000 + 5));
        }
    }
    graph_case::<f32>(&gpu.ctx, 4, Algorithm::Auto, shape(1 << 16, 1 << 12));
    for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
        graph_fused_case::<bf16>(&gpu.ctx, 4, algo, 4096, 3);
    }
    graph_fused_case::<f16>(&gpu.ctx, 8, Algorithm::TwoShot, 64, 16);
}

// ---------------------------------------------------------------------------------------
// A peer that never comes.
// ---------------------------------------------------------------------------------------

#[test]
#[cfg_attr(
    not(any(feature = "gpu-tests", feature = "emulator")),
    ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
)]
fn a_missing_peer_is_a_bounded_peer_timeout_that_poisons_the_group() {
    type T = bf16;
    let gpu = gpu();
    let timeout = Duration::from_millis(200);
    let bound = timeout * 3 + Duration::from_secs(2);
    let options = GroupOptions {
        timeout,
        ..GroupOptions::default()
    };
    let n = 4096 + 3;
    for (world, algo) in [
        (2, Algorithm::OneShot),
        (4, Algorithm::OneShot),
        (4, Algorithm::TwoShot),
    ] {
        let label = format!("timeout W={world} {algo:?}");
        let missing = world - 1;
        let groups = virtual_group(&gpu.ctx, world, options.clone());
        let seed = case_seed::<T>(Variant::Timeout, &[world as u64, algo as u64]);
        let inputs = random_ranks::<T>(seed, world, n);
        let ins: Vec<CudaSlice<T>> = upload_ranks(&groups, &inputs);
        let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, n);
        for g in &groups {
            g.stream().synchronize().expect("uploading the inputs");
        }

        // The bounds are in the time the kernels' deadlines run on (virtual on the emulator).
        let start = device_clock();
        for r in 0..missing {
            ops::all_reduce(&groups[r], &ins[r], &mut outs[r], algo)
                .unwrap_or_else(|e| panic!("{label}: rank {r}: {e}"));
        }
        let first = groups[0].check();
        let elapsed = device_clock() - start;
        match first {
            Err(Error::PeerTimeout { rank, peer, after }) => {
                assert_eq!(rank, 0, "{label}");
                assert_eq!(peer, missing, "{label}: the error names the wrong peer");
                assert_eq!(after, timeout, "{label}");
            }
            other => panic!("{label}: expected PeerTimeout(rank 0, peer {missing}), got {other:?}"),
        }
        assert!(
            elapsed < bound,
            "{label}: the timeout surfaced after {elapsed:?}, beyond {bound:?}"
        );
        // The groups of one process share one poison flag: the others report it.
        for (r, g) in groups.iter().enumerate().take(missing).skip(1) {
            match g.check() {
                Err(Error::GroupPoisoned(_)) => {}
                Err(Error::PeerTimeout { peer, .. }) if peer == missing => {}
                other => panic!("{label}: rank {r}: expected GroupPoisoned, got {other:?}"),
            }
        }
        for g in &groups {
            assert!(
                g.is_poisoned(),
                "{label}: rank {} is not poisoned",
                g.rank()
            );
        }
        for r in [0, missing] {
            match ops::all_reduce(&groups[r], &ins[r], &mut outs[r], algo) {
                Err(Error::GroupPoisoned(_)) => {}
                other => {
                    panic!("{label}: a later op on rank {r}: expected GroupPoisoned, got {other:?}")
                }
            }
        }
        match groups[missing].check() {
            Err(Error::GroupPoisoned(_)) => {}
            other => panic!(
                "{label}: check() on the missing rank: expected GroupPoisoned, got {other:?}"
            ),
        }
        // The launched ranks gave up at the first barrier and marked their outputs failed;
        // the missing rank's is untouched. (Their streams drain within the deadline; the
        // download waits for them.)
        for r in 0..missing {
            assert_failed(
                &format!("{label}: rank {r}'s output"),
                &download(&groups[r], &outs[r]),
            );
        }
        assert_poisoned(
            &format!("{label}: the missing rank's output"),
            &download(&groups[missing], &outs[missing]),
        );
        assert!(
            device_clock() - start < bound * 2,
            "{label}: the launched ranks took {:?} to stop",
            device_clock() - start
        );
        drop(ins);
        drop(outs);
        drop(groups);

        // A rebuilt group works.
        let groups = virtual_group(&gpu.ctx, world, options.clone());
        let ins: Vec<CudaSlice<T>> = upload_ranks(&groups, &inputs);
        let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, n);
        let l = format!("{label}: rebuilt group");
        round(&groups, &l, |r| {
            ops::all_reduce(&groups[r], &ins[r], &mut outs[r], algo)
        });
        let (exact, _) = sum_references(&inputs);
        for r in 0..world {
            assert_same_bits(
                &format!("{l}: rank {r}"),
                &download(&groups[r], &outs[r]),
                &exact,
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Validation on real buffers.
// ---------------------------------------------------------------------------------------

#[test]
#[cfg_attr(
    not(any(feature = "gpu-tests", feature = "emulator")),
    ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
)]
fn invalid_arguments_are_refused_before_anything_runs() {
    type T = bf16;
    let gpu = gpu();
    let capacity = 64 << 10;
    let options = GroupOptions {
        capacity_bytes: capacity,
        // A launch that validation let through by mistake would wait for rank 1, which
        // never comes: keep that short.
        timeout: Duration::from_secs(2),
        ..GroupOptions::default()
    };
    let groups = virtual_group(&gpu.ctx, 2, options);
    let g = &groups[0];
    let n = 1024;
    let hidden = 64;
    let seed = case_seed::<T>(Variant::Validation, &[]);
    let host: Vec<T> = random_vec(seed, n + 16, -4.0, 4.0);
    // Long enough for the case of a gamma twice the bias's length.
    let row: Vec<T> = random_vec(splitmix64(seed), 2 * hidden + 16, 0.5, 1.5);
    let input = upload(g, &host);
    let mut out = poisoned::<T>(g, n + 16);
    let mut residual = upload(g, &host);
    let bias = upload(g, &row);
    let gamma = upload(g, &row);
    let one_shot = Algorithm::OneShot;

    // Misaligned buffers (one element off a 256-byte aligned allocation), each named.
    let r = ops::all_reduce(
        g,
        &input.slice(1..n + 1),
        &mut out.slice_mut(0..n),
        one_shot,
    );
    expect_invalid_saying("misaligned partial", r, "partial", &["16-byte aligned"]);
    let r = ops::all_reduce(
        g,
        &input.slice(0..n),
        &mut out.slice_mut(1..n + 1),
        one_shot,
    );
    expect_invalid_saying("misaligned out", r, "out", &["16-byte aligned"]);
    let r = ops::all_reduce_in_place(g, &mut out.slice_mut(1..n + 1), one_shot);
    expect_invalid_saying(
        "misaligned in-place buffer",
        r,
        "partial",
        &["16-byte aligned"],
    );
    {
        let mut res = residual.slice_mut(1..n + 1);
        let e = Epilogue {
            residual: Some(&mut res as &mut dyn DevicePtrMut<T>),
            ..Epilogue::default()
        };
        let r = ops::all_reduce_fused(g, &input.slice(0..n), e, &mut out.slice_mut(0..n), one_shot);
        expect_invalid_saying("misaligned residual", r, "residual", &["16-byte aligned"]);
    }
    {
        let b = bias.slice(1..hidden + 1);
        let e = Epilogue {
            bias: Some(&b as &dyn DevicePtr<T>),
            ..Epilogue::default()
        };
        let r = ops::all_reduce_fused(g, &input.slice(0..n), e, &mut out.slice_mut(0..n), one_shot);
        expect_invalid_saying("misaligned bias", r, "bias", &["16-byte aligned"]);
    }
    {
        let gm = gamma.slice(1..hidden + 1);
        let r = ops::all_reduce_residual_rmsnorm(
            g,
            &input.slice(0..n),
            &mut residual.slice_mut(0..n),
            &gm,
            EPS,
            &mut out.slice_mut(0..n),
        );
        expect_invalid_saying("misaligned gamma", r, "gamma", &["16-byte aligned"]);
    }

    // Lengths and shapes.
    let r = ops::all_reduce(
        g,
        &input.slice(0..n),
        &mut out.slice_mut(0..n + 8),
        one_shot,
    );
    expect_invalid_saying("out longer than partial", r, "out", &["holds"]);
    {
        let mut res = residual.slice_mut(0..n - 8);
        let e = Epilogue {
            residual: Some(&mut res as &mut dyn DevicePtrMut<T>),
            ..Epilogue::default()
        };
        let r = ops::all_reduce_fused(g, &input.slice(0..n), e, &mut out.slice_mut(0..n), one_shot);
        expect_invalid_saying("short residual", r, "residual", &["holds"]);
    }
    {
        let b = bias.slice(0..12); // not a multiple of 8 bf16 elements
        let e = Epilogue {
            bias: Some(&b as &dyn DevicePtr<T>),
            ..Epilogue::default()
        };
        let r = ops::all_reduce_fused(g, &input.slice(0..n), e, &mut out.slice_mut(0..n), one_shot);
        expect_invalid_saying("bias of 12 elements", r, "bias", &["multiple"]);
    }
    {
        let gm = gamma.slice(0..48); // 1024 is not a whole number of rows of 48
        let r = ops::all_reduce_residual_rmsnorm(
            g,
            &input.slice(0..n),
            &mut residual.slice_mut(0..n),
            &gm,
            EPS,
            &mut out.slice_mut(0..n),
        );
        expect_invalid_saying("rows of 48", r, "partial", &["rows"]);
    }
    {
        let b = bias.slice(0..hidden);
        let gm = gamma.slice(0..2 * hidden);
        let e = Epilogue {
            bias: Some(&b as &dyn DevicePtr<T>),
            norm: Some(RmsNorm {
                gamma: &gm as &dyn DevicePtr<T>,
                eps: EPS,
            }),
            ..Epilogue::default()
        };
        let r = ops::all_reduce_fused(g, &input.slice(0..n), e, &mut out.slice_mut(0..n), one_shot);
        expect_invalid_saying("bias and gamma of different lengths", r, "bias", &["gamma"]);
    }
    for eps in [f32::NAN, -1.0, f32::INFINITY] {
        let r = ops::all_reduce_residual_rmsnorm(
            g,
            &input.slice(0..n),
            &mut residual.slice_mut(0..n),
            &gamma.slice(0..hidden),
            eps,
            &mut out.slice_mut(0..n),
        );
        expect_invalid_saying(&format!("eps {eps}"), r, "eps", &[]);
    }

    // Capacity and algorithm.
    let big_n = capacity / 2 + 8;
    let big = upload(g, &vec![T::from_f32(1.0); big_n]);
    let mut big_out = poisoned::<T>(g, big_n);
    for algo in ALGORITHMS {
        let r = ops::all_reduce(g, &big, &mut big_out, algo);
        expect_invalid_saying(
            &format!("{algo:?} above the capacity"),
            r,
            "partial",
            &["capacity"],
        );
    }
    let r = ops::all_reduce(
        g,
        &input.slice(0..n),
        &mut out.slice_mut(0..n),
        Algorithm::Nccl,
    );
    expect_invalid_saying("NCCL on virtual ranks", r, "algorithm", &["communicator"]);

    // All-gather and reduce-scatter.
    let mut gathered = poisoned::<T>(g, 2 * n + 16);
    let r = ops::all_gather(g, &input.slice(0..n), &mut gathered.slice_mut(0..2 * n + 8));
    expect_invalid_saying("all_gather out of the wrong length", r, "out", &["world"]);
    let r = ops::all_gather(g, &input.slice(0..7), &mut gathered.slice_mut(0..14));
    expect_invalid_saying("all_gather of 14 bytes", r, "input", &["16"]);
    let r = ops::all_gather(g, &input.slice(0..n), &mut gathered.slice_mut(1..2 * n + 1));
    expect_invalid_saying("all_gather misaligned out", r, "out", &["16-byte aligned"]);
    let mut big_gathered = poisoned::<T>(g, 2 * big_n);
    let r = ops::all_gather(g, &big, &mut big_gathered);
    expect_invalid_saying("all_gather above the capacity", r, "input", &["capacity"]);
    let r = ops::reduce_scatter(g, &input.slice(0..n), &mut out.slice_mut(0..n / 2 + 8));
    expect_invalid_saying(
        "reduce_scatter input of the wrong length",
        r,
        "input",
        &["world"],
    );
    let r = ops::reduce_scatter(g, &input.slice(0..2 * 12), &mut out.slice_mut(0..12));
    expect_invalid_saying(
        "reduce_scatter of 12 elements per rank",
        r,
        "out",
        &["multiple"],
    );
    let r = ops::reduce_scatter(g, &input.slice(1..n + 1), &mut out.slice_mut(0..n / 2));
    expect_invalid_saying(
        "reduce_scatter misaligned input",
        r,
        "input",
        &["16-byte aligned"],
    );
    let r = ops::reduce_scatter(g, &big_gathered, &mut big_out);
    expect_invalid_saying(
        "reduce_scatter above the capacity",
        r,
        "input",
        &["capacity"],
    );

    // A buffer of another device.
    match tpfuse::device::device_count() {
        Ok(count) if count >= 2 => {
            let other = tpfuse::device::open(1).expect("opening GPU 1");
            let stream = other.new_stream().expect("a stream on GPU 1");
            let elsewhere = stream.clone_htod(&host[..n]).expect("uploading to GPU 1");
            let r = ops::all_reduce(g, &elsewhere, &mut out.slice_mut(0..n), one_shot);
            expect_invalid_saying("partial on GPU 1", r, "partial", &["device 1"]);
        }
        _ => eprintln!("one GPU: the other-device check is skipped"),
    }

    // Empty messages launch nothing and succeed.
    let r = ops::all_reduce(g, &input.slice(0..0), &mut out.slice_mut(0..0), one_shot);
    assert!(r.is_ok(), "an empty all-reduce: {r:?}");
    ops::all_gather(g, &input.slice(0..0), &mut gathered.slice_mut(0..0))
        .expect("empty all_gather");
    ops::reduce_scatter(g, &input.slice(0..0), &mut out.slice_mut(0..0))
        .expect("empty reduce_scatter");

    // Nothing ran: no rank waits for a peer, nothing was written.
    check_all(&groups, "after the refused calls");
    assert_poisoned("out after the refused calls", &download(g, &out));
    assert_poisoned(
        "the big out after the refused calls",
        &download(g, &big_out),
    );
    assert_poisoned("gathered after the refused calls", &download(g, &gathered));
    assert_same_bits(
        "residual after the refused calls",
        &download(g, &residual),
        &host,
    );
    assert!(!g.is_poisoned());

    // And the group still works.
    let inputs = random_ranks::<T>(splitmix64(seed ^ 0x600d), 2, n);
    let ins: Vec<CudaSlice<T>> = upload_ranks(&groups, &inputs);
    let mut outs: Vec<CudaSlice<T>> = poisoned_ranks(&groups, n);
    round(&groups, "a valid call afterwards", |r| {
        ops::all_reduce(&groups[r], &ins[r], &mut outs[r], one_shot)
    });
    let (exact, _) = sum_references(&inputs);
    for r in 0..2 {
        assert_same_bits(
            &format!("a valid call afterwards: rank {r}"),
            &download(&groups[r], &outs[r]),
            &exact,
        );
    }
}

// ---------------------------------------------------------------------------------------
// Two processes on one GPU: TpGroup::from_comm over CUDA IPC, or the NCCL fallback.
// ---------------------------------------------------------------------------------------

const ROLE: &str = "ipc_all_reduce";
const CHILD_TEST: &str = "child_ipc_all_reduce";
/// Bound on the whole multi-process test (children started to all exited). Two processes
/// on one GPU without MPS are time-sliced: every barrier may cost a scheduling slice.
const IPC_BOUND: Duration = Duration::from_secs(300);

/// FNV-1a over the bits of `xs`, folded into `h`.
fn digest<T: Bits>(h: &mut u64, xs: &[T]) {
    for x in xs {
        for byte in x.bits().to_le_bytes() {
            *h = (*h ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// One all-reduce on this process's rank, checked bitwise against `want`.
fn child_all_reduce<T: TestElement>(
    group: &TpGroup,
    label: &str,
    mine: &[T],
    want: &[T],
    algo: Algorithm,
) -> (AllReduceAlgo, Vec<T>) {
    let input = upload(group, mine);
    let mut out = poisoned::<T>(group, mine.len());
    let ran =
        ops::all_reduce(group, &input, &mut out, algo).unwrap_or_else(|e| panic!("{label}: {e}"));
    group
        .check()
        .unwrap_or_else(|e| panic!("{label}: check(): {e}"));
    let got = download(group, &out);
    assert_same_bits(label, &got, want);
    (ran, got)
}

fn child_check_ipc(env: &ChildEnv) {
    let (rank, world) = (env.rank, env.world);
    let comm = env.comm(Duration::from_secs(60));
    let options = GroupOptions {
        capacity_bytes: 1 << 20,
        timeout: Duration::from_secs(30),
        ..GroupOptions::default()
    };
    let group = TpGroup::from_comm(comm, options)
        .unwrap_or_else(|e| panic!("rank {rank}/{world}: TpGroup::from_comm: {e}"));
    println!("rank {rank}/{world}: {group:?}");
    assert_eq!((group.rank(), group.world()), (rank, world));
    assert!(!group.is_virtual());

    // f32 small integers: exact whatever the order, so NCCL and the kernels agree bitwise.
    let ints_for = |n: usize| -> (Vec<f32>, Vec<f32>) {
        let seed = env.seed ^ n as u64;
        let mine = (0..n).map(|i| small_int(seed, rank, i)).collect();
        let want = (0..n)
            .map(|i| (0..world).map(|r| small_int(seed, r, i)).sum::<f32>())
            .collect();
        (mine, want)
    };
    // bf16 random data: every rank's inputs from the shared seed, so each rank knows the sum.
    let n = 4096 * 3 + 5;
    let all: Vec<Vec<bf16>> = random_ranks(splitmix64(env.seed), world, n);
    let (exact, wide) = sum_references(&all);
    let mut hash = 0xcbf2_9ce4_8422_2325u64;

    let note = match group.custom_kernels_refused() {
        Some(reason) => {
            println!("rank {rank}/{world}: custom kernels refused: {reason}");
            assert_eq!(group.capacity(), 0);
            for len in [1, 4099, 65_539] {
                let (mine, want) = ints_for(len);
                for algo in [Algorithm::Auto, Algorithm::Nccl] {
                    let label = format!("rank {rank}: NCCL fallback f32 n={len} {algo:?}");
                    let (ran, _) = child_all_reduce(&group, &label, &mine, &want, algo);
                    assert_eq!(ran, AllReduceAlgo::Nccl, "{label}");
                }
            }
            let input = upload(&group, &all[rank]);
            let mut out = poisoned::<bf16>(&group, n);
            let ran = ops::all_reduce(&group, &input, &mut out, Algorithm::Auto)
                .unwrap_or_else(|e| panic!("rank {rank}: NCCL fallback bf16: {e}"));
            assert_eq!(ran, AllReduceAlgo::Nccl);
            group.check().expect("check() after NCCL");
            assert_close(
                "NCCL fallback bf16",
                &download(&group, &out),
                &wide,
                bf16::TOLERANCE,
            );
            let r = ops::all_reduce(&group, &input, &mut out, Algorithm::OneShot);
            expect_invalid_saying(
                "one-shot without symmetric memory",
                r,
                "partial",
                &["capacity"],
            );
            format!("nccl-fallback: {reason}")
        }
        None => {
            assert!(group.capacity() >= 1 << 20);
            for len in [1, 4099, 65_539] {
                let (mine, want) = ints_for(len);
                for algo in [
                    Algorithm::OneShot,
                    Algorithm::TwoShot,
                    Algorithm::Auto,
                    Algorithm::Nccl,
                ] {
                    let label = format!("rank {rank}: IPC f32 n={len} {algo:?}");
                    let (_, got) = child_all_reduce(&group, &label, &mine, &want, algo);
                    digest(&mut hash, &got);
                }
            }
            for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
                let label = format!("rank {rank}: IPC bf16 {algo:?}");
                let (ran, got) = child_all_reduce(&group, &label, &all[rank], &exact, algo);
                assert_ne!(ran, AllReduceAlgo::Nccl, "{label}");
                digest(&mut hash, &got);
                let mut buf = upload(&group, &all[rank]);
                ops::all_reduce_in_place(&group, &mut buf, algo)
                    .unwrap_or_else(|e| panic!("{label} in place: {e}"));
                group
                    .check()
                    .unwrap_or_else(|e| panic!("{label} in place: {e}"));
                assert_same_bits(
                    &format!("{label} in place"),
                    &download(&group, &buf),
                    &exact,
                );
            }
            assert_close("IPC bf16", &exact, &wide, bf16::TOLERANCE);

            // The decode hot path, fused, both kernels: same bits.
            let hidden = 4096;
            let rows = 3;
            let m = hidden * rows;
            let partials: Vec<Vec<bf16>> = random_ranks(splitmix64(env.seed ^ 0xf5), world, m);
            let residual0: Vec<bf16> = random_vec(splitmix64(env.seed ^ 0x4e), m, -4.0, 4.0);
            let gamma: Vec<bf16> = random_vec(splitmix64(env.seed ^ 0x6a), hidden, 0.5, 1.5);
            let refs: Vec<&[bf16]> = partials.iter().map(|x| &x[..]).collect();
            let h = all_reduce_epilogue_exact(&refs, None, Some(&residual0), hidden);
            let (_, wide_out) = all_reduce_fused_f64(
                &refs,
                None,
                Some(&residual0),
                Some(&gamma),
                f64::from(EPS),
                hidden,
            );
            let partial = upload(&group, &partials[rank]);
            let gamma_dev = upload(&group, &gamma);
            let mut first: Option<Vec<bf16>> = None;
            for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
                let label = format!("rank {rank}: IPC fused residual + RMSNorm {algo:?}");
                let mut residual = upload(&group, &residual0);
                let mut out = poisoned::<bf16>(&group, m);
                let e = Epilogue {
                    bias: None,
                    residual: Some(&mut residual as &mut dyn DevicePtrMut<bf16>),
                    norm: Some(RmsNorm {
                        gamma: &gamma_dev as &dyn DevicePtr<bf16>,
                        eps: EPS,
                    }),
                };
                ops::all_reduce_fused(&group, &partial, e, &mut out, algo)
                    .unwrap_or_else(|e| panic!("{label}: {e}"));
                group
                    .check()
                    .unwrap_or_else(|e| panic!("{label}: check(): {e}"));
                assert_same_bits(
                    &format!("{label}: residual"),
                    &download(&group, &residual),
                    &h,
                );
                let got = download(&group, &out);
                match &first {
                    Some(f) => assert_same_bits(&format!("{label}: vs one-shot"), &got, f),
                    None => {
                        assert_close(&label, &got, &wide_out, bf16::NORM_TOLERANCE);
                        digest(&mut hash, &got);
                        first = Some(got);
                    }
                }
            }
            format!("custom kernels over CUDA IPC, digest {hash:016x}")
        }
    };
    group
        .check()
        .unwrap_or_else(|e| panic!("rank {rank}: final check(): {e}"));
    env.mark_ok(&note);
    // Dropping an IPC group meets the peer at a barrier before it frees its buffers.
    drop(group);
}

/// Child entry point of the multi-process test; does nothing in any other run.
#[test]
#[ignore = "child process of the multi-process test (it runs it with --include-ignored)"]
fn child_ipc_all_reduce() {
    match ChildEnv::from_env(ROLE) {
        Some(env) => child_check_ipc(&env),
        None => println!("{CHILD_TEST}: not started by the multi-process test; nothing to do"),
    }
}

#[test]
#[cfg_attr(
    not(feature = "gpu-tests"),
    ignore = "needs a CUDA GPU: CUDA IPC or NCCL between processes"
)]
fn two_processes_on_one_gpu_all_reduce_over_ipc_or_nccl() {
    // Held so that no test of this process shares the GPU meanwhile.
    let _lock = gpu_lock();
    let mut children = Children::spawn(Spawn {
        test: CHILD_TEST,
        role: ROLE,
        world: 2,
        seed: splitmix64(base_seed(DEFAULT_SEED) ^ 0x1bc),
        dir_prefix: "tpfuse-gpu-all-reduce",
        host_prefix: "tpfuse-ar-test",
        env: &[],
    });
    children.wait_all(IPC_BOUND);
    let notes = children.notes();
    println!(
        "every rank passed in {:?}: {notes:?}",
        children.started.elapsed()
    );
    let custom = notes.iter().filter(|n| n.starts_with("custom")).count();
    assert!(
        custom == 0 || custom == notes.len(),
        "the ranks disagree on whether the custom kernels run: {notes:?}"
    );
    if custom == notes.len() {
        assert!(
            notes.iter().all(|n| n == &notes[0]),
            "the ranks' results differ (digests): {notes:?}"
        );
    }
}
