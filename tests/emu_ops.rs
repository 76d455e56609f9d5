//! The emulator's own operations (feature `emulator`), against vectors written from the PTX
//! ISA's tables here, independently of the emulator's code: the register layout of each
//! fragment is restated below from the ISA's per-element formulas ("Matrix Fragments for
//! mma.m16n8k16 with floating point type", "ldmatrix"), not from cuda/emu/warp.cpp.
//! Also: cp.async group completion, partial-warp collectives, the shared-memory opt-in and a
//! deadlock that names the blocks involved.
#![cfg(feature = "emulator")]

mod common;
use common::emu::{session, session_with};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tpfuse::emulator::{self, probe, Stream};

/// groupID and threadID_in_group of a lane, as the ISA names them.
fn ids(lane: usize) -> (usize, usize) {
    (lane >> 2, lane % 4)
}

/// (row, col) of element a_i (i in 0..8) of lane `lane`'s A fragment: row groupID for
/// a0, a1, a4, a5 and groupID + 8 otherwise; col threadID_in_group * 2 + (i & 1), + 8 for
/// i >= 4. Register j holds a_{2j} (low half) and a_{2j+1}.
fn a_element(lane: usize, i: usize) -> (usize, usize) {
    let (g, t) = ids(lane);
    let row = if i < 2 || (4..6).contains(&i) {
        g
    } else {
        g + 8
    };
    let col = t * 2 + (i & 1) + if i >= 4 { 8 } else { 0 };
    (row, col)
}

/// (k, n) of element b_i (i in 0..4): k = threadID_in_group * 2 + (i & 1), + 8 for i >= 2;
/// n = groupID.
fn b_element(lane: usize, i: usize) -> (usize, usize) {
    let (g, t) = ids(lane);
    (t * 2 + (i & 1) + if i >= 2 { 8 } else { 0 }, g)
}

/// (row, col) of c_i / d_i (i in 0..4): row groupID, + 8 for i >= 2; col
/// threadID_in_group * 2 + (i & 1).
fn c_element(lane: usize, i: usize) -> (usize, usize) {
    let (g, t) = ids(lane);
    (g + if i >= 2 { 8 } else { 0 }, t * 2 + (i & 1))
}

fn mma_case(bf16_inputs: bool, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    // Small integers: exact in f16, bf16 and f32, so every model of the arithmetic that
    // does not lose exact values agrees, and any misplaced element shows.
    let a: Vec<Vec<f32>> = (0..16)
        .map(|_| (0..16).map(|_| rng.random_range(-8..=8) as f32).collect())
        .collect();
    let b: Vec<Vec<f32>> = (0..16)
        .map(|_| (0..8).map(|_| rng.random_range(-8..=8) as f32).collect())
        .collect();
    let c: Vec<Vec<f32>> = (0..16)
        .map(|_| {
            (0..8)
                .map(|_| rng.random_range(-100..=100) as f32)
                .collect()
        })
        .collect();
    let bits = |x: f32| -> u32 {
        if bf16_inputs {
            u32::from(bf16::from_f32(x).to_bits())
        } else {
            u32::from(f16::from_f32(x).to_bits())
        }
    };
    let (mut ra, mut rb, mut rc) = ([0u32; 128], [0u32; 64], [0f32; 128]);
    for lane in 0..32 {
        for j in 0..4 {
            let (r0, c0) = a_element(lane, 2 * j);
            let (r1, c1) = a_element(lane, 2 * j + 1);
            ra[4 * lane + j] = bits(a[r0][c0]) | (bits(a[r1][c1]) << 16);
            let (cr, cc) = c_element(lane, j);
            rc[4 * lane + j] = c[cr][cc];
        }
        for j in 0..2 {
            let (k0, n0) = b_element(lane, 2 * j);
            let (k1, n1) = b_element(lane, 2 * j + 1);
            rb[2 * lane + j] = bits(b[k0][n0]) | (bits(b[k1][n1]) << 16);
        }
    }
    let d = probe::mma(bf16_inputs, &ra, &rb, &rc).expect("mma probe");
    for lane in 0..32 {
        for i in 0..4 {
            let (row, col) = c_element(lane, i);
            let want = c[row][col] + (0..16).map(|k| a[row][k] * b[k][col]).sum::<f32>();
            assert_eq!(
                d[4 * lane + i],
                want,
                "d{i} of lane {lane} (D[{row}][{col}]), bf16={bf16_inputs}, seed {seed}"
            );
        }
    }
}

