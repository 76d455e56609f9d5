//! `tpfuse`: the command-line face of the crate.
//!
//! - `tpfuse doctor [--build] [--json] [--topology FILE]`: what was built, what this machine
//!   has and what connects its GPUs, what is missing, and which algorithms each GPU set can use.
//! - `tpfuse selftest [--counters]`: checks that run here (NCCL, unique ids) and, with a GPU
//!   or the CPU emulator, every kernel family on virtual ranks against the references (and a
//!   one-rank NCCL communicator on a GPU); `--counters` prints the emulator's counters.
//! - `tpfuse plan --model NAME | --config FILE [--tp 2,4,8] [--m 1,16,64] [--device PROFILE]
//!   [--fusion auto|fused|unfused] [--all-reduce-packets] [--json]`: what tpfuse runs for each GEMM and collective of a layer, its bytes per SM,
//!   bytes in flight, rounds, floor and modelled time (tpfuse::plan).
//! - `tpfuse bench`: a quick reduce_ranks bandwidth figure (needs a GPU; the criterion
//!   benches are the real measurement); fails (exit 1) without one.
//! - `tpfuse --version`: the crate version.

mod bench;
mod doctor;
mod kernel_checks;
mod plan;
mod selftest;
mod traffic;

use std::process::ExitCode;

const USAGE: &str = "usage: tpfuse <command>

commands:
  doctor [--build] [--json] [--topology FILE]
                     build facts, NCCL, the CUDA driver, the GPUs and what connects them,
                     and which algorithms each GPU set can use
                       --build     adds the ptxas report of every kernel and architecture
                       --json      the same facts as JSON (the topology included)
                       --topology  examines a topology recorded elsewhere (--json output
                                   or a bare topology) instead of this machine's
  selftest [--counters]
                     run the checks this machine can run: with a GPU, or on the CPU
                     emulator (--features emulator), every kernel family on virtual ranks
                     against the f64 and bit-exact references
                       --counters  the emulator's counters per op (emulator builds)
  plan --model NAME | --config FILE [--tp N,..] [--m M,..] [--device PROFILE]
       [--fusion auto|fused|unfused] [--all-reduce-packets] [--json]
                     what tpfuse runs for each GEMM and collective of a decoder layer, the
                     bytes each SM moves and keeps in flight, sync rounds, the bandwidth
                     floor and a modelled time (a model, not a measurement)
                       --model     llama-3-8b, llama-3-70b, qwen2.5-72b
                       --config    a Hugging Face config.json (dense Llama-style)
                       --tp        ranks (default 2,4,8);  --m  rows per rank (default 1,16,64)
                       --device    h100-sxm, h200, a100-sxm, l40s, b200 (default: GPU 0)
                       --fusion    the row-parallel layers' Fusion (default auto, the layers'
                                   default: unfused; fused shows the fused kernel's rows)
                       --all-reduce-packets  a group with GroupOptions::all_reduce_packets
                                   (the one-shot all-reduce by packets where they fit)
                       --json      an array of rows
  bench              quick reduce_ranks bandwidth on GPU 0 (fails without a GPU)
  help               this text

options:
  --version, -V      the version of tpfuse";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["doctor", rest @ ..] => match doctor::Options::parse(rest) {
            Ok(options) => doctor::run(&options),
            Err(e) => {
                eprintln!("tpfuse doctor: {e}\n\n{USAGE}");
                ExitCode::from(2)
            }
        },
        ["selftest", rest @ ..] => match selftest::Options::parse(rest) {
            Ok(options) => selftest::run(&options),
            Err(e) => {
                eprintln!("tpfuse selftest: {e}\n\n{USAGE}");
                ExitCode::from(2)
            }
        },
        ["plan", rest @ ..] => match plan::Options::parse(rest) {
            Ok(options) => plan::run(&options),
            Err(e) => {
                eprintln!("tpfuse plan: {e}\n\n{USAGE}");
                ExitCode::from(2)
            }
        },
        ["bench"] => bench::run(),
        ["--version"] | ["-V"] => {
            println!("tpfuse {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        [] | ["help"] | ["--help"] | ["-h"] => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("tpfuse: unknown arguments {args:?}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}
