//! The fused GEMM kernels' failures on the CPU emulator (feature `emulator`), through the C
//! ABI, on virtual ranks: a missing rank (a timeout on every survivor, naming it, every output
//! marked failed), ranks that launch different shapes (a mismatch, not wrong data), a flag of
//! a launch long past, and co-residency: every fused launch is cooperative, so a grid past
//! what the device holds is refused before anything runs, and a kernel of another stream
//! holding SMs delays a launch without stranding part of its grid.
#![cfg(feature = "emulator")]

mod common;
use common::assert_same_bits;
use common::emu::{launched, session, session_with, Ranks};
use common::fused::*;
use common::gpu::{base_seed, mix_seed, random_vec, TestElement};
use half::{bf16, f16};
use tpfuse::emulator::{self, abi, DeviceBuffer, Fault};
use tpfuse::ops::gemm::{select_config, GemmShape};
use tpfuse::Element;

/// Every rank's launch counter set to `start` and every flag a fused launch waits for (tile,
/// strip, slice and gather flags, and the started words) set to a launch long past (`stale`
/// launches before the next one), in the pads' layout (tpfuse.h).
fn age_pads(ranks: &mut Ranks, start: u64, stale: u64) {
    let epoch_word = abi::TPFUSE_SIGNAL_FUSED_EPOCH_OFFSET as usize / 4;
    let tiles = (abi::TPFUSE_MAX_FUSED_TILES * abi::TPFUSE_MAX_RANKS) as usize;
    let strips = abi::TPFUSE_MAX_FUSED_TILES as usize;
    let ranks_max = abi::TPFUSE_MAX_RANKS as usize;
    let regions = [
        (abi::TPFUSE_SIGNAL_TILE_FLAGS_OFFSET, tiles),
        (abi::TPFUSE_SIGNAL_STRIP_FLAGS_OFFSET, strips),
        (abi::TPFUSE_SIGNAL_SLICE_FLAGS_OFFSET, ranks_max),
        (abi::TPFUSE_SIGNAL_GATHER_FLAGS_OFFSET, ranks_max),
        (abi::TPFUSE_SIGNAL_STARTED_OFFSET, ranks_max),
    ];
    let old_epoch = (start + 1).wrapping_sub(stale) & ((1 << 40) - 1);
    let flag = old_epoch << 24 | 0x00ab_cdef;
    for pad in ranks.signals.iter_mut() {
        let mut words = pad.to_vec();
        words[epoch_word] = start as u32;
        words[epoch_word + 1] = (start >> 32) as u32;
        for &(offset, count) in &regions {
            let first = offset as usize / 4;
            for f in 0..count {
                words[first + 2 * f] = flag as u32;
                words[first + 2 * f + 1] = (flag >> 32) as u32;
            }
        }
        pad.copy_from(&words);
    }
}

