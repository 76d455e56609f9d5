//! The rows of a plan report: for each GEMM and collective of a layer, what tpfuse runs
//! (chosen by the same functions the launches use) and what that costs in bytes per SM,
//! bytes in flight, synchronisation rounds and a modelled time.

use super::collective::all_reduce_row;
use super::fused::{fused_row, not_fused};
use super::model::{LayerGemm, ModelShape};
use super::profile::{DeviceProfile, Link};
use crate::error::Result;
use crate::group::SPLIT_SCRATCH_BYTES;
use crate::ops::gemm::{select_config, split_parts, split_scratch_bytes, GemmConfig, GemmShape};
use crate::ops::linear::Fusion;
use crate::topology::{AllReduceAlgo, AllReduceRule, SizeLimits};

/// Bytes of one element: the plan assumes 16-bit activations and weights (f16 / bf16).
pub const ELEMENT_BYTES: u64 = 2;

/// Threads per block of the collectives (`kThreads` in `cuda/common.cuh`).
pub(super) const COLLECTIVE_THREADS: usize = 512;

/// Turns of a segment a block's RMSNorm issues together (`kInFlight` in `cuda/epilogue.cuh`).
const NORM_TURNS_IN_FLIGHT: usize = 8;

/// The segments of a row of `element_bytes` elements that a block of `threads` normalises from
/// registers (`kHeldSegments` in `cuda/epilogue.cuh`): two of 16-bit elements in the
/// standalone kernel's blocks of `COLLECTIVE_THREADS`, one where a segment's turns fit one
/// round (blocks of 64 to 256 threads), none in smaller blocks.
pub(super) fn held_segments(threads: usize, element_bytes: u64) -> usize {
    let turns = COLLECTIVE_THREADS / threads.max(1);
    if threads >= COLLECTIVE_THREADS && element_bytes == 2 {
        2
    } else if turns <= NORM_TURNS_IN_FLIGHT {
        1
    } else {
        0
    }
}

/// The group's CTA budget for the collectives on a real (one process per GPU) group:
/// [`crate::group::cta_budget`].
pub(super) fn collective_budget(profile: &DeviceProfile, tp: usize) -> usize {
    crate::group::cta_budget(profile.sms, tp, false)
}

/// One row of `tpfuse plan`: a GEMM or a collective of one layer at one `m`. The field
/// names are the JSON keys.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PlanRow {
    /// `"qkv"`, `"o_proj"`, `"gate_up"` or `"down"`.
    pub layer: String,
    /// What runs: `"gemm"`, `"gemm_all_reduce"` (the fused row-parallel kernel, with the
    /// residual add and RMSNorm), or `"all_reduce"` (the unfused layer's collective, with the
    /// residual add and RMSNorm).
    pub op: String,
    /// Rows (tokens) on each rank.
    pub m: usize,
    /// Output features on each rank (a collective: the hidden size).
    pub n: usize,
    /// Input features on each rank (0 for a collective).
    pub k: usize,
    /// Ranks.
    pub tp: usize,
    /// The GEMM's tile configuration, or the collective's algorithm.
    pub config: String,
    /// Parts `k` is split into (1: one accumulation chain over all of `k`).
    pub split_k: usize,
    /// Thread blocks of the launch (the fused kernel: its persistent grid).
    pub blocks: usize,
    /// SMs of the device.
    pub sms: usize,
    /// SMs that get at least one block (for a GEMM: the SMs streaming weights).
    pub sms_streaming: usize,
    /// Global-memory bytes (read + written) of the SM that moves the most, blocks dealt to
    /// SMs in turn (block `b` on SM `b mod sms`).
    pub bytes_per_sm_max: u64,
    /// The launch's global-memory bytes over all the device's SMs.
    pub bytes_per_sm_mean: f64,
    /// Bytes of loads in flight on a busy SM: resident blocks x loads in flight per block.
    pub bytes_in_flight_per_sm: u64,
    /// Synchronisation rounds on the critical path: flag or barrier waits across GPUs (the
    /// fused kernel: one, for every rank's flag of the block's tiles), and the fused
    /// one-shot's wait for a row strip's flag within one (its dealt RMSNorm rows) or the
    /// two-shot's for the slices.
    pub sync_rounds: usize,
    /// The least time the op's minimum bytes take at the device's peak bandwidths (DRAM, and
    /// the link for peer bytes), plus one round for a collective, µs.
    pub floor_us: f64,
    /// The model's time, µs (`docs/performance.md`): a model, not a measurement.
    pub model_us: f64,
    /// Why this runs.
    pub choice: String,
}

