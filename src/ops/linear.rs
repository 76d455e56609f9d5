//! Tensor-parallel linear layers over a [`TpGroup`]: a rank's weight shard on its device,
//! the GEMM, and the collective that joins the ranks.
//!
//! | layer | a rank holds | `forward` | then |
//! |---|---|---|---|
//! | [`ColumnParallelLinear`] | weight rows `r·out/W .. (r+1)·out/W` (and that bias slice) | `[m, in] -> [m, out/W]` | optionally [`all_gather`] to `[m, out]` ([`forward_gather`](ColumnParallelLinear::forward_gather)) |
//! | [`MergedColumnParallelLinear`] | its heads of q, k, v (or its part of gate and up) | `[m, in] -> [m, out_per_rank]` | the caller reads the sections ([`QkvSplit`], [`GateUpSplit`]) |
//! | [`RowParallelLinear`] | weight columns `r·in/W .. (r+1)·in/W`, and the whole bias | `[m, in/W] -> partial [m, out]` | [`all_reduce_fused`]: `out = Σ partials + bias`, bias added once, in f32; or with residual add and RMSNorm ([`forward_residual_rmsnorm`](RowParallelLinear::forward_residual_rmsnorm)) |
//!
//! The shard math (which rows, columns and heads a rank takes, and the checks that name the
//! layer) is host-only, in [`crate::shard`]; a layer is built from a spec of that module and
//! either the rank's shard already on the device (`from_shard`) or the full host weight
//! `[out_features, in_features]` it cuts and uploads (`from_host`).
//!
//! # Calls
//!
//! Every rank of the group builds the same layers and calls `forward` with the same `m` in
//! the same order (as for any collective). A layer is built for one rank of one group:
//! `forward` refuses a group of another rank or world size. Activations are row-major; `m`
//! (tokens) is read from the input's length. Outputs and workspaces are the caller's: no
//! `forward` allocates, so a layer's calls can be captured into a CUDA graph (with the
//! collectives' own conditions, see [`mod@crate::ops::all_reduce`]).
//!
//! # Errors
//!
//! Before anything is launched, every length is checked against the layer's shape and a
//! wrong one is an [`Error::InvalidArgument`] whose `arg` is the layer's description (e.g.
//! `row-parallel 'layers.0.mlp.down_proj'`) and whose reason names the buffer. The checks of
//! the GEMM and the collectives (alignment, devices, aliasing, capacity) keep their reasons
//! and are renamed after the layer the same way.
//!
//! # Example: a tensor-parallel MLP on one rank
//!
//! ```no_run
//! use half::bf16;
//! use tpfuse::ops::linear::{MergedColumnParallelLinear, RowParallelLinear};
//! use tpfuse::shard::{MergedColumnSpec, RowParallelSpec};
//! use tpfuse::{GroupOptions, TpGroup};
//!
//! # fn main() -> tpfuse::Result<()> {
//! let ctx = tpfuse::device::open(0)?;
//! let groups = TpGroup::virtual_ranks(&ctx, 2, GroupOptions::default())?;
//! let (hidden, inter, m) = (1024, 4096, 4);
//! let gate_up_w = vec![bf16::ZERO; 2 * inter * hidden]; // [2·inter, hidden], from safetensors
//! let down_w = vec![bf16::ZERO; hidden * inter]; // [hidden, inter]
//! let group = &groups[0];
//! let w = group.world();
//! let gate_up = MergedColumnParallelLinear::from_host(
//!     group, MergedColumnSpec::gate_up("mlp.gate_up_proj", hidden, inter, w)?, &gate_up_w, None)?;
//! let down = RowParallelLinear::from_host(
//!     group, RowParallelSpec::new("mlp.down_proj", inter, hidden, w)?, &down_w, None)?;
//! let alloc = |n| group.stream().alloc_zeros::<bf16>(n)
//!     .map_err(|e| tpfuse::Error::Cuda { context: "alloc", source: e });
//! let x = alloc(m * hidden)?;
//! let mut h = alloc(m * gate_up.spec().out_per_rank())?; // [m, gate_r | up_r]
//! gate_up.forward(group, &x, &mut h)?;
//! let act = alloc(m * inter / w)?; // SiLU(gate_r) · up_r, by the engine's own kernel
//! let (mut partial, mut y) = (alloc(m * hidden)?, alloc(m * hidden)?);
//! down.forward(group, &act, &mut partial, &mut y)?; // every other rank makes the same calls
//! # Ok(()) }
//! ```

