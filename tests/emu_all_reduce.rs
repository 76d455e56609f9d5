//! The custom collectives on the CPU emulator (feature `emulator`), through the C ABI, on
//! virtual ranks W = 2, 3, 4, 6, 8 (one emulated stream each, kernels of all ranks running
//! at once and waiting on each other's flags): one-shot and two-shot all-reduce with every
//! epilogue (+ bias, + residual, RMSNorm), the unfused sequence (all-reduce, then the
//! standalone bias/residual and RMSNorm kernels), all-gather and reduce-scatter; then a
//! missing rank, a poisoned group, a frozen timer and a late rank.
//!
//! Every case has fresh random inputs (seeded; `TPFUSE_TEST_SEED` changes them) and poisoned
//! outputs; many launches are in flight on every rank before the one synchronize. Checked:
//! bitwise equality on every rank, across one-shot, two-shot and unfused, with the kernels'
//! arithmetic done on the host where the docs promise bits (the sum and the element-wise
//! epilogue), and the DESIGN.md tolerance against the f64 reference for RMSNorm.
#![cfg(feature = "emulator")]

mod common;
use common::assert_same_bits;
use common::emu::{launched, session, session_with, Ranks};
use common::gpu::{assert_close, base_seed, mix_seed, random_ranks, random_vec, TestElement};
use half::{bf16, f16};
use std::ffi::c_void;
use tpfuse::emulator::{self, abi, DeviceBuffer, Fault};
use tpfuse::reference::{all_reduce_epilogue_exact, all_reduce_fused_f64, reduce_ranks_exact};
use tpfuse::Element;

const WORLDS: [usize; 5] = [2, 3, 4, 6, 8];
const EPS: f32 = 1e-5;
const LONG_TIMEOUT_NS: u64 = 60_000_000_000;

impl Ranks {
    /// A flat f32 all-reduce of `n` elements, no epilogue, on `rank`'s stream.
    fn plain_all_reduce(
        &self,
        rank: usize,
        path: Path,
        input: &DeviceBuffer<f32>,
        out: &DeviceBuffer<f32>,
        n: usize,
    ) {
        self.plain_all_reduce_on(
            rank,
            path,
            input,
            out,
            (n, abi::TPFUSE_DTYPE_F32),
            self.blocks,
        );
    }

    /// The same on a grid of `blocks` (which every rank must agree on), of `n` elements of
    /// `dtype` (a `TPFUSE_DTYPE_*`: the f32 buffers hold them as bits).
    fn plain_all_reduce_on(
        &self,
        rank: usize,
        path: Path,
        input: &DeviceBuffer<f32>,
        out: &DeviceBuffer<f32>,
        (n, dtype): (usize, u32),
        blocks: i32,
    ) {
        // SAFETY: both buffers hold n f32 elements (so n of any dtype) and live until the caller
        // synchronizes.
        let code = unsafe {
            abi::tpfuse_all_reduce(
                dtype as i32,
                path.algo(),
                &self.peers(),
                &abi::tpfuse_group_args {
                    blocks,
                    ..self.args(rank)
                },
                input.ptr().cast(),
                std::ptr::null(),
                std::ptr::null_mut(),
                std::ptr::null(),
                EPS,
                out.ptr().cast(),
                1,
                n,
                self.stream(rank),
            )
        };
        launched(&format!("all_reduce rank {rank}"), code);
    }
}

fn ptr_of<T: Copy>(b: &Option<DeviceBuffer<T>>) -> *mut c_void {
    b.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr().cast())
}

/// What follows the reduction.
#[derive(Clone, Copy, Debug)]
struct Epi {
    bias: bool,
    residual: bool,
    gamma: bool,
}

const FLAT_EPILOGUES: [Epi; 2] = [
    Epi {
        bias: false,
        residual: false,
        gamma: false,
    },
    Epi {
        bias: false,
        residual: true,
        gamma: false,
    },
];
const ROW_EPILOGUES: [Epi; 5] = [
    Epi {
        bias: true,
        residual: false,
        gamma: false,
    },
    Epi {
        bias: false,
        residual: true,
        gamma: false,
    },
    Epi {
        bias: true,
        residual: true,
        gamma: false,
    },
    Epi {
        bias: false,
        residual: false,
        gamma: true,
    },
    Epi {
        bias: true,
        residual: true,
        gamma: true,
    },
];

/// How a case is computed.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    /// One-shot by flags.
    OneShot,
    /// `TPFUSE_ALGO_ONE_SHOT_PACKETS`: by packets where the message fits them
    /// (`cuda/all_reduce_packets.cu`), else by flags.
    Packets,
    TwoShot,
    /// Plain one-shot all-reduce (by flags), then the standalone bias/residual and RMSNorm
    /// kernels.
    Unfused,
}

impl Path {
    /// The C ABI's algorithm (the unfused path's all-reduce is one-shot, by flags).
    fn algo(self) -> i32 {
        (match self {
            Path::TwoShot => abi::TPFUSE_ALGO_TWO_SHOT,
            Path::Packets => abi::TPFUSE_ALGO_ONE_SHOT_PACKETS,
            _ => abi::TPFUSE_ALGO_ONE_SHOT,
        }) as i32
    }
}

/// One all-reduce of one shape and epilogue, as every rank enqueued it.
struct Launch<T: TestElement> {
    path: Path,
    out: Vec<DeviceBuffer<T>>,
    residual: Vec<Option<DeviceBuffer<T>>>,
    _inputs: Vec<DeviceBuffer<T>>,
    _shared: Vec<Option<DeviceBuffer<T>>>,
}

struct Data<T> {
    partials: Vec<Vec<T>>,
    bias: Option<Vec<T>>,
    residual: Option<Vec<T>>,
    gamma: Option<Vec<T>>,
    rows: usize,
    hidden: usize,
}

fn data<T: TestElement>(world: usize, rows: usize, hidden: usize, epi: Epi, seed: u64) -> Data<T> {
    let n = rows * hidden;
    let pick = |on: bool, part: u64, len: usize, lo: f32, hi: f32| {
        on.then(|| random_vec::<T>(mix_seed(seed, &[part]), len, lo, hi))
    };
    Data {
        partials: random_ranks(world, n, |r| mix_seed(seed, &[100 + r as u64])),
        bias: pick(epi.bias, 1, hidden, -1.0, 1.0),
        residual: pick(epi.residual, 2, n, -4.0, 4.0),
        gamma: pick(epi.gamma, 3, hidden, 0.5, 1.5),
        rows,
        hidden,
    }
}

