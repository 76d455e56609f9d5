//! The host's share of a decode step: how long one rank's
//! `RowParallelLinear::forward_residual_rmsnorm` (m = 1, bf16, Llama-3-8B's down projection
//! at TP 2 on a GPU: in 14336, out 4096) takes to return, and how many heap allocations it
//! makes. That is tpfuse's validation, its choice of path and the packing of the kernels'
//! arguments, plus the enqueue of its launches (the driver's, or the emulator's, which stands
//! in for it); not the kernels, which run after the call returned. Criterion group
//! `host_cost_bf16_virtual_w2`, one function per fusion, and a reference, `OneLaunch`: a
//! bare `ops::epilogue::rms_norm` of the same row, one launch behind the least validation
//! tpfuse has, and `BareLaunch`: the driver's `cuLaunchKernel` of an empty kernel (loaded
//! from PTX; a GPU only), the floor under any launch. Printed after: allocations per call.
//!
//! Runs without a GPU under `--features emulator` (shapes divided by 64, a short measurement:
//! every timed call's kernels still execute, on the CPU, between the samples):
//!   `cargo bench --features emulator --bench host_cost`
//! `TPFUSE_BENCH_SMOKE=1` (or criterion's `--test`) runs each function once.
#[path = "common/mod.rs"]
mod common;

use common::{random_device, smoke};
use criterion::{BenchmarkId, Criterion, SamplingMode};
use cudarc::driver::{sys, CudaContext, CudaSlice};
use half::bf16;
use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tpfuse::ops::linear::{Fusion, RowParallelLinear};
use tpfuse::ops::RmsNorm;
use tpfuse::shard::{HostWeight, RowParallelSpec};
use tpfuse::{GroupOptions, TpGroup};

/// The process's heap allocations (and reallocations), whichever thread made them.
struct Counting;
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call goes to the system allocator with the caller's arguments.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const WORLD: usize = 2;
/// Calls per rank between two synchronisations (the queue of launches stays short).
const BATCH: u64 = 4;

/// A dimension: itself on a GPU, divided by 64 (at least 64) on the emulator.
fn dim(full: usize) -> usize {
    if cfg!(feature = "emulator") {
        (full / 64).max(64)
    } else {
        full
    }
}

/// One rank's layer and buffers.
struct Rank {
    layer: RowParallelLinear<bf16>,
    x: CudaSlice<bf16>,
    partial: CudaSlice<bf16>,
    residual: CudaSlice<bf16>,
    gamma: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
}

/// What one timed call runs.
#[derive(Clone, Copy, Debug)]
enum Call {
    Layer(Fusion),
    OneLaunch,
    BareLaunch(sys::CUfunction),
}

/// An empty kernel, for the driver's own launch cost.
const EMPTY_PTX: &str = ".version 7.0\n.target sm_80\n.address_size 64\n\
                         .visible .entry tpfuse_empty()\n{\n  ret;\n}\n";

/// The empty kernel loaded into `ctx` (the emulator loads no PTX: `None` there).
fn empty_kernel(ctx: &CudaContext) -> Option<sys::CUfunction> {
    if cfg!(feature = "emulator") {
        return None;
    }
    ctx.bind_to_thread().expect("binding the context");
    let ptx = CString::new(EMPTY_PTX).expect("no NUL in the PTX");
    let (mut module, mut function) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: a NUL-terminated PTX image and out-pointers to locals; the module stays loaded
    // for the process's life.
    unsafe {
        let loaded = sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast());
        assert_eq!(
            loaded,
            sys::CUresult::CUDA_SUCCESS,
            "loading the empty kernel"
        );
        let found = sys::cuModuleGetFunction(&mut function, module, c"tpfuse_empty".as_ptr());
        assert_eq!(
            found,
            sys::CUresult::CUDA_SUCCESS,
            "finding the empty kernel"
        );
    }
    Some(function)
}