/// Global-memory bytes (read + written) of each block of a GEMM launch of `config`, index =
/// `blockIdx.x`, as `cuda/gemm_sm80.cuh` moves them: the tile's live rows of `A` and of `B`
/// over all of `k` once, and per output element the bias (when given), the residual (when
/// given) and the store.
pub fn gemm_block_bytes(
    config: GemmConfig,
    shape: GemmShape,
    bias: bool,
    residual: bool,
) -> Vec<u64> {
    let info = config.info();
    let GemmShape { m, n, k } = shape;
    let (tiles_m, tiles_n) = (m.div_ceil(info.block_m), n.div_ceil(info.block_n));
    let per_output = 1 + u64::from(bias) + u64::from(residual);
    (0..tiles_m * tiles_n)
        .map(|b| {
            let (rows, cols, _, _) = tile_extent(config, shape, b);
            ((rows + cols) * k as u64 + per_output * rows * cols) * ELEMENT_BYTES
        })
        .collect()
}

/// Global-memory bytes of each block of the parallel split of `k` into `parts`
/// (`cuda/gemm_split.cuh`), index = `blockIdx.x` (block `b`: part `b / tiles` of tile
/// `b % tiles`): the tile's live rows of `A` and `B` over the part's `k`, and its f32 chains
/// stored. Part `j > 0` is then folded into the running sum (part 0's chains read with it),
/// the sum stored, or for the last part handed to the epilogue. Which block folds a part, and
/// how many parts one pass folds, depend on timing: here, each part its own, one pass each
/// (each part stored after the fold of the one before: the tile's most in all, 3S - 4
/// partials, spread over its blocks; one pass of all S is the least).
pub fn gemm_split_block_bytes(
    config: GemmConfig,
    shape: GemmShape,
    parts: usize,
    bias: bool,
    residual: bool,
) -> Vec<u64> {
    let info = config.info();
    let GemmShape { m, n, k } = shape;
    let (tiles_m, tiles_n) = (m.div_ceil(info.block_m), n.div_ceil(info.block_n));
    let tiles = tiles_m * tiles_n;
    let per_output = 1 + u64::from(bias) + u64::from(residual);
    (0..tiles * parts)
        .map(|b| {
            let (rows, cols, _, _) = tile_extent(config, shape, b % tiles);
            let part = b / tiles;
            let part_k =
                (part_begin(k, parts, part + 1).min(k) - part_begin(k, parts, part)) as u64;
            let chains = rows * cols * 4;
            let mut bytes = (rows + cols) * part_k * ELEMENT_BYTES + chains;
            if part > 0 {
                bytes += 2 * chains;
                bytes += if part + 1 == parts {
                    per_output * rows * cols * ELEMENT_BYTES
                } else {
                    chains
                };
            }
            bytes
        })
        .collect()
}

/// The first `k` of part `p` of `parts` (`part_begin` of `cuda/gemm_sm80.cuh`).
fn part_begin(k: usize, parts: usize, p: usize) -> usize {
    64 * (k.div_ceil(64) * p / parts)
}

/// The live rows and columns of tile `tile` (in `tile_of_block`'s order) of `shape` in
/// `config`'s tiles, and the tile's row and column indices.
pub(super) fn tile_extent(
    config: GemmConfig,
    shape: GemmShape,
    tile: usize,
) -> (u64, u64, usize, usize) {
    let info = config.info();
    let (tiles_m, tiles_n) = (
        shape.m.div_ceil(info.block_m),
        shape.n.div_ceil(info.block_n),
    );
    let (tm, tn) = tile_of_block(tile, tiles_m, tiles_n);
    let rows = info.block_m.min(shape.m - tm * info.block_m) as u64;
    let cols = info.block_n.min(shape.n - tn * info.block_n) as u64;
    (rows, cols, tm, tn)
}

/// The tile `(tile_m, tile_n)` block `block` computes: `tile_of_block` of
/// `cuda/gemm_sm80.cuh` (groups of 8 tile rows, walked down before right).
fn tile_of_block(block: usize, tiles_m: usize, tiles_n: usize) -> (usize, usize) {
    const GROUP: usize = 8;
    let per_group = GROUP * tiles_n;
    let group = block / per_group;
    let first = group * GROUP;
    let rows = (tiles_m - first).min(GROUP);
    let within = block - group * per_group;
    (first + within % rows, within / rows)
}