use crate::device::cuda;
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::group::TpGroup;
use crate::ops::all_reduce::{all_reduce_fused, Algorithm, Epilogue, RmsNorm};
use crate::ops::collectives::all_gather;
use crate::ops::gemm::{gemm, GemmElement};
use crate::shard::{ColumnParallelSpec, GateUpSplit, MergedColumnSpec, QkvSplit, RowParallelSpec};
use crate::topology::AllReduceAlgo;
use crate::validate::owner;
use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

/// The names the GEMM's errors use for its arguments, and what a layer calls them.
const GEMM_NAMES: [(&str, &str); 5] = [
    ("a", "x"),
    ("b", "the weight shard"),
    ("bias", "the bias shard"),
    ("c", "out"),
    ("residual", "residual"),
];

/// Turns an inner op's [`Error::InvalidArgument`] into one naming the layer (`arg`) and, in
/// the reason, the layer's name for the argument the op named.
fn in_layer<'a>(label: &'a str, names: &'a [(&'a str, &'a str)]) -> impl Fn(Error) -> Error + 'a {
    move |e| match e {
        Error::InvalidArgument { arg, reason } => {
            let what = names
                .iter()
                .find(|(inner, _)| *inner == arg)
                .map_or(arg.as_str(), |(_, outer)| outer);
            Error::InvalidArgument {
                arg: label.to_string(),
                reason: format!("{what}: {reason}"),
            }
        }
        other => other,
    }
}

/// Errors unless `group` is rank `rank` of a group of `world` ranks.
fn check_group(label: &str, group: &TpGroup, rank: usize, world: usize) -> Result<()> {
    if group.world() != world {
        return Err(Error::invalid(
            label,
            format!(
                "the layer is sharded for world {world} but the group has {} ranks",
                group.world()
            ),
        ));
    }
    if group.rank() != rank {
        return Err(Error::invalid(
            label,
            format!(
                "the layer holds rank {rank}'s shard but the group is rank {}",
                group.rank()
            ),
        ));
    }
    Ok(())
}

/// The rows `m` of an activation of `len` elements, `k` per row.
fn rows_of(label: &str, what: &str, len: usize, k: usize) -> Result<usize> {
    if len % k != 0 {
        return Err(Error::invalid(
            label,
            format!("{what} holds {len} elements: not whole rows of {k}"),
        ));
    }
    Ok(len / k)
}

/// Errors unless a buffer holds `[rows, cols]` elements.
fn check_len(label: &str, what: &str, len: usize, rows: usize, cols: usize) -> Result<()> {
    let want = rows * cols;
    if len != want {
        return Err(Error::invalid(
            label,
            format!("{what} holds {len} elements but [{rows}, {cols}] needs {want}"),
        ));
    }
    Ok(())
}

/// Errors unless a device shard holds `want` elements on the group's device.
fn check_shard<T>(
    label: &str,
    what: &str,
    shard: &CudaSlice<T>,
    want: usize,
    shape: &str,
    group: &TpGroup,
) -> Result<()> {
    if shard.len() != want {
        return Err(Error::invalid(
            label,
            format!(
                "{what} holds {} elements but {shape} needs {want}",
                shard.len()
            ),
        ));
    }
    let device = owner(shard);
    if device != group.device() {
        return Err(Error::invalid(
            label,
            format!(
                "{what} lives on device {device} but the group's rank {} is on device {}",
                group.rank(),
                group.device()
            ),
        ));
    }
    Ok(())
}