fn enqueue<T: TestElement>(ranks: &Ranks, d: &Data<T>, path: Path, label: &str) -> Launch<T> {
    let n = d.rows * d.hidden;
    let peers = ranks.peers();
    let mut launch = Launch {
        path,
        out: Vec::new(),
        residual: Vec::new(),
        _inputs: Vec::new(),
        _shared: Vec::new(),
    };
    for r in 0..ranks.world {
        let input = DeviceBuffer::from_slice(&d.partials[r]);
        let bias = d.bias.as_deref().map(DeviceBuffer::from_slice);
        let residual = d.residual.as_deref().map(DeviceBuffer::from_slice);
        let gamma = d.gamma.as_deref().map(DeviceBuffer::from_slice);
        let out = DeviceBuffer::<T>::new(n);
        let args = ranks.args(r);
        let s = ranks.stream(r);
        let o = out.ptr().cast::<c_void>();
        // SAFETY: every buffer holds what the ABI says and lives until the launch is checked.
        unsafe {
            let code = match path {
                Path::OneShot | Path::Packets | Path::TwoShot => abi::tpfuse_all_reduce(
                    T::DTYPE,
                    path.algo(),
                    &peers,
                    &args,
                    input.ptr().cast(),
                    ptr_of(&bias),
                    ptr_of(&residual),
                    ptr_of(&gamma),
                    EPS,
                    o,
                    d.rows,
                    d.hidden,
                    s,
                ),
                Path::Unfused => {
                    let std = std::ptr::null_mut();
                    let mut code = abi::tpfuse_all_reduce(
                        T::DTYPE,
                        abi::TPFUSE_ALGO_ONE_SHOT as i32,
                        &peers,
                        &args,
                        input.ptr().cast(),
                        std,
                        std,
                        std,
                        EPS,
                        o,
                        d.rows,
                        d.hidden,
                        s,
                    );
                    if code == 0 && (bias.is_some() || residual.is_some()) {
                        code = abi::tpfuse_bias_residual(
                            T::DTYPE,
                            o,
                            ptr_of(&bias),
                            ptr_of(&residual),
                            o,
                            d.rows,
                            d.hidden,
                            s,
                        );
                    }
                    if code == 0 && gamma.is_some() {
                        code = abi::tpfuse_rms_norm(
                            T::DTYPE,
                            o,
                            ptr_of(&gamma),
                            EPS,
                            o,
                            d.rows,
                            d.hidden,
                            s,
                        );
                    }
                    code
                }
            };
            launched(&format!("{label} {path:?} rank {r}"), code);
        }
        launch.out.push(out);
        launch.residual.push(residual);
        launch._inputs.push(input);
        launch._shared.push(bias);
        launch._shared.push(gamma);
    }
    launch
}

/// Every rank and path holds the same bits; the sum and the element-wise epilogue are the
/// kernels' arithmetic exactly; RMSNorm is within tolerance of the f64 reference.
fn check<T: TestElement>(label: &str, d: &Data<T>, launches: &[Launch<T>]) {
    let parts: Vec<&[T]> = d.partials.iter().map(Vec::as_slice).collect();
    let h = all_reduce_epilogue_exact(&parts, d.bias.as_deref(), d.residual.as_deref(), d.hidden);
    let (_, out_f64) = all_reduce_fused_f64(
        &parts,
        d.bias.as_deref(),
        d.residual.as_deref(),
        d.gamma.as_deref(),
        f64::from(EPS),
        d.hidden,
    );
    let first = launches[0].out[0].to_vec();
    for l in launches {
        for (r, out) in l.out.iter().enumerate() {
            let at = format!("{label} {:?} rank {r}", l.path);
            let got = out.to_vec();
            if d.gamma.is_none() {
                assert_same_bits(&format!("{at}: out"), &got, &h);
            } else {
                assert_same_bits(
                    &format!("{at}: out vs {:?} rank 0", launches[0].path),
                    &got,
                    &first,
                );
                assert_close(&format!("{at}: out"), &got, &out_f64, T::TOLERANCE);
            }
            if let Some(res) = &l.residual[r] {
                assert_same_bits(&format!("{at}: residual"), &res.to_vec(), &h);
            }
        }
    }
}

fn all_reduce_every_world<T: TestElement>(seed: u64) {
    for (wi, &world) in WORLDS.iter().enumerate() {
        let ranks = Ranks::new(world, 1 + (world % 3) as i32, LONG_TIMEOUT_NS);
        let mut cases: Vec<(String, Data<T>, Vec<Launch<T>>)> = Vec::new();
        let shapes: Vec<(usize, usize, &[Epi])> = vec![
            (1, 1, &FLAT_EPILOGUES),
            (1, 13, &FLAT_EPILOGUES),
            (1, 4100, &FLAT_EPILOGUES),
            (1, 256, &ROW_EPILOGUES),
            (3, 520, &ROW_EPILOGUES),
            // Rows of exactly one segment of f16/bf16 (two of f32), and of f32: one-shot
            // normalises each row in one block, from registers.
            (4, 4096, &ROW_EPILOGUES),
            (2, 2048, &ROW_EPILOGUES),
            // A row of two segments: with two blocks or more, each holds one in registers.
            (1, 8192, &ROW_EPILOGUES),
            // Rows of several RMSNorm segments (4096 elements of f16/bf16, 2048 of f32), the
            // last one short: one-shot splits them across blocks.
            (2, 4104, &ROW_EPILOGUES),
        ];
        for (si, (rows, hidden, epilogues)) in shapes.into_iter().enumerate() {
            for (ei, &epi) in epilogues.iter().enumerate() {
                let case_seed = mix_seed(seed, &[T::ID, wi as u64, si as u64, ei as u64]);
                let label = format!(
                    "{} W={world} {rows}x{hidden} {epi:?} seed {case_seed}",
                    T::NAME
                );
                cases.push((
                    label,
                    data::<T>(world, rows, hidden, epi, case_seed),
                    Vec::new(),
                ));
            }
        }
        // Path by path, so that consecutive launches on a rank have different inputs: a rank
        // that overwrote its staging, or a packet half, too early would show. By packets on
        // W = 2, 3 and 8 only: each vector costs the weak-memory passes about 16·W strong
        // accesses there (the rest of this test took 6.6 s of forward/weak, the packets on
        // every W 29 s more).
        let packets: &[Path] = if [2, 3, 6].contains(&world) {
            &[Path::Packets]
        } else {
            &[]
        };
        let paths = [
            &[Path::OneShot][..],
            packets,
            &[Path::TwoShot, Path::Unfused],
        ]
        .concat();
        for path in paths {
            for (label, d, launches) in cases.iter_mut() {
                launches.push(enqueue(&ranks, d, path, label));
            }
        }
        ranks.synchronize();
        for (label, d, launches) in &cases {
            check(label, d, launches);
        }
        for r in 0..world {
            assert_eq!(ranks.error_word(r), 0, "W={world} rank {r}: error word");
        }
    }
}

