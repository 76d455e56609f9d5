//! What `TpGroup` and the symmetric workspace decide without a GPU: the CTA budget, option
//! and argument validation (which comes before any driver call), and the no-driver error.
//!
//! `TpGroup::virtual_ranks` and `TpGroup::from_comm` take a CUDA context or an NCCL
//! communicator, neither of which exists without a driver, so only `single_process` can be
//! called here; the other two are covered by tests/gpu_group.rs.

use std::time::Duration;
use tpfuse::group::{cta_budget, MAX_BLOCKS, MAX_WORLD, PACKET_HALF_BYTES};
use tpfuse::symmetric::{round_capacity, CAPACITY_ALIGN, MAX_RANKS, SIGNAL_PAD_BYTES};
use tpfuse::{Error, GroupOptions, TpGroup};

fn assert_invalid<T: std::fmt::Debug>(r: tpfuse::Result<T>, arg: &str, words: &[&str]) {
    match r {
        Err(Error::InvalidArgument { arg: got, reason }) => {
            assert_eq!(got, arg, "wrong argument named: {reason}");
            for w in words {
                assert!(reason.contains(w), "`{w}` missing from: {reason}");
            }
        }
        other => panic!("expected InvalidArgument({arg}), got {other:?}"),
    }
}

#[test]
fn the_cta_budget_fits_every_virtual_rank_on_the_device() {
    for sms in [1usize, 2, 16, 78, 108, 114, 132, 144, 148, 1000] {
        for world in 2..=MAX_WORLD {
            let b = cta_budget(sms, world, true);
            assert!(
                (1..=MAX_BLOCKS).contains(&b),
                "sms {sms}, world {world}: {b}"
            );
            if sms >= world {
                assert!(b * world <= sms, "sms {sms}, world {world}: {b} blocks");
            } else {
                assert_eq!(b, 1);
            }
        }
    }
    assert_eq!(cta_budget(132, 2, true), 64);
    assert_eq!(cta_budget(132, 4, true), 33);
    assert_eq!(cta_budget(132, 8, true), 16);
    assert_eq!(cta_budget(108, 8, true), 13);
}

#[test]
fn the_cta_budget_of_a_real_group_is_half_the_gpu_capped() {
    assert_eq!(cta_budget(132, 8, false), 64);
    assert_eq!(cta_budget(108, 2, false), 54);
    assert_eq!(cta_budget(46, 4, false), 23);
    assert_eq!(cta_budget(1, 2, false), 1);
    // Independent of the world size: every rank derives the same value from the SM count.
    for world in 2..=MAX_WORLD {
        assert_eq!(cta_budget(80, world, false), 40);
    }
}

#[test]
fn the_default_options_are_8_mib_10_s_and_the_budget() {
    let o = GroupOptions::default();
    assert_eq!(o.capacity_bytes, 8 << 20);
    assert_eq!(o.timeout, Duration::from_secs(10));
    assert_eq!(o.blocks, None);
    o.validate().unwrap();
}

#[test]
fn invalid_options_name_the_field() {
    let bad = |f: fn(&mut GroupOptions)| {
        let mut o = GroupOptions::default();
        f(&mut o);
        o.validate()
    };
    assert_invalid(
        bad(|o| o.capacity_bytes = 0),
        "options.capacity_bytes",
        &["0 bytes"],
    );
    assert_invalid(
        bad(|o| o.capacity_bytes = usize::MAX),
        "options.capacity_bytes",
        &[],
    );
    assert_invalid(
        bad(|o| o.timeout = Duration::ZERO),
        "options.timeout",
        &["positive"],
    );
    assert_invalid(
        bad(|o| o.timeout = Duration::MAX),
        "options.timeout",
        &["64-bit"],
    );
    assert_invalid(bad(|o| o.blocks = Some(0)), "options.blocks", &["1 to 64"]);
    assert_invalid(bad(|o| o.blocks = Some(65)), "options.blocks", &["65"]);
    assert_invalid(
        bad(|o| o.fused_blocks_per_sm = Some(0)),
        "options.fused_blocks_per_sm",
        &["0", "1 to 32"],
    );
    assert_invalid(
        bad(|o| o.fused_blocks_per_sm = Some(33)),
        "options.fused_blocks_per_sm",
        &["33", "1 to 32"],
    );
    for b in [1, 16, 64] {
        let o = GroupOptions {
            blocks: Some(b),
            ..GroupOptions::default()
        };
        o.validate().unwrap();
    }
    let o = GroupOptions {
        capacity_bytes: 1,
        timeout: Duration::from_nanos(1),
        blocks: None,
        fused_blocks_per_sm: Some(1),
        fused_packets: false,
        all_reduce_packets: true,
    };
    o.validate().unwrap();
}