fn upload<T: GemmElement>(group: &TpGroup, host: &[T]) -> Result<CudaSlice<T>> {
    group
        .stream()
        .clone_htod(host)
        .map_err(cuda("uploading a layer's shard"))
}

fn as_dyn<T>(bias: &Option<CudaSlice<T>>) -> Option<&dyn DevicePtr<T>> {
    bias.as_ref().map(|b| b as &dyn DevicePtr<T>)
}

/// A column-parallel shard on the device: `[n, k]` weight rows of the full weight and `[n]`
/// bias, shared by [`ColumnParallelLinear`] and [`MergedColumnParallelLinear`].
struct ColumnShard<T> {
    label: String,
    rank: usize,
    world: usize,
    n: usize,
    k: usize,
    weight: CudaSlice<T>,
    bias: Option<CudaSlice<T>>,
}

impl<T: GemmElement + NcclType> ColumnShard<T> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        label: String,
        group: &TpGroup,
        world: usize,
        n: usize,
        k: usize,
        weight: CudaSlice<T>,
        bias: Option<CudaSlice<T>>,
    ) -> Result<Self> {
        check_shard(
            &label,
            "the weight shard",
            &weight,
            n * k,
            &format!("[out_per_rank, in_features] = [{n}, {k}]"),
            group,
        )?;
        if let Some(b) = &bias {
            check_shard(
                &label,
                "the bias shard",
                b,
                n,
                &format!("[out_per_rank] = [{n}]"),
                group,
            )?;
        }
        Ok(ColumnShard {
            label,
            rank: group.rank(),
            world,
            n,
            k,
            weight,
            bias,
        })
    }

    /// `out [m, n] = x [m, k] · weightᵀ (+ bias)`; returns `m`.
    fn forward(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<usize> {
        let label = self.label.as_str();
        check_group(label, group, self.rank, self.world)?;
        let m = rows_of(label, "x", x.len(), self.k)?;
        check_len(label, "out", out.len(), m, self.n)?;
        gemm(
            group.stream(),
            x,
            &self.weight,
            as_dyn(&self.bias),
            None,
            out,
            m,
            self.n,
            self.k,
        )
        .map_err(in_layer(label, &GEMM_NAMES))?;
        Ok(m)
    }
}

/// What a layer's `Debug` shows: its shape, rank and shard lengths (not the device buffers).
fn debug_layer<T>(
    f: &mut std::fmt::Formatter<'_>,
    kind: &str,
    spec: &dyn std::fmt::Debug,
    rank: usize,
    weight: &CudaSlice<T>,
    bias: Option<&CudaSlice<T>>,
) -> std::fmt::Result {
    f.debug_struct(kind)
        .field("spec", spec)
        .field("rank", &rank)
        .field("weight_len", &weight.len())
        .field("bias_len", &bias.map(|b| b.len()))
        .finish()
}

// ---------------------------------------------------------------------------------------
// Column-parallel.
// ---------------------------------------------------------------------------------------

/// A column-parallel linear layer, one rank of it: `y[:, r·out/W .. (r+1)·out/W] = x · W_rᵀ
/// (+ b_r)`, where `W_r` `[out/W, in]` are rows `r·out/W .. (r+1)·out/W` of the full weight
/// and `b_r` the same slice of the bias. The output stays sharded ([`forward`](Self::forward))
/// or is gathered to the full `[m, out]` on every rank
/// ([`forward_gather`](Self::forward_gather)).
pub struct ColumnParallelLinear<T> {
    spec: ColumnParallelSpec,
    shard: ColumnShard<T>,
}

impl<T> std::fmt::Debug for ColumnParallelLinear<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.shard;
        debug_layer(
            f,
            "ColumnParallelLinear",
            &self.spec,
            s.rank,
            &s.weight,
            s.bias.as_ref(),
        )
    }
}

