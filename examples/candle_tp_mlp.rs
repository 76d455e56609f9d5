//! A Llama MLP in candle at tensor parallelism W, in the shape of candle's
//! `llama_multiprocess` example: `gate_proj` and `up_proj` column-parallel (candle matmuls of
//! each rank's rows), `down_proj` row-parallel through tpfuse, with its all-reduce, the residual
//! add and the next block's RMSNorm fused (`tpfuse::candle::row_parallel_residual_rmsnorm`),
//! the down-projection weight a candle tensor borrowed by the layer (`tpfuse::candle::Weight`).
//!
//! ```sh
//! cargo run --release --features candle --example candle_tp_mlp
//!     # W = 2 virtual ranks on GPU 0, one thread per rank (candle's Device::new_cuda)
//! torchrun --nproc-per-node 2 target/release/examples/candle_tp_mlp
//!     # one process per GPU, NCCL, the group on candle's stream (Device::new_cuda_with_stream)
//! ```
//!
//! Each rank checks `residual` (now `h = x + MLP(x)`) and the returned `rmsnorm(h) · γ` against
//! the unsharded MLP computed on the host in f64 from the same bf16 inputs (relative Frobenius
//! error below 1e-2; candle rounds `gate`, `up` and the activation to bf16 on the way), and
//! exits with status 1 if either is off. CI type-checks it (`scripts/candle-check.sh`:
//! candle's CUDA backend does not run on the emulator); it runs where a GPU is.

use candle_core::{DType, Device, Result, Tensor};
use half::bf16;
use std::sync::Barrier;
use std::time::Duration;
use tpfuse::candle::{error, row_parallel_residual_rmsnorm, Weight};
use tpfuse::comm::{bootstrap, Comm, CommOptions, UniqueId};
use tpfuse::ops::linear::RowParallelLinear;
use tpfuse::reference::{gated_mlp_f64, relative_error, rms_norm_f64};
use tpfuse::shard::{HostWeight, RowParallelSpec};
use tpfuse::{GroupOptions, TpGroup};

const HIDDEN: usize = 1024;
const INTERMEDIATE: usize = 2816;
const ROWS: usize = 4;
const EPS: f32 = 1e-5;

/// The whole model's tensors on the host, as a checkpoint holds them (`[out, in]`), bf16.
struct Checkpoint {
    gate: Vec<bf16>,
    up: Vec<bf16>,
    down: Vec<bf16>,
    gamma: Vec<bf16>,
    x: Vec<bf16>,
}

impl Checkpoint {
    /// Deterministic pseudo-random values in [-scale, scale) (the same on every rank).
    fn new() -> Checkpoint {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut values = |n: usize, scale: f32| -> Vec<bf16> {
            (0..n)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let unit = (state >> 40) as f32 / (1u64 << 24) as f32;
                    bf16::from_f32((2.0 * unit - 1.0) * scale)
                })
                .collect()
        };
        Checkpoint {
            gate: values(INTERMEDIATE * HIDDEN, 0.05),
            up: values(INTERMEDIATE * HIDDEN, 0.05),
            down: values(HIDDEN * INTERMEDIATE, 0.05),
            gamma: values(HIDDEN, 1.0),
            x: values(ROWS * HIDDEN, 1.0),
        }
    }
}

// [README: candle]
/// One rank's MLP: its rows of gate and up (candle tensors), its columns of down (a tpfuse
/// layer over a candle tensor).
struct Mlp {
    gate: Tensor,
    up: Tensor,
    down: RowParallelLinear<bf16, Weight<bf16>>,
}

impl Mlp {
    fn load(group: &TpGroup, device: &Device, ckpt: &Checkpoint) -> Result<Mlp> {
        let (rank, world) = (group.rank(), group.world());
        let rows = INTERMEDIATE / world;
        let take = |w: &[bf16]| w[rank * rows * HIDDEN..(rank + 1) * rows * HIDDEN].to_vec();
        let gate = Tensor::from_vec(take(&ckpt.gate), (rows, HIDDEN), device)?;
        let up = Tensor::from_vec(take(&ckpt.up), (rows, HIDDEN), device)?;
        let spec =
            RowParallelSpec::new("mlp.down_proj", INTERMEDIATE, HIDDEN, world).map_err(error)?;
        let shard = spec
            .shard_weight(rank, HostWeight::new(&ckpt.down, HIDDEN, INTERMEDIATE))
            .map_err(error)?;
        let shard = Tensor::from_vec(shard, (HIDDEN, rows), device)?;
        let down = RowParallelLinear::from_shard(group, spec, Weight::new(group, &shard)?, None)
            .map_err(error)?;
        Ok(Mlp { gate, up, down })
    }