/// Launch counters past 32 bits, and flags left by a launch 2^39 + 7 launches ago (a tile
/// index, strip or slice unused that long): such a flag is not ready (a window of "at or
/// after this launch" would take it for this launch's and read the peer's tile, or the rows,
/// before they are there). The one-shot's 16 rows make one strip whose dealt rows wait for its
/// flag; the two-shot's 18 rows, three slices; then an all-gather + GEMM, which waits for
/// every rank's gather flag.
#[test]
fn a_flag_of_a_long_past_launch_is_not_ready() {
    let _s = session(
        "emu_fused_failures",
        "a_flag_of_a_long_past_launch_is_not_ready",
    );
    let world = 3;
    let mut ranks = Ranks::with_capacity(world, 2, LONG_TIMEOUT_NS, CAPACITY);
    // By flags (packets carry no epoch window: their consumers clear them).
    ranks.packet_bytes = 0;
    age_pads(&mut ranks, (1 << 33) + 5, (1 << 39) + 7);
    let seed = base_seed(0xf05e_0006);
    for (step, (path, m)) in [(Path::Fused, 16), (Path::TwoShot, 18), (Path::Fused, 16)]
        .into_iter()
        .enumerate()
    {
        let p = problem::<bf16>(world, (m, 136, 40), ALL, mix_seed(seed, &[step as u64]));
        let (fused, fused_res) = run(&ranks, &p, path);
        let (unfused, unfused_res) = run(&ranks, &p, Path::Unfused);
        for r in 0..world {
            let at = format!("step {step} ({path:?}, m = {m}) rank {r}");
            assert_same_bits(
                &format!("{at}: out"),
                &fused[r].out.to_vec(),
                &unfused[r].out.to_vec(),
            );
            assert_same_bits(
                &format!("{at}: residual"),
                fused_res[r].as_ref().expect("residual"),
                unfused_res[r].as_ref().expect("residual"),
            );
        }
    }
    // All-gather + GEMM, after the GEMM + all-reduce launches: the same bits as on fresh pads.
    let fresh = Ranks::with_capacity(world, 2, LONG_TIMEOUT_NS, CAPACITY);
    let gathered = |ranks: &Ranks| -> Vec<Vec<bf16>> {
        let (m, n, k) = (6, 136, 40);
        let config = auto_config(m, n, k);
        let seed = mix_seed(seed, &[7]);
        let kept: Vec<_> = (0..world)
            .map(|r| {
                let x = DeviceBuffer::from_slice(&random_vec::<bf16>(
                    mix_seed(seed, &[1, r as u64]),
                    m / world * k,
                    -1.0,
                    1.0,
                ));
                let w = DeviceBuffer::from_slice(&random_vec::<bf16>(
                    mix_seed(seed, &[2, r as u64]),
                    n * k,
                    -0.3,
                    0.3,
                ));
                let out = poisoned::<bf16>(m * n);
                let code =
                    enqueue_all_gather_gemm(config, ranks, r, &x, &w, &None, &out, (m, n, k), 2);
                launched(&format!("all-gather + GEMM rank {r}"), code);
                (x, w, out)
            })
            .collect();
        ranks.synchronize();
        (0..world)
            .map(|r| {
                assert_eq!(ranks.error_word(r), 0, "all-gather + GEMM rank {r}: failed");
                kept[r].2.to_vec()
            })
            .collect()
    };
    let (aged, fresh) = (gathered(&ranks), gathered(&fresh));
    for r in 0..world {
        assert_same_bits(
            &format!("all-gather + GEMM rank {r}: aged pads vs fresh"),
            &aged[r],
            &fresh[r],
        );
    }
}

/// Ranks `0..launching` each launch the fused `p` (a residual and RMSNorm) along `path`, then
/// synchronize: each must report `word` (its error word and the host's copy) and mark `out`
/// and the residual failed, not before the deadline. Returns the residuals and the virtual
/// time the launches took.
fn fused_launches_fail(
    ranks: &Ranks,
    p: &Problem<bf16>,
    path: Path,
    launching: usize,
    word: u32,
) -> (Vec<Option<DeviceBuffer<bf16>>>, u64) {
    let res = residuals(ranks.world, p);
    let start = emulator::now_ns();
    let launches: Vec<Buffers<bf16>> = (0..launching)
        .map(|r| enqueue(ranks, r, p, path, &res[r]))
        .collect();
    for r in 0..launching {
        ranks.streams[r]
            .synchronize()
            .unwrap_or_else(|e| panic!("rank {r}: {e} (the emulator's deadlock report?)"));
    }
    let elapsed = emulator::now_ns() - start;
    let timeout = ranks.timeout_ns;
    assert!(
        elapsed >= timeout,
        "gave up after {elapsed} ns, before the {timeout} ns deadline"
    );
    for (r, b) in launches.iter().enumerate() {
        assert_eq!(ranks.error_word(r), word, "rank {r}: the error word");
        assert_eq!(
            ranks.host_error_word(r),
            word,
            "rank {r}: published to the host"
        );
        assert!(
            b.out.to_vec().iter().all(|x| x.is_failed_output()),
            "rank {r}: out marked failed"
        );
        let residual = res[r].as_ref().expect("residual").to_vec();
        assert!(
            residual.iter().all(|x| x.is_failed_output()),
            "rank {r}: residual marked failed"
        );
    }
    (res, elapsed)
}