impl<T: GemmElement + NcclType> ColumnParallelLinear<T> {
    /// The layer from this rank's shard, already on the group's device: `weight`
    /// `[out/W, in]`, `bias` `[out/W]`. Errors (naming the layer): a spec for another world
    /// size than the group's, a shard the GEMM cannot take (`out/W` or `in` not a multiple of
    /// 8), a shard of the wrong length or on another device.
    pub fn from_shard(
        group: &TpGroup,
        spec: ColumnParallelSpec,
        weight: CudaSlice<T>,
        bias: Option<CudaSlice<T>>,
    ) -> Result<Self> {
        let label = spec.label();
        check_group(&label, group, group.rank(), spec.world())?;
        spec.check_gemm_dims()?;
        let shard = ColumnShard::new(
            label,
            group,
            spec.world(),
            spec.out_per_rank(),
            spec.in_features(),
            weight,
            bias,
        )?;
        Ok(ColumnParallelLinear { spec, shard })
    }

    /// The layer from the full host weight `[out_features, in_features]` (and bias
    /// `[out_features]`): this rank's rows are cut ([`ColumnParallelSpec::shard_weight`]) and
    /// uploaded on the group's stream. Errors: as [`from_shard`](Self::from_shard), and host
    /// slices of the wrong length.
    pub fn from_host(
        group: &TpGroup,
        spec: ColumnParallelSpec,
        weight: &[T],
        bias: Option<&[T]>,
    ) -> Result<Self> {
        check_group(&spec.label(), group, group.rank(), spec.world())?;
        spec.check_gemm_dims()?;
        let w = spec.shard_weight(group.rank(), weight)?;
        let b = bias.map(|b| spec.shard_bias(group.rank(), b)).transpose()?;
        let w = upload(group, &w)?;
        let b = b.map(|b| upload(group, &b)).transpose()?;
        Self::from_shard(group, spec, w, b)
    }

    /// The layer's shape.
    pub fn spec(&self) -> &ColumnParallelSpec {
        &self.spec
    }

    /// The layer's name.
    pub fn name(&self) -> &str {
        self.spec.name()
    }

    /// The rank whose shard the layer holds.
    pub fn rank(&self) -> usize {
        self.shard.rank
    }

    /// The weight shard, `[out/W, in]`.
    pub fn weight(&self) -> &CudaSlice<T> {
        &self.shard.weight
    }

    /// The bias shard, `[out/W]`.
    pub fn bias(&self) -> Option<&CudaSlice<T>> {
        self.shard.bias.as_ref()
    }

    /// This rank's columns of the output: `out` `[m, out/W]` = `x` `[m, in]` · `W_rᵀ`
    /// (+ `b_r`), enqueued on the group's stream. `m` is `x.len() / in`; 0 enqueues nothing.
    pub fn forward(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.shard.forward(group, x, out).map(|_| ())
    }

    /// The whole output on every rank: [`forward`](Self::forward) into `local` `[m, out/W]`,
    /// [`all_gather`] of every rank's `local` into `gathered` `[W, m, out/W]` (rank-major),
    /// then `W` strided device-to-device copies (`cuMemcpy2DAsync`, no kernel) into `out`
    /// `[m, out]`, where rank `r`'s columns are `r·out/W .. (r+1)·out/W`. For `m = 1` the two
    /// layouts are the same: the gather writes `out` directly and `gathered` is not touched
    /// (its length is still checked). A collective: every rank calls it with the same `m`.
    pub fn forward_gather(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        local: &mut (impl DevicePtr<T> + DevicePtrMut<T>),
        gathered: &mut (impl DevicePtr<T> + DevicePtrMut<T>),
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let label = self.shard.label.as_str();
        check_group(label, group, self.shard.rank, self.shard.world)?;
        let (n, world) = (self.shard.n, self.shard.world);
        let m = rows_of(label, "x", x.len(), self.shard.k)?;
        check_len(label, "local", local.len(), m, n)?;
        check_len(label, "gathered", gathered.len(), world * m, n)?;
        check_len(label, "out", out.len(), m, self.spec.out_features())?;
        let device = owner(&*out);
        if device != group.device() {
            return Err(Error::invalid(
                label,
                format!(
                    "out lives on device {device} but the group's rank {} is on device {}",
                    group.rank(),
                    group.device()
                ),
            ));
        }
        self.shard.forward(group, x, local)?;
        if m == 0 {
            return Ok(());
        }
        if m == 1 {
            let names = [("input", "local"), ("out", "out")];
            return all_gather(group, &*local, out).map_err(in_layer(label, &names));
        }
        let names = [("input", "local"), ("out", "gathered")];
        all_gather(group, &*local, gathered).map_err(in_layer(label, &names))?;
        rank_major_to_rows(group.stream(), &*gathered, out, world, m, n)
    }
}

