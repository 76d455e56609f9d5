//! Generated bindings and the thin unsafe glue around them. Nothing here is public API.

pub(crate) mod nccl;
pub(crate) mod process_nccl;

#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    unsafe_op_in_unsafe_fn,
    clippy::all,
    missing_docs
)]
pub(crate) mod nccl_sys {
    include!(concat!(env!("OUT_DIR"), "/nccl_bindings.rs"));
}

#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    clippy::all,
    missing_docs
)]
pub mod kernels {
    include!(concat!(env!("OUT_DIR"), "/kernel_bindings.rs"));
}

#[cfg(feature = "emulator")]
#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    clippy::all,
    missing_docs
)]
pub(crate) mod emu {
    include!(concat!(env!("OUT_DIR"), "/emu_bindings.rs"));
}