/// Co-residency on a device of 2 SMs, 2 virtual ranks. Block b of a rank waits for block b of
/// the other ranks, and the two-shot's blocks for their own rank's slice, so every fused launch
/// is cooperative: a rank's blocks are all resident at once, or the launch is refused before
/// anything runs. At the grid bound (`TpGroup::fused_blocks`: the SMs divided among the ranks,
/// one block a rank here) every path gives the unfused bits. A grid past what the device holds
/// at once (32 blocks a rank; the SM holds 2 or 3 such blocks, by registers and shared memory)
/// is refused with cudaErrorCooperativeLaunchTooLarge on every rank: out keeps its poison and
/// no error word is set (before issue 21 the blocks that fit started, waited for blocks that
/// could not, and every rank timed out).
#[test]
fn on_a_small_device_the_grid_bound_completes_and_a_grid_past_it_is_refused() {
    let _s = session_with(
        "emu_fused_failures",
        "on_a_small_device_the_grid_bound_completes_and_a_grid_past_it_is_refused",
        2,
        60_000_000_000,
    );
    let seed = base_seed(0xf05e_000a);
    case::<bf16>(2, 1, (16, 264, 40), ALL, mix_seed(seed, &[1]));

    let ranks = Ranks::with_capacity(2, 32, 2_000_000, CAPACITY);
    // At least 32 tiles in every configuration (4096 columns: 32 tiles of 128).
    let p = problem::<bf16>(2, (16, 4096, 16), ALL, mix_seed(seed, &[2]));
    let res = residuals(2, &p);
    for path in [Path::Fused, Path::TwoShot] {
        let launches: Vec<(Buffers<bf16>, i32)> = (0..2)
            .map(|r| try_enqueue(&ranks, r, &p, path, &res[r]))
            .collect();
        ranks.synchronize();
        for (r, (b, code)) in launches.iter().enumerate() {
            assert_eq!(
                *code, COOPERATIVE_LAUNCH_TOO_LARGE,
                "{path:?} rank {r}: the launch's code"
            );
            assert!(
                b.out
                    .to_vec()
                    .iter()
                    .all(|x| x.is_nan() && !x.is_failed_output()),
                "{path:?} rank {r}: out keeps its poison (nothing ran)"
            );
            assert_eq!(ranks.error_word(r), 0, "{path:?} rank {r}: the error word");
        }
    }
}

/// `launch` on fresh ranks (2, grids of 8, `timeout`) while another stream's kernel holds 15
/// of the device's 16 SMs for `held_ns`; checks that it did not end before that kernel.
fn while_sms_are_held<R>(
    timeout: u64,
    held_ns: u64,
    what: &str,
    launch: impl FnOnce(&Ranks) -> R,
) -> R {
    let ranks = Ranks::with_capacity(2, 8, timeout, CAPACITY);
    let other = emulator::Stream::new();
    other.occupy_sms(15, held_ns).expect("the other kernel");
    let start = emulator::now_ns();
    let result = launch(&ranks);
    other.synchronize().expect("the other kernel");
    assert!(
        emulator::now_ns() - start >= held_ns,
        "{what}: ran before the other kernel ended"
    );
    result
}

