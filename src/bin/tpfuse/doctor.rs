//! `tpfuse doctor`: the first command to run on a new machine.
//!
//! Gathers the facts once (build, NCCL, CUDA driver, NVML topology) and prints them for
//! people or, with `--json`, for machines. Exits 0 whatever the machine lacks: saying what is
//! missing is its job. A `--topology` file that cannot be read is a usage error (exit 2). A
//! reader that goes away early (`tpfuse doctor | head -3`) ends the report quietly.

use serde_json::{json, Value};
use std::io::{self, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use tpfuse::build_info::{self, KernelResources};
use tpfuse::comm::{nccl_info, NcclInfo, UniqueId};
use tpfuse::topology::{self, Discovery, Topology};

/// The command line of `tpfuse doctor`.
pub struct Options {
    build_report: bool,
    json: bool,
    topology_file: Option<PathBuf>,
}

impl Options {
    /// Parses the arguments after `doctor`.
    pub fn parse(args: &[&str]) -> Result<Options, String> {
        let mut options = Options {
            build_report: false,
            json: false,
            topology_file: None,
        };
        let mut rest = args.iter();
        while let Some(arg) = rest.next() {
            match *arg {
                "--build" => options.build_report = true,
                "--json" => options.json = true,
                "--topology" => match rest.next() {
                    Some(path) => options.topology_file = Some(PathBuf::from(path)),
                    None => return Err("--topology needs a file".to_string()),
                },
                other => return Err(format!("unknown option {other}")),
            }
        }
        Ok(options)
    }
}

/// A GPU as the CUDA driver sees it.
struct Device {
    ordinal: usize,
    name: String,
    code: String,
    sms: i32,
    kernels: &'static str,
}

/// Where the topology came from.
enum TopologySource {
    Machine(Discovery),
    File(PathBuf, Topology),
}

struct Facts {
    resources: Vec<KernelResources>,
    nccl: Result<NcclInfo, String>,
    unique_ids: Result<(), String>,
    driver_present: bool,
    driver_version: Option<String>,
    /// Whether the driver is new enough for this build (`None`: no driver, or the emulator).
    driver_sufficient: Option<bool>,
    devices: Result<Vec<Device>, String>,
    topology: TopologySource,
    missing: Vec<String>,
}

/// Runs the command.
pub fn run(options: &Options) -> ExitCode {
    let topology = match &options.topology_file {
        Some(path) => match read_topology(path) {
            Ok(t) => TopologySource::File(path.clone(), t),
            Err(e) => {
                eprintln!(
                    "tpfuse doctor: cannot read the topology in {}: {e}",
                    path.display()
                );
                return ExitCode::from(2);
            }
        },
        None => TopologySource::Machine(topology::discover()),
    };
    let facts = gather(topology);
    let mut out = io::stdout().lock();
    let written = if options.json {
        let text = serde_json::to_string_pretty(&to_json(&facts))
            .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
        writeln!(out, "{text}")
    } else {
        print_text(&mut out, &facts, options.build_report)
    };
    match written.and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader has what it wanted (`tpfuse doctor | head -3`): not a failure.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tpfuse doctor: writing the report failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn gather(topology: TopologySource) -> Facts {
    let mut missing = Vec::new();
    let resources = build_info::kernel_resources();
    for k in resources.iter().filter(|k| k.spills()) {
        missing.push(format!(
            "kernel {} spills on {} ({} B stores, {} B loads): a defect",
            k.kernel, k.arch, k.spill_stores, k.spill_loads
        ));
    }
    let nccl = nccl_info().map_err(|e| e.to_string());
    let unique_ids = match &nccl {
        Ok(_) => UniqueId::new().map(|_| ()).map_err(|e| e.to_string()),
        Err(_) => Err("NCCL is not loaded".to_string()),
    };
    match (&nccl, &unique_ids) {
        (Err(_), _) => {
            missing.push("NCCL (pip install nvidia-nccl-cu13, or set TPFUSE_NCCL_LIB)".into())
        }
        (Ok(_), Err(e)) => missing.push(format!("a working ncclGetUniqueId ({e})")),
        _ => {}
    }
    let driver_present = tpfuse::device::driver_present();
    let driver = tpfuse::device::driver_version().ok();
    let driver_sufficient = driver_sufficient(driver);
    if let (Some((major, minor)), Some(((need_major, need_minor), branch))) =
        (driver, build_info::minimum_driver())
    {
        if driver_sufficient == Some(false) {
            missing.push(format!(
                "a CUDA driver for CUDA {need_major}.{need_minor} or newer ({branch} or newer): \
                 this one is CUDA {major}.{minor}, and this build's kernels (CUDA {} runtime, \
                 linked statically) fail to launch on it. Update the driver, or build tpfuse \
                 with a CUDA {major}.x toolkit (12.8 or newer) first on PATH (README, \
                 \"Drivers and toolkits\")",
                runtime_text()
            ));
        }
    }
    let driver_version = driver.map(|(a, b)| format!("{a}.{b}"));
    let devices = if driver_present {
        devices(&mut missing)
    } else {
        missing.push(
            "an NVIDIA driver and GPU, to run kernels. What runs here: the CPU tests, and every \
             kernel on the crate's CPU emulator (`cargo run --features emulator --bin tpfuse \
             -- selftest`)"
                .into(),
        );
        Ok(Vec::new())
    };
    if let TopologySource::Machine(Discovery::Broken(e)) = &topology {
        missing.push(format!(
            "a working NVML (the driver is installed but broken: {e})"
        ));
    }
    Facts {
        resources,
        nccl,
        unique_ids,
        driver_present,
        driver_version,
        driver_sufficient,
        devices,
        topology,
        missing,
    }
}

/// Whether `driver` (its CUDA version) runs this build's kernels; `None` without a driver or
/// on the emulator.
fn driver_sufficient(driver: Option<(u32, u32)>) -> Option<bool> {
    let ((need_major, need_minor), _) = build_info::minimum_driver()?;
    driver.map(|v| v >= (need_major, need_minor))
}

/// The CUDA runtime the kernels link, e.g. "13.0".
fn runtime_text() -> String {
    let (major, minor) = build_info::cudart_version();
    format!("{major}.{minor}")
}

/// A topology recorded by `tpfuse doctor --json` (its "topology" field) or a bare one.
fn read_topology(path: &PathBuf) -> Result<Topology, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let value: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let inner = match value.get("topology") {
        Some(t) if !t.is_null() => t.clone(),
        Some(_) => return Err("the recording holds no topology (no driver there)".into()),
        None => value,
    };
    serde_json::from_value(inner).map_err(|e| e.to_string())
}

fn devices(missing: &mut Vec<String>) -> Result<Vec<Device>, String> {
    use cudarc::driver::sys::CUdevice_attribute as A;
    let count = tpfuse::device::device_count().map_err(|e| {
        missing.push(format!("a working CUDA driver ({e})"));
        e.to_string()
    })?;
    if count == 0 {
        missing.push("a visible GPU (check CUDA_VISIBLE_DEVICES)".into());
    }
    let built = build_info::architectures();
    let mut out = Vec::new();
    for ordinal in 0..count {
        let ctx = match tpfuse::device::open(ordinal) {
            Ok(c) => c,
            Err(e) => {
                missing.push(format!("access to GPU {ordinal} ({e})"));
                continue;
            }
        };
        let attr = |a| ctx.attribute(a).unwrap_or(0);
        let (major, minor) = (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        );
        let code = format!("sm_{major}{minor}");
        let native = built.iter().any(|a| a.trim_end_matches(['a', 'f']) == code);
        let ptx = built.iter().any(|a| {
            a.strip_prefix("compute_")
                .and_then(|n| n.parse::<i32>().ok())
                .is_some_and(|n| n <= major * 10 + minor)
        });
        let kernels = if build_info::EMULATED {
            "emulated on the CPU"
        } else if native {
            "native code"
        } else if ptx {
            "PTX, JIT-compiled at first use"
        } else {
            missing.push(format!(
                "kernels for {code} (GPU {ordinal}): rebuild with TPFUSE_CUDA_ARCHS including {code}"
            ));
            "NO kernels for this GPU"
        };
        out.push(Device {
            ordinal,
            name: ctx.name().unwrap_or_else(|_| "?".into()),
            code,
            sms: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            kernels,
        });
    }
    Ok(out)
}

fn print_text(out: &mut impl Write, facts: &Facts, build_report: bool) -> io::Result<()> {
    writeln!(out, "tpfuse {} doctor\n", env!("CARGO_PKG_VERSION"))?;
    print_build(out, facts, build_report)?;

    writeln!(out, "\nNCCL")?;
    match &facts.nccl {
        Ok(info) => {
            let (a, b, c) = info.version;
            writeln!(out, "  found               {a}.{b}.{c} at {}", info.path)?;
            writeln!(out, "  bindings from       nccl.h {}", info.header_version)?;
            match &facts.unique_ids {
                Ok(()) => writeln!(out, "  unique ids          ok (ncclGetUniqueId works)")?,
                Err(e) => writeln!(out, "  unique ids          FAILED: {e}")?,
            }
        }
        Err(e) => writeln!(out, "  not found           {e}")?,
    }

    writeln!(out, "\nCUDA driver")?;
    if facts.driver_present {
        if let Some(v) = &facts.driver_version {
            let verdict = match (facts.driver_sufficient, build_info::minimum_driver()) {
                (_, None) => " (the CPU emulator, this build's own libcuda.so)".to_string(),
                (Some(false), Some(((a, b), branch))) => format!(
                    ": TOO OLD for this build, which needs CUDA {a}.{b} or newer ({branch} or newer)"
                ),
                (_, Some(((a, b), branch))) => {
                    format!(" (this build needs CUDA {a}.{b} or newer: {branch} or newer)")
                }
            };
            writeln!(out, "  driver              CUDA {v}{verdict}")?;
        }
        match &facts.devices {
            Ok(devices) => {
                writeln!(out, "  devices             {}", devices.len())?;
                for d in devices {
                    writeln!(
                        out,
                        "    {}: {}, {}, {} SMs: {}",
                        d.ordinal, d.name, d.code, d.sms, d.kernels
                    )?;
                }
            }
            Err(e) => writeln!(out, "  devices             error: {e}")?,
        }
    } else {
        writeln!(out, "  not found           libcuda.so could not be loaded")?;
        writeln!(
            out,
            "  This machine has no NVIDIA driver, so no GPU work can run here: the kernels,\n  \
             Comm::init_* and the gpu-tests need one. Building, the CPU tests and NCCL's\n  \
             version and unique ids work without it."
        )?;
    }

    writeln!(out, "\nTopology")?;
    match &facts.topology {
        TopologySource::Machine(Discovery::Found(t)) => print_indented(out, &topology::render(t))?,
        TopologySource::Machine(Discovery::NoDriver) => writeln!(
            out,
            "  NVML (libnvidia-ml.so) is not installed: without an NVIDIA driver tpfuse cannot\n  \
             see the GPUs, their NVLink and PCIe connections or peer access here.\n  \
             (tpfuse doctor --topology FILE examines a topology recorded elsewhere.)"
        )?,
        TopologySource::Machine(Discovery::Broken(e)) => {
            writeln!(out, "  NVML is installed but failed: {e}")?
        }
        TopologySource::File(path, t) => {
            writeln!(out, "  recorded topology from {}", path.display())?;
            print_indented(out, &topology::render(t))?;
        }
    }

    writeln!(out)?;
    if facts.missing.is_empty() {
        writeln!(out, "Verdict: nothing missing.")?;
    } else {
        writeln!(out, "Verdict: missing on this machine:")?;
        for m in &facts.missing {
            writeln!(out, "  - {m}")?;
        }
    }
    Ok(())
}

fn print_indented(out: &mut impl Write, text: &str) -> io::Result<()> {
    for line in text.lines() {
        if line.is_empty() {
            writeln!(out)?;
        } else {
            writeln!(out, "  {line}")?;
        }
    }
    Ok(())
}

fn print_build(out: &mut impl Write, facts: &Facts, build_report: bool) -> io::Result<()> {
    writeln!(out, "Build")?;
    if build_info::EMULATED {
        writeln!(
            out,
            "  kernels run on      the CPU emulator (cargo feature `emulator`): cuda/ compiled as\n  \
             {:20}host C++ with the emulator, which is also this build's CUDA driver; no GPU\n  \
             {:20}code. `tpfuse selftest` runs every kernel family here (docs/emulator.md)",
            "", ""
        )?;
        writeln!(out, "  CUDA architectures  none (emulated)")?;
        writeln!(out, "  compiler            {}", build_info::NVCC)?;
    } else {
        writeln!(
            out,
            "  CUDA architectures  {}",
            build_info::architectures().join(", ")
        )?;
        writeln!(
            out,
            "  nvcc                {} ({})",
            build_info::NVCC_RELEASE,
            build_info::NVCC
        )?;
        writeln!(
            out,
            "  CUDA runtime        {}, linked statically",
            runtime_text()
        )?;
    }
    if !build_info::EMULATED {
        let kernels = build_info::kernels();
        let spilling = facts.resources.iter().filter(|k| k.spills()).count();
        writeln!(
            out,
            "  kernels             {} ({} kernel x architecture builds, {spilling} with spills)",
            kernels.len(),
            facts.resources.len(),
        )?;
        for k in &kernels {
            writeln!(out, "    {k}")?;
        }
    }
    writeln!(out, "  nccl.h              {}", build_info::NCCL_HEADER)?;
    if !build_report {
        writeln!(out,
            "  (tpfuse doctor --build shows the GEMM paths and registers, spills and memory per kernel)"
        )?;
        return Ok(());
    }
    writeln!(
        out,
        "\n  GEMM paths per architecture (chosen at run time by compute capability)"
    )?;
    for (arch, paths) in tpfuse::ops::gemm::gemm_paths() {
        let names: Vec<&str> = paths.iter().map(|p| p.name()).collect();
        let names = if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        };
        writeln!(out, "  {arch:<12} {names}")?;
    }
    if build_info::EMULATED {
        writeln!(
            out,
            "\n  ptxas resource report: none (the emulator build compiles no GPU code)"
        )?;
        return Ok(());
    }
    writeln!(
        out,
        "\n  ptxas resource report (per kernel and architecture)"
    )?;
    writeln!(
        out,
        "  {:<8} {:>5} {:>12} {:>11} {:>6} {:>6}  kernel",
        "arch", "regs", "spill stores", "spill loads", "stack", "smem"
    )?;
    for k in &facts.resources {
        writeln!(
            out,
            "  {:<8} {:>5} {:>12} {:>11} {:>6} {:>6}  {}",
            k.arch, k.registers, k.spill_stores, k.spill_loads, k.stack, k.shared, k.kernel
        )?;
    }
    Ok(())
}

