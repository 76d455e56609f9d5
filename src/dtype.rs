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
}

/// A type NCCL can reduce or move: `f32`, `f16`, `bf16`, `f64`, `i32`, `u8`.
pub trait NcclType: sealed::Sealed + DeviceRepr + Copy + Send + Sync + 'static {
    /// The NCCL data type.
    #[doc(hidden)]
    const NCCL: nccl_sys::ncclDataType_t;
}

macro_rules! element {
    ($t:ty, $name:literal, $tag:expr, $to32:expr, $from32:expr) => {
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
        }
    };
}

element!(f32, "f32", kernels::TPFUSE_DTYPE_F32, |x| x, |x| x);
element!(
    f16,
    "f16",
    kernels::TPFUSE_DTYPE_F16,
    f16::to_f32,
    f16::from_f32
);
element!(
    bf16,
    "bf16",
    kernels::TPFUSE_DTYPE_BF16,
    bf16::to_f32,
    bf16::from_f32
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
