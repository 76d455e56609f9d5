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

use crate::device::{bind, cuda};
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
use std::borrow::Cow;

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

/// Errors unless a buffer that lives on device `device` is on the group's device.
fn check_device(label: &str, what: &str, device: usize, group: &TpGroup) -> Result<()> {
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
    check_device(label, what, owner(shard), group)
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

/// How a layer's shard errors name its dimensions: the weight shard is `[n, k]`, the bias
/// `[n]`.
struct ShardNames {
    /// The weight's rows, e.g. `out_per_rank`.
    n: &'static str,
    /// The weight's columns, e.g. `in_features`.
    k: &'static str,
    /// The bias, e.g. `the bias shard`.
    bias: &'static str,
    /// Said after the bias's shape.
    bias_note: &'static str,
}

/// What a layer needs of its spec (from [`crate::shard`]); each method is the spec's own.
trait LayerSpec {
    /// How the layer's shard errors name its dimensions.
    const NAMES: ShardNames;
    fn label(&self) -> String;
    fn world(&self) -> usize;
    fn check_gemm_dims(&self) -> Result<()>;
    /// A rank's weight shard is `[n, k]`.
    fn shard_dims(&self) -> (usize, usize);
    /// Rank `rank`'s weight, cut from the full host weight.
    fn shard_weight<T: Copy>(&self, rank: usize, full: &[T]) -> Result<Vec<T>>;
    /// Rank `rank`'s bias from the full host bias: cut, or (row-parallel) checked and whole.
    fn shard_bias<'a, T: Copy>(&self, rank: usize, full: &'a [T]) -> Result<Cow<'a, [T]>>;
}

/// [`LayerSpec`] for the column-parallel specs: `[out_per_rank, in_features]` shards, and a
/// bias cut like the weight's rows.
macro_rules! column_layer_spec {
    ($($spec:ty),*) => {$(
        impl LayerSpec for $spec {
            const NAMES: ShardNames = ShardNames {
                n: "out_per_rank",
                k: "in_features",
                bias: "the bias shard",
                bias_note: "",
            };
            fn label(&self) -> String {
                <$spec>::label(self)
            }
            fn world(&self) -> usize {
                <$spec>::world(self)
            }
            fn check_gemm_dims(&self) -> Result<()> {
                <$spec>::check_gemm_dims(self)
            }
            fn shard_dims(&self) -> (usize, usize) {
                (self.out_per_rank(), self.in_features())
            }
            fn shard_weight<T: Copy>(&self, rank: usize, full: &[T]) -> Result<Vec<T>> {
                <$spec>::shard_weight(self, rank, full)
            }
            fn shard_bias<'a, T: Copy>(&self, rank: usize, full: &'a [T]) -> Result<Cow<'a, [T]>> {
                <$spec>::shard_bias(self, rank, full).map(Cow::Owned)
            }
        }
    )*};
}

column_layer_spec!(ColumnParallelSpec, MergedColumnSpec);

impl LayerSpec for RowParallelSpec {
    const NAMES: ShardNames = ShardNames {
        n: "out_features",
        k: "in_features / world",
        bias: "the bias",
        bias_note: " (a row-parallel bias is whole on every rank)",
    };
    fn label(&self) -> String {
        RowParallelSpec::label(self)
    }
    fn world(&self) -> usize {
        RowParallelSpec::world(self)
    }
    fn check_gemm_dims(&self) -> Result<()> {
        RowParallelSpec::check_gemm_dims(self)
    }
    fn shard_dims(&self) -> (usize, usize) {
        (self.out_features(), self.in_per_rank())
    }
    fn shard_weight<T: Copy>(&self, rank: usize, full: &[T]) -> Result<Vec<T>> {
        RowParallelSpec::shard_weight(self, rank, full)
    }
    fn shard_bias<'a, T: Copy>(&self, _rank: usize, full: &'a [T]) -> Result<Cow<'a, [T]>> {
        self.check_bias(full)?;
        Ok(Cow::Borrowed(full))
    }
}

/// What every constructor checks first: the spec is for the group's world size, and the GEMM
/// can take its shard.
fn check_spec(group: &TpGroup, spec: &impl LayerSpec) -> Result<()> {
    check_group(&spec.label(), group, group.rank(), spec.world())?;
    spec.check_gemm_dims()
}