/// Bytes per SM with `block_bytes` dealt to `sms` SMs in turn: (the most, the mean over all
/// SMs, how many SMs got a block).
pub(super) fn per_sm(block_bytes: &[u64], sms: usize) -> (u64, f64, usize) {
    let sms = sms.max(1);
    let mut on_sm = vec![0u64; sms];
    for (b, bytes) in block_bytes.iter().enumerate() {
        on_sm[b % sms] += bytes;
    }
    let total: u64 = on_sm.iter().sum();
    let max = on_sm.iter().copied().max().unwrap_or(0);
    (max, total as f64 / sms as f64, block_bytes.len().min(sms))
}

/// Registers per thread of the first kernel on `arch` whose name contains every one of
/// `names`, from the ptxas report (0 when the build has no such row).
fn registers_of(arch: &str, names: &[&str]) -> usize {
    crate::build_info::kernel_resources()
        .into_iter()
        .filter(|r| r.arch == arch && names.iter().all(|n| r.kernel.contains(n)))
        .map(|r| r.registers as usize)
        .max()
        .unwrap_or(0)
}

/// Blocks of the fused GEMM + all-reduce kernel of `config` one SM of `p` holds at once, as
/// the occupancy API counts them (`TpGroup`'s grid): its threads, shared memory (dynamic and
/// the kernel's static) and registers (the most of its instantiations; 255, the most its
/// launch bounds allow, where the build has no ptxas report for `p`'s architecture, so never
/// more blocks than the GPU holds).
pub(super) fn fused_blocks_per_sm(config: GemmConfig, p: &DeviceProfile) -> usize {
    const KERNEL: &str = "gemm_all_reduce_kernel";
    let info = config.fused_info();
    let registers = match registers_of(p.arch, &[KERNEL, config_struct(config)]) {
        0 => 255,
        r => r,
    };
    let static_smem = crate::build_info::kernel_resources()
        .into_iter()
        .filter(|r| r.arch == p.arch && r.kernel.contains(KERNEL))
        .map(|r| r.shared as usize)
        .max()
        .unwrap_or(0);
    p.blocks_per_sm_for(info.threads, info.smem_bytes + static_smem, registers)
        .max(1)
}

/// The kernel-name fragment of a GEMM configuration (its struct in `gemm_sm80.cuh`).
fn config_struct(config: GemmConfig) -> &'static str {
    match config {
        GemmConfig::SmallM16x16 => "SmallM16x16",
        GemmConfig::SmallM16x32 => "SmallM16x32",
        GemmConfig::SmallM16x64 => "SmallM16x64",
        GemmConfig::Tile64x64 => "Tile64x64",
        GemmConfig::Tile128x128 => "Tile128x128",
    }
}

/// What a launch's blocks keep in flight on one busy SM.
pub(super) struct InFlight {
    /// Blocks of the launch one SM runs at once.
    resident: usize,
    /// Bytes in flight per SM.
    pub(super) bytes: u64,
}

/// A GEMM's loads in flight: each block has `stages - 1` k-slices of its live `A` rows and
/// its `B` rows on the way (the `cp.async` ring of `gemm_sm80.cuh`), or all of its slices
/// when its `k` (`block_k`: a part's, for a parallel split) has fewer. `fused`: a fused
/// kernel's, which runs its own variant of the configuration.
pub(super) fn gemm_in_flight(
    config: GemmConfig,
    (m, block_k): (usize, usize),
    blocks: usize,
    profile: &DeviceProfile,
    kernel: &str,
    fused: bool,
) -> InFlight {
    let info = if fused {
        config.fused_info()
    } else {
        config.info()
    };
    let fit = if fused {
        fused_blocks_per_sm(config, profile)
    } else {
        let registers = registers_of(profile.arch, &[kernel, config_struct(config)]);
        profile.blocks_per_sm_for(info.threads, info.smem_bytes, registers)
    };
    let resident = fit.min(blocks.div_ceil(profile.sms.max(1))).max(1);
    let rows = info.block_m.min(m.max(1)) + info.block_n;
    let slices = (info.stages - 1).min(block_k.div_ceil(info.block_k)).max(1);
    let per_block = slices * rows * info.block_k * ELEMENT_BYTES as usize;
    InFlight {
        resident,
        bytes: (resident * per_block) as u64,
    }
}