/// `out[i, r·n .. (r+1)·n] = gathered[r, i, ..]` for every rank `r` and row `i`: one
/// `cuMemcpy2DAsync` per rank (`m` rows of `n` elements, source pitch `n`, destination pitch
/// `world·n`), enqueued on `stream`.
fn rank_major_to_rows<T>(
    stream: &CudaStream,
    gathered: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
    world: usize,
    m: usize,
    n: usize,
) -> Result<()> {
    let size = std::mem::size_of::<T>();
    let (src, _src_guard) = gathered.device_ptr(stream);
    let (dst, _dst_guard) = out.device_ptr_mut(stream);
    stream
        .context()
        .bind_to_thread()
        .map_err(cuda("binding the context"))?;
    for r in 0..world {
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src + (r * m * n * size) as u64,
            srcArray: std::ptr::null_mut(),
            srcPitch: n * size,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst + (r * n * size) as u64,
            dstArray: std::ptr::null_mut(),
            dstPitch: world * n * size,
            WidthInBytes: n * size,
            Height: m,
        };
        // SAFETY: the caller checked that `gathered` holds world·m·n and `out` m·world·n
        // elements on the stream's device: every source row r·m·n + i·n .. + n and every
        // destination row i·world·n + r·n .. + n lies inside them; the guards keep cudarc's
        // stream ordering until the copies are enqueued.
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream.cu_stream()) }
            .result()
            .map_err(cuda("rearranging the gathered output (cuMemcpy2DAsync)"))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Merged column-parallel.
// ---------------------------------------------------------------------------------------

/// A merged column-parallel layer, one rank of it: QKV with grouped-query heads or gate_up
/// (see [`MergedColumnSpec`]). Rank `r`'s weight is its part of each section, stacked, so
/// its output row `[m, out_per_rank]` is `[q_r | k_r | v_r]` or `[gate_r | up_r]`;
/// [`qkv_split`](Self::qkv_split) and [`gate_up_split`](Self::gate_up_split) say where.
pub struct MergedColumnParallelLinear<T> {
    spec: MergedColumnSpec,
    shard: ColumnShard<T>,
}

impl<T> std::fmt::Debug for MergedColumnParallelLinear<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.shard;
        debug_layer(
            f,
            "MergedColumnParallelLinear",
            &self.spec,
            s.rank,
            &s.weight,
            s.bias.as_ref(),
        )
    }
}

impl<T: GemmElement + NcclType> MergedColumnParallelLinear<T> {
    /// The layer from this rank's shard, already on the group's device: `weight`
    /// `[out_per_rank, in]` (its part of each section, stacked), `bias` `[out_per_rank]`.
    /// Errors (naming the layer): a spec for another world size than the group's, a shard
    /// the GEMM cannot take (`out_per_rank` or `in` not a multiple of 8), a shard of the
    /// wrong length or on another device.
    pub fn from_shard(
        group: &TpGroup,
        spec: MergedColumnSpec,
        weight: CudaSlice<T>,
        bias: Option<CudaSlice<T>>,
    ) -> Result<Self> {
        let label = spec.label();
        check_group(&label, group, group.rank(), spec.world())?;
        spec.check_gemm_dims()?;
        let shard = ColumnShard::new(
            label,
            group,
            spec.world(),
            spec.out_per_rank(),
            spec.in_features(),
            weight,
            bias,
        )?;
        Ok(MergedColumnParallelLinear { spec, shard })
    }