/// Another stream's kernel (an engine's, NCCL's, an MPS neighbour's) holds 15 of the device's
/// 16 SMs for ten times the kernels' deadline while both ranks launch grids of 8 blocks, which
/// the free SM cannot hold. The launches whose blocks wait for one another are cooperative:
/// each starts once all its blocks fit, after that kernel, and gives the bits of the same
/// launch on an idle device. (As plain launches, the blocks that fit started at once and
/// waited for blocks that could not start, past the deadline: a timeout and a poisoned group;
/// issue 21, defect 2.)
#[test]
fn launches_wait_for_the_sms_another_kernel_holds() {
    let _s = session_with(
        "emu_fused_failures",
        "launches_wait_for_the_sms_another_kernel_holds",
        16,
        60_000_000_000,
    );
    let seed = base_seed(0xf05e_000b);
    let timeout = 2_000_000;
    let held_ns = 10 * timeout;
    // 16 tiles of the 16x64 configuration; the one-shot all-reduce of the unfused path takes
    // 4 blocks (one SM each).
    let shape = (16, 1024, 40);
    let p = problem::<bf16>(2, shape, ALL, mix_seed(seed, &[1]));
    for path in [Path::Fused, Path::TwoShot, Path::Unfused] {
        let idle = Ranks::with_capacity(2, 8, timeout, CAPACITY);
        let (expected, expected_res) = run(&idle, &p, path);
        let (got, got_res) = while_sms_are_held(timeout, held_ns, &format!("{path:?}"), |ranks| {
            run(ranks, &p, path)
        });
        for r in 0..2 {
            assert_same_bits(
                &format!("{path:?} rank {r}: out, held vs idle"),
                &got[r].out.to_vec(),
                &expected[r].out.to_vec(),
            );
            if let (Some(g), Some(e)) = (&got_res[r], &expected_res[r]) {
                assert_same_bits(&format!("{path:?} rank {r}: residual, held vs idle"), g, e);
            }
        }
    }
    // All-gather + GEMM: its blocks wait for their own rank's parts.
    let (m, n, k) = shape;
    let xs: Vec<DeviceBuffer<bf16>> = (0..2)
        .map(|r| DeviceBuffer::from_slice(&p.x[r][r * m / 2 * k..(r + 1) * m / 2 * k]))
        .collect();
    let ws: Vec<DeviceBuffer<bf16>> = (0..2).map(|r| DeviceBuffer::from_slice(&p.w[r])).collect();
    let gather = |ranks: &Ranks| -> Vec<Vec<bf16>> {
        let outs: Vec<DeviceBuffer<bf16>> = (0..2)
            .map(|r| {
                let out = poisoned::<bf16>(m * n);
                let config = auto_config(m, n, k);
                let code = enqueue_all_gather_gemm(
                    config, ranks, r, &xs[r], &ws[r], &None, &out, shape, 8,
                );
                launched(&format!("all_gather_gemm rank {r}"), code);
                out
            })
            .collect();
        ranks.synchronize();
        (0..2).for_each(|r| assert_eq!(ranks.error_word(r), 0, "all-gather + GEMM rank {r}"));
        outs.iter().map(DeviceBuffer::to_vec).collect()
    };
    let expected = gather(&Ranks::with_capacity(2, 8, timeout, CAPACITY));
    let got = while_sms_are_held(timeout, held_ns, "all-gather + GEMM", gather);
    for r in 0..2 {
        assert_same_bits(
            &format!("all-gather + GEMM rank {r}: out, held vs idle"),
            &got[r],
            &expected[r],
        );
    }
}

/// A rank that never launches: every survivor times out within its deadline, names the
/// missing rank, publishes the error word and marks out and residual failed.
#[test]
fn a_missing_rank_times_out_and_every_output_is_marked() {
    let _s = session(
        "emu_fused_failures",
        "a_missing_rank_times_out_and_every_output_is_marked",
    );
    let timeout = 2_000_000;
    let world = 3;
    let ranks = Ranks::with_capacity(world, 2, timeout, CAPACITY);
    ranks.streams[2].set_fault(Fault {
        stop: true,
        ..Fault::default()
    });
    let p = problem::<bf16>(world, (5, 136, 40), ALL, base_seed(0xf05e_0004));
    let word = abi::TPFUSE_ERROR_PEER_TIMEOUT | 2;
    let (res, elapsed) = fused_launches_fail(&ranks, &p, Path::Fused, 2, word);
    assert!(
        elapsed <= timeout * 3 / 2,
        "gave up after {elapsed} ns, deadline {timeout} ns"
    );

    // The group is poisoned now: a launch gives up at once and marks its outputs.
    let start = emulator::now_ns();
    let again = enqueue(&ranks, 0, &p, Path::Fused, &res[0]);
    ranks.streams[0].synchronize().expect("rank 0");
    assert!(
        emulator::now_ns() - start < timeout / 10,
        "a poisoned group waited"
    );
    assert!(
        again.out.to_vec().iter().all(|x| x.is_failed_output()),
        "out marked on a poisoned group"
    );
}