/// Uploads a rank's host weight, then its bias, on the group's stream.
fn upload_shard<T: GemmElement>(
    group: &TpGroup,
    weight: &[T],
    bias: Option<&[T]>,
) -> Result<(CudaSlice<T>, Option<CudaSlice<T>>)> {
    let w = upload(group, weight)?;
    let b = bias.map(|b| upload(group, b)).transpose()?;
    Ok((w, b))
}

/// What a `from_host` does before `from_shard`: [`check_spec`], this rank's weight and bias
/// from the full host ones ([`LayerSpec::shard_weight`], [`LayerSpec::shard_bias`]), uploaded.
fn host_shard<T: GemmElement>(
    group: &TpGroup,
    spec: &impl LayerSpec,
    weight: &[T],
    bias: Option<&[T]>,
) -> Result<(CudaSlice<T>, Option<CudaSlice<T>>)> {
    check_spec(group, spec)?;
    let w = spec.shard_weight(group.rank(), weight)?;
    let b = bias.map(|b| spec.shard_bias(group.rank(), b)).transpose()?;
    upload_shard(group, &w, b.as_deref())
}

/// A rank's shard of a layer on the device, `[n, k]` weight and `[n]` bias, with what its
/// calls are checked against; shared by the three layers.
struct Shard<T> {
    label: String,
    rank: usize,
    world: usize,
    n: usize,
    k: usize,
    weight: CudaSlice<T>,
    bias: Option<CudaSlice<T>>,
}

impl<T: GemmElement + NcclType> Shard<T> {
    /// A layer's `from_shard`: [`check_spec`], then the shards' lengths and devices.
    fn new<S: LayerSpec>(
        group: &TpGroup,
        spec: &S,
        weight: CudaSlice<T>,
        bias: Option<CudaSlice<T>>,
    ) -> Result<Self> {
        check_spec(group, spec)?;
        let label = spec.label();
        let (n, k) = spec.shard_dims();
        let names = &S::NAMES;
        check_shard(
            &label,
            "the weight shard",
            &weight,
            n * k,
            &format!("[{}, {}] = [{n}, {k}]", names.n, names.k),
            group,
        )?;
        if let Some(b) = &bias {
            check_shard(
                &label,
                names.bias,
                b,
                n,
                &format!("[{}] = [{n}]{}", names.n, names.bias_note),
                group,
            )?;
        }
        Ok(Shard {
            label,
            rank: group.rank(),
            world: spec.world(),
            n,
            k,
            weight,
            bias,
        })
    }

    /// Errors unless `group` is the layer's; `m` from the length of `x`, `[m, k]`.
    fn rows(&self, group: &TpGroup, x: usize) -> Result<usize> {
        check_group(&self.label, group, self.rank, self.world)?;
        rows_of(&self.label, "x", x, self.k)
    }

    /// `out [m, n] = x [m, k] · weightᵀ (+ bias)`, the GEMM's errors renamed by `names`.
    fn gemm(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        bias: Option<&dyn DevicePtr<T>>,
        out: &mut impl DevicePtrMut<T>,
        m: usize,
        names: &[(&str, &str)],
    ) -> Result<()> {
        gemm(
            group.stream(),
            x,
            &self.weight,
            bias,
            None,
            out,
            m,
            self.n,
            self.k,
        )
        .map_err(in_layer(&self.label, names))
    }

    /// A column-parallel `forward`: `out [m, n] = x [m, k] · weightᵀ (+ bias)`; returns `m`.
    fn forward(
        &self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<usize> {
        let m = self.rows(group, x.len())?;
        check_len(&self.label, "out", out.len(), m, self.n)?;
        self.gemm(group, x, as_dyn(&self.bias), out, m, &GEMM_NAMES)?;
        Ok(m)
    }
}

impl<T> Shard<T> {
    /// What a layer's `Debug` shows: its shape, rank and shard lengths (not the device
    /// buffers).
    fn debug(
        &self,
        f: &mut std::fmt::Formatter<'_>,
        kind: &str,
        spec: &dyn std::fmt::Debug,
    ) -> std::fmt::Result {
        f.debug_struct(kind)
            .field("spec", spec)
            .field("rank", &self.rank)
            .field("weight_len", &self.weight.len())
            .field("bias_len", &self.bias.as_ref().map(|b| b.len()))
            .finish()
    }
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
    shard: Shard<T>,
}

impl<T> std::fmt::Debug for ColumnParallelLinear<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.shard.debug(f, "ColumnParallelLinear", &self.spec)
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
        let shard = Shard::new(group, &spec, weight, bias)?;
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
        let (w, b) = host_shard(group, &spec, weight, bias)?;
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
        let m = self.shard.rows(group, x.len())?;
        let (n, world) = (self.shard.n, self.shard.world);
        check_len(label, "local", local.len(), m, n)?;
        check_len(label, "gathered", gathered.len(), world * m, n)?;
        check_len(label, "out", out.len(), m, self.spec.out_features())?;
        check_device(label, "out", owner(&*out), group)?;
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
    bind(stream)?;
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
    shard: Shard<T>,
}

