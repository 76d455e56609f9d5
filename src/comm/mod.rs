//! Communicators: the safe NCCL [`Comm`] and the [`bootstrap`] that carries its unique id
//! to every rank.

pub mod bootstrap;
mod collectives;
mod communicator;
mod unique_id;

pub use collectives::ReduceOp;
pub use communicator::{group, nccl_info, Comm, CommOptions, NcclInfo};
pub use unique_id::{UniqueId, UNIQUE_ID_BYTES};
