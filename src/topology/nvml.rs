//! NVML -> [`Topology`]: what the driver says about the machine's GPUs and their links.
//!
//! [`discover`] is the only function here that touches the driver. Everything it derives
//! (CPU lists from affinity masks, architecture names, CUDA ordinals from bus ids or from
//! `CUDA_VISIBLE_DEVICES`) is a pure function, public so that it can be tested and reused
//! on recorded data.

use super::model::{
    normalize_bus_id, same_bus_id, Ancestor, ComputeCapability, Gpu, GpuPair, LinkRemote, NvLink,
    P2p, P2pStatus, Topology,
};
use cudarc::driver::sys as cu;
use nvml_wrapper::enum_wrappers::device::{
    P2pCapabilitiesIndex, P2pStatus as NvmlP2pStatus, TopologyLevel,
};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use std::ffi::{c_char, c_int, c_ulong, CStr};

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

/// Links NVML can report per GPU (`NVML_NVLINK_MAX_LINKS` in recent `nvml.h`).
const NVLINK_MAX_LINKS: u32 = 18;

/// CPUs the affinity mask is sized for (more than any current machine numbers).
const AFFINITY_MAX_CPUS: usize = 4096;

/// `NVML_DEVICE_ARCH_UNKNOWN`.
const NVML_ARCH_UNKNOWN: u32 = 0xffff_ffff;

/// Reads the topology from NVML.
///
/// - [`Discovery::NoDriver`] when `libnvidia-ml.so.1` cannot be loaded.
/// - [`Discovery::Broken`] when NVML loads but initialising it or enumerating the GPUs fails
///   (the text names the NVML call and gives NVML's message). GPUs whose handle NVML refuses
///   with "no permission" (GPUs fenced off by a cgroup, as under Slurm) are left out rather
///   than failing the whole discovery.
/// - [`Discovery::Found`] otherwise. A GPU whose individual queries fail keeps what could be
///   read: `numa_node: None`, an empty `cpu_affinity`, no links, compute capability 0.0,
///   `memory_bytes: 0`, name "unknown", an empty uuid or bus id. A pair whose P2P status NVML
///   cannot give gets [`P2pStatus::Unknown`]; one whose common ancestor it cannot give gets
///   [`Ancestor::System`] (the most distant, so no policy assumes a closer path).
///
/// CUDA ordinals come from the CUDA driver when it loads: `cuInit`, then the PCI bus id of
/// each ordinal `0..cuDeviceGetCount()` matched to NVML's ([`cuda_ordinals_from_bus_ids`]).
/// This initialises CUDA in the calling process. Without a usable CUDA driver they come from
/// `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER` ([`cuda_ordinals_from_env`], approximate
/// on machines with different GPU models).
pub fn discover() -> Discovery {
    let nvml = match Nvml::init() {
        Ok(nvml) => nvml,
        Err(NvmlError::LibloadingError(_)) => return Discovery::NoDriver,
        Err(e) => return Discovery::Broken(failed("nvmlInit_v2", &e)),
    };
    match collect(&nvml) {
        Ok(topology) => Discovery::Found(topology),
        Err(text) => Discovery::Broken(text),
    }
}

fn failed(call: &str, e: &NvmlError) -> String {
    format!("{call} failed: {e}")
}

/// One GPU as read, before the links' far ends are resolved.
struct Read<'nvml> {
    device: Device<'nvml>,
    gpu: Gpu,
    /// Far-end kind per entry of `gpu.nvlinks`, `None` where NVML could not tell.
    remote_kinds: Vec<Option<LinkRemote>>,
}