impl Rank {
    fn call(&mut self, group: &TpGroup, what: Call) {
        if let Call::BareLaunch(function) = what {
            // SAFETY: a kernel of no parameters on a live stream of its context.
            let launched = unsafe {
                sys::cuLaunchKernel(
                    function,
                    1,
                    1,
                    1,
                    32,
                    1,
                    1,
                    0,
                    group.stream().cu_stream(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                )
            };
            assert_eq!(launched, sys::CUresult::CUDA_SUCCESS, "cuLaunchKernel");
            return;
        }
        let Call::Layer(_) = what else {
            tpfuse::ops::epilogue::rms_norm(
                group.stream(),
                &self.residual,
                &self.gamma,
                1e-5,
                &mut self.out,
            )
            .expect("rms_norm");
            return;
        };
        let norm = RmsNorm {
            gamma: &self.gamma,
            eps: 1e-5,
        };
        self.layer
            .forward_residual_rmsnorm(
                group,
                &self.x,
                Some(&mut self.partial),
                &mut self.residual,
                norm,
                &mut self.out,
            )
            .expect("forward_residual_rmsnorm");
    }
}

fn build_ranks(groups: &[TpGroup], fusion: Fusion, inner: usize, hidden: usize) -> Vec<Rank> {
    let spec = RowParallelSpec::new("down_proj", inner, hidden, WORLD).expect("spec");
    let weight: Vec<bf16> = (0..hidden * inner)
        .map(|i| bf16::from_f32(((i * 7919) % 255) as f32 / 255.0 - 0.5))
        .collect();
    let bias = vec![bf16::from_f32(0.25); hidden];
    groups
        .iter()
        .enumerate()
        .map(|(r, g)| {
            let s = g.stream();
            let layer = RowParallelLinear::from_host(
                g,
                spec.clone(),
                HostWeight::new(&weight, hidden, inner),
                Some(&bias),
            )
            .expect("layer")
            .with_fusion(fusion);
            Rank {
                layer,
                x: random_device(s, inner / WORLD, 1.0, 1 + r as u64),
                partial: s.alloc_zeros(hidden).expect("partial"),
                residual: random_device(s, hidden, 1.0, 11 + r as u64),
                gamma: random_device(s, hidden, 1.0, 21),
                out: s.alloc_zeros(hidden).expect("out"),
            }
        })
        .collect()
}

/// `iters` calls per rank, every rank in turn, timed around the calls only (the
/// synchronisation after each batch is not); returns the time per rank's call and adds the
/// allocations made inside the timed calls to `allocations`.
fn timed_calls(
    groups: &[TpGroup],
    ranks: &mut [Rank],
    what: Call,
    iters: u64,
    allocations: &mut u64,
) -> Duration {
    let mut host = Duration::ZERO;
    let mut done = 0;
    while done < iters {
        let batch = BATCH.min(iters - done);
        let before = ALLOCATIONS.load(Ordering::Relaxed);
        let started = Instant::now();
        for _ in 0..batch {
            for (rank, group) in ranks.iter_mut().zip(groups) {
                rank.call(group, what);
            }
        }
        host += started.elapsed();
        *allocations += ALLOCATIONS.load(Ordering::Relaxed) - before;
        for g in groups {
            g.stream().synchronize().expect("synchronize");
        }
        done += batch;
    }
    host / WORLD as u32
}

fn main() {
    if !common::driver_present("host_cost") {
        return;
    }
    let mut c = if cfg!(feature = "emulator") {
        Criterion::default()
            .warm_up_time(Duration::from_millis(20))
            .measurement_time(Duration::from_millis(300))
            .sample_size(10)
    } else {
        Criterion::default()
    }
    .configure_from_args();
    let ctx = tpfuse::device::open(0).unwrap_or_else(|e| panic!("opening GPU 0: {e}"));
    // SAFETY: every buffer lives on its rank's stream.
    unsafe { ctx.disable_event_tracking() };
    let groups =
        TpGroup::virtual_ranks(&ctx, WORLD, GroupOptions::default()).expect("virtual ranks");
    let (inner, hidden) = (dim(14336), dim(4096));
    let mut lines = Vec::new();
    let mut group = c.benchmark_group(format!("host_cost_bf16_virtual_w{WORLD}"));
    // Every iteration costs its kernels' time on top of the timed host work: flat sampling
    // (the same iterations per sample) keeps criterion from ramping up to thousands of them.
    group.sampling_mode(SamplingMode::Flat);
    let bare = empty_kernel(&ctx);
    if bare.is_none() {
        lines.push("BareLaunch: not measured (the emulator loads no PTX)".to_string());
    }
    let calls = [
        Some(Call::Layer(Fusion::Unfused)),
        Some(Call::Layer(Fusion::Fused)),
        Some(Call::OneLaunch),
        bare.map(Call::BareLaunch),
    ];
    for what in calls.into_iter().flatten() {
        let fusion = match what {
            Call::Layer(fusion) => fusion,
            _ => Fusion::Unfused,
        };
        let name = match what {
            Call::Layer(fusion) => format!("{fusion:?}"),
            Call::OneLaunch => "OneLaunch".to_string(),
            Call::BareLaunch(_) => "BareLaunch".to_string(),
        };
        let mut ranks = build_ranks(&groups, fusion, inner, hidden);
        // The first call of a shape (kernel loading, the group's first launch) is not timed.
        timed_calls(&groups, &mut ranks, what, 1, &mut 0);
        let (mut calls, mut allocations) = (0, 0);
        let id = BenchmarkId::new(&name, format!("m1_in{inner}_out{hidden}"));
        if smoke() {
            timed_calls(&groups, &mut ranks, what, 1, &mut allocations);
            calls += WORLD as u64;
        } else {
            group.bench_function(id, |b| {
                b.iter_custom(|iters| {
                    calls += iters * WORLD as u64;
                    timed_calls(&groups, &mut ranks, what, iters, &mut allocations)
                })
            });
        }
        lines.push(format!(
            "{name}: {:.2} heap allocations per call ({allocations} in {calls} calls)",
            allocations as f64 / calls.max(1) as f64
        ));
    }
    group.finish();
    c.final_summary();
    println!("\nforward_residual_rmsnorm, m = 1, in {inner}, out {hidden}, {WORLD} virtual ranks:");
    for line in lines {
        println!("  {line}");
    }
}