#[test]
fn mma_m16n8k16_f16_matches_the_isa_fragment_tables() {
    let _s = session(
        "emu_ops",
        "mma_m16n8k16_f16_matches_the_isa_fragment_tables",
    );
    for seed in 0..4 {
        mma_case(false, seed);
    }
}

#[test]
fn mma_m16n8k16_bf16_matches_the_isa_fragment_tables() {
    let _s = session(
        "emu_ops",
        "mma_m16n8k16_bf16_matches_the_isa_fragment_tables",
    );
    for seed in 10..14 {
        mma_case(true, seed);
    }
}

#[test]
fn mma_rounds_once_to_f32() {
    // The emulator's model (docs/emulator.md): exact products, one rounding to f32. Row 0 of
    // A and column 0 of B are 1.0 at k = 0 and 2^-12 elsewhere, C = 0: D[0][0] is exactly
    // 1 + 15 * 2^-24, which rounds once to 1 + 8 * 2^-23 (7.5 ulps, a tie, to even).
    let _s = session("emu_ops", "mma_rounds_once_to_f32");
    let small = f16::from_f32(2f32.powi(-12)).to_bits() as u32;
    let one = f16::from_f32(1.0).to_bits() as u32;
    let (mut ra, mut rb) = ([0u32; 128], [0u32; 64]);
    for lane in 0..32 {
        for j in 0..4 {
            let mut reg = 0u32;
            for h in 0..2 {
                let (row, col) = a_element(lane, 2 * j + h);
                let v = if row == 0 {
                    if col == 0 {
                        one
                    } else {
                        small
                    }
                } else {
                    0
                };
                reg |= v << (16 * h);
            }
            ra[4 * lane + j] = reg;
        }
        for j in 0..2 {
            let mut reg = 0u32;
            for h in 0..2 {
                let (k, n) = b_element(lane, 2 * j + h);
                let v = if n == 0 {
                    if k == 0 {
                        one
                    } else {
                        small
                    }
                } else {
                    0
                };
                reg |= v << (16 * h);
            }
            rb[2 * lane + j] = reg;
        }
    }
    let d = probe::mma(false, &ra, &rb, &[0f32; 128]).expect("mma probe");
    // Lane 0's d0 is D[0][0].
    let exact = 1.0f64 + 15.0 * 2f64.powi(-24);
    assert_eq!(d[0], exact as f32, "D[0][0] is the exact sum rounded once");
    assert_eq!(d[0], 1.0 + 2f32.powi(-20));
    // A chain of f32 additions in k order would give 1.0 (each 2^-24 is a tie lost to even).
    assert_ne!(d[0], 1.0f32);
}

#[test]
fn ldmatrix_x4_gives_each_lane_its_row_and_column_pair() {
    let _s = session(
        "emu_ops",
        "ldmatrix_x4_gives_each_lane_its_row_and_column_pair",
    );
    // Four 8x8 matrices of b16 whose element (m, r, c) holds the id m * 64 + r * 8 + c, rows
    // placed at scattered 16-byte aligned offsets of a 1 KiB shared buffer.
    let mut smem = vec![0xEEu8; 1024];
    let mut addr = [0u32; 32];
    for m in 0..4 {
        for r in 0..8 {
            let slot = (m * 8 + r) * 37 % 64; // a permutation of the 64 row slots
            let at = slot * 16;
            addr[8 * m + r] = at as u32;
            for c in 0..8 {
                let id = (m * 64 + r * 8 + c) as u16;
                smem[at + 2 * c..at + 2 * c + 2].copy_from_slice(&id.to_le_bytes());
            }
        }
    }
    let out = probe::ldmatrix_x4(&smem, &addr).expect("ldmatrix probe");
    for lane in 0..32 {
        for m in 0..4 {
            // Lane l receives row l / 4, columns 2 * (l % 4) and 2 * (l % 4) + 1 of matrix m.
            let (r, c) = (lane / 4, 2 * (lane % 4));
            let want = (m * 64 + r * 8 + c) as u32 | (((m * 64 + r * 8 + c + 1) as u32) << 16);
            assert_eq!(out[4 * lane + m], want, "lane {lane} register {m}");
        }
    }
}