fn collect(nvml: &Nvml) -> Result<Topology, String> {
    let count = nvml
        .device_count()
        .map_err(|e| failed("nvmlDeviceGetCount_v2", &e))?;
    let mut read = Vec::with_capacity(count as usize);
    for index in 0..count {
        match nvml.device_by_index(index) {
            Ok(device) => read.push(read_gpu(device, index)),
            Err(NvmlError::NoPermission) => continue,
            Err(e) => {
                return Err(failed(
                    &format!("nvmlDeviceGetHandleByIndex_v2({index})"),
                    &e,
                ))
            }
        }
    }

    // A link whose far-end kind NVML did not give: a GPU if its bus id is one of ours.
    let bus_ids: Vec<String> = read.iter().map(|r| r.gpu.pci_bus_id.clone()).collect();
    for r in &mut read {
        for (link, kind) in r.gpu.nvlinks.iter_mut().zip(&r.remote_kinds) {
            link.remote = kind.unwrap_or_else(|| {
                let is_ours = link.remote_pci_bus_id.as_deref().is_some_and(|remote| {
                    bus_ids
                        .iter()
                        .any(|b| !b.is_empty() && same_bus_id(b, remote))
                });
                if is_ours {
                    LinkRemote::Gpu
                } else {
                    LinkRemote::Other
                }
            });
        }
    }

    let ordinals = cuda_ordinals(&read);
    for (r, ordinal) in read.iter_mut().zip(ordinals) {
        r.gpu.cuda_ordinal = ordinal;
    }

    let mut pairs = Vec::new();
    for (i, x) in read.iter().enumerate() {
        for y in &read[i + 1..] {
            pairs.push(read_pair(nvml, x, y));
        }
    }

    let gpus = read.into_iter().map(|r| r.gpu).collect();
    Ok(Topology {
        hostname: hostname(),
        source: "nvml".to_string(),
        driver_version: nvml.sys_driver_version().ok(),
        cuda_visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        gpus,
        pairs,
    })
}

