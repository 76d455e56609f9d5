//! The PTX memory model's litmus tests as kernels on the emulator (`cuda/emu/litmus.cpp`), for
//! the weak-memory modes ([`super::Memory`]): each test's threads run many times and the
//! outcomes are counted.

use super::{emulator_result, sys};
use crate::error::Result;

/// A litmus test (PTX ISA, "Memory Consistency Model"; IRIW and WRC derived from its axioms).
/// Registers r0.. are the values the threads' loads returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Message passing. T0: x = 1; flag = 1. T1: r0 = flag (waits for it); r1 = x.
    Mp,
    /// Store buffering. T0: x = 1; r0 = y. T1: y = 1; r1 = x.
    Sb,
    /// Load buffering. T0: r0 = x; y = 1. T1: r1 = y; x = 1.
    Lb,
    /// Coherence of two strong reads. T0: x = 1. T1: r0 = x; r1 = x.
    CoRr,
    /// Write-to-read causality. T0: x = 1. T1: r0 = x (waits for it); y = 1. T2: r1 = y
    /// (waits for it); r2 = x.
    Wrc,
    /// Independent reads of independent writes. T0: x = 1. T1: y = 1. T2: r0 = x; r1 = y.
    /// T3: r2 = y; r3 = x.
    Iriw,
    /// A kernel boundary: two launches on two streams (placement `Gpus` only), T1's starting
    /// after T0's completed, ordered after it by an event (`Required`) or by nothing
    /// (`Missing`), on the 16-bit halves lo and hi of one word. T0: lo = 1. T1: r0 = lo;
    /// hi = 2; lo = 2. Then r1 = (lo == 1): T0's write landed last.
    KernelBoundary,
}

/// How a test's threads synchronise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sync {
    /// As the model requires to forbid the weak outcome: release and acquire (MP, WRC),
    /// fence.sc (SB; IRIW, with strong loads), at a scope that includes every thread.
    Required,
    /// Relaxed operations and no fences (IRIW: weak loads).
    Missing,
    /// As `Required`, at a scope that does not include the other thread (.cta across
    /// blocks, .gpu across GPUs).
    NarrowScope,
}

/// Where a test's threads run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Each thread a block of one launch on one GPU (the wide scope is .gpu).
    Ctas,
    /// Each thread its own launch on its own virtual GPU (the wide scope is .sys).
    Gpus,
}

/// Runs `shape` `runs` times; element k counts the runs whose registers r_i were non-zero
/// exactly for the bits i of k. A failed launch (the emulator's report of an acquire that
/// read a release of too narrow a scope, say) is the error, with its message.
pub fn run(shape: Shape, sync: Sync, placement: Placement, runs: u32) -> Result<[u32; 16]> {
    let test = match shape {
        Shape::Mp => sys::TPFUSE_EMU_LITMUS_MP,
        Shape::Sb => sys::TPFUSE_EMU_LITMUS_SB,
        Shape::Lb => sys::TPFUSE_EMU_LITMUS_LB,
        Shape::CoRr => sys::TPFUSE_EMU_LITMUS_CORR,
        Shape::Wrc => sys::TPFUSE_EMU_LITMUS_WRC,
        Shape::Iriw => sys::TPFUSE_EMU_LITMUS_IRIW,
        Shape::KernelBoundary => sys::TPFUSE_EMU_LITMUS_KB,
    };
    let variant = match sync {
        Sync::Required => 0,
        Sync::Missing => 1,
        Sync::NarrowScope => 2,
    };
    let placement = match placement {
        Placement::Ctas => 0,
        Placement::Gpus => 1,
    };
    let mut outcomes = [0u32; 16];
    let mut message = vec![0u8; 1024];
    // SAFETY: outcomes holds 16 counters; message is writable for its length.
    let code = unsafe {
        sys::tpfuse_emu_litmus(
            test as i32,
            variant,
            placement,
            runs,
            outcomes.as_mut_ptr(),
            message.as_mut_ptr().cast(),
            message.len(),
        )
    };
    let len = message
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(message.len());
    let message = String::from_utf8_lossy(&message[..len]).into_owned();
    emulator_result("tpfuse_emu_litmus", code, message)?;
    Ok(outcomes)
}