#[test]
fn all_reduce_f32_every_world_path_and_epilogue() {
    let _s = session(
        "emu_all_reduce",
        "all_reduce_f32_every_world_path_and_epilogue",
    );
    all_reduce_every_world::<f32>(base_seed(0xa11_0001));
}

#[test]
fn all_reduce_f16_every_world_path_and_epilogue() {
    let _s = session(
        "emu_all_reduce",
        "all_reduce_f16_every_world_path_and_epilogue",
    );
    all_reduce_every_world::<f16>(base_seed(0xa11_0002));
}

#[test]
fn all_reduce_bf16_every_world_path_and_epilogue() {
    let _s = session(
        "emu_all_reduce",
        "all_reduce_bf16_every_world_path_and_epilogue",
    );
    all_reduce_every_world::<bf16>(base_seed(0xa11_0003));
}

#[test]
fn all_gather_every_world() {
    let _s = session("emu_all_reduce", "all_gather_every_world");
    let seed = base_seed(0xa11_0004);
    for &world in &WORLDS {
        let ranks = Ranks::new(world, 2, LONG_TIMEOUT_NS);
        let peers = ranks.peers();
        let mut cases = Vec::new();
        for (i, len_bytes) in [16usize, 48, 4096, 16 * 1000].into_iter().enumerate() {
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| {
                    random_vec::<f32>(
                        mix_seed(seed, &[world as u64, i as u64, r as u64]),
                        len_bytes / 4,
                        -4.0,
                        4.0,
                    )
                })
                .map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect())
                .collect();
            let bufs: Vec<DeviceBuffer<u8>> =
                inputs.iter().map(|x| DeviceBuffer::from_slice(x)).collect();
            let outs: Vec<DeviceBuffer<u8>> = (0..world)
                .map(|_| DeviceBuffer::new(world * len_bytes))
                .collect();
            for r in 0..world {
                // SAFETY: buffers of len_bytes and world * len_bytes.
                let code = unsafe {
                    abi::tpfuse_all_gather(
                        &peers,
                        &ranks.args(r),
                        bufs[r].ptr().cast(),
                        outs[r].ptr().cast(),
                        len_bytes,
                        ranks.stream(r),
                    )
                };
                launched("all_gather", code);
            }
            cases.push((len_bytes, inputs, bufs, outs));
        }
        ranks.synchronize();
        for (len_bytes, inputs, _, outs) in &cases {
            let want: Vec<u8> = inputs.concat();
            for (r, out) in outs.iter().enumerate() {
                assert_same_bits(
                    &format!("all_gather W={world} {len_bytes} B rank {r}"),
                    &out.to_vec(),
                    &want,
                );
            }
        }
    }
}

fn reduce_scatter_every_world<T: TestElement>(seed: u64) {
    for &world in &WORLDS {
        let ranks = Ranks::new(world, 3, LONG_TIMEOUT_NS);
        let peers = ranks.peers();
        let mut cases = Vec::new();
        for (i, len) in [8usize, 40, 1000].into_iter().enumerate() {
            let inputs: Vec<Vec<T>> = random_ranks(world, world * len, |r| {
                mix_seed(seed, &[T::ID, world as u64, i as u64, r as u64])
            });
            let bufs: Vec<DeviceBuffer<T>> =
                inputs.iter().map(|x| DeviceBuffer::from_slice(x)).collect();
            let outs: Vec<DeviceBuffer<T>> = (0..world).map(|_| DeviceBuffer::new(len)).collect();
            for r in 0..world {
                // SAFETY: buffers of world * len and len elements.
                let code = unsafe {
                    abi::tpfuse_reduce_scatter(
                        T::DTYPE,
                        &peers,
                        &ranks.args(r),
                        bufs[r].ptr().cast(),
                        outs[r].ptr().cast(),
                        len,
                        ranks.stream(r),
                    )
                };
                launched("reduce_scatter", code);
            }
            cases.push((len, inputs, bufs, outs));
        }
        ranks.synchronize();
        for (len, inputs, _, outs) in &cases {
            for (r, out) in outs.iter().enumerate() {
                let slices: Vec<&[T]> = inputs.iter().map(|x| &x[r * len..(r + 1) * len]).collect();
                let want = reduce_ranks_exact(&slices);
                assert_same_bits(
                    &format!("reduce_scatter {} W={world} len {len} rank {r}", T::NAME),
                    &out.to_vec(),
                    &want,
                );
            }
        }
    }
}

#[test]
fn reduce_scatter_every_world_and_dtype() {
    let _s = session("emu_all_reduce", "reduce_scatter_every_world_and_dtype");
    let seed = base_seed(0xa11_0005);
    reduce_scatter_every_world::<f32>(seed);
    reduce_scatter_every_world::<f16>(seed);
    reduce_scatter_every_world::<bf16>(seed);
}

/// One plain one-shot all-reduce of `n` f32 on every rank not in `skip`; the outputs.
fn launch_survivors(
    ranks: &Ranks,
    path: Path,
    n: usize,
    skip: &[usize],
    seed: u64,
) -> Vec<Option<DeviceBuffer<f32>>> {
    let inputs: Vec<Vec<f32>> = random_ranks(ranks.world, n, |r| mix_seed(seed, &[r as u64]));
    (0..ranks.world)
        .map(|r| {
            if skip.contains(&r) {
                return None;
            }
            let input = DeviceBuffer::from_slice(&inputs[r]);
            let out = DeviceBuffer::<f32>::new(n);
            // The input is copied (or sent) by the kernel before it waits.
            ranks.plain_all_reduce(r, path, &input, &out, n);
            ranks.streams[r].synchronize().ok();
            Some(out)
        })
        .collect()
}

#[test]
fn a_missing_rank_times_out_on_every_survivor_within_the_deadline() {
    let _s = session(
        "emu_all_reduce",
        "a_missing_rank_times_out_on_every_survivor_within_the_deadline",
    );
    // 1000 f32: by packets on a group that offers them.
    for path in [Path::OneShot, Path::Packets] {
        missing_rank(path);
    }
}