fn read_gpu(device: Device<'_>, nvml_index: u32) -> Read<'_> {
    let compute_capability = device
        .cuda_compute_capability()
        .map(|cc| ComputeCapability {
            major: u32::try_from(cc.major).unwrap_or(0),
            minor: u32::try_from(cc.minor).unwrap_or(0),
        })
        .unwrap_or(ComputeCapability { major: 0, minor: 0 });
    let arch_code = match device.architecture() {
        Ok(arch) => arch.as_c(),
        // A value newer than nvml-wrapper knows: keep the code.
        Err(NvmlError::UnexpectedVariant(code)) => code,
        Err(_) => NVML_ARCH_UNKNOWN,
    };
    let pci_bus_id = device
        .pci_info()
        .map(|p| normalize_bus_id(&p.bus_id))
        .unwrap_or_default();
    let numa_node = device
        .numa_node_id()
        .ok()
        .or_else(|| sysfs_numa_node(&pci_bus_id));
    let cpu_affinity = device
        .cpu_affinity(AFFINITY_MAX_CPUS.div_ceil(c_ulong::BITS as usize))
        .map(|words| {
            // `c_ulong` is u64 on 64-bit Linux, u32 on 32-bit.
            #[allow(clippy::useless_conversion)]
            let words: Vec<u64> = words.into_iter().map(u64::from).collect();
            cpu_list_from_mask(&words, c_ulong::BITS)
        })
        .unwrap_or_default();
    let (nvlinks, remote_kinds) = read_links(&device);
    let gpu = Gpu {
        nvml_index,
        cuda_ordinal: None,
        name: device.name().unwrap_or_else(|_| "unknown".to_string()),
        uuid: device.uuid().unwrap_or_default(),
        pci_bus_id,
        architecture: architecture_name(arch_code, compute_capability),
        compute_capability,
        memory_bytes: device.memory_info().map(|m| m.total).unwrap_or(0),
        numa_node,
        cpu_affinity,
        nvlinks,
    };
    Read {
        device,
        gpu,
        remote_kinds,
    }
}

/// The GPU's links, `0..NVLINK_MAX_LINKS`, up to the first one NVML says does not exist.
fn read_links(device: &Device<'_>) -> (Vec<NvLink>, Vec<Option<LinkRemote>>) {
    let mut links = Vec::new();
    let mut kinds = Vec::new();
    for link in 0..NVLINK_MAX_LINKS {
        let wrapper = device.link_wrapper_for(link);
        let active = match wrapper.is_active() {
            Ok(active) => active,
            // No NVLink at all, or no link with this number: the list is complete.
            Err(NvmlError::NotSupported | NvmlError::InvalidArg) => break,
            // This link could not be read; the next ones may.
            Err(_) => continue,
        };
        links.push(NvLink {
            link,
            active,
            version: wrapper.version().ok(),
            remote_pci_bus_id: wrapper
                .remote_pci_info()
                .ok()
                .map(|p| normalize_bus_id(&p.bus_id))
                .filter(|b| !b.is_empty()),
            remote: LinkRemote::Other,
        });
        kinds.push(remote_device_type(device, link));
    }
    (links, kinds)
}

/// `nvmlDeviceGetNvLinkRemoteDeviceType`, called directly: nvml-wrapper 0.13's
/// `NvLink::remote_device_type` writes the answer into a temporary and always returns
/// `Unknown`. `None` when the driver lacks the call or it fails.
fn remote_device_type(device: &Device<'_>, link: u32) -> Option<LinkRemote> {
    let f = device
        .nvml()
        .lib()
        .nvmlDeviceGetNvLinkRemoteDeviceType
        .as_ref()
        .ok()?;
    let mut kind: u32 = 255; // NVML_NVLINK_DEVICE_TYPE_UNKNOWN
                             // SAFETY: the handle is valid while `device` (and the `Nvml` it borrows) lives; the
                             // symbol has the signature of nvml.h, `(nvmlDevice_t, unsigned int,
                             // nvmlIntNvLinkDeviceType_t *)`, and writes one unsigned int through the pointer.
    let code = unsafe { (*f)(device.handle(), link, &mut kind) };
    if code != 0 {
        return None;
    }
    Some(match kind {
        0 => LinkRemote::Gpu,      // NVML_NVLINK_DEVICE_TYPE_GPU
        2 => LinkRemote::NvSwitch, // NVML_NVLINK_DEVICE_TYPE_SWITCH
        _ => LinkRemote::Other,    // IBM NPU, unknown
    })
}

fn read_pair(nvml: &Nvml, x: &Read<'_>, y: &Read<'_>) -> GpuPair {
    let p2p = |index| match x.device.p2p_status(&y.device, index) {
        Ok(status) => p2p_status(status),
        Err(_) => P2pStatus::Unknown,
    };
    // nvml-wrapper takes the other device by value: a second handle to it.
    let common_ancestor = nvml
        .device_by_index(y.gpu.nvml_index)
        .and_then(|other| x.device.topology_common_ancestor(other))
        .map(ancestor)
        .unwrap_or(Ancestor::System);
    GpuPair {
        a: x.gpu.nvml_index,
        b: y.gpu.nvml_index,
        p2p: P2p {
            read: p2p(P2pCapabilitiesIndex::Read),
            write: p2p(P2pCapabilitiesIndex::Write),
            atomics: p2p(P2pCapabilitiesIndex::Atomics),
            nvlink: p2p(P2pCapabilitiesIndex::NvLink),
        },
        common_ancestor,
    }
}

fn p2p_status(status: NvmlP2pStatus) -> P2pStatus {
    match status {
        NvmlP2pStatus::Ok => P2pStatus::Ok,
        NvmlP2pStatus::ChipsetNotSupported => P2pStatus::ChipsetNotSupported,
        NvmlP2pStatus::GpuNotSupported => P2pStatus::GpuNotSupported,
        NvmlP2pStatus::IohTopologyNotSupported => P2pStatus::IohTopologyNotSupported,
        NvmlP2pStatus::DisabledByRegkey => P2pStatus::DisabledByRegkey,
        NvmlP2pStatus::NotSupported => P2pStatus::NotSupported,
        NvmlP2pStatus::Unknown => P2pStatus::Unknown,
    }
}

fn ancestor(level: TopologyLevel) -> Ancestor {
    match level {
        TopologyLevel::Internal => Ancestor::Board,
        TopologyLevel::Single => Ancestor::PcieSwitch,
        TopologyLevel::Multiple => Ancestor::PcieSwitches,
        TopologyLevel::HostBridge => Ancestor::HostBridge,
        TopologyLevel::Node => Ancestor::NumaNode,
        TopologyLevel::System => Ancestor::System,
    }
}

/// The CUDA ordinal of each read GPU: from the CUDA driver when it answers, else from the
/// environment.
fn cuda_ordinals(read: &[Read<'_>]) -> Vec<Option<u32>> {
    let bus_ids: Vec<&str> = read.iter().map(|r| r.gpu.pci_bus_id.as_str()).collect();
    if let Ok(cuda_ids) = cuda_bus_ids() {
        let cuda_ids: Vec<&str> = cuda_ids.iter().map(String::as_str).collect();
        return cuda_ordinals_from_bus_ids(&cuda_ids, &bus_ids);
    }
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let order = std::env::var("CUDA_DEVICE_ORDER").ok();
    let gpus: Vec<(u32, &str, &str)> = read
        .iter()
        .map(|r| {
            (
                r.gpu.nvml_index,
                r.gpu.uuid.as_str(),
                r.gpu.pci_bus_id.as_str(),
            )
        })
        .collect();
    cuda_ordinals_from_env(visible.as_deref(), order.as_deref(), &gpus)
}

/// The PCI bus id of every CUDA ordinal of this process, in ordinal order.
fn cuda_bus_ids() -> Result<Vec<String>, String> {
    crate::device::require_driver().map_err(|e| e.to_string())?;
    // SAFETY: the driver library loads (checked above); cuInit takes flags that must be 0.
    let code = unsafe { cu::cuInit(0) };
    if code == cu::CUresult::CUDA_ERROR_NO_DEVICE {
        // Nothing visible to CUDA (CUDA_VISIBLE_DEVICES="" or "-1", say): every GPU hidden.
        return Ok(Vec::new());
    }
    code.result().map_err(|e| format!("cuInit failed: {e}"))?;
    let mut count: c_int = 0;
    // SAFETY: CUDA is initialised; the call writes one int.
    unsafe { cu::cuDeviceGetCount(&mut count) }
        .result()
        .map_err(|e| format!("cuDeviceGetCount failed: {e}"))?;
    let mut ids = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
    for ordinal in 0..count {
        let mut device: cu::CUdevice = 0;
        // SAFETY: CUDA is initialised, `ordinal` is below the count; writes one CUdevice.
        unsafe { cu::cuDeviceGet(&mut device, ordinal) }
            .result()
            .map_err(|e| format!("cuDeviceGet({ordinal}) failed: {e}"))?;
        let mut buf: [c_char; 64] = [0; 64];
        // SAFETY: the driver writes at most `len` bytes, NUL included, into `buf`.
        unsafe { cu::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as c_int, device) }
            .result()
            .map_err(|e| format!("cuDeviceGetPCIBusId({ordinal}) failed: {e}"))?;
        let bytes: Vec<u8> = buf
            .iter()
            .map(|&c| u8::from_ne_bytes(c.to_ne_bytes()))
            .collect();
        let id = CStr::from_bytes_until_nul(&bytes)
            .map_err(|_| format!("cuDeviceGetPCIBusId({ordinal}) returned no terminated string"))?;
        ids.push(id.to_string_lossy().into_owned());
    }
    Ok(ids)
}

/// Matches CUDA's devices to NVML's GPUs by PCI bus id.
///
/// `cuda_bus_ids[o]` is the bus id of CUDA ordinal `o` (as `cuDeviceGetPCIBusId` writes it,
/// "0000:18:00.0"); `gpu_bus_ids` are the GPUs' bus ids in any form [`same_bus_id`]
/// accepts. Returns, per GPU, the first ordinal on the same bus, `None` for a GPU CUDA does
/// not show (or whose bus id is empty).
pub fn cuda_ordinals_from_bus_ids(cuda_bus_ids: &[&str], gpu_bus_ids: &[&str]) -> Vec<Option<u32>> {
    gpu_bus_ids
        .iter()
        .map(|gpu| {
            if gpu.trim().is_empty() {
                return None;
            }
            cuda_bus_ids
                .iter()
                .position(|cuda| same_bus_id(cuda, gpu))
                .and_then(|o| u32::try_from(o).ok())
        })
        .collect()
}

/// The CUDA ordinal of each GPU as `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER` make it,
/// without asking the CUDA driver (the fallback of [`discover`]).
///
/// `gpus` holds `(nvml_index, uuid, pci_bus_id)` per GPU; the result has one entry per GPU,
/// in the same order: its ordinal, or `None` when it is hidden. `visible` and `order` are the
/// values of the two variables (`None` when unset).
///
/// The rules are CUDA's:
/// - `visible` unset: every GPU, in enumeration order.
/// - Otherwise a comma-separated list; the n-th valid entry becomes ordinal n. An entry is a
///   decimal index into the enumeration order or `GPU-` followed by a prefix of a GPU's UUID
///   that no other GPU's UUID shares (case-insensitive). Whitespace around an entry is
///   ignored.
/// - Parsing stops at the first entry that is invalid: empty, not a number, an index past the
///   last GPU, a negative index (`-1` hides everything), an unknown or ambiguous UUID prefix,
///   a `MIG-` entry (MIG instances are not resolved here), or a GPU already listed. That entry
///   and every later one are dropped, so an empty string hides every GPU.
///
/// The enumeration order is PCI bus order (ties and empty bus ids broken by NVML index, empty
/// bus ids last). That is exact with `CUDA_DEVICE_ORDER=PCI_BUS_ID`. With the default,
/// `FASTEST_FIRST`, CUDA puts faster GPUs first and this function assumes all the GPUs are
/// equally fast, so that PCI order applies; on a machine with different GPU models the
/// result is approximate. [`discover`] uses the CUDA driver instead whenever it can.
pub fn cuda_ordinals_from_env(
    visible: Option<&str>,
    order: Option<&str>,
    gpus: &[(u32, &str, &str)],
) -> Vec<Option<u32>> {
    // PCI_BUS_ID and FASTEST_FIRST (for identical GPUs) both come out in PCI bus order.
    let _ = order;
    let mut enumeration: Vec<usize> = (0..gpus.len()).collect();
    enumeration.sort_by_key(|&i| {
        let (nvml_index, _, bus) = gpus[i];
        let bus = normalize_bus_id(bus);
        (bus.is_empty(), bus, nvml_index)
    });

    let mut ordinals = vec![None; gpus.len()];
    let Some(visible) = visible else {
        for (ordinal, &i) in (0u32..).zip(&enumeration) {
            ordinals[i] = Some(ordinal);
        }
        return ordinals;
    };
    for (next, entry) in (0u32..).zip(visible.split(',')) {
        let Some(i) = visible_entry(entry.trim(), gpus, &enumeration) else {
            break;
        };
        if ordinals[i].is_some() {
            break;
        }
        ordinals[i] = Some(next);
    }
    ordinals
}

/// The position in `gpus` that one `CUDA_VISIBLE_DEVICES` entry names, `None` if invalid.
fn visible_entry(entry: &str, gpus: &[(u32, &str, &str)], enumeration: &[usize]) -> Option<usize> {
    if !entry.is_empty() && entry.bytes().all(|b| b.is_ascii_digit()) {
        let index: usize = entry.parse().ok()?;
        return enumeration.get(index).copied();
    }
    let prefix = strip_prefix_ignore_case(entry, "GPU-")?.to_ascii_lowercase();
    if prefix.is_empty() {
        return None;
    }
    let mut matches = gpus.iter().enumerate().filter(|(_, (_, uuid, _))| {
        strip_prefix_ignore_case(uuid, "GPU-")
            .is_some_and(|u| u.to_ascii_lowercase().starts_with(&prefix))
    });
    match (matches.next(), matches.next()) {
        (Some((i, _)), None) => Some(i),
        _ => None,
    }
}

fn strip_prefix_ignore_case<'s>(s: &'s str, prefix: &str) -> Option<&'s str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