    /// The layer from the full host weight `[out_features, in_features]` (the sections
    /// stacked along the rows) and bias `[out_features]`, cut by
    /// [`MergedColumnSpec::shard_weight`] and uploaded on the group's stream.
    pub fn from_host(
        group: &TpGroup,
        spec: MergedColumnSpec,
        weight: &[T],
        bias: Option<&[T]>,
    ) -> Result<Self> {
        check_group(&spec.label(), group, group.rank(), spec.world())?;
        spec.check_gemm_dims()?;
        let w = spec.shard_weight(group.rank(), weight)?;
        let b = bias.map(|b| spec.shard_bias(group.rank(), b)).transpose()?;
        let w = upload(group, &w)?;
        let b = b.map(|b| upload(group, &b)).transpose()?;
        Self::from_shard(group, spec, w, b)
    }

    /// The layer from one host weight per section (e.g. `q_proj`, `k_proj`, `v_proj`,
    /// each `[heads·head_dim, in_features]`) and optionally one bias per section, cut by
    /// [`MergedColumnSpec::shard_weight_parts`] and uploaded on the group's stream.
    pub fn from_host_parts(
        group: &TpGroup,
        spec: MergedColumnSpec,
        weights: &[&[T]],
        biases: Option<&[&[T]]>,
    ) -> Result<Self> {
        check_group(&spec.label(), group, group.rank(), spec.world())?;
        spec.check_gemm_dims()?;
        let w = spec.shard_weight_parts(group.rank(), weights)?;
        let b = biases
            .map(|b| spec.shard_bias_parts(group.rank(), b))
            .transpose()?;
        let w = upload(group, &w)?;
        let b = b.map(|b| upload(group, &b)).transpose()?;
        Self::from_shard(group, spec, w, b)
    }

    /// The layer's shape.
    pub fn spec(&self) -> &MergedColumnSpec {
        &self.spec
    }

    /// The layer's name.
    pub fn name(&self) -> &str {
        self.spec.name()
    }

    /// The rank whose shard the layer holds.
    pub fn rank(&self) -> usize {
        self.shard.rank
    }

    /// The weight shard, `[out_per_rank, in]`.
    pub fn weight(&self) -> &CudaSlice<T> {
        &self.shard.weight
    }

    /// The bias shard, `[out_per_rank]`.
    pub fn bias(&self) -> Option<&CudaSlice<T>> {
        self.shard.bias.as_ref()
    }

    /// For a QKV layer: the columns of q, k and v in a rank's output row.
    pub fn qkv_split(&self) -> Option<QkvSplit> {
        self.spec.qkv_split()
    }

    /// For a gate_up layer: the columns of gate and up in a rank's output row.
    pub fn gate_up_split(&self) -> Option<GateUpSplit> {
        self.spec.gate_up_split()
    }

    /// `out` `[m, out_per_rank]` = `x` `[m, in]` · `W_rᵀ` (+ `b_r`), enqueued on the group's
    /// stream; `m` is `x.len() / in`, 0 enqueues nothing. No collective: each rank's
    /// sections are what its attention heads (or its MLP slice) need.
    pub fn forward(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.shard.forward(group, x, out).map(|_| ())
    }
}

// ---------------------------------------------------------------------------------------
// Row-parallel.
// ---------------------------------------------------------------------------------------

/// The names the all-reduce's errors use, and what a row-parallel layer calls them.
const ALL_REDUCE_NAMES: [(&str, &str); 7] = [
    ("partial", "partial"),
    ("out", "out"),
    ("bias", "the bias"),
    ("residual", "residual"),
    ("gamma", "norm.gamma"),
    ("eps", "norm.eps"),
    ("algorithm", "the layer's algorithm"),
];