#[test]
fn ldmatrix_rejects_a_misaligned_row_address() {
    let _s = session("emu_ops", "ldmatrix_rejects_a_misaligned_row_address");
    let mut addr = [0u32; 32];
    for (l, a) in addr.iter_mut().enumerate() {
        *a = 16 * l as u32;
    }
    addr[5] += 4;
    let err = probe::ldmatrix_x4(&[0u8; 1024], &addr).expect_err("misaligned ldmatrix must fail");
    assert!(err.to_string().contains("ldmatrix"), "{err}");
}

/// A 16-byte global access (a vector load or store, a cp.async source) off a 16-byte boundary
/// is a misaligned-address fault on a GPU, and a failed launch here (it was accepted before
/// issue 21).
#[test]
fn a_misaligned_16_byte_global_access_fails_the_launch() {
    let _s = session(
        "emu_ops",
        "a_misaligned_16_byte_global_access_fails_the_launch",
    );
    for (kind, what) in [(0, "load"), (1, "store"), (2, "cp.async source")] {
        probe::global_access(kind, 16).unwrap_or_else(|e| panic!("an aligned {what}: {e}"));
        for offset in [4, 8] {
            let err = probe::global_access(kind, offset)
                .expect_err("a misaligned access must fail the launch");
            let text = err.to_string();
            assert!(
                text.contains("716") && text.contains("not 16-byte aligned"),
                "{what} at +{offset}: {text}"
            );
        }
    }
}

/// A write through a plain pointer past a block's dynamic shared memory or past a `__shared__`
/// array (undefined on a GPU: a fault, or another block's shared memory corrupted) fails the
/// launch when the block ends; the last element in range does not.
#[test]
fn a_write_past_shared_memory_fails_the_launch() {
    let _s = session("emu_ops", "a_write_past_shared_memory_fails_the_launch");
    for (kind, len, what) in [
        (0, 64, "dynamic shared memory"),
        (1, 16, "a __shared__ array"),
    ] {
        probe::shared_write(kind, len - 1)
            .unwrap_or_else(|e| panic!("the last byte of {what}: {e}"));
        let err = probe::shared_write(kind, len).expect_err("a write past the end must fail");
        let text = err.to_string();
        assert!(
            text.contains("700") && text.contains("written past"),
            "{what}: {text}"
        );
    }
}

/// The SMs' limits follow the configured architecture (`Config::arch`): an A100 (8.0) lets a
/// block opt in to 163 KiB of shared memory and an H100 (9.0) to 227 KiB; an RTX 3090's SM
/// (8.6) holds 1536 threads, so two blocks of 1024 never share one, where an H100's SM holds
/// both. The device reports the compute capability.
#[test]
fn the_architecture_sets_the_sms_limits() {
    let _s = session_with(
        "emu_ops",
        "the_architecture_sets_the_sms_limits",
        1,
        1_000_000_000,
    );
    let with_arch = |arch: u32| {
        let mut c = emulator::config();
        c.arch = arch;
        emulator::set_config(&c).expect("an idle device takes a configuration");
    };
    with_arch(80);
    probe::smem_launch(32, 163 * 1024, true).expect("163 KiB on an A100");
    probe::smem_launch(32, 200 * 1024, true).expect_err("200 KiB is past an A100's opt-in");
    with_arch(90);
    probe::smem_launch(32, 200 * 1024, true).expect("200 KiB on an H100");
    let stream = emulator::Stream::new();
    probe::wait_for_last_block(2, &stream).expect("two blocks of 1024 threads share an H100's SM");
    with_arch(86);
    let err = probe::wait_for_last_block(2, &stream)
        .expect_err("an RTX 3090's SM holds one block of 1024 threads");
    assert!(err.to_string().contains("not resident"), "{err}");
}

