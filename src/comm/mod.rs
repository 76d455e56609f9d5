//! Communicators: the safe NCCL [`Comm`] and the [`bootstrap`] that carries its unique id
//! to every rank.

pub mod bootstrap;
mod call_lock;
mod collectives;
mod communicator;
mod group;
mod unique_id;

pub use collectives::ReduceOp;
pub use communicator::{nccl_info, Comm, CommOptions, NcclInfo};
pub use group::group;
pub use unique_id::{UniqueId, UNIQUE_ID_BYTES};