fn missing_rank(path: Path) {
    let timeout = 2_000_000; // 2 ms of virtual time
    let ranks = Ranks::new(4, 2, timeout);
    ranks.streams[2].set_fault(Fault {
        stop: true,
        ..Fault::default()
    });
    // By packets every thread of a vector waits (by flags, one a peer), and each resume of a
    // waiting thread moves the emulator's clock 1 ns: with 250 vectors on each of 3 ranks the
    // threads' checks of the deadline (every 1024 polls) came 1.6 ms late in virtual time.
    // 64 vectors keep the bound's meaning (a wait ends at its deadline, not much later).
    let n = if path == Path::Packets { 256 } else { 1000 };
    let inputs: Vec<Vec<f32>> =
        random_ranks(4, n, |r| mix_seed(base_seed(0xa11_0006), &[r as u64]));
    let bufs: Vec<DeviceBuffer<f32>> = inputs.iter().map(|x| DeviceBuffer::from_slice(x)).collect();
    let outs: Vec<DeviceBuffer<f32>> = (0..4).map(|_| DeviceBuffer::new(n)).collect();
    let start = emulator::now_ns();
    for r in 0..4 {
        ranks.plain_all_reduce(r, path, &bufs[r], &outs[r], n);
    }
    ranks.synchronize();
    let elapsed = emulator::now_ns() - start;
    let word = abi::TPFUSE_ERROR_PEER_TIMEOUT | 2;
    for r in [0, 1, 3] {
        assert_eq!(
            ranks.error_word(r),
            word,
            "{path:?} rank {r}: error word names rank 2"
        );
        assert_eq!(
            ranks.host_error_word(r),
            word,
            "rank {r}: the failed launch published its error word to the host"
        );
        let failed = outs[r].to_vec().iter().all(|x| x.is_failed_output());
        assert!(
            failed,
            "rank {r}: the failed launch marked every output failed"
        );
    }
    assert_eq!(
        ranks.error_word(2),
        word,
        "the missing rank was told too (it stops at once if it comes late)"
    );
    assert!(
        elapsed >= timeout,
        "gave up after {elapsed} ns, before the {timeout} ns deadline"
    );
    assert!(
        elapsed <= timeout * 3 / 2,
        "gave up after {elapsed} ns, deadline {timeout} ns"
    );

    // A poisoned group returns at once: no waiting, nothing written.
    let start = emulator::now_ns();
    let outs = launch_survivors(&ranks, path, n, &[2], base_seed(0xa11_0007));
    let elapsed = emulator::now_ns() - start;
    assert!(
        elapsed < timeout / 10,
        "a poisoned group waited {elapsed} ns"
    );
    for (r, out) in outs.iter().enumerate() {
        if let Some(out) = out {
            assert!(
                out.to_vec().iter().all(|x| x.is_failed_output()),
                "rank {r}: a launch on a poisoned group marks its output failed"
            );
        }
    }
}

#[test]
fn a_rank_whose_timer_is_frozen_learns_of_the_timeout_from_its_peers() {
    let _s = session(
        "emu_all_reduce",
        "a_rank_whose_timer_is_frozen_learns_of_the_timeout_from_its_peers",
    );
    let ranks = Ranks::stopped_and_frozen(3, 1, 1_000_000, 2, 0);
    let input = DeviceBuffer::from_slice(&vec![1.0f32; 64]);
    let outs: Vec<DeviceBuffer<f32>> = (0..2).map(|_| DeviceBuffer::new(64)).collect();
    for (r, out) in outs.iter().enumerate() {
        ranks.plain_all_reduce(r, Path::TwoShot, &input, out, 64);
    }
    ranks.streams[0].synchronize().expect("rank 0 returns");
    ranks.streams[1].synchronize().expect("rank 1 returns");
    let word = abi::TPFUSE_ERROR_PEER_TIMEOUT | 2;
    assert_eq!(ranks.error_word(1), word);
    assert_eq!(
        ranks.error_word(0),
        word,
        "rank 0 (frozen timer) was told by rank 1"
    );
}

#[test]
fn a_late_rank_within_the_deadline_gives_the_right_result() {
    let _s = session(
        "emu_all_reduce",
        "a_late_rank_within_the_deadline_gives_the_right_result",
    );
    // Each path first, so that each kind of wait (a barrier's, a packet's, a started flag's)
    // polls through the delay: thousands of polls, as on a GPU, so every check a stalled
    // wait makes runs (docs/emulator.md, "Virtual time"), and none may take the late rank
    // for a failure.
    let d = data::<bf16>(4, 2, 264, ROW_EPILOGUES[4], base_seed(0xa11_0008));
    for first in 0..3 {
        let ranks = Ranks::new(4, 2, 50_000_000);
        ranks.streams[1].set_fault(Fault {
            delay_ns: 5_000_000,
            ..Fault::default()
        });
        let mut paths = [Path::OneShot, Path::Packets, Path::TwoShot];
        paths.rotate_left(first);
        let label = format!("late rank, {:?} first", paths[0]);
        let launches: Vec<Launch<bf16>> = paths
            .iter()
            .map(|&path| enqueue(&ranks, &d, path, &label))
            .collect();
        let start = emulator::now_ns();
        ranks.synchronize();
        assert!(
            emulator::now_ns() - start >= 5_000_000,
            "{label}: rank 1 started late"
        );
        check(&label, &d, &launches);
        for r in 0..4 {
            assert_eq!(ranks.error_word(r), 0, "{label}: rank {r}");
        }
    }
}

#[test]
fn all_reduces_by_packets_back_to_back_each_get_their_own_inputs() {
    let _s = session(
        "emu_all_reduce",
        "all_reduces_by_packets_back_to_back_each_get_their_own_inputs",
    );
    // Five launches a rank, all enqueued before any runs (no host synchronisation between
    // them). The packet halves alternate, so launch E stores into the half whose packets
    // launch E - 2's consumers cleared, and only the started flags order those clears before
    // the new packets (cuda/fused_flags.cuh). Under the weak passes a clear that nothing
    // orders lands after the packet (cuda/emu/weak_memory.cpp), as a GPU may land it, and the
    // consumer's wait runs to the deadline.
    let world = 3;
    let ranks = Ranks::new(world, 2, 20_000_000);
    let cases: Vec<Data<bf16>> = (0..5u64)
        .map(|i| {
            data::<bf16>(
                world,
                2,
                264,
                ROW_EPILOGUES[4],
                mix_seed(base_seed(0xa11_0010), &[i]),
            )
        })
        .collect();
    let launches: Vec<Launch<bf16>> = cases
        .iter()
        .map(|d| enqueue(&ranks, d, Path::Packets, "in a row"))
        .collect();
    ranks.synchronize();
    for r in 0..world {
        assert_eq!(ranks.error_word(r), 0, "rank {r}");
    }
    for (i, (d, l)) in cases.iter().zip(launches).enumerate() {
        check(&format!("launch {i} of 5"), d, &[l]);
    }
}