/// The model's time of a launch, seconds: the launches, then the longest of the aggregate
/// times (DRAM bytes at the DRAM's bandwidth, peer bytes at the link's) and the busiest SM's
/// time (its bytes at what its loads in flight sustain, by Little's law, or its blocks'
/// chains of dependent `mma`, whichever is longer), then the rounds and the latencies waited
/// one after another.
pub(super) struct Model {
    pub(super) launches: usize,
    /// Bytes the DRAM must move (a GEMM: the minimum; the re-reads of `A` by each column
    /// tile come from L2).
    pub(super) dram_bytes: f64,
    /// Bytes across the link, per direction.
    pub(super) peer_bytes: f64,
    /// Global bytes of the busiest SM (L2 hits included).
    pub(super) busiest_sm_bytes: f64,
    /// The share of the busiest SM's bytes that come from a peer (at the peer latency; the
    /// rest at the DRAM latency).
    pub(super) peer_share: f64,
    /// Whether the launch streams weights on every SM at once (a GEMM): its DRAM loads wait
    /// the loaded latency (`streaming_latency_s`), a collective's the idle one.
    pub(super) streams_weights: bool,
    pub(super) in_flight: f64,
    pub(super) chain_s: f64,
    pub(super) rounds: usize,
    /// Latencies the busiest block waits one after another on top of the rest (the fused
    /// kernel: a pipeline fill per tile after its first, and one peer read; a collective:
    /// its load phases after the first).
    pub(super) serial_s: f64,
}

impl Model {
    pub(super) fn seconds(&self, p: &DeviceProfile) -> f64 {
        let dram_latency = if self.streams_weights {
            p.streaming_latency_s
        } else {
            p.dram_latency_s
        };
        let latency = (1.0 - self.peer_share) * dram_latency + self.peer_share * p.peer_latency_s;
        let streaming =
            (self.busiest_sm_bytes * latency / self.in_flight.max(1.0)).max(self.chain_s);
        let aggregate =
            (self.dram_bytes / p.dram_bytes_per_s).max(self.peer_bytes / p.link_bytes_per_s);
        self.launches as f64 * p.launch_s
            + aggregate.max(streaming)
            + self.rounds as f64 * p.round_s
            + self.serial_s
    }
}

pub(super) fn us(seconds: f64) -> f64 {
    (seconds * 1e7).round() / 10.0
}

/// The chain of dependent `mma.sync` one block runs over `k` (one accumulator chain per
/// output element, `k / 16` steps), seconds; `tiles` such chains one after another.
pub(super) fn chain_seconds(k: usize, tiles: usize, p: &DeviceProfile) -> f64 {
    (k.div_ceil(16) * tiles) as f64 * p.mma_latency_cycles / p.clock_hz
}

/// What a row's choice says of its split of k into `parts`, run `parallel` or not (empty
/// without a split).
pub(super) fn split_choice(parts: usize, parallel: bool) -> String {
    match (parts, parallel) {
        (1, _) => String::new(),
        (_, true) => format!("; k in {parts} parts, in parallel"),
        (_, false) => format!("; k in {parts} parts, one after another"),
    }
}

/// The row of a GEMM that runs alone (a column-parallel layer, or an unfused row-parallel
/// layer's GEMM into its workspace).
pub fn gemm_row(g: &LayerGemm, m: usize, tp: usize, p: &DeviceProfile) -> Option<PlanRow> {
    let shape = GemmShape { m, n: g.n, k: g.k };
    let config = select_config(shape, p.compute_capability, p.sms)?;
    let parts = split_parts(g.n, g.k, p.sms);
    // The layers give decode-sized GEMMs the group's scratch: a split k runs its parts in
    // parallel where the scratch holds them.
    let parallel = parts > 1
        && split_scratch_bytes(shape, p.sms) > 0
        && split_scratch_bytes(shape, p.sms) <= SPLIT_SCRATCH_BYTES;
    let block_bytes = if parallel {
        gemm_split_block_bytes(config, shape, parts, false, false)
    } else {
        gemm_block_bytes(config, shape, false, false)
    };
    let (max, mean, streaming) = per_sm(&block_bytes, p.sms);
    // A block's k: its part's in parallel, all of k one after another.
    let block_k = if parallel { g.k.div_ceil(parts) } else { g.k };
    let flight = gemm_in_flight(
        config,
        (m, block_k),
        block_bytes.len(),
        p,
        "gemm_sm80_kernel",
        false,
    );
    let minimum = ((g.n * g.k + m * g.k + m * g.n) as u64 * ELEMENT_BYTES) as f64;
    let waves = block_bytes.len().div_ceil(p.sms * flight.resident);
    // DRAM moves the minimum: the re-reads of A by each column tile come from L2.
    let model = Model {
        launches: 1,
        dram_bytes: minimum,
        peer_bytes: 0.0,
        busiest_sm_bytes: max as f64,
        peer_share: 0.0,
        streams_weights: true,
        in_flight: flight.bytes as f64,
        chain_s: chain_seconds(block_k, waves, p),
        rounds: 0,
        serial_s: 0.0,
    };
    let how = split_choice(parts, parallel);
    Some(PlanRow {
        layer: g.layer.to_string(),
        op: "gemm".into(),
        m,
        n: g.n,
        k: g.k,
        tp,
        config: config.name().into(),
        split_k: parts,
        blocks: block_bytes.len(),
        sms: p.sms,
        sms_streaming: streaming,
        bytes_per_sm_max: max,
        bytes_per_sm_mean: mean,
        bytes_in_flight_per_sm: flight.bytes,
        sync_rounds: 0,
        floor_us: us(minimum / p.dram_bytes_per_s),
        model_us: us(model.seconds(p)),
        choice: if g.row_parallel {
            format!("unfused: into the workspace{how}")
        } else {
            format!("column-parallel{how}")
        },
    })
}