#[test]
fn capacities_round_up_to_the_alignment() {
    assert_eq!(CAPACITY_ALIGN, 256);
    assert_eq!(round_capacity(0), None);
    assert_eq!(round_capacity(1), Some(256));
    assert_eq!(round_capacity(1000), Some(1024));
    assert_eq!(round_capacity(8 << 20), Some(8 << 20));
    assert_eq!(round_capacity(usize::MAX), None);
}

#[test]
fn the_abi_limits_are_the_headers() {
    assert_eq!(MAX_RANKS, 8);
    assert_eq!(MAX_WORLD, 8);
    assert_eq!(MAX_BLOCKS, 64);
    // flags[64][8] + counters[64] (u32 each) + 256 bytes for the error word and the rank's
    // grid barrier + descriptors[64][8] + 256 bytes for the fused kernel's epoch and end
    // count + strip_counts[4096] (u32) + tile_flags[4096][8] (u64) + strip_flags[4096] (u64)
    // + the fused blocks' phase records [1024][9] (u64) + part_counts[4096] (u32), then, at
    // the next multiple of 256 (already one), 256 bytes of started flags and the packet area's
    // two halves.
    assert_eq!(PACKET_HALF_BYTES, 1 << 20);
    assert_eq!(
        SIGNAL_PAD_BYTES,
        4 * 64 * 8
            + 4 * 64
            + 256
            + 4 * 64 * 8
            + 256
            + 4 * 4096
            + 8 * 4096 * 8
            + 8 * 4096
            + 8 * 1024 * 9
            + 4 * 4096
            + 256
            + 2 * PACKET_HALF_BYTES
    );
}

#[test]
fn single_process_checks_its_arguments_before_the_driver() {
    let opts = GroupOptions::default;
    assert_invalid(
        TpGroup::single_process(&[], opts()),
        "ordinals",
        &["world size 0"],
    );
    assert_invalid(
        TpGroup::single_process(&[0], opts()),
        "ordinals",
        &["world size 1", "2 to 8"],
    );
    let nine: Vec<usize> = (0..9).collect();
    assert_invalid(
        TpGroup::single_process(&nine, opts()),
        "ordinals",
        &["world size 9"],
    );
    assert_invalid(
        TpGroup::single_process(&[0, 1, 0], opts()),
        "ordinals",
        &["device 0", "ranks 0 and 2"],
    );
    let bad = GroupOptions {
        blocks: Some(100),
        ..GroupOptions::default()
    };
    assert_invalid(TpGroup::single_process(&[0, 1], bad), "options.blocks", &[]);
}

#[test]
#[cfg_attr(
    any(feature = "gpu-tests", feature = "emulator"),
    ignore = "asserts the behaviour without a driver (the emulator is one)"
)]
fn single_process_without_a_driver_says_so() {
    match TpGroup::single_process(&[0, 1], GroupOptions::default()) {
        Err(Error::NoCudaDriver) => {}
        other => panic!("expected NoCudaDriver, got {other:?}"),
    }
}

#[test]
fn a_group_can_move_to_another_thread() {
    fn assert_send<T: Send>() {}
    assert_send::<TpGroup>();
    assert_send::<tpfuse::symmetric::SymmetricWorkspace>();
}
