//! `tpfuse plan`: what tpfuse runs for a model's layers on a device, and how far from the
//! bandwidth floor (tpfuse::plan).

use std::process::ExitCode;
use tpfuse::ops::linear::Fusion;
use tpfuse::plan::{
    plan_model_with, DeviceProfile, ModelShape, PlanRow, BUILTIN_DEVICES, BUILTIN_MODELS,
};

pub struct Options {
    model: ModelSource,
    tp: Vec<usize>,
    ms: Vec<usize>,
    device: Option<String>,
    fusion: Fusion,
    all_reduce_packets: bool,
    json: bool,
}

enum ModelSource {
    Builtin(String),
    Config(String),
}

fn list(flag: &str, value: &str) -> Result<Vec<usize>, String> {
    let values: Result<Vec<usize>, _> = value.split(',').map(|v| v.trim().parse()).collect();
    match values {
        Ok(v) if !v.is_empty() && v.iter().all(|&x| x > 0) => Ok(v),
        _ => Err(format!(
            "{flag} {value}: a comma-separated list of positive integers"
        )),
    }
}

impl Options {
    pub fn parse(args: &[&str]) -> Result<Options, String> {
        let mut model = None;
        let mut options = Options {
            model: ModelSource::Builtin(String::new()),
            tp: vec![2, 4, 8],
            ms: vec![1, 16, 64],
            device: None,
            fusion: Fusion::Auto,
            all_reduce_packets: false,
            json: false,
        };
        let mut it = args.iter();
        while let Some(&arg) = it.next() {
            let mut value = || {
                it.next()
                    .copied()
                    .ok_or_else(|| format!("{arg} needs a value"))
            };
            match arg {
                "--model" => model = Some(ModelSource::Builtin(value()?.to_string())),
                "--config" => model = Some(ModelSource::Config(value()?.to_string())),
                "--tp" => options.tp = list(arg, value()?)?,
                "--m" => options.ms = list(arg, value()?)?,
                "--device" => options.device = Some(value()?.to_string()),
                "--fusion" => {
                    options.fusion = match value()? {
                        "auto" => Fusion::Auto,
                        "fused" => Fusion::Fused,
                        "unfused" => Fusion::Unfused,
                        v => return Err(format!("--fusion {v}: auto, fused or unfused")),
                    }
                }
                "--all-reduce-packets" => options.all_reduce_packets = true,
                "--json" => options.json = true,
                other => return Err(format!("unknown option {other}")),
            }
        }
        options.model = model.ok_or("--model NAME or --config config.json is required")?;
        Ok(options)
    }
}

pub fn run(options: &Options) -> ExitCode {
    match rows(options) {
        Ok((device, rows)) => {
            if options.json {
                match serde_json::to_string_pretty(&rows) {
                    Ok(text) => println!("{text}"),
                    Err(e) => {
                        eprintln!("tpfuse plan: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            } else {
                print_table(&device, &rows);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tpfuse plan: {e}");
            ExitCode::from(2)
        }
    }
}

fn rows(options: &Options) -> Result<(DeviceProfile, Vec<PlanRow>), String> {
    let model = match &options.model {
        ModelSource::Builtin(name) => ModelShape::builtin(name).ok_or_else(|| {
            format!(
                "no built-in model {name:?} (built in: {})",
                BUILTIN_MODELS.join(", ")
            )
        })?,
        ModelSource::Config(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
            ModelShape::from_hf_config(path, &text).map_err(|e| format!("{path}: {e}"))?
        }
    };
    let device = match &options.device {
        Some(name) => DeviceProfile::builtin(name).ok_or_else(|| {
            format!(
                "no device profile {name:?} (built in: {})",
                BUILTIN_DEVICES.join(", ")
            )
        })?,
        None => DeviceProfile::local(0).map_err(|e| {
            format!(
                "no --device, and the local GPU cannot be read ({e}); name a profile: {}",
                BUILTIN_DEVICES.join(", ")
            )
        })?,
    };
    let mut rows = Vec::new();
    for &tp in &options.tp {
        rows.extend(
            plan_model_with(
                &model,
                tp,
                &options.ms,
                &device,
                options.fusion,
                options.all_reduce_packets,
            )
            .map_err(|e| e.to_string())?,
        );
    }
    Ok((device, rows))
}

fn print_table(device: &DeviceProfile, rows: &[PlanRow]) {
    println!(
        "device {}: {} SMs, {:.2} TB/s DRAM, {:.0} GB/s per direction to a peer; bf16; model times are a model (docs/performance.md)",
        device.name,
        device.sms,
        device.dram_bytes_per_s / 1e12,
        device.link_bytes_per_s / 1e9
    );
    println!(
        "{:<8} {:<16} {:>3} {:>5} {:>6} {:>6} {:<24} {:>5} {:>6} {:>9} {:>10} {:>10} {:>9} {:>6} {:>8} {:>8}  choice",
        "layer", "op", "tp", "m", "n", "k", "config", "split", "blocks", "streaming", "B/SM max", "B/SM mean", "in flight", "rounds", "floor us", "model us"
    );
    for r in rows {
        println!(
            "{:<8} {:<16} {:>3} {:>5} {:>6} {:>6} {:<24} {:>5} {:>6} {:>5}/{:<3} {:>10} {:>10.0} {:>9} {:>6} {:>8.1} {:>8.1}  {}",
            r.layer,
            r.op,
            r.tp,
            r.m,
            r.n,
            r.k,
            r.config,
            r.split_k,
            r.blocks,
            r.sms_streaming,
            r.sms,
            r.bytes_per_sm_max,
            r.bytes_per_sm_mean,
            r.bytes_in_flight_per_sm,
            r.sync_rounds,
            r.floor_us,
            r.model_us,
            r.choice
        );
    }
}