#[test]
fn a_wait_ends_when_the_timer_stands_still() {
    let _s = session("emu_all_reduce", "a_wait_ends_when_the_timer_stands_still");
    // Rank 1 never comes and rank 0's %globaltimer stands still: only the %clock64 backstop
    // (4 x the timeout at the peak clock) ends rank 0's wait. Before it, the wait was endless.
    // By flags (the barrier's wait) and by packets (a packet's).
    let timeout = 1_000_000;
    for path in [Path::OneShot, Path::Packets] {
        let ranks = Ranks::stopped_and_frozen(2, 2, timeout, 1, 0);
        let input = DeviceBuffer::from_slice(&vec![1.0f32; 64]);
        let out = DeviceBuffer::<f32>::new(64);
        let start = emulator::now_ns();
        ranks.plain_all_reduce(0, path, &input, &out, 64);
        ranks.streams[0].synchronize().expect("rank 0 returns");
        let elapsed = emulator::now_ns() - start;
        let word = abi::TPFUSE_ERROR_PEER_TIMEOUT | 1;
        assert_eq!(ranks.error_word(0), word, "{path:?}");
        assert_eq!(ranks.host_error_word(0), word, "{path:?}");
        assert!(
            elapsed >= 4 * timeout && elapsed <= 5 * timeout,
            "{path:?}: the backstop ended the wait after {elapsed} ns (timeout {timeout} ns)"
        );
        assert!(
            out.to_vec().iter().all(|x| x.is_failed_output()),
            "{path:?}"
        );
    }
}

/// Rank 0 launches (n0, blocks0) elements of dtype0, rank 1 (n1, blocks1) of dtype1: both must
/// fail at once with TPFUSE_ERROR_PEER_MISMATCH naming both, mark their outputs failed, and
/// tell the host.
fn mismatch(label: &str, path: Path, rank0: (usize, i32, u32), rank1: (usize, i32, u32)) {
    mismatch_along(label, [path, path], rank0, rank1);
}

/// The same, rank r along `paths[r]`.
fn mismatch_along(
    label: &str,
    paths: [Path; 2],
    (n0, blocks0, dtype0): (usize, i32, u32),
    (n1, blocks1, dtype1): (usize, i32, u32),
) {
    let ranks = Ranks::new(2, blocks0, LONG_TIMEOUT_NS);
    let input = DeviceBuffer::from_slice(&vec![1.0f32; n0.max(n1)]);
    let outs: Vec<DeviceBuffer<f32>> = (0..2).map(|_| DeviceBuffer::new(n0.max(n1))).collect();
    let start = emulator::now_ns();
    ranks.plain_all_reduce_on(0, paths[0], &input, &outs[0], (n0, dtype0), blocks0);
    ranks.plain_all_reduce_on(1, paths[1], &input, &outs[1], (n1, dtype1), blocks1);
    ranks.synchronize();
    // The f32 words the outputs' failed elements fill.
    let words = |n: usize, dtype: u32| {
        if dtype == abi::TPFUSE_DTYPE_F32 {
            n
        } else {
            n / 2
        }
    };
    let outs = [(&outs[0], words(n0, dtype0)), (&outs[1], words(n1, dtype1))];
    assert_mismatched(label, &ranks, start, outs);
}

/// After `ranks.synchronize()`: the two ranks' launches (started at virtual time `start`)
/// failed at once with TPFUSE_ERROR_PEER_MISMATCH naming both, marked the first n elements
/// of their outputs failed, and told the host.
fn assert_mismatched<T: TestElement>(
    label: &str,
    ranks: &Ranks,
    start: u64,
    outs: [(&DeviceBuffer<T>, usize); 2],
) {
    let elapsed = emulator::now_ns() - start;
    assert!(
        elapsed < LONG_TIMEOUT_NS / 100,
        "{label}: the mismatch took {elapsed} ns to surface"
    );
    // Whichever rank noticed first, the word names both: p | q << 16.
    let words = [0u32, 1].map(|q| abi::TPFUSE_ERROR_PEER_MISMATCH | (1 - q) | q << 16);
    for (r, (out, n)) in outs.into_iter().enumerate() {
        let word = ranks.error_word(r);
        assert!(
            words.contains(&word),
            "{label}: rank {r}'s error word {word:#x}"
        );
        // (Peers store into the word unconditionally: the host may have seen the other one.)
        let host = ranks.host_error_word(r);
        assert!(
            words.contains(&host),
            "{label}: rank {r}'s host word {host:#x}"
        );
        let out = out.to_vec();
        assert!(
            out[..n].iter().all(|x| x.is_failed_output()),
            "{label}: rank {r}'s output is not marked failed"
        );
    }
}

/// Registers count toward an SM's room, as on a GPU: a one-shot all-reduce + RMSNorm block
/// (512 threads of 78 registers on sm_90a: 40960 of an SM's 65536) holds a whole SM, though
/// its threads (512 of 2048) and shared memory would let four share one. Its launch by flags
/// is cooperative (its blocks meet), so on a device of 2 SMs a grid of 3 is refused
/// (cudaErrorCooperativeLaunchTooLarge) on every rank before anything runs, and a grid of 1 a
/// rank runs.
#[test]
fn registers_hold_an_sm_and_a_cooperative_grid_past_them_is_refused() {
    let _s = session_with(
        "emu_all_reduce",
        "registers_hold_an_sm_and_a_cooperative_grid_past_them_is_refused",
        2,
        60_000_000_000,
    );
    // 3 rows of 2048 f32: 1536 vectors, 3 blocks of 512.
    let (rows, hidden) = (3usize, 2048usize);
    let gamma = DeviceBuffer::from_slice(&vec![1.0f32; hidden]);
    let input = DeviceBuffer::from_slice(&vec![1.0f32; rows * hidden]);
    for (blocks, expected) in [(3, 720), (1, 0)] {
        let ranks = Ranks::new(2, blocks, LONG_TIMEOUT_NS);
        let outs: Vec<DeviceBuffer<f32>> = (0..2)
            .map(|_| DeviceBuffer::from_slice(&vec![f32::NAN; rows * hidden]))
            .collect();
        let codes: Vec<i32> = (0..2)
            .map(|r| {
                // SAFETY: the buffers hold rows x hidden (gamma: hidden) elements and live
                // until the synchronize below.
                unsafe {
                    abi::tpfuse_all_reduce(
                        abi::TPFUSE_DTYPE_F32 as i32,
                        abi::TPFUSE_ALGO_ONE_SHOT as i32,
                        &ranks.peers(),
                        &ranks.args(r),
                        input.ptr().cast(),
                        std::ptr::null(),
                        std::ptr::null_mut(),
                        gamma.ptr().cast(),
                        EPS,
                        outs[r].ptr().cast(),
                        rows,
                        hidden,
                        ranks.stream(r),
                    )
                }
            })
            .collect();
        ranks.synchronize();
        for r in 0..2 {
            assert_eq!(
                codes[r], expected,
                "grid {blocks}, rank {r}: the launch's code"
            );
            assert_eq!(
                ranks.error_word(r),
                0,
                "grid {blocks}, rank {r}: the error word"
            );
            let out = outs[r].to_vec();
            if expected == 0 {
                // Every row is 2.0 before the norm: 1.0 after it (gamma 1).
                assert!(
                    out.iter().all(|&x| (x - 1.0).abs() < 1e-3),
                    "grid {blocks}, rank {r}: out"
                );
            } else {
                assert!(
                    out.iter().all(|x| x.is_nan() && !x.is_failed_output()),
                    "grid {blocks}, rank {r}: out keeps its poison (nothing ran)"
                );
            }
        }
    }
}