    /// `residual := residual + down(SiLU(x · gateᵀ) · (x · upᵀ))` summed over the ranks;
    /// returns `rmsnorm(residual) · gamma`.
    fn forward(
        &self,
        group: &TpGroup,
        x: &Tensor,
        residual: &Tensor,
        gamma: &Tensor,
    ) -> Result<Tensor> {
        row_parallel_residual_rmsnorm(group, &self.down, &self.act(x)?, residual, gamma, EPS)
    }

    /// `SiLU(x · gateᵀ) · (x · upᵀ)`: this rank's columns of the intermediate activation.
    fn act(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.gate.t()?)?.silu()? * x.matmul(&self.up.t()?)?
    }
}
// [/README: candle]

/// Runs the MLP on one rank and checks it; returns the failed checks. With `ready` (one
/// thread per rank), every rank's candle work is warmed up (candle's modules loaded) before
/// any rank's first collective: a first-time load could otherwise wait for a peer's kernel.
fn run_rank(
    group: &TpGroup,
    device: &Device,
    ckpt: &Checkpoint,
    ready: Option<&Barrier>,
) -> Result<Vec<String>> {
    let mlp = Mlp::load(group, device, ckpt)?;
    let x = Tensor::from_vec(ckpt.x.clone(), (ROWS, HIDDEN), device)?;
    let residual = x.copy()?; // the residual stream entering the MLP is x itself here
    let gamma = Tensor::from_vec(ckpt.gamma.clone(), HIDDEN, device)?;
    if let Some(ready) = ready {
        mlp.act(&x)?.sum_all()?.to_vec0::<bf16>()?;
        ready.wait();
    }
    let normed = mlp.forward(group, &x, &residual, &gamma)?;
    group.check().map_err(error)?;

    let mlp_out = gated_mlp_f64(
        &ckpt.x,
        &[&ckpt.gate[..], &ckpt.up[..]].concat(),
        &ckpt.down,
        None,
        ROWS,
        HIDDEN,
        INTERMEDIATE,
    );
    let h: Vec<f64> = mlp_out
        .iter()
        .zip(&ckpt.x)
        .map(|(y, x)| y + x.to_f64())
        .collect();
    let want_normed = rms_norm_f64(&h, &ckpt.gamma, f64::from(EPS));
    let mut failed = Vec::new();
    for (name, got, want) in [("h", &residual, &h), ("rmsnorm(h)", &normed, &want_normed)] {
        let got: Vec<bf16> = got.to_dtype(DType::BF16)?.flatten_all()?.to_vec1()?;
        let err = relative_error(&got, want);
        let verdict = if err < 1e-2 { "ok" } else { "FAILED" };
        println!(
            "rank {}: {name}: relative error {err:.2e} {verdict}",
            group.rank()
        );
        if err >= 1e-2 {
            failed.push(format!("rank {}: {name} {err:.2e}", group.rank()));
        }
    }
    Ok(failed)
}

fn main() -> Result<()> {
    let ckpt = Checkpoint::new();
    let failed = if std::env::var_os("WORLD_SIZE").is_some() {
        // One process per GPU: the group on candle's own stream (no joins needed).
        let env = bootstrap::LaunchEnv::from_env().map_err(error)?;
        let id = bootstrap::unique_id_from_env(&env, UniqueId::new, Duration::from_secs(60))
            .map_err(error)?;
        let device = Device::new_cuda_with_stream(env.local_rank)?;
        let stream = device.as_cuda_device()?.cuda_stream();
        let comm = Comm::init_rank(&id, env.rank, env.world, stream, CommOptions::default())
            .map_err(error)?;
        let group = TpGroup::from_comm(comm, GroupOptions::default()).map_err(error)?;
        run_rank(&group, &device, &ckpt, None)?
    } else {
        // Virtual ranks on GPU 0, one thread each: every thread's candle device runs on that
        // thread's per-thread stream, and the groups on tpfuse's streams (the ops join them).
        let ctx = tpfuse::device::open(0).map_err(error)?;
        let groups = TpGroup::virtual_ranks(&ctx, 2, GroupOptions::default()).map_err(error)?;
        let (ckpt, ready) = (&ckpt, &Barrier::new(groups.len()));
        std::thread::scope(|s| {
            let ranks: Vec<_> = groups
                .iter()
                .map(|g| s.spawn(move || run_rank(g, &Device::new_cuda(0)?, ckpt, Some(ready))))
                .collect();
            ranks.into_iter().try_fold(Vec::new(), |mut all, rank| {
                all.extend(rank.join().expect("a rank's thread panicked")?);
                Ok::<_, candle_core::Error>(all)
            })
        })?
    };
    if !failed.is_empty() {
        eprintln!("FAILED: {}", failed.join("; "));
        std::process::exit(1);
    }
    println!("all checks passed");
    Ok(())
}