/// The two-shot with a rank that never launches names it too. Three tile rows, one per rank's
/// slice, and three blocks per rank: block b computes tile row b only (tile_of_block), so on a
/// survivor the blocks of the other rows consume nothing and wait only for the slice flags,
/// which stall because the survivor's own slice needs the missing rank's tiles. Those waits
/// must not name the survivor (a grid timeout) or a live peer: the tile waits name rank 2.
/// (On a GPU the slice waits could time out first, so they wait twice the deadline; the
/// emulator's schedules, forward, reverse and random, always let the tile wait report
/// first, even with the plain deadline: this checks the outcome, not that race.)
#[test]
fn a_missing_rank_is_named_by_the_two_shot_too() {
    let _s = session(
        "emu_fused_failures",
        "a_missing_rank_is_named_by_the_two_shot_too",
    );
    let (world, n, k) = (3, 136, 40);
    let m = [16, 64, 128]
        .into_iter()
        .map(|bm| 3 * bm)
        .find(|&m| {
            // auto_config's choice, as a GemmConfig.
            let sms = emulator::config().sms as usize;
            let config = select_config(GemmShape { m, n, k }, (9, 0), sms);
            config.is_some_and(|c| 3 * c.info().block_m == m)
        })
        .expect("a shape of three tile rows");
    let timeout = 2_000_000;
    let ranks = Ranks::with_capacity(world, 3, timeout, CAPACITY);
    ranks.streams[2].set_fault(Fault {
        stop: true,
        ..Fault::default()
    });
    let p = problem::<bf16>(world, (m, n, k), ALL, base_seed(0xf05e_000b));
    let word = abi::TPFUSE_ERROR_PEER_TIMEOUT | 2;
    fused_launches_fail(&ranks, &p, Path::TwoShot, 2, word);
}

/// GEMM + reduce-scatter and all-gather + GEMM with a rank that never launches: every
/// survivor times out naming it, and marks its whole output failed (random schedules included:
/// every warp takes the same branch when the wait fails). Also with k split in parallel (6
/// parts of 800 on 32 SMs) in forced 16 x 64 tiles of 3 tile rows, one a rank: all-gather +
/// GEMM starts with the units of its own rank's tile row, so it fails with parts of tiles
/// stored (and folds left to blocks that gave up).
#[test]
fn the_sequence_parallel_kernels_time_out_on_a_missing_rank() {
    let _s = session(
        "emu_fused_failures",
        "the_sequence_parallel_kernels_time_out_on_a_missing_rank",
    );
    let (world, timeout, n) = (3, 2_000_000, 136);
    let cases = [
        (12, 40, None),
        (48, 800, Some(abi::TPFUSE_GEMM_CONFIG_SMALL_16X64 as i32)),
    ];
    for ((m, k, forced), gather) in cases
        .into_iter()
        .flat_map(|case| [(case, false), (case, true)])
    {
        let rows = m / world;
        let ranks = Ranks::with_capacity(world, 2, timeout, CAPACITY);
        ranks.streams[2].set_fault(Fault {
            stop: true,
            ..Fault::default()
        });
        let p = problem::<bf16>(world, (m, n, k), NONE, base_seed(0xf05e_0009));
        let out_len = if gather { m * n } else { rows * n };
        let mut kept = Vec::new();
        for r in 0..2 {
            let x_len = if gather { rows * k } else { m * k };
            let x = DeviceBuffer::from_slice(&p.x[r][..x_len]);
            let w = DeviceBuffer::from_slice(&p.w[r]);
            let out = poisoned::<bf16>(out_len);
            let (peers, args, stream) = (ranks.peers(), ranks.args(r), ranks.stream(r));
            let config = forced.unwrap_or_else(|| auto_config(m, n, k));
            // SAFETY: the buffers hold what the shapes need and are kept until the synchronize.
            let code = unsafe {
                if gather {
                    abi::tpfuse_all_gather_gemm(
                        bf16::DTYPE,
                        config,
                        &peers,
                        &args,
                        2,
                        x.ptr().cast(),
                        w.ptr().cast(),
                        std::ptr::null(),
                        out.ptr().cast(),
                        m,
                        n,
                        k,
                        stream,
                    )
                } else {
                    abi::tpfuse_gemm_reduce_scatter(
                        bf16::DTYPE,
                        config,
                        &peers,
                        &args,
                        2,
                        x.ptr().cast(),
                        w.ptr().cast(),
                        out.ptr().cast(),
                        m,
                        n,
                        k,
                        stream,
                    )
                }
            };
            launched(&format!("gather={gather} k={k} rank {r}"), code);
            kept.push((x, w, out));
        }
        for (r, (_, _, out)) in kept.iter().enumerate() {
            ranks.streams[r]
                .synchronize()
                .unwrap_or_else(|e| panic!("gather={gather} k={k} rank {r}: {e}"));
            let word = abi::TPFUSE_ERROR_PEER_TIMEOUT | 2;
            assert_eq!(
                ranks.error_word(r),
                word,
                "gather={gather} k={k} rank {r}: names rank 2"
            );
            assert_eq!(
                ranks.host_error_word(r),
                word,
                "gather={gather} k={k} rank {r}: published"
            );
            assert!(
                out.to_vec().iter().all(|x| x.is_failed_output()),
                "gather={gather} k={k} rank {r}: out marked"
            );
        }
    }
}