/// A row-parallel linear layer, one rank of it: a partial `x_r · W_rᵀ`, where `W_r`
/// `[out, in/W]` are columns `r·in/W .. (r+1)·in/W` of the full weight and `x_r` the same
/// columns of the input, then the all-reduce `y = Σ_r partial_r + b`. The bias is whole on
/// every rank and is the all-reduce epilogue's bias: added exactly once, in f32, to the
/// rank-ordered f32 sum, before the single rounding. Every rank ends with the same bits.
pub struct RowParallelLinear<T> {
    spec: RowParallelSpec,
    rank: usize,
    weight: CudaSlice<T>,
    bias: Option<CudaSlice<T>>,
    algorithm: Algorithm,
}

impl<T> std::fmt::Debug for RowParallelLinear<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        debug_layer(
            f,
            "RowParallelLinear",
            &self.spec,
            self.rank,
            &self.weight,
            self.bias.as_ref(),
        )
    }
}

impl<T: GemmElement + NcclType> RowParallelLinear<T> {
    /// The layer from this rank's shard, already on the group's device: `weight`
    /// `[out, in/W]` and the whole `bias` `[out]`. The all-reduce algorithm is
    /// [`Algorithm::Auto`] ([`with_algorithm`](Self::with_algorithm) changes it). Errors
    /// (naming the layer): a spec for another world size than the group's, a shard the GEMM
    /// cannot take (`out` or `in/W` not a multiple of 8), a shard of the wrong length or on
    /// another device.
    pub fn from_shard(
        group: &TpGroup,
        spec: RowParallelSpec,
        weight: CudaSlice<T>,
        bias: Option<CudaSlice<T>>,
    ) -> Result<Self> {
        let label = spec.label();
        check_group(&label, group, group.rank(), spec.world())?;
        spec.check_gemm_dims()?;
        let (n, k) = (spec.out_features(), spec.in_per_rank());
        check_shard(
            &label,
            "the weight shard",
            &weight,
            n * k,
            &format!("[out_features, in_features / world] = [{n}, {k}]"),
            group,
        )?;
        if let Some(b) = &bias {
            check_shard(
                &label,
                "the bias",
                b,
                n,
                &format!("[out_features] = [{n}] (a row-parallel bias is whole on every rank)"),
                group,
            )?;
        }
        Ok(RowParallelLinear {
            spec,
            rank: group.rank(),
            weight,
            bias,
            algorithm: Algorithm::Auto,
        })
    }

    /// The layer from the full host weight `[out_features, in_features]` (this rank's
    /// columns are cut by [`RowParallelSpec::shard_weight`]) and the full bias
    /// `[out_features]` (uploaded whole), on the group's stream.
    pub fn from_host(
        group: &TpGroup,
        spec: RowParallelSpec,
        weight: &[T],
        bias: Option<&[T]>,
    ) -> Result<Self> {
        check_group(&spec.label(), group, group.rank(), spec.world())?;
        spec.check_gemm_dims()?;
        let w = spec.shard_weight(group.rank(), weight)?;
        if let Some(b) = bias {
            spec.check_bias(b)?;
        }
        let w = upload(group, &w)?;
        let b = bias.map(|b| upload(group, b)).transpose()?;
        Self::from_shard(group, spec, w, b)
    }

    /// The same layer with another all-reduce algorithm (every rank must choose the same).
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// The all-reduce algorithm the layer asks for.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The layer's shape.
    pub fn spec(&self) -> &RowParallelSpec {
        &self.spec
    }

    /// The layer's name.
    pub fn name(&self) -> &str {
        self.spec.name()
    }

    /// The rank whose shard the layer holds.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The weight shard, `[out, in/W]`.
    pub fn weight(&self) -> &CudaSlice<T> {
        &self.weight
    }

    /// The bias, `[out]`, whole.
    pub fn bias(&self) -> Option<&CudaSlice<T>> {
        self.bias.as_ref()
    }

