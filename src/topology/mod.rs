//! Topology: what connects the GPUs (from NVML), and the policy that decides which
//! algorithms a set of ranks can use.

mod model;
mod nvml;
mod policy;
mod report;

pub use model::{
    normalize_bus_id, same_bus_id, Ancestor, ComputeCapability, Gpu, GpuPair, LinkRemote, NvLink,
    P2p, P2pStatus, Topology,
};
pub use nvml::{
    architecture_name, cpu_list_from_mask, cuda_ordinals_from_bus_ids, cuda_ordinals_from_env,
    discover, Discovery,
};
pub use policy::{
    assess, assess_places, groups, AllReduceAlgo, AllReduceRule, FusedKernel, FusionRule,
    Interconnect, RankPlace, Refusal, SizeLimits, Verdict,
};
pub use report::render;
