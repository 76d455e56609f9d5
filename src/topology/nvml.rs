//! PLACEHOLDER: filled in by the NVML collection work.
use super::Topology;

/// What NVML could see.
#[derive(Debug)]
pub enum Discovery {
    /// The topology.
    Found(Topology),
    /// No NVML library: no NVIDIA driver on this machine.
    NoDriver,
    /// NVML is there but failed: a broken driver, named.
    Broken(String),
}

/// Reads the topology from NVML.
pub fn discover() -> Discovery {
    Discovery::NoDriver
}