/// Ranks that launch different shapes (here m = 16 and m = 17: other tiles, another
/// configuration), paths or element types get TPFUSE_ERROR_PEER_MISMATCH, and their outputs
/// are marked failed.
#[test]
fn ranks_that_launch_different_shapes_get_a_mismatch() {
    let _s = session(
        "emu_fused_failures",
        "ranks_that_launch_different_shapes_get_a_mismatch",
    );
    // Another m, by packets (packets of other tags) and by flags (flags of other
    // descriptors); the same shape one-shot by packets on rank 0 and two-shot on rank 1
    // (flags); the same shape one-shot, rank 1 offering no packet area (flags against
    // packets); the same shape fused on rank 0, by packets and by flags, and unfused on rank 1
    // (its all-reduce's barrier against a fused kernel: cuda/barrier.cuh, "A rank in a fused
    // kernel").
    for (m1, path1, packets0, packets1) in [
        (17, Path::Fused, true, true),
        (17, Path::Fused, false, false),
        (16, Path::TwoShot, true, true),
        (16, Path::Fused, true, false),
        (16, Path::Unfused, true, true),
        (16, Path::Unfused, false, false),
    ] {
        let mut ranks = Ranks::with_capacity(2, 2, 1_000_000_000, CAPACITY);
        let packet_bytes = ranks.packet_bytes;
        let p0 = problem::<bf16>(2, (16, 72, 40), BIAS_RESIDUAL, base_seed(0xf05e_0005));
        let p1 = problem::<bf16>(2, (m1, 72, 40), BIAS_RESIDUAL, base_seed(0xf05e_0005));
        let (r0, r1) = (residuals(2, &p0), residuals(2, &p1));
        ranks.packet_bytes = if packets0 { packet_bytes } else { 0 };
        let b0 = enqueue(&ranks, 0, &p0, Path::Fused, &r0[0]);
        ranks.packet_bytes = if packets1 { packet_bytes } else { 0 };
        let b1 = enqueue(&ranks, 1, &p1, path1, &r1[1]);
        let case = format!("rank 1 with m {m1} {path1:?} (packets {packets0}, {packets1})");
        let start = emulator::now_ns();
        ranks.synchronize();
        assert!(
            emulator::now_ns() - start < ranks.timeout_ns / 100,
            "{case}: the mismatch was noticed at once"
        );
        for (r, b) in [b0, b1].iter().enumerate() {
            let word = ranks.error_word(r);
            assert_eq!(
                word & 0xff00,
                abi::TPFUSE_ERROR_PEER_MISMATCH,
                "{case}, rank {r}: error word {word:#x}"
            );
            assert!(
                b.out.to_vec().iter().all(|x| x.is_failed_output()),
                "rank {r}: out marked failed"
            );
        }
    }
    // The same shape in f16 on rank 1: f16 and bf16 have one size, the descriptor names the
    // type.
    let ranks = Ranks::with_capacity(2, 2, 1_000_000_000, CAPACITY);
    let seed = base_seed(0xf05e_0005);
    let p0 = problem::<bf16>(2, (16, 72, 40), BIAS_RESIDUAL, seed);
    let p1 = problem::<f16>(2, (16, 72, 40), BIAS_RESIDUAL, seed);
    let (r0, r1) = (residuals(2, &p0), residuals(2, &p1));
    let b0 = enqueue(&ranks, 0, &p0, Path::Fused, &r0[0]);
    let b1 = enqueue(&ranks, 1, &p1, Path::Fused, &r1[1]);
    ranks.synchronize();
    for r in 0..2 {
        let word = ranks.error_word(r);
        assert_eq!(
            word & 0xff00,
            abi::TPFUSE_ERROR_PEER_MISMATCH,
            "f16 against bf16, rank {r}: error word {word:#x}"
        );
    }
    assert!(b0.out.to_vec().iter().all(|x| x.is_failed_output()));
    assert!(b1.out.to_vec().iter().all(|x| x.is_failed_output()));
}