/// Other sizes, grids or element types (f16 against bf16: the same size) on the two ranks.
#[test]
fn ranks_that_launch_different_sizes_or_grids_get_a_mismatch_not_wrong_data() {
    let _s = session(
        "emu_all_reduce",
        "ranks_that_launch_different_sizes_or_grids_get_a_mismatch_not_wrong_data",
    );
    let f32 = abi::TPFUSE_DTYPE_F32;
    for path in [Path::OneShot, Path::Packets, Path::TwoShot] {
        mismatch(
            &format!("{path:?} n 1000 vs 1024"),
            path,
            (1000, 2, f32),
            (1024, 2, f32),
        );
        // 8000 f32 = 2000 vectors want 4 blocks: the budgets 2 and 4 give different grids.
        mismatch(
            &format!("{path:?} grid 2 vs 4"),
            path,
            (8000, 2, f32),
            (8000, 4, f32),
        );
        // f16 and bf16 elements have one size: the descriptor names the type.
        mismatch(
            &format!("{path:?} f16 vs bf16"),
            path,
            (1024, 2, abi::TPFUSE_DTYPE_F16),
            (1024, 2, abi::TPFUSE_DTYPE_BF16),
        );
    }
}

/// One rank by packets (a fused launch: it waits for packets), the other by flags (a
/// collective: its barrier waits for flags): neither sends what the other waits for, and no
/// descriptor is compared between them. The barrier's stalled wait finds the peer's started
/// flag of a fused launch its own rank has not made (cuda/barrier.cuh, "A rank in a fused
/// kernel"): a mismatch at once, where it was a timeout at the deadline. Either rank first.
#[test]
fn a_rank_by_packets_against_one_by_flags_is_a_mismatch_not_a_timeout() {
    let _s = session(
        "emu_all_reduce",
        "a_rank_by_packets_against_one_by_flags_is_a_mismatch_not_a_timeout",
    );
    let f32 = abi::TPFUSE_DTYPE_F32;
    for paths in [
        [Path::Packets, Path::OneShot],
        [Path::TwoShot, Path::Packets],
    ] {
        mismatch_along(&format!("{paths:?}"), paths, (1024, 2, f32), (1024, 2, f32));
    }
}

#[test]
fn a_failed_two_shot_marks_out_and_residual_through_its_rmsnorm() {
    let _s = session(
        "emu_all_reduce",
        "a_failed_two_shot_marks_out_and_residual_through_its_rmsnorm",
    );
    // Rank 1 never comes; rank 0's two-shot gives up, and the RMSNorm kernel that follows it
    // must keep the marker (normalising it would turn it into an ordinary NaN).
    let ranks = Ranks::new(2, 2, 1_000_000);
    ranks.streams[1].set_fault(Fault {
        stop: true,
        ..Fault::default()
    });
    let (rows, hidden) = (3usize, 64usize);
    let n = rows * hidden;
    let input = DeviceBuffer::from_slice(&vec![bf16::from_f32(1.0); n]);
    let residual = DeviceBuffer::from_slice(&vec![bf16::from_f32(0.5); n]);
    let gamma = DeviceBuffer::from_slice(&vec![bf16::from_f32(1.0); hidden]);
    let out = DeviceBuffer::<bf16>::new(n);
    // SAFETY: every buffer holds what the shape needs and lives until the synchronize below.
    let code = unsafe {
        abi::tpfuse_all_reduce(
            abi::TPFUSE_DTYPE_BF16 as i32,
            abi::TPFUSE_ALGO_TWO_SHOT as i32,
            &ranks.peers(),
            &ranks.args(0),
            input.ptr().cast(),
            std::ptr::null(),
            residual.ptr().cast(),
            gamma.ptr().cast(),
            EPS,
            out.ptr().cast(),
            rows,
            hidden,
            ranks.stream(0),
        )
    };
    launched("two-shot with RMSNorm", code);
    ranks.streams[0].synchronize().expect("rank 0 returns");
    assert_eq!(ranks.host_error_word(0), abi::TPFUSE_ERROR_PEER_TIMEOUT | 1);
    for (what, buf) in [("out", &out), ("residual", &residual)] {
        let got = buf.to_vec();
        assert!(
            got.iter().all(|x| x.is_failed_output()),
            "{what} is not marked failed: {:?}",
            &got[..4]
        );
    }
}

