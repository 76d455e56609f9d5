//! Helpers shared by the GPU tests: exact comparison of element bits, and poison values
//! that an output holds before a call so that an element never written fails the check
//! (here); seeds, random data, references, GPU 0 and transfers ([`gpu`]); virtual ranks
//! ([`ranks`]); tests that run their own binary as one child process per rank
//! ([`children`]).
#![allow(dead_code)]

pub mod children;
#[cfg(feature = "emulator")]
pub mod emu;
#[cfg(feature = "emulator")]
pub mod fused;
pub mod gpu;
pub mod graphs;
pub mod ranks;

/// GPU tests, `name => body;` each (doc comments allowed before the name): run on a GPU
/// (`gpu-tests`) or on the CPU emulator (`emulator`), listed as ignored otherwise.
#[macro_export]
macro_rules! gpu_tests {
    ($($(#[$meta:meta])* $name:ident => $body:expr;)*) => {
        $(
            $(#[$meta])*
            #[test]
            #[cfg_attr(
                not(any(feature = "gpu-tests", feature = "emulator")),
                ignore = "needs a CUDA GPU (gpu-tests) or the CPU emulator (emulator)"
            )]
            fn $name() {
                $body
            }
        )*
    };
}

/// GPU tests that do not run on the emulator (NCCL, CUDA IPC between processes, cuBLASLt, or
/// not moved there yet): `"why" => { name => body; ... }`; listed as ignored, with the
/// reason, without the `gpu-tests` feature.
#[macro_export]
macro_rules! gpu_only_tests {
    ($why:literal => { $($(#[$meta:meta])* $name:ident => $body:expr;)* }) => {
        $(
            $(#[$meta])*
            #[test]
            #[cfg_attr(not(feature = "gpu-tests"), ignore = $why)]
            fn $name() {
                $body
            }
        )*
    };
}

/// The clock the kernels' deadlines run on, as time since some fixed start: wall-clock time
/// on a GPU, the emulator's virtual `%globaltimer` under `emulator` (where a CPU runs the
/// kernels far slower than a GPU and the deadlines follow that virtual clock).
pub fn device_clock() -> std::time::Duration {
    #[cfg(feature = "emulator")]
    {
        std::time::Duration::from_nanos(tpfuse::emulator::now_ns())
    }
    #[cfg(not(feature = "emulator"))]
    {
        static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        START.get_or_init(std::time::Instant::now).elapsed()
    }
}

use half::{bf16, f16};

/// Whether the kernels run on the CPU emulator (feature `emulator`), where GPU tests use the
/// reduced shapes of [`shape`].
pub const EMULATED: bool = cfg!(feature = "emulator");

/// Whether a test's copy for element type `T` is a reduced copy: on the emulator, every type
/// but bf16 (the emulator suite checks each type's kernels bit for bit in tests/emu_*.rs; the
/// GPU suite's f16 and f32 copies of the largest matrices would cost most of its time there).
pub fn reduced_copy<T: 'static>() -> bool {
    EMULATED && std::any::TypeId::of::<T>() != std::any::TypeId::of::<bf16>()
}

/// The one knob of shapes: `full` on a GPU, `reduced` on the emulator (its kernels run at
/// tens of millions of operations a second on one core).
pub const fn shape(full: usize, reduced: usize) -> usize {
    if EMULATED {
        reduced
    } else {
        full
    }
}
use std::fmt::Debug;

/// A type whose values the tests compare bit for bit.
pub trait Bits: Copy + Debug {
    /// The bit pattern (NaN-safe, tells -0 from +0).
    fn bits(self) -> u64;
    /// What outputs are filled with before a call: NaN for floats, a value the tests never
    /// generate for integers.
    fn poison() -> Self;
}

macro_rules! bits {
    ($($t:ty => $poison:expr, |$x:ident| $bits:expr);* $(;)?) => {
        $(impl Bits for $t {
            fn bits(self) -> u64 {
                let $x = self;
                $bits
            }
            fn poison() -> Self {
                $poison
            }
        })*
    };
}

bits! {
    f32 => f32::NAN, |x| u64::from(x.to_bits());
    f64 => f64::NAN, |x| x.to_bits();
    f16 => f16::NAN, |x| u64::from(x.to_bits());
    bf16 => bf16::NAN, |x| u64::from(x.to_bits());
    i32 => i32::MIN, |x| u64::from(x as u32);
    u8 => u8::MAX, |x| u64::from(x);
}

/// Asserts `got` has the bits of `want` everywhere; the message counts the elements that
/// differ and how many of them still hold the poison (were never written).
pub fn assert_same_bits<T: Bits>(label: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{label}: length");
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].bits() != want[i].bits())
        .collect();
    if let Some(&i) = bad.first() {
        let poisoned = bad
            .iter()
            .filter(|&&j| got[j].bits() == T::poison().bits())
            .count();
        panic!(
            "{label}: {} of {} elements differ ({poisoned} still hold the poison, i.e. were \
             never written); first at {i}: got {:?} (bits {:#x}), want {:?} (bits {:#x})",
            bad.len(),
            got.len(),
            got[i],
            got[i].bits(),
            want[i],
            want[i].bits()
        );
    }
}