impl<T> std::fmt::Debug for MergedColumnParallelLinear<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.shard
            .debug(f, "MergedColumnParallelLinear", &self.spec)
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
        let shard = Shard::new(group, &spec, weight, bias)?;
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
        let (w, b) = host_shard(group, &spec, weight, bias)?;
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
        check_spec(group, &spec)?;
        let w = spec.shard_weight_parts(group.rank(), weights)?;
        let b = biases
            .map(|b| spec.shard_bias_parts(group.rank(), b))
            .transpose()?;
        let (w, b) = upload_shard(group, &w, b.as_deref())?;
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
    shard: Shard<T>,
    algorithm: Algorithm,
}

impl<T> std::fmt::Debug for RowParallelLinear<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.shard.debug(f, "RowParallelLinear", &self.spec)
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
        let shard = Shard::new(group, &spec, weight, bias)?;
        Ok(RowParallelLinear {
            spec,
            shard,
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
        let (w, b) = host_shard(group, &spec, weight, bias)?;
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
        self.shard.rank
    }

    /// The weight shard, `[out, in/W]`.
    pub fn weight(&self) -> &CudaSlice<T> {
        &self.shard.weight
    }

    /// The bias, `[out]`, whole.
    pub fn bias(&self) -> Option<&CudaSlice<T>> {
        self.shard.bias.as_ref()
    }

    /// `m` from `x`, and the lengths of `partial` and `out` (`[m, out]`).
    fn check_call(&self, group: &TpGroup, x: usize, partial: usize, out: usize) -> Result<usize> {
        let (label, n) = (self.shard.label.as_str(), self.shard.n);
        let m = self.shard.rows(group, x)?;
        check_len(label, "partial", partial, m, n)?;
        check_len(label, "out", out, m, n)?;
        Ok(m)
    }

    /// What both forwards enqueue once their buffers are checked: the partial product into
    /// the caller's workspace, `partial = x · W_rᵀ` (no bias), then [`all_reduce_fused`] of
    /// the partials with the bias and the given residual and norm as its epilogue.
    #[allow(clippy::too_many_arguments)]
    fn gemm_all_reduce<'e>(
        &'e self,
        group: &TpGroup,
        x: &impl DevicePtr<T>,
        partial: &mut (impl DevicePtr<T> + DevicePtrMut<T>),
        m: usize,
        residual: Option<&'e mut dyn DevicePtrMut<T>>,
        norm: Option<RmsNorm<'e, T>>,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<AllReduceAlgo> {
        let names = [("a", "x"), ("b", "the weight shard"), ("c", "partial")];
        self.shard.gemm(group, x, None, partial, m, &names)?;
        let epilogue = Epilogue {
            bias: as_dyn(&self.shard.bias),
            residual,
            norm,
        };
        all_reduce_fused(group, &*partial, epilogue, out, self.algorithm)
            .map_err(in_layer(&self.shard.label, &ALL_REDUCE_NAMES))
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
        let m = self.check_call(group, x.len(), partial.len(), out.len())?;
        self.gemm_all_reduce(group, x, partial, m, None, None, out)
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
        let m = self.check_call(group, x.len(), partial.len(), out.len())?;
        let (label, n) = (self.shard.label.as_str(), self.shard.n);
        check_len(label, "residual", residual.len(), m, n)?;
        if norm.gamma.len() != n {
            return Err(Error::invalid(
                label,
                format!(
                    "norm.gamma holds {} elements but a row of out_features needs {n}",
                    norm.gamma.len()
                ),
            ));
        }
        self.gemm_all_reduce(group, x, partial, m, Some(residual), Some(norm), out)
    }
}