#[test]
fn ranks_that_pass_different_eps_get_a_mismatch_not_different_bits() {
    let _s = session(
        "emu_all_reduce",
        "ranks_that_pass_different_eps_get_a_mismatch_not_different_bits",
    );
    // Same shapes, same epilogue, same grid: only eps differs (with an RMSNorm it changes the
    // bits). Two-shot's RMSNorm is a kernel of its own after, so it is the two-shot kernel's
    // first barrier that must see the difference.
    let (rows, hidden) = (3usize, 64usize);
    let n = rows * hidden;
    for path in [Path::OneShot, Path::Packets, Path::TwoShot] {
        let ranks = Ranks::new(2, 2, LONG_TIMEOUT_NS);
        let inputs: Vec<Vec<bf16>> =
            random_ranks(2, n, |r| mix_seed(base_seed(0xa11_0009), &[r as u64]));
        let inputs: Vec<DeviceBuffer<bf16>> =
            inputs.iter().map(|x| DeviceBuffer::from_slice(x)).collect();
        let gamma = DeviceBuffer::from_slice(&vec![bf16::from_f32(1.0); hidden]);
        let outs: Vec<DeviceBuffer<bf16>> = (0..2).map(|_| DeviceBuffer::new(n)).collect();
        let start = emulator::now_ns();
        for (r, eps) in [(0, 1e-5f32), (1, 1e-6f32)] {
            // SAFETY: every buffer holds what the shape needs and lives until the checks.
            let code = unsafe {
                abi::tpfuse_all_reduce(
                    abi::TPFUSE_DTYPE_BF16 as i32,
                    path.algo(),
                    &ranks.peers(),
                    &ranks.args(r),
                    inputs[r].ptr().cast(),
                    std::ptr::null(),
                    std::ptr::null_mut(),
                    gamma.ptr().cast(),
                    eps,
                    outs[r].ptr().cast(),
                    rows,
                    hidden,
                    ranks.stream(r),
                )
            };
            launched(&format!("{path:?} rank {r} eps {eps}"), code);
        }
        ranks.synchronize();
        assert_mismatched(
            &format!("{path:?} eps 1e-5 vs 1e-6"),
            &ranks,
            start,
            [(&outs[0], n), (&outs[1], n)],
        );
    }
}

/// cudaErrorInvalidValue.
const INVALID_VALUE: i32 = 1;
/// Staging per rank in `bad_calls_are_refused_before_anything_is_launched`.
const BAD_CAPACITY: usize = 4096;
/// Bytes of each of a rank's buffers there: room for every refused message at any offset.
const BAD_BYTES: usize = 3 * BAD_CAPACITY;
/// What the inputs (and the residual, which a launch would overwrite) hold there: not poison.
const INPUT_BYTE: u8 = 0x3c;

/// One rank's buffers for calls that must be refused: inputs of INPUT_BYTE, out of poison.
struct BadBuffers {
    input: DeviceBuffer<u8>,
    bias: DeviceBuffer<u8>,
    residual: DeviceBuffer<u8>,
    gamma: DeviceBuffer<u8>,
    out: DeviceBuffer<u8>,
}

impl BadBuffers {
    fn new() -> BadBuffers {
        let filled = || DeviceBuffer::from_slice(&vec![INPUT_BYTE; BAD_BYTES]);
        BadBuffers {
            input: filled(),
            bias: filled(),
            residual: filled(),
            gamma: filled(),
            out: DeviceBuffer::new(BAD_BYTES),
        }
    }
}

/// An all-reduce call: byte offsets into the rank's buffers (a pointer `None` is NULL).
#[derive(Clone, Copy, Debug)]
struct BadAllReduce {
    dtype: u32,
    rows: usize,
    hidden: usize,
    input: usize,
    out: usize,
    bias: Option<usize>,
    residual: Option<usize>,
    gamma: Option<usize>,
}

const GOOD_F32: BadAllReduce = BadAllReduce {
    dtype: abi::TPFUSE_DTYPE_F32,
    rows: 2,
    hidden: 64,
    input: 0,
    out: 0,
    bias: Some(0),
    residual: Some(0),
    gamma: Some(0),
};

/// What a collective's call is, for `refused`.
enum BadCall {
    AllReduce(u32, BadAllReduce),
    ReduceScatter(u32, usize, usize, usize),
    AllGather(usize, usize, usize),
}

/// Makes `call` on every rank; what each returned.
fn make(ranks: &Ranks, bufs: &[BadBuffers], call: &BadCall) -> Vec<i32> {
    let at = |b: &DeviceBuffer<u8>, offset: usize| b.ptr().wrapping_add(offset).cast::<c_void>();
    let opt = |b: &DeviceBuffer<u8>, offset: Option<usize>| {
        offset.map_or(std::ptr::null_mut(), |o| at(b, o))
    };
    (0..ranks.world)
        .map(|r| {
            let b = &bufs[r];
            // SAFETY: every pointer lies in a buffer of BAD_BYTES that lives until the checks;
            // the calls are refused (what this asserts), so nothing is read or written.
            unsafe {
                match *call {
                    BadCall::AllReduce(algo, c) => abi::tpfuse_all_reduce(
                        c.dtype as i32,
                        algo as i32,
                        &ranks.peers(),
                        &ranks.args(r),
                        at(&b.input, c.input),
                        opt(&b.bias, c.bias),
                        opt(&b.residual, c.residual),
                        opt(&b.gamma, c.gamma),
                        EPS,
                        at(&b.out, c.out),
                        c.rows,
                        c.hidden,
                        ranks.stream(r),
                    ),
                    BadCall::ReduceScatter(dtype, len, input, out) => abi::tpfuse_reduce_scatter(
                        dtype as i32,
                        &ranks.peers(),
                        &ranks.args(r),
                        at(&b.input, input),
                        at(&b.out, out),
                        len,
                        ranks.stream(r),
                    ),
                    BadCall::AllGather(len, input, out) => abi::tpfuse_all_gather(
                        &ranks.peers(),
                        &ranks.args(r),
                        at(&b.input, input),
                        at(&b.out, out),
                        len,
                        ranks.stream(r),
                    ),
                }
            }
        })
        .collect()
}

/// Makes `call` on both ranks; each must return cudaErrorInvalidValue and launch nothing:
/// after a synchronize, no staging or result byte of any rank, no output and no residual
/// byte changed, and no error word is set.
fn refused(label: &str, ranks: &Ranks, bufs: &[BadBuffers], call: &BadCall) {
    let codes = make(ranks, bufs, call);
    // Whatever was launched runs now, while every buffer lives (a failed assertion would free
    // the buffers before the streams, whose drop waits for their work).
    for s in &ranks.streams {
        s.synchronize().ok();
    }
    for (r, code) in codes.iter().enumerate() {
        assert_eq!(
            *code, INVALID_VALUE,
            "{label}: rank {r} returned {code}, not cudaErrorInvalidValue"
        );
    }
    ranks.synchronize();
    for (r, b) in bufs.iter().enumerate() {
        let untouched = |what: &str, got: Vec<u8>, want: u8| {
            if let Some(i) = got.iter().position(|&x| x != want) {
                panic!(
                    "{label}: rank {r}'s {what} byte {i} is {:#x}, was {want:#x}",
                    got[i]
                );
            }
        };
        untouched("staging and result", ranks.data[r].to_vec(), 0xff);
        untouched("out", b.out.to_vec(), 0xff);
        untouched("residual", b.residual.to_vec(), INPUT_BYTE);
        assert_eq!(ranks.error_word(r), 0, "{label}: rank {r}'s error word");
    }
}

