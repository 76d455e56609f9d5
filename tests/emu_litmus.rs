//! The PTX memory model's litmus tests on the emulator's weak-memory modes
//! (`TPFUSE_EMU_MEMORY=weak|weak-random`, docs/emulator.md "Weak memory"): with the
//! synchronisation the model requires, the forbidden outcome never appears; without it, or at
//! a scope too narrow, the weak modes produce it (or report the narrow scope) within the
//! test's runs. Each shape runs across the blocks of one GPU and across virtual GPUs.

#![cfg(feature = "emulator")]

mod common;

use common::emu::{session, Session};
use tpfuse::emulator::litmus::{self, Placement, Shape, Sync};
use tpfuse::emulator::{Memory, Schedule};

const RUNS: u32 = 200;
const PLACEMENTS: [Placement; 2] = [Placement::Ctas, Placement::Gpus];

/// The outcome the model forbids when the threads synchronise (bit i: register r_i was 1).
fn forbidden(shape: Shape) -> usize {
    match shape {
        Shape::Mp | Shape::CoRr => 0b01, // r0 = 1, r1 = 0
        Shape::Sb => 0b00,               // r0 = r1 = 0
        Shape::Lb => 0b11,               // r0 = r1 = 1
        Shape::Wrc => 0b011,             // r0 = r1 = 1, r2 = 0
        Shape::Iriw => 0b0101,           // r0 = 1, r1 = 0, r2 = 1, r3 = 0
        Shape::KernelBoundary => 0b00,   // unused: the test below checks every outcome
    }
}

fn outcomes(shape: Shape, sync: Sync, placement: Placement, runs: u32) -> [u32; 16] {
    litmus::run(shape, sync, placement, runs)
        .unwrap_or_else(|e| panic!("{shape:?} {sync:?} {placement:?}: {e}"))
}

fn weak_session(test: &'static str, memory: Memory) -> Session {
    session("emu_litmus", test).with_memory(memory)
}

#[test]
fn synchronised_shapes_never_show_the_forbidden_outcome() {
    for memory in [Memory::Weak, Memory::WeakRandom] {
        let _s = weak_session(
            "synchronised_shapes_never_show_the_forbidden_outcome",
            memory,
        );
        for placement in PLACEMENTS {
            for shape in [Shape::Mp, Shape::Sb, Shape::Wrc, Shape::Iriw, Shape::CoRr] {
                let o = outcomes(shape, Sync::Required, placement, RUNS);
                assert_eq!(
                    o[forbidden(shape)],
                    0,
                    "{memory:?} {shape:?} {placement:?}: the forbidden outcome appeared ({o:?})"
                );
                assert_eq!(o.iter().sum::<u32>(), RUNS, "{shape:?}: every run counted");
                // Not vacuous: the readers saw the flag (their bounded waits did not all
                // time out) and, through it, the data.
                if let Some(all_seen) = match shape {
                    Shape::Mp => Some(0b11),
                    Shape::Wrc => Some(0b111),
                    _ => None,
                } {
                    assert!(o[all_seen] > 0, "{memory:?} {shape:?} {placement:?}: {o:?}");
                }
            }
        }
    }
}

#[test]
fn without_synchronisation_the_weak_mode_shows_the_forbidden_outcome() {
    let _s = weak_session(
        "without_synchronisation_the_weak_mode_shows_the_forbidden_outcome",
        Memory::Weak,
    );
    for placement in PLACEMENTS {
        for shape in [Shape::Mp, Shape::Sb, Shape::Wrc] {
            let o = outcomes(shape, Sync::Missing, placement, RUNS);
            assert!(
                o[forbidden(shape)] > 0,
                "{shape:?} {placement:?} without release/acquire or fence: never weak ({o:?})"
            );
        }
    }
}

/// IRIW's readers disagree only when a weak load may read a write its thread has not
/// synchronised with: the random mode, not the oldest-value one. Under the suite's schedule,
/// except the reverse one: it runs every thread in descending order, the readers before the
/// writers, so the readers see no write to disagree about (0 of 30 seeds showed it; every
/// seed of the others does). There the test runs forward.
#[test]
fn iriw_readers_disagree_under_weak_random_loads() {
    let s = weak_session(
        "iriw_readers_disagree_under_weak_random_loads",
        Memory::WeakRandom,
    );
    let _s = match s.schedule() {
        Schedule::Reverse => s.with_schedule(Schedule::Forward),
        _ => s,
    };
    for placement in PLACEMENTS {
        let o = outcomes(Shape::Iriw, Sync::Missing, placement, 1000);
        assert!(o[forbidden(Shape::Iriw)] > 0, "{placement:?}: {o:?}");
    }
}