/// The algorithm the layer's all-reduce of `bytes` per rank takes on `tp` ranks of `p`
/// (the group's rule, [`AllReduceRule`], as a group with that link would apply it).
pub(super) fn all_reduce_algo(bytes: usize, tp: usize, p: &DeviceProfile) -> AllReduceAlgo {
    AllReduceRule::choose_within(limits(tp, p), bytes)
}

/// The all-reduce rule's limits for `tp` ranks on `p`'s link (`None`: no custom kernels).
pub(super) fn limits(tp: usize, p: &DeviceProfile) -> Option<SizeLimits> {
    let rule = AllReduceRule::default();
    match p.link {
        Link::NvSwitch => rule.nvlink_limits(tp),
        Link::Pcie => rule.pcie_limits(tp),
    }
}

/// What a real group of `tp` ranks on `p` offers the fused kernels (default options; the
/// persistent grid's SMs every SM, as `TpGroup::fused_blocks` on a real group; the blocks an
/// SM holds from the kernels' resources in the ptxas report of `p`'s architecture, as the
/// occupancy API counts them on a GPU).
/// Every row of one layer of `model` on `tp` ranks of `p`, for each `m` of `ms`: per `m`,
/// the four GEMMs in order, a row-parallel one as its fused row or as its GEMM row followed
/// by its all-reduce row, as a row-parallel layer with `fusion` runs it
/// ([`Fusion::Auto`]: the layers' default), on a group with the default options.
pub fn plan_model(
    model: &ModelShape,
    tp: usize,
    ms: &[usize],
    p: &DeviceProfile,
    fusion: Fusion,
) -> Result<Vec<PlanRow>> {
    plan_model_with(model, tp, ms, p, fusion, false)
}

/// [`plan_model`] on a group whose one-shot all-reduce goes by packets where they fit
/// (`all_reduce_packets`: [`GroupOptions::all_reduce_packets`](crate::group::GroupOptions::all_reduce_packets)).
pub fn plan_model_with(
    model: &ModelShape,
    tp: usize,
    ms: &[usize],
    p: &DeviceProfile,
    fusion: Fusion,
    all_reduce_packets: bool,
) -> Result<Vec<PlanRow>> {
    let packet_bytes = if all_reduce_packets {
        crate::group::PACKET_HALF_BYTES
    } else {
        0
    };
    let gemms = model.layer_gemms(tp)?;
    let (major, minor) = p.compute_capability;
    let no_path = || {
        crate::error::Error::invalid(
            "device",
            format!(
                "{}: compute capability {major}.{minor} has no GEMM path",
                p.name
            ),
        )
    };
    let mut rows = Vec::new();
    for &m in ms {
        for g in &gemms {
            if g.row_parallel {
                match not_fused(g, m, tp, p, fusion) {
                    None => {
                        let mut row = fused_row(g, m, tp, p).ok_or_else(no_path)?;
                        let alone = gemm_row(g, m, tp, p).ok_or_else(no_path)?;
                        row.choice =
                            format!("{}; the GEMM alone {} us", row.choice, alone.model_us);
                        rows.push(row);
                    }
                    Some(reason) => {
                        let mut row = gemm_row(g, m, tp, p).ok_or_else(no_path)?;
                        row.choice = format!("{} ({reason})", row.choice);
                        rows.push(row);
                        if tp > 1 {
                            rows.push(all_reduce_row(g.layer, m, g.n, tp, p, true, packet_bytes));
                        }
                    }
                }
            } else {
                rows.push(gemm_row(g, m, tp, p).ok_or_else(no_path)?);
            }
        }
    }
    Ok(rows)
}