/// A CPU bitmask as a Linux cpu list: bit `b` of `words[w]` is CPU `w * word_bits + b`;
/// runs of CPUs become ranges. `[0xff, 0]` with 64-bit words is "0-7", `[0b1011]` is
/// "0-1,3", no bit set is "".
///
/// `word_bits` is the width of the words the mask was written in (64 for NVML's
/// `unsigned long` on 64-bit Linux), clamped to `1..=64`; bits above it are ignored.
pub fn cpu_list_from_mask(words: &[u64], word_bits: u32) -> String {
    let bits = word_bits.clamp(1, 64);
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for (w, &word) in (0u64..).zip(words) {
        for b in 0..bits {
            if (word >> b) & 1 == 0 {
                continue;
            }
            let cpu = w * u64::from(bits) + u64::from(b);
            match ranges.last_mut() {
                Some((_, last)) if *last + 1 == cpu => *last = cpu,
                _ => ranges.push((cpu, cpu)),
            }
        }
    }
    ranges
        .iter()
        .map(|&(first, last)| {
            if first == last {
                first.to_string()
            } else {
                format!("{first}-{last}")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The architecture name of an NVML architecture code (`nvmlDeviceArchitecture_t`: 7 is
/// "Ampere", 8 "Ada", 9 "Hopper", 10 "Blackwell", ...). For a code this table does not know
/// (`NVML_DEVICE_ARCH_UNKNOWN`, or one newer than it), the name comes from the compute
/// capability (9.0 is "Hopper", 10.0 and 12.0 "Blackwell", ...); failing that it is
/// "Unknown", with the code when there is one.
pub fn architecture_name(nvml_code: u32, compute_capability: ComputeCapability) -> String {
    let name = match nvml_code {
        2 => "Kepler",
        3 => "Maxwell",
        4 => "Pascal",
        5 => "Volta",
        6 => "Turing",
        7 => "Ampere",
        8 => "Ada",
        9 => "Hopper",
        10 => "Blackwell",
        11 => "Orin",
        _ => match (compute_capability.major, compute_capability.minor) {
            (3, _) => "Kepler",
            (5, _) => "Maxwell",
            (6, _) => "Pascal",
            (7, 0..=4) => "Volta",
            (7, _) => "Turing",
            (8, 9) => "Ada",
            (8, _) => "Ampere",
            (9, _) => "Hopper",
            (10..=12, _) => "Blackwell",
            _ if nvml_code == NVML_ARCH_UNKNOWN => "Unknown",
            _ => return format!("Unknown (NVML architecture {nvml_code})"),
        },
    };
    name.to_string()
}

/// NUMA node of a PCI device from sysfs, for drivers whose NVML does not say. `None` when
/// the file is missing or says -1 (no NUMA).
fn sysfs_numa_node(nvml_bus_id: &str) -> Option<u32> {
    let path = format!(
        "/sys/bus/pci/devices/{}/numa_node",
        sysfs_bus_id(nvml_bus_id)?
    );
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// "00000000:18:00.0" -> "0000:18:00.0" (sysfs writes the domain with 4 digits or more).
fn sysfs_bus_id(nvml_bus_id: &str) -> Option<String> {
    let normalized = normalize_bus_id(nvml_bus_id);
    let (domain, rest) = normalized.split_once(':')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    Some(format!("{domain:04x}:{rest}"))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::env::var("HOSTNAME")
                .ok()
                .map(|h| h.trim().to_string())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| "unknown".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysfs_bus_ids_have_four_domain_digits() {
        assert_eq!(
            sysfs_bus_id("00000000:18:00.0").as_deref(),
            Some("0000:18:00.0")
        );
        assert_eq!(
            sysfs_bus_id("0001:AB:00.0").as_deref(),
            Some("0001:ab:00.0")
        );
        assert_eq!(
            sysfs_bus_id("00010000:18:00.0").as_deref(),
            Some("10000:18:00.0")
        );
        assert_eq!(sysfs_bus_id(""), None);
    }

    #[test]
    fn ancestors_map_nearest_first() {
        let levels = [
            TopologyLevel::Internal,
            TopologyLevel::Single,
            TopologyLevel::Multiple,
            TopologyLevel::HostBridge,
            TopologyLevel::Node,
            TopologyLevel::System,
        ];
        let mapped: Vec<Ancestor> = levels.into_iter().map(ancestor).collect();
        let mut sorted = mapped.clone();
        sorted.sort();
        assert_eq!(mapped, sorted);
        assert_eq!(mapped[0], Ancestor::Board);
        assert_eq!(mapped[5], Ancestor::System);
    }

    #[test]
    fn hostname_is_never_empty() {
        assert!(!hostname().is_empty());
    }
}