#[test]
fn shfl_xor_reads_the_butterfly_partner() {
    let _s = session("emu_ops", "shfl_xor_reads_the_butterfly_partner");
    let input: [f32; 32] = std::array::from_fn(|l| 100.0 + l as f32);
    for mask in [1, 2, 4, 8, 16, 31] {
        let out = probe::shfl_xor(&input, mask).expect("shfl probe");
        for lane in 0..32 {
            assert_eq!(
                out[lane],
                input[lane ^ mask as usize],
                "lane {lane}, mask {mask}"
            );
        }
    }
}

#[test]
fn cp_async_lands_whole_groups_at_the_wait_that_completes_them() {
    let _s = session(
        "emu_ops",
        "cp_async_lands_whole_groups_at_the_wait_that_completes_them",
    );
    let src: [u8; 48] = std::array::from_fn(|i| i as u8 + 1);
    let [after2, after1, after0] = probe::cp_async(&src).expect("cp.async probe");
    // wait_group 2: of three committed groups only the oldest must be complete.
    assert_eq!(&after2[..16], &src[..16]);
    assert!(after2[16..].iter().all(|&b| b == 0xFF), "{after2:?}");
    // wait_group 1: the two oldest.
    assert_eq!(&after1[..32], &src[..32]);
    assert!(after1[32..].iter().all(|&b| b == 0xFF), "{after1:?}");
    // wait_group 0: all; the third had src-size 0, so it is zero-filled.
    assert_eq!(&after0[..32], &src[..32]);
    assert!(after0[32..].iter().all(|&b| b == 0), "{after0:?}");
}

#[test]
fn a_collective_reached_by_part_of_a_warp_fails_the_launch() {
    let _s = session(
        "emu_ops",
        "a_collective_reached_by_part_of_a_warp_fails_the_launch",
    );
    probe::partial_warp(32).expect("a full warp shuffles");
    let err = probe::partial_warp(16).expect_err("half a warp must fail");
    assert!(err.to_string().contains("16 of 32 lanes"), "{err}");
}

#[test]
fn more_than_48_kib_of_dynamic_shared_memory_needs_the_opt_in() {
    let _s = session(
        "emu_ops",
        "more_than_48_kib_of_dynamic_shared_memory_needs_the_opt_in",
    );
    probe::smem_launch(64, 40 * 1024, false).expect("40 KiB needs no opt-in");
    let err = probe::smem_launch(64, 64 * 1024, false).expect_err("64 KiB without opt-in");
    assert!(
        matches!(err, tpfuse::Error::Emulator { code: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("48 KiB"), "{err}");
    probe::smem_launch(64, 64 * 1024, true).expect("64 KiB with the opt-in");
}

#[test]
fn a_wait_for_a_block_that_cannot_be_resident_is_a_reported_deadlock() {
    // One SM holds two blocks of 1024 threads: with three, blocks 0 and 1 wait (without a
    // deadline) for block 2, which can only start when one of them ends.
    let _s = session_with(
        "emu_ops",
        "a_wait_for_a_block_that_cannot_be_resident_is_a_reported_deadlock",
        1,
        1_000_000,
    );
    let ok = Stream::new();
    probe::wait_for_last_block(2, &ok).expect("two blocks fit together");
    let stream = Stream::new();
    let err = probe::wait_for_last_block(3, &stream).expect_err("must be a deadlock");
    let msg = err.to_string();
    assert!(msg.contains("deadlock"), "{msg}");
    assert!(msg.contains("block 0"), "names the waiting block: {msg}");
    assert!(
        msg.contains("blocks 2..2 not resident"),
        "names the missing block: {msg}"
    );
    // The failure sticks to its stream only.
    assert!(stream.synchronize().is_err());
    probe::wait_for_last_block(2, &Stream::new()).expect("the device still works");
}