#[test]
fn an_acquire_of_a_release_at_too_narrow_a_scope_is_reported_with_both_sides() {
    let _s = weak_session(
        "an_acquire_of_a_release_at_too_narrow_a_scope_is_reported_with_both_sides",
        Memory::Weak,
    );
    for (placement, scope) in [(Placement::Ctas, ".cta"), (Placement::Gpus, ".gpu")] {
        let err = litmus::run(Shape::Mp, Sync::NarrowScope, placement, 1)
            .expect_err("an acquire that reads a release of too narrow a scope must fail");
        let msg = err.to_string();
        for needle in ["not morally strong", "a release", scope, "thread 0"] {
            assert!(
                msg.contains(needle),
                "{placement:?}: {msg:?} lacks {needle:?}"
            );
        }
        // The acquire, or the relaxed poll before it, which races the release already.
        assert!(
            msg.contains("an acquire") || msg.contains("a strong load"),
            "{placement:?}: {msg:?} names neither the acquire nor the load"
        );
    }
    // fence.sc at a scope that leaves the other thread out orders nothing.
    for placement in PLACEMENTS {
        let o = outcomes(Shape::Sb, Sync::NarrowScope, placement, RUNS);
        assert!(
            o[forbidden(Shape::Sb)] > 0,
            "SB with narrow fences {placement:?}: {o:?}"
        );
    }
}

/// Limit: a load reads only writes already made (no load buffering): LB's r0 = r1 = 1, which
/// the model allows, never appears (docs/emulator.md).
#[test]
fn load_buffering_is_a_limit_the_emulator_never_shows() {
    for memory in [Memory::Weak, Memory::WeakRandom] {
        let _s = weak_session("load_buffering_is_a_limit_the_emulator_never_shows", memory);
        for placement in PLACEMENTS {
            let o = outcomes(Shape::Lb, Sync::Missing, placement, RUNS);
            assert_eq!(
                o[forbidden(Shape::Lb)],
                0,
                "{memory:?} {placement:?}: {o:?}"
            );
        }
    }
}

/// The sequentially consistent mode cannot show a missing release: why the weak modes exist.
#[test]
fn the_sc_mode_never_shows_message_passing_fail() {
    let _s = weak_session("the_sc_mode_never_shows_message_passing_fail", Memory::Sc);
    for placement in PLACEMENTS {
        let o = outcomes(Shape::Mp, Sync::Missing, placement, RUNS);
        assert_eq!(o[forbidden(Shape::Mp)], 0, "{placement:?}: {o:?}");
    }
}

#[test]
fn a_kernel_boundary_orders_only_what_cuda_orders() {
    // T0's launch writes the low half of a word (lo = 1) and completes; T1's launch, on
    // another stream, starts after it and reads lo, then writes the high half (no race) and lo
    // = 2. Ordered by an event, T1 reads 1 and its write lands last (outcome r0 = 1, r1 = 0).
    // Ordered by nothing (a peer's launch that merely completed earlier), T1 may read the old
    // 0 and T0's write may land after T1's, past T1's own write of the other half: `weak`
    // shows both every time, `weak-random` some of the time.
    let runs = 40;
    for memory in [Memory::Weak, Memory::WeakRandom] {
        let _s = weak_session("a_kernel_boundary_orders_only_what_cuda_orders", memory);
        let ordered = outcomes(Shape::KernelBoundary, Sync::Required, Placement::Gpus, runs);
        assert_eq!(
            ordered[0b01], runs,
            "{memory:?}, ordered by an event: {ordered:?}"
        );
        let unordered = outcomes(Shape::KernelBoundary, Sync::Missing, Placement::Gpus, runs);
        let stale_reads: u32 = (0..16).filter(|k| k & 1 == 0).map(|k| unordered[k]).sum();
        let landed_last: u32 = (0..16).filter(|k| k & 2 != 0).map(|k| unordered[k]).sum();
        if memory == Memory::Weak {
            assert_eq!(
                unordered[0b10], runs,
                "{memory:?}, unordered: {unordered:?}"
            );
        } else {
            assert!(
                stale_reads > 0 && landed_last > 0 && stale_reads < runs && landed_last < runs,
                "{memory:?}, unordered: {unordered:?}"
            );
        }
    }
    let err = litmus::run(Shape::KernelBoundary, Sync::Missing, Placement::Ctas, 1)
        .expect_err("one launch has no kernel boundary");
    assert!(format!("{err}").contains("tpfuse_emu_litmus"), "{err}");
}