fn to_json(facts: &Facts) -> Value {
    let (rt_major, rt_minor) = build_info::cudart_version();
    let nccl = match &facts.nccl {
        Ok(info) => json!({
            "found": true,
            "version": format!("{}.{}.{}", info.version.0, info.version.1, info.version.2),
            "path": info.path,
            "header_version": info.header_version,
            "unique_ids": match &facts.unique_ids {
                Ok(()) => json!({ "works": true }),
                Err(e) => json!({ "works": false, "error": e }),
            },
        }),
        Err(e) => json!({ "found": false, "error": e }),
    };
    let devices = match &facts.devices {
        Ok(devices) => json!(devices
            .iter()
            .map(|d| json!({
                "ordinal": d.ordinal,
                "name": d.name,
                "sm": d.code,
                "sms": d.sms,
                "kernels": d.kernels,
            }))
            .collect::<Vec<_>>()),
        Err(e) => json!({ "error": e }),
    };
    let (nvml, topo) = match &facts.topology {
        TopologySource::Machine(Discovery::Found(t)) => (json!({"status": "found"}), Some(t)),
        TopologySource::Machine(Discovery::NoDriver) => (json!({"status": "no_driver"}), None),
        TopologySource::Machine(Discovery::Broken(e)) => {
            (json!({"status": "broken", "error": e}), None)
        }
        TopologySource::File(path, t) => (
            json!({"status": "recorded", "file": path.display().to_string()}),
            Some(t),
        ),
    };
    let verdicts = topo.map(|t| {
        topology::groups(&t.cuda_ordinals())
            .into_iter()
            .map(|(label, group)| json!({"group": label, "verdict": topology::assess(t, &group)}))
            .collect::<Vec<_>>()
    });
    json!({
        "tpfuse_version": env!("CARGO_PKG_VERSION"),
        "build": {
            "emulated": build_info::EMULATED,
            "minimum_driver": build_info::minimum_driver()
                .map(|((a, b), branch)| json!({ "cuda": format!("{a}.{b}"), "branch": branch })),
            "architectures": build_info::architectures(),
            "nvcc": build_info::NVCC,
            "nvcc_release": build_info::NVCC_RELEASE,
            "cudart": format!("{rt_major}.{rt_minor}"),
            "nccl_header": build_info::NCCL_HEADER,
            "kernels": facts.resources,
        },
        "nccl": nccl,
        "cuda_driver": {
            "found": facts.driver_present,
            "version": facts.driver_version,
            "sufficient": facts.driver_sufficient,
            "devices": devices,
        },
        "nvml": nvml,
        "topology": topo,
        "verdicts": verdicts,
        "missing": facts.missing,
    })
}
