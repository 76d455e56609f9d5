//! Element types: what the kernels compute on, and what NCCL can move.

use crate::ffi::kernels;
use crate::ffi::nccl_sys;
use cudarc::driver::DeviceRepr;
use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
}

/// An element type tpfuse's kernels compute on: `f32`, `f16` or `bf16`, always accumulated
/// in f32.
pub trait Element: sealed::Sealed + DeviceRepr + Copy + Send + Sync + 'static {
    /// The type's name, for messages.
    const NAME: &'static str;
    /// The kernel ABI's tag (`TPFUSE_DTYPE_*` in `cuda/tpfuse.h`).
    #[doc(hidden)]
    const DTYPE: kernels::tpfuse_dtype;
    /// Widens to f64 (for references).
    fn to_f64(self) -> f64;
    /// Widens to f32, exactly.
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type, to nearest even (as the kernels do).
    fn from_f32(x: f32) -> Self;
    /// The value a custom collective writes into every output element it could not
    /// compute (`TPFUSE_FAILED_OUTPUT_BITS16` in every 16 bits: a quiet NaN with a payload
    /// arithmetic never produces), and [`Element::is_failed_output`] recognises.
    fn failed_output() -> Self;
    /// Whether `self` has exactly the bits of [`Element::failed_output`]: an output of a
    /// launch that did not complete (a NaN computed from data is never one).
    fn is_failed_output(self) -> bool;
}

/// A type NCCL can reduce or move: `f32`, `f16`, `bf16`, `f64`, `i32`, `u8`.
pub trait NcclType: sealed::Sealed + DeviceRepr + Copy + Send + Sync + 'static {
    /// The NCCL data type.
    #[doc(hidden)]
    const NCCL: nccl_sys::ncclDataType_t;
}

const FAILED16: u16 = kernels::TPFUSE_FAILED_OUTPUT_BITS16 as u16;
const FAILED32: u32 = (FAILED16 as u32) << 16 | FAILED16 as u32;

macro_rules! element {
    ($t:ty, $name:literal, $tag:expr, $to32:expr, $from32:expr, $failed:expr) => {
        impl Element for $t {
            const NAME: &'static str = $name;
            const DTYPE: kernels::tpfuse_dtype = $tag as kernels::tpfuse_dtype;
            fn to_f64(self) -> f64 {
                f64::from(Element::to_f32(self))
            }
            fn to_f32(self) -> f32 {
                ($to32)(self)
            }
            fn from_f32(x: f32) -> Self {
                ($from32)(x)
            }
            fn failed_output() -> Self {
                <$t>::from_bits($failed)
            }
            fn is_failed_output(self) -> bool {
                self.to_bits() == $failed
            }
        }
    };
}

element!(
    f32,
    "f32",
    kernels::TPFUSE_DTYPE_F32,
    |x| x,
    |x| x,
    FAILED32
);
element!(
    f16,
    "f16",
    kernels::TPFUSE_DTYPE_F16,
    f16::to_f32,
    f16::from_f32,
    FAILED16
);
element!(
    bf16,
    "bf16",
    kernels::TPFUSE_DTYPE_BF16,
    bf16::to_f32,
    bf16::from_f32,
    FAILED16
);

macro_rules! nccl_type {
    ($($t:ty => $tag:ident),* $(,)?) => {
        $(
            impl sealed::Sealed for $t {}
            impl NcclType for $t {
                const NCCL: nccl_sys::ncclDataType_t = nccl_sys::$tag;
            }
        )*
    };
}

nccl_type!(
    f32 => ncclDataType_t_ncclFloat32,
    f16 => ncclDataType_t_ncclFloat16,
    bf16 => ncclDataType_t_ncclBfloat16,
    f64 => ncclDataType_t_ncclFloat64,
    i32 => ncclDataType_t_ncclInt32,
    u8 => ncclDataType_t_ncclUint8,
);

#[cfg(test)]
mod tests {
    use super::*;

    fn failed_is_a_nan_of_its_own<T: Element>(nan: T) {
        let failed = T::failed_output();
        assert!(failed.to_f32().is_nan(), "{}", T::NAME);
        assert!(failed.is_failed_output());
        assert!(!nan.is_failed_output(), "{}: the arithmetic NaN", T::NAME);
        assert!(!T::from_f32(1.0).is_failed_output());
    }

    #[test]
    fn the_failed_output_is_a_nan_arithmetic_does_not_make() {
        failed_is_a_nan_of_its_own(f32::NAN);
        failed_is_a_nan_of_its_own(f16::NAN);
        failed_is_a_nan_of_its_own(bf16::NAN);
        assert_eq!(f32::failed_output().to_bits(), 0xFFD5_FFD5);
        assert_eq!(bf16::failed_output().to_bits(), 0xFFD5);
    }
}