    /// `m` from `x`, and the lengths of `partial` and `out` (`[m, out]`).
    fn check_call(
        &self,
        group: &TpGroup,
        x: usize,
        partial: usize,
        out: usize,
    ) -> Result<(String, usize)> {
        let label = self.spec.label();
        check_group(&label, group, self.rank, self.spec.world())?;
        let (n, k) = (self.spec.out_features(), self.spec.in_per_rank());
        let m = rows_of(&label, "x", x, k)?;
        check_len(&label, "partial", partial, m, n)?;
        check_len(&label, "out", out, m, n)?;
        Ok((label, m))
    }

    /// The partial product into the caller's workspace: `partial = x · W_rᵀ`, no bias.
    fn partial_gemm(
        &self,
        label: &str,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        partial: &mut impl DevicePtrMut<T>,
        m: usize,
    ) -> Result<()> {
        let names = [("a", "x"), ("b", "the weight shard"), ("c", "partial")];
        let (n, k) = (self.spec.out_features(), self.spec.in_per_rank());
        gemm(
            group.stream(),
            x,
            &self.weight,
            None,
            None,
            partial,
            m,
            n,
            k,
        )
        .map_err(in_layer(label, &names))
    }

    /// `out` `[m, out]` = `Σ_r x_r · W_rᵀ + b` on every rank: the GEMM of this rank's input
    /// columns `x` `[m, in/W]` into the workspace `partial` `[m, out]`, then
    /// [`all_reduce_fused`] of the partials with the bias as its epilogue (added once, in
    /// f32). Enqueued on the group's stream; returns the all-reduce algorithm that ran. A
    /// collective: every rank calls it with the same `m`. `m` is `x.len() / (in/W)`.
    pub fn forward(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        partial: &mut (impl DevicePtr<T> + DevicePtrMut<T>),
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<AllReduceAlgo> {
        let (label, m) = self.check_call(group, x.len(), partial.len(), out.len())?;
        self.partial_gemm(&label, group, x, partial, m)?;
        let epilogue = Epilogue {
            bias: as_dyn(&self.bias),
            residual: None,
            norm: None,
        };
        all_reduce_fused(group, &*partial, epilogue, out, self.algorithm)
            .map_err(in_layer(&label, &ALL_REDUCE_NAMES))
    }

    /// The decode hot path of a transformer block: `h = Σ_r x_r · W_rᵀ + b + residual`,
    /// `residual := h`, `out = rmsnorm(h) · norm.gamma`, on every rank. The GEMM writes the
    /// workspace `partial` `[m, out]`; the reduction, bias, residual add and RMSNorm are one
    /// [`all_reduce_fused`] (fully fused on the one-shot path). Shapes: `x` `[m, in/W]`,
    /// `partial`, `residual` and `out` `[m, out]`, `norm.gamma` `[out]`. Returns the
    /// all-reduce algorithm that ran. A collective, as [`forward`](Self::forward).
    ///
    /// Without a bias and with [`Algorithm::Auto`] this is the GEMM followed by
    /// [`all_reduce_residual_rmsnorm`](crate::ops::all_reduce_residual_rmsnorm); with a
    /// bias, the bias is the epilogue's, added once after the reduction and before the
    /// residual.
    pub fn forward_residual_rmsnorm(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        partial: &mut (impl DevicePtr<T> + DevicePtrMut<T>),
        residual: &mut impl DevicePtrMut<T>,
        norm: RmsNorm<'_, T>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<AllReduceAlgo> {
        let (label, m) = self.check_call(group, x.len(), partial.len(), out.len())?;
        let n = self.spec.out_features();
        check_len(&label, "residual", residual.len(), m, n)?;
        if norm.gamma.len() != n {
            return Err(Error::invalid(
                &label,
                format!(
                    "norm.gamma holds {} elements but a row of out_features needs {n}",
                    norm.gamma.len()
                ),
            ));
        }
        self.partial_gemm(&label, group, x, partial, m)?;
        let epilogue = Epilogue {
            bias: as_dyn(&self.bias),
            residual: Some(residual),
            norm: Some(norm),
        };
        all_reduce_fused(group, &*partial, epilogue, out, self.algorithm)
            .map_err(in_layer(&label, &ALL_REDUCE_NAMES))
    }
}