#[test]
fn bad_calls_are_refused_before_anything_is_launched() {
    let _s = session(
        "emu_all_reduce",
        "bad_calls_are_refused_before_anything_is_launched",
    );
    let mut ranks = Ranks::with_capacity(2, 2, 2_000_000, BAD_CAPACITY);
    let bufs: Vec<BadBuffers> = (0..2).map(|_| BadBuffers::new()).collect();
    // A packet area past the pad's half is refused too.
    ranks.packet_bytes = abi::TPFUSE_PACKET_HALF_BYTES as u64 + 16;
    let too_many_packets = make(
        &ranks,
        &bufs,
        &BadCall::AllReduce(abi::TPFUSE_ALGO_ONE_SHOT_PACKETS, GOOD_F32),
    );
    assert_eq!(too_many_packets, [1, 1], "packet_bytes past the half");
    ranks.packet_bytes = abi::TPFUSE_PACKET_HALF_BYTES as u64;
    let f16 = abi::TPFUSE_DTYPE_F16;
    let f32 = abi::TPFUSE_DTYPE_F32;
    for algo in [
        abi::TPFUSE_ALGO_ONE_SHOT,
        abi::TPFUSE_ALGO_ONE_SHOT_PACKETS,
        abi::TPFUSE_ALGO_TWO_SHOT,
    ] {
        // Messages one vector past the staging, first (the old launchers launched them);
        // then pointers 4 and 8 bytes past a 16-byte boundary, one at a time; then rows
        // that bias or gamma cannot be read along in vectors; then sizes whose byte count
        // wraps around (rows * hidden * 4 = 2^64 + 16, and 2^64 exactly).
        let mut calls = vec![
            (
                "one vector past the staging (rows 1)",
                BadAllReduce {
                    rows: 1,
                    hidden: BAD_CAPACITY / 4 + 4,
                    bias: None,
                    residual: None,
                    gamma: None,
                    ..GOOD_F32
                },
            ),
            (
                "one row past the staging (f16)",
                BadAllReduce {
                    dtype: f16,
                    rows: BAD_CAPACITY / 2 / 64 + 1,
                    ..GOOD_F32
                },
            ),
        ];
        for offset in [4, 8] {
            calls.extend([
                (
                    "input misaligned",
                    BadAllReduce {
                        input: offset,
                        ..GOOD_F32
                    },
                ),
                (
                    "out misaligned",
                    BadAllReduce {
                        out: offset,
                        ..GOOD_F32
                    },
                ),
                (
                    "bias misaligned",
                    BadAllReduce {
                        bias: Some(offset),
                        ..GOOD_F32
                    },
                ),
                (
                    "residual misaligned",
                    BadAllReduce {
                        residual: Some(offset),
                        ..GOOD_F32
                    },
                ),
                (
                    "gamma misaligned",
                    BadAllReduce {
                        gamma: Some(offset),
                        ..GOOD_F32
                    },
                ),
            ]);
        }
        calls.extend([
            (
                "gamma, hidden 36 f16",
                BadAllReduce {
                    dtype: f16,
                    hidden: 36,
                    bias: None,
                    residual: None,
                    ..GOOD_F32
                },
            ),
            (
                "bias, hidden 36 f16",
                BadAllReduce {
                    dtype: f16,
                    hidden: 36,
                    residual: None,
                    gamma: None,
                    ..GOOD_F32
                },
            ),
            (
                "bias, hidden 62 f32",
                BadAllReduce {
                    hidden: 62,
                    residual: None,
                    gamma: None,
                    ..GOOD_F32
                },
            ),
            (
                "rows * hidden * 4 = 2^64 + 16",
                BadAllReduce {
                    rows: (1 << 62) + 1,
                    hidden: 4,
                    bias: None,
                    residual: None,
                    gamma: None,
                    ..GOOD_F32
                },
            ),
            (
                "rows * hidden = 2^64",
                BadAllReduce {
                    rows: 1 << 32,
                    hidden: 1 << 32,
                    bias: None,
                    residual: None,
                    gamma: None,
                    ..GOOD_F32
                },
            ),
        ]);
        for (what, c) in calls {
            refused(
                &format!("all-reduce algo {algo}: {what} {c:?}"),
                &ranks,
                &bufs,
                &BadCall::AllReduce(algo, c),
            );
        }
    }
    // Reduce-scatter stages world x len elements: len fits, world x len does not.
    let len = BAD_CAPACITY / 4 / 2 + 4;
    for (what, call) in [
        (
            "world x len one vector past the staging",
            BadCall::ReduceScatter(f32, len, 0, 0),
        ),
        ("input misaligned", BadCall::ReduceScatter(f32, 64, 8, 0)),
        ("out misaligned", BadCall::ReduceScatter(f32, 64, 0, 4)),
        (
            "len not whole vectors",
            BadCall::ReduceScatter(f16, 60, 0, 0),
        ),
        (
            "world x len x 4 = 2^64 + 32",
            BadCall::ReduceScatter(f32, (1 << 61) + 4, 0, 0),
        ),
        ("an unknown dtype", BadCall::ReduceScatter(7, 64, 0, 0)),
    ] {
        refused(&format!("reduce-scatter: {what}"), &ranks, &bufs, &call);
    }
    for (what, call) in [
        (
            "one vector past the staging",
            BadCall::AllGather(BAD_CAPACITY + 16, 0, 0),
        ),
        ("input misaligned", BadCall::AllGather(256, 8, 0)),
        ("out misaligned", BadCall::AllGather(256, 0, 4)),
    ] {
        refused(&format!("all-gather: {what}"), &ranks, &bufs, &call);
    }
    // The control: the well-formed call on the same buffers is launched, and leaves the
    // marks the checks above look for (staged input, written out and residual).
    let codes = make(
        &ranks,
        &bufs,
        &BadCall::AllReduce(abi::TPFUSE_ALGO_ONE_SHOT, GOOD_F32),
    );
    assert_eq!(codes, [0, 0], "the well-formed call");
    ranks.synchronize();
    for (r, b) in bufs.iter().enumerate() {
        assert_eq!(ranks.error_word(r), 0, "the well-formed call: rank {r}");
        let staging = ranks.data[r].to_vec();
        assert!(staging.contains(&INPUT_BYTE), "rank {r}: staged");
        assert!(b.out.to_vec()[..16] != [0xff; 16], "rank {r}: out written");
        assert!(
            b.residual.to_vec()[..16] != [INPUT_BYTE; 16],
            "rank {r}: residual written"
        );
    }
}