/// All-gather + GEMM against a rank that launched something else: another m, a larger grid (3
/// blocks against 2: another descriptor in its gather flag), f16 elements against bf16 (the
/// same size) and GEMM + reduce-scatter (it publishes no gather flag, and awaits tile flags
/// rank 0 never publishes: a stalled wait finds the other's started flag). Every rank gets
/// TPFUSE_ERROR_PEER_MISMATCH at once, not wrong data or a timeout, and marks its output
/// failed.
#[test]
fn all_gather_gemm_against_another_launch_is_a_mismatch() {
    let _s = session(
        "emu_fused_failures",
        "all_gather_gemm_against_another_launch_is_a_mismatch",
    );
    let (world, n, k) = (2, 136, 40);
    // Rank 1's (m, blocks, all-gather + GEMM or not, f16 or bf16).
    let cases = [
        (4, 2, true, false),
        (2, 3, true, false),
        (2, 2, true, true),
        (2, 2, false, false),
    ];
    for (m1, blocks1, gather1, f16_1) in cases {
        let case =
            format!("rank 1 with m {m1}, {blocks1} blocks, all-gather {gather1}, f16 {f16_1}");
        let ranks = Ranks::with_capacity(world, 3, 1_000_000_000, CAPACITY);
        let p = problem::<bf16>(world, (4, n, k), NONE, base_seed(0xf05e_000c));
        let mut outs = Vec::new();
        let start = emulator::now_ns();
        for r in 0..world {
            let (m, blocks, gather, f16) = if r == 0 {
                (2, 2, true, false)
            } else {
                (m1, blocks1, gather1, f16_1)
            };
            let (x, w) = (&p.x[r][..m * k], &p.w[r]);
            let launch = ((m, n, k), blocks, gather);
            let (code, failed) = if f16 {
                let f16_of = |v: &[bf16]| -> Vec<f16> {
                    v.iter().map(|e| f16::from_f32(e.to_f32())).collect()
                };
                enqueue_sequence_parallel(&ranks, r, launch, &f16_of(x), &f16_of(w))
            } else {
                enqueue_sequence_parallel(&ranks, r, launch, x, w)
            };
            launched(&format!("{case}: rank {r}"), code);
            outs.push(failed);
        }
        ranks.synchronize();
        assert!(
            emulator::now_ns() - start < ranks.timeout_ns / 100,
            "{case}: the mismatch was noticed at once"
        );
        for (r, out) in outs.iter().enumerate() {
            let word = ranks.error_word(r);
            assert_eq!(
                word & 0xff00,
                abi::TPFUSE_ERROR_PEER_MISMATCH,
                "{case}, rank {r}: error word {word:#x}"
            );
            assert!(out(), "{case}, rank {r}: out marked failed");
        }
    }
}

/// Rank `r`'s all-gather + GEMM (`gather`) or GEMM + reduce-scatter of x [m / W or m, k] and w
/// [n, k] on a grid of `blocks`: its code, and whether every element of its out is marked
/// failed (called after the synchronize; it keeps the buffers until then).
fn enqueue_sequence_parallel<T: TestElement>(
    ranks: &Ranks,
    r: usize,
    (shape, blocks, gather): (Shape, i32, bool),
    x: &[T],
    w: &[T],
) -> (i32, Box<dyn Fn() -> bool>) {
    let (m, n, k) = shape;
    let (x, w) = (DeviceBuffer::from_slice(x), DeviceBuffer::from_slice(w));
    let out_len = if gather {
        m * n
    } else {
        m / ranks.signals.len() * n
    };
    let out = poisoned::<T>(out_len);
    let config = auto_config(m, n, k);
    let code = if gather {
        enqueue_all_gather_gemm(config, ranks, r, &x, &w, &None, &out, shape, blocks)
    } else {
        enqueue_gemm_reduce_scatter(ranks, r, (&x, &w, &out), shape, config, blocks)
    };
    let failed = move || {
        let _kept = (&x, &w);
        out.to_vec().iter().all(|e| e.is_failed_output())
    };
    (code, Box::new(failed))
}
