//! `gemm`: `C[m, n] = A[m, k] · B[n, k]ᵀ (+ bias[n]) (+ residual[m, n])` on tensor cores.
//!
//! Everything is row-major; `B` is a PyTorch / safetensors weight `[out_features,
//! in_features]`, so `y = x · Wᵀ + b` is `gemm(x, W, Some(b), None, y, tokens, out, in)`.
//! `A`, `B`, `bias`, `residual` and `C` share one element type, f16 or bf16 ([`GemmElement`]);
//! products are accumulated in f32 and the result is rounded once to the element type.
//!
//! # Batch invariance
//!
//! A row of `C` has the same bits whatever `m` is and whichever path or tile configuration
//! computes it. `k` is cut into `S` parts ([`split_parts`]`(n, k, SMs)`: a function of `n`,
//! `k` and the device's SM count, never of `m`; part boundaries at multiples of 64); every
//! output accumulates each part by one chain of `mma.sync.m16n8k16` instructions over the
//! part's `k` in ascending steps of 16 from zero, adds the parts' chains in ascending order in
//! f32, then adds bias and residual in f32 in that order and rounds once, by the same code on
//! every path. Whether a tile's parts run one after another in its block or each in a block of
//! its own ([`gemm_with_scratch`]) changes the speed, never the bits. So a token's output in a
//! decode step (m = 1) equals its output inside a prefill batch (m = 4096), on one GPU model
//! (a device with another SM count may split differently; another architecture may round
//! differently).
//!
//! # Paths
//!
//! Chosen at run time by the device's compute capability and the shape (see [`gemm_paths`],
//! [`select_config`]):
//!
//! - [`GemmPath::Sm80SmallM`], m ≤ [`SMALL_M_MAX`] (decode): one row of 16 tokens per block,
//!   warps spread across `N`, a deep `cp.async` pipeline over the weight slice each block
//!   streams once.
//! - [`GemmPath::Sm80Tiled`], m > [`SMALL_M_MAX`]: 128×128 tiles with 32-deep k-slices in a
//!   4-stage `cp.async` pipeline, or 64×64 tiles with 32-deep slices in 6 stages, swizzled
//!   shared memory, `ldmatrix` + `mma.sync`.
//!
//! A shape whose `k` splits (`S > 1`: narrow layers, whose column tiles alone would leave SMs
//! idle) runs 16×64 (m ≤ 16) or 64×64 tiles; with a scratch ([`gemm_with_scratch`]) and
//! m ≤ [`SPLIT_PARALLEL_M_MAX`], each part of each tile is a block of its own.
//!
//! Both run on every architecture tpfuse builds (sm_80 to sm_120a, and compute_80 PTX).
//!
//! # Example: one linear layer, `y = x · Wᵀ + b`
//!
//! ```no_run
//! use half::bf16;
//! use tpfuse::ops::gemm;
//!
//! # fn main() -> tpfuse::Result<()> {
//! let ctx = tpfuse::device::open(0)?;
//! let stream = ctx.default_stream();
//! let (tokens, out_features, in_features) = (4, 1280, 8192);
//! let alloc = |n| {
//!     stream
//!         .alloc_zeros::<bf16>(n)
//!         .map_err(|e| tpfuse::Error::Cuda { context: "alloc", source: e })
//! };
//! let x = alloc(tokens * in_features)?; // [tokens, in]
//! let w = alloc(out_features * in_features)?; // [out, in], as in PyTorch
//! let b = alloc(out_features)?;
//! let mut y = alloc(tokens * out_features)?; // [tokens, out]
//! gemm(&stream, &x, &w, Some(&b), None, &mut y, tokens, out_features, in_features)?;
//! # Ok(()) }
//! ```
//!
//! `f32` has no GEMM path, so a call on f32 buffers does not compile:
//!
//! ```compile_fail
//! # use cudarc::driver::{CudaSlice, CudaStream};
//! # fn f(s: &CudaStream, a: &CudaSlice<f32>, b: &CudaSlice<f32>, c: &mut CudaSlice<f32>) {
//! tpfuse::ops::gemm(s, a, b, None, None, c, 1, 8, 8).unwrap();
//! # }
//! ```

use crate::device::bind;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::ffi::kernels;
use crate::validate::{check_disjoint, owner, BufferInfo};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::{bf16, f16};
use std::ffi::c_void;

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// An element type the GEMM kernels take: [`struct@f16`] or [`struct@bf16`] (f32 has no GEMM
/// path).
pub trait GemmElement: Element + sealed::Sealed {}
impl GemmElement for f16 {}
impl GemmElement for bf16 {}

/// The largest `m` the automatic choice sends to the small-m (decode) path.
pub const SMALL_M_MAX: usize = kernels::TPFUSE_GEMM_SMALL_M_MAX as usize;

/// The largest `m`, `n` or `k` a call takes (2^30).
pub const MAX_DIM: usize = 1 << 30;

/// The largest `m` whose parts of `k` run in parallel with a scratch ([`gemm_with_scratch`]).
pub const SPLIT_PARALLEL_M_MAX: usize = kernels::TPFUSE_GEMM_SPLIT_PARALLEL_M_MAX as usize;

/// The shape of a GEMM: `A` is `[m, k]`, `B` is `[n, k]`, `C` is `[m, n]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmShape {
    /// Rows of `A` and `C` (tokens). Any value up to [`MAX_DIM`]; 0 launches nothing.
    pub m: usize,
    /// Rows of `B`, columns of `C` (output features). A positive multiple of 8.
    pub n: usize,
    /// Columns of `A` and `B` (input features). A positive multiple of 8.
    pub k: usize,
}

impl GemmShape {
    /// The floating-point operations of one call, `2·m·n·k`.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

/// A kernel path: the family of kernels that runs a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GemmPath {
    /// `mma.sync` with 16-row blocks spread across `N`, for m ≤ [`SMALL_M_MAX`] (sm_80 on).
    Sm80SmallM,
    /// `mma.sync` with `cp.async` multistage 64×64 / 128×128 tiles (sm_80 on).
    Sm80Tiled,
}

impl GemmPath {
    /// A short name, e.g. `"sm80-small-m"`.
    pub fn name(self) -> &'static str {
        match self {
            GemmPath::Sm80SmallM => "sm80-small-m",
            GemmPath::Sm80Tiled => "sm80-tiled",
        }
    }

    fn from_abi(path: i32) -> Option<GemmPath> {
        match u32::try_from(path).ok()? {
            kernels::TPFUSE_GEMM_PATH_SM80_SMALL_M => Some(GemmPath::Sm80SmallM),
            kernels::TPFUSE_GEMM_PATH_SM80_TILED => Some(GemmPath::Sm80Tiled),
            _ => None,
        }
    }
}

/// A tile configuration of the kernels. Every configuration is valid for every shape and gives
/// the same bits, except that [`GemmConfig::Tile128x128`] runs no split of `k`
/// ([`GemmConfig::splits_k`]); [`gemm`] picks one by device and shape, [`gemm_with_config`]
/// forces one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GemmConfig {
    /// Small-m path, 16×16 tiles, one warp per block.
    SmallM16x16,
    /// Small-m path, 16×32 tiles, two warps per block.
    SmallM16x32,
    /// Small-m path, 16×64 tiles, four warps per block.
    SmallM16x64,
    /// Tiled path, 64×64 tiles, four warps per block.
    Tile64x64,
    /// Tiled path, 128×128 tiles, eight warps per block.
    Tile128x128,
}

/// What a [`GemmConfig`] is, as the kernels define it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmConfigInfo {
    /// Its path.
    pub path: GemmPath,
    /// Rows of `C` per block.
    pub block_m: usize,
    /// Columns of `C` per block.
    pub block_n: usize,
    /// Depth of one k-slice in shared memory.
    pub block_k: usize,
    /// k-slices in the `cp.async` pipeline.
    pub stages: usize,
    /// Threads per block.
    pub threads: usize,
    /// Dynamic shared memory per block, in bytes.
    pub smem_bytes: usize,
}

impl GemmConfig {
    /// Every configuration.
    pub const ALL: [GemmConfig; 5] = [
        GemmConfig::SmallM16x16,
        GemmConfig::SmallM16x32,
        GemmConfig::SmallM16x64,
        GemmConfig::Tile64x64,
        GemmConfig::Tile128x128,
    ];

    /// A short name, e.g. `"tile-128x128"`.
    pub fn name(self) -> &'static str {
        match self {
            GemmConfig::SmallM16x16 => "small-m-16x16",
            GemmConfig::SmallM16x32 => "small-m-16x32",
            GemmConfig::SmallM16x64 => "small-m-16x64",
            GemmConfig::Tile64x64 => "tile-64x64",
            GemmConfig::Tile128x128 => "tile-128x128",
        }
    }

    pub(crate) fn abi(self) -> i32 {
        let id = match self {
            GemmConfig::SmallM16x16 => kernels::TPFUSE_GEMM_CONFIG_SMALL_16X16,
            GemmConfig::SmallM16x32 => kernels::TPFUSE_GEMM_CONFIG_SMALL_16X32,
            GemmConfig::SmallM16x64 => kernels::TPFUSE_GEMM_CONFIG_SMALL_16X64,
            GemmConfig::Tile64x64 => kernels::TPFUSE_GEMM_CONFIG_TILE_64X64,
            GemmConfig::Tile128x128 => kernels::TPFUSE_GEMM_CONFIG_TILE_128X128,
        };
        id as i32
    }

    fn from_abi(id: i32) -> Option<GemmConfig> {
        GemmConfig::ALL.into_iter().find(|c| c.abi() == id)
    }

    /// Its tile shape, pipeline, block size and path, from the kernels' own definitions.
    pub fn info(self) -> GemmConfigInfo {
        self.describe(false)
    }

    /// What the fused kernels ([`crate::ops::gemm_all_reduce()`],
    /// [`crate::ops::all_gather_gemm()`], ...) run for this configuration: the same tiles (the
    /// same bits), with [`GemmConfig::Tile64x64`]'s k-slices 64 deep (all-gather + GEMM runs
    /// one block per SM by default, GEMM + all-reduce two on an H100: few blocks share an SM's
    /// bytes in flight).
    pub fn fused_info(self) -> GemmConfigInfo {
        self.describe(true)
    }

    fn describe(self, fused: bool) -> GemmConfigInfo {
        let mut raw = kernels::tpfuse_gemm_config_info {
            path: 0,
            block_m: 0,
            block_n: 0,
            block_k: 0,
            stages: 0,
            threads: 0,
            smem_bytes: 0,
        };
        // SAFETY: writes one plain struct; needs no GPU.
        let code = unsafe {
            if fused {
                kernels::tpfuse_gemm_describe_fused(self.abi(), &mut raw)
            } else {
                kernels::tpfuse_gemm_describe(self.abi(), &mut raw)
            }
        };
        debug_assert_eq!(code, 0, "every GemmConfig has an ABI id");
        let size = |v: i32| usize::try_from(v).unwrap_or(0);
        GemmConfigInfo {
            path: GemmPath::from_abi(raw.path).unwrap_or(GemmPath::Sm80Tiled),
            block_m: size(raw.block_m),
            block_n: size(raw.block_n),
            block_k: size(raw.block_k),
            stages: size(raw.stages),
            threads: size(raw.threads),
            smem_bytes: size(raw.smem_bytes),
        }
    }

    /// Its path.
    pub fn path(self) -> GemmPath {
        self.info().path
    }

    /// Whether it runs a split of `k` ([`split_parts`] > 1). Every configuration but
    /// [`GemmConfig::Tile128x128`] does; forcing that one on a shape whose `k` splits is an
    /// error (it could not give the contract's bits).
    pub fn splits_k(self) -> bool {
        self != GemmConfig::Tile128x128
    }
}

/// The configuration [`gemm`] runs for `shape` on a device of compute capability
/// `(major, minor)` with `sm_count` SMs; `None` where that device has no GEMM path (before
/// compute capability 8.0). The same function the kernels' entry point uses.
pub fn select_config(
    shape: GemmShape,
    compute_capability: (u32, u32),
    sm_count: usize,
) -> Option<GemmConfig> {
    let (major, minor) = compute_capability;
    // SAFETY: pure function of its arguments; needs no GPU.
    let id = unsafe {
        kernels::tpfuse_gemm_select(
            shape.m,
            shape.n,
            shape.k,
            i32::try_from(major).unwrap_or(i32::MAX),
            i32::try_from(minor).unwrap_or(i32::MAX),
            i32::try_from(sm_count).unwrap_or(i32::MAX),
        )
    };
    GemmConfig::from_abi(id)
}

/// The parts `S` the batch-invariance contract cuts `k` into for an `[n, k]` weight on a
/// device of `sm_count` SMs (1: no split): the fewest that give a decode step's 64-column tiles
/// x parts enough blocks to keep the SMs busy, at most 16 and `k / 128`. The same function
/// the kernels use; it never depends on `m`.
pub fn split_parts(n: usize, k: usize, sm_count: usize) -> usize {
    // SAFETY: pure function of its arguments; needs no GPU.
    let parts = unsafe {
        kernels::tpfuse_gemm_split_parts(n, k, i32::try_from(sm_count).unwrap_or(i32::MAX))
    };
    usize::try_from(parts).unwrap_or(1).max(1)
}

/// [`split_parts`] on the device of `stream` (its SM count read from the driver).
pub fn split_parts_on(stream: &CudaStream, n: usize, k: usize) -> Result<usize> {
    Ok(split_parts(n, k, crate::group::sm_count(stream.context())?))
}

/// The scratch, in bytes, that [`gemm_with_scratch`] needs to run the parts of `shape`'s `k`
/// in parallel on a device of `sm_count` SMs; 0 when it would not (one part, or `m` past
/// [`SPLIT_PARALLEL_M_MAX`]).
pub fn split_scratch_bytes(shape: GemmShape, sm_count: usize) -> usize {
    // SAFETY: pure function of its arguments; needs no GPU.
    unsafe {
        kernels::tpfuse_gemm_scratch_bytes(
            shape.m,
            shape.n,
            shape.k,
            i32::try_from(sm_count).unwrap_or(i32::MAX),
        )
    }
}

/// The GEMM paths this build has for each compiled architecture, in build order, e.g.
/// `("sm_90a", [Sm80SmallM, Sm80Tiled])`. `compute_*` entries are PTX that the driver compiles
/// for newer GPUs; they carry the same paths. (A future sm_90a wgmma path is listed here for
/// `sm_90a` only.) The emulator build has one row, `("emulator", [Sm80SmallM, Sm80Tiled])`:
/// it runs the sm80 paths on the CPU.
pub fn gemm_paths() -> Vec<(&'static str, Vec<GemmPath>)> {
    if crate::build_info::EMULATED {
        return vec![("emulator", vec![GemmPath::Sm80SmallM, GemmPath::Sm80Tiled])];
    }
    crate::build_info::architectures()
        .into_iter()
        .map(|arch| {
            let digits: String = arch
                .trim_start_matches("sm_")
                .trim_start_matches("compute_")
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            let cc: u32 = digits.parse().unwrap_or(0);
            let paths = if cc >= 80 {
                vec![GemmPath::Sm80SmallM, GemmPath::Sm80Tiled]
            } else {
                Vec::new()
            };
            (arch, paths)
        })
        .collect()
}

/// The buffers of one call, as the checks see them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmBuffers {
    /// `[m, k]`.
    pub a: BufferInfo,
    /// `[n, k]`.
    pub b: BufferInfo,
    /// `[n]`, if given.
    pub bias: Option<BufferInfo>,
    /// `[m, n]`, if given; may be exactly `c` (in-place accumulation).
    pub residual: Option<BufferInfo>,
    /// `[m, n]`, the output.
    pub c: BufferInfo,
}

/// `c = a · bᵀ (+ bias) (+ residual)`, enqueued on `stream`.
///
/// Shapes (elements, row-major): `a` `[m, k]`, `b` `[n, k]` (a weight `[out, in]`), `bias`
/// `[n]`, `residual` `[m, n]`, `c` `[m, n]`, all on `stream`'s device, all 16-byte aligned.
/// `n` and `k` are positive multiples of 8, `m` any value (0 enqueues nothing); each at most
/// [`MAX_DIM`]. `c` must not overlap `a`, `b`, `bias` or `residual` (for `c += a · bᵀ` use
/// [`gemm_accumulate`]).
///
/// `c[i, j] = round(Σ_l a[i, l]·b[j, l] + bias[j] + residual[i, j])`: f32 accumulation in
/// ascending `l`, bias then residual added in f32, one rounding to `T`. Batch invariant (see
/// the [module docs](self)).
///
/// Errors, before anything is launched: [`Error::InvalidArgument`] naming `m`, `n`, `k`, or
/// the buffer that has the wrong length, lives on another device, is misaligned or overlaps
/// `c`. A device older than compute capability 8.0 gives [`Error::KernelLaunch`] (no kernel
/// image; nothing runs).
#[allow(clippy::too_many_arguments)]
pub fn gemm<T: GemmElement>(
    stream: &CudaStream,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    bias: Option<&dyn DevicePtr<T>>,
    residual: Option<&dyn DevicePtr<T>>,
    c: &mut impl DevicePtrMut<T>,
    m: usize,
    n: usize,
    k: usize,
) -> Result<()> {
    let residual = Residual::separate(residual);
    launch(
        stream,
        a,
        b,
        bias,
        residual,
        c,
        GemmShape { m, n, k },
        None,
        None,
    )
}

/// `c = c + a · bᵀ (+ bias)` in place, enqueued on `stream`: [`gemm`] with `c` as its own
/// residual (the residual stream of a transformer block). The same bits as [`gemm`] with a
/// separate residual that holds `c`'s values. Shapes and errors as for [`gemm`].
pub fn gemm_accumulate<T: GemmElement>(
    stream: &CudaStream,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    bias: Option<&dyn DevicePtr<T>>,
    c: &mut impl DevicePtrMut<T>,
    shape: GemmShape,
) -> Result<()> {
    launch(stream, a, b, bias, Residual::InPlace, c, shape, None, None)
}

/// [`gemm`] with a forced tile configuration instead of the automatic choice, for tests and
/// benchmarks (every configuration gives the same bits; only the speed differs). A
/// configuration that does not [split k](GemmConfig::splits_k) is refused
/// ([`Error::InvalidArgument`] naming `config`) for a shape whose `k` splits on this device.
#[allow(clippy::too_many_arguments)]
pub fn gemm_with_config<T: GemmElement>(
    stream: &CudaStream,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    bias: Option<&dyn DevicePtr<T>>,
    residual: Option<&dyn DevicePtr<T>>,
    c: &mut impl DevicePtrMut<T>,
    shape: GemmShape,
    config: GemmConfig,
) -> Result<()> {
    let residual = Residual::separate(residual);
    launch(stream, a, b, bias, residual, c, shape, Some(config), None)
}

/// [`gemm_with_config`] with a scratch for the parallel split of `k` ([`gemm_with_scratch`]):
/// a forced configuration as a group's decode GEMMs would run it, for benchmarks that
/// compare configurations. The same bits as [`gemm`]; arguments and errors as for those two.
/// The scratch is used only by a configuration with a parallel split (16×64 and 64×64 tiles)
/// at m ≤ [`SPLIT_PARALLEL_M_MAX`]; otherwise the parts run one after another in each block.
#[allow(clippy::too_many_arguments)]
pub fn gemm_with_config_and_scratch<T: GemmElement>(
    stream: &CudaStream,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    bias: Option<&dyn DevicePtr<T>>,
    residual: Option<&dyn DevicePtr<T>>,
    c: &mut impl DevicePtrMut<T>,
    shape: GemmShape,
    config: GemmConfig,
    scratch: &mut dyn DevicePtrMut<u8>,
) -> Result<()> {
    let residual = Residual::separate(residual);
    launch(
        stream,
        a,
        b,
        bias,
        residual,
        c,
        shape,
        Some(config),
        Some(scratch),
    )
}

/// [`gemm`] with a scratch for the parallel split of `k`: where `shape`'s `k` splits into
/// parts ([`split_parts`] > 1) and `m` ≤ [`SPLIT_PARALLEL_M_MAX`], each part of each output
/// tile runs in a block of its own, so that more SMs stream the weight, and the parts are
/// folded in order into a running sum, each run of stored parts by the block whose part finds
/// every earlier one folded (`cuda/gemm_split.cuh`). The same bits as [`gemm`] (the parts are
/// added in the same order either way).
///
/// `scratch`: bytes on `stream`'s device, 16-byte aligned, **zeroed before its first use**
/// (e.g. `alloc_zeros`), used by one stream at a time (and not by two branches of one CUDA
/// graph). Calls of any shape may share it: its first 16 KiB hold per-tile counts that every
/// completed call leaves at zero, the rest the parts' f32 partials, written before they are
/// read. After a launch that failed (a device error), zero it again. [`split_scratch_bytes`]
/// says how much a shape needs; a smaller scratch runs the parts one after another. It must
/// not overlap any other buffer of the call. Shapes and errors as for [`gemm`], and `scratch`
/// named when it lives elsewhere, is misaligned or overlaps.
#[allow(clippy::too_many_arguments)]
pub fn gemm_with_scratch<T: GemmElement>(
    stream: &CudaStream,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    bias: Option<&dyn DevicePtr<T>>,
    residual: Option<&dyn DevicePtr<T>>,
    c: &mut impl DevicePtrMut<T>,
    shape: GemmShape,
    scratch: &mut dyn DevicePtrMut<u8>,
) -> Result<()> {
    let residual = Residual::separate(residual);
    launch(stream, a, b, bias, residual, c, shape, None, Some(scratch))
}

/// Where the residual comes from.
enum Residual<'a, T> {
    None,
    Separate(&'a dyn DevicePtr<T>),
    InPlace,
}

impl<'a, T> Residual<'a, T> {
    /// A caller's optional separate residual.
    fn separate(residual: Option<&'a dyn DevicePtr<T>>) -> Self {
        residual.map_or(Residual::None, Residual::Separate)
    }
}

#[allow(clippy::too_many_arguments)]
fn launch<T: GemmElement>(
    stream: &CudaStream,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    bias: Option<&dyn DevicePtr<T>>,
    residual: Residual<'_, T>,
    c: &mut impl DevicePtrMut<T>,
    shape: GemmShape,
    config: Option<GemmConfig>,
    scratch: Option<&mut dyn DevicePtrMut<u8>>,
) -> Result<()> {
    let device = stream.context().ordinal();
    // Devices and lengths first, before any pointer is taken: taking the pointer of a buffer
    // on another device would order that device's events on this stream.
    let c_info = BufferInfo::new(0, c.len(), owner(&*c));
    let mut buffers = GemmBuffers {
        a: BufferInfo::new(0, a.len(), owner(a)),
        b: BufferInfo::new(0, b.len(), owner(b)),
        bias: bias.map(|x| BufferInfo::new(0, x.len(), owner(x))),
        residual: match residual {
            Residual::None => None,
            Residual::Separate(x) => Some(BufferInfo::new(0, x.len(), owner(x))),
            Residual::InPlace => Some(c_info),
        },
        c: c_info,
    };
    check_shapes(&buffers, shape, device)?;
    if let Some(scratch) = scratch.as_deref() {
        BufferInfo::new(0, scratch.len(), owner(scratch)).check_device("scratch", device)?;
    }
    if shape.m == 0 {
        return Ok(());
    }
    if let Some(config) = config.filter(|c| !c.splits_k()) {
        let parts = split_parts_on(stream, shape.n, shape.k)?;
        if parts > 1 {
            return Err(Error::invalid(
                "config",
                format!(
                    "{} runs no split of k, and n = {}, k = {} split into {parts} parts on \
                     this device",
                    config.name(),
                    shape.n,
                    shape.k
                ),
            ));
        }
    }
    let (a_ptr, _a_guard) = a.device_ptr(stream);
    let (b_ptr, _b_guard) = b.device_ptr(stream);
    let (bias_ptr, _bias_guard) = bias.map(|x| x.device_ptr(stream)).unzip();
    let (residual_ptr, _residual_guard) = match residual {
        Residual::Separate(x) => {
            let (ptr, guard) = x.device_ptr(stream);
            (Some(ptr), Some(guard))
        }
        _ => (None, None),
    };
    let (c_ptr, _c_guard) = c.device_ptr_mut(stream);
    buffers.a.addr = a_ptr;
    buffers.b.addr = b_ptr;
    if let (Some(info), Some(ptr)) = (buffers.bias.as_mut(), bias_ptr) {
        info.addr = ptr;
    }
    let residual_ptr = match residual {
        Residual::InPlace => Some(c_ptr),
        _ => residual_ptr,
    };
    if let (Some(info), Some(ptr)) = (buffers.residual.as_mut(), residual_ptr) {
        info.addr = ptr;
    }
    buffers.c.addr = c_ptr;
    check_layout::<T>(&buffers)?;
    let (scratch_ptr, scratch_len, _scratch_guard) = match scratch {
        Some(s) => {
            let len = s.len();
            let (ptr, guard) = s.device_ptr_mut(stream);
            check_scratch(ptr, len, &buffers)?;
            (ptr, len, Some(guard))
        }
        None => (0, 0, None),
    };
    bind(stream)?;
    let as_ptr = |p: Option<u64>| p.map_or(std::ptr::null(), |p| p as *const c_void);
    // SAFETY: validated above: a holds m*k, b n*k, bias n, residual and c m*n elements of T,
    // all on this stream's device and 16-byte aligned, n and k positive multiples of 8, every
    // dimension at most 2^30, c disjoint from a, b and bias, residual either c itself or
    // disjoint from it; the guards keep cudarc's stream ordering until the kernel is enqueued.
    // The scratch, when given, holds scratch_len bytes on this device, 16-byte aligned and
    // disjoint from every other buffer (checked above).
    let code = unsafe {
        kernels::tpfuse_gemm_scratch(
            T::DTYPE,
            config.map_or(kernels::TPFUSE_GEMM_CONFIG_AUTO, GemmConfig::abi),
            a_ptr as *const c_void,
            b_ptr as *const c_void,
            as_ptr(bias_ptr),
            as_ptr(residual_ptr),
            c_ptr as *mut c_void,
            shape.m,
            shape.n,
            shape.k,
            scratch_ptr as *mut c_void,
            scratch_len,
            stream.cu_stream() as *mut c_void,
        )
    };
    crate::validate::launched("tpfuse_gemm", code)
}

/// The checks of [`gemm`], on buffer descriptions (so they run without a GPU): the shape,
/// every buffer's device and length, then alignment and overlaps.
pub fn check_gemm<T: GemmElement>(
    buffers: &GemmBuffers,
    shape: GemmShape,
    device: usize,
) -> Result<()> {
    check_shapes(buffers, shape, device)?;
    if shape.m == 0 {
        return Ok(());
    }
    check_layout::<T>(buffers)
}

/// The dimensions, then every buffer's device and length (no addresses needed).
pub(crate) fn check_gemm_shapes(
    buffers: &GemmBuffers,
    shape: GemmShape,
    device: usize,
) -> Result<()> {
    check_shapes(buffers, shape, device)
}

/// The dimensions, then every buffer's device and length.
fn check_shapes(buffers: &GemmBuffers, shape: GemmShape, device: usize) -> Result<()> {
    let GemmShape { m, n, k } = shape;
    for (name, value) in [("k", k), ("n", n)] {
        if value == 0 || value % 8 != 0 {
            return Err(Error::invalid(
                name,
                format!("{name} = {value}: must be a positive multiple of 8"),
            ));
        }
    }
    for (name, value) in [("m", m), ("n", n), ("k", k)] {
        if value > MAX_DIM {
            return Err(Error::invalid(
                name,
                format!("{name} = {value} exceeds the largest supported dimension, 2^30"),
            ));
        }
    }
    // Products of two dimensions of at most 2^30 fit in a 64-bit usize; checked anyway.
    let product = |x: usize, y: usize, what: &str| {
        x.checked_mul(y).ok_or_else(|| {
            Error::invalid(
                what,
                format!("{x} x {y} elements overflow the address space"),
            )
        })
    };
    let mn = product(m, n, "c")?;
    let expected = [
        ("a", Some(&buffers.a), product(m, k, "a")?, "m * k"),
        ("b", Some(&buffers.b), product(n, k, "b")?, "n * k"),
        ("bias", buffers.bias.as_ref(), n, "n"),
        ("residual", buffers.residual.as_ref(), mn, "m * n"),
        ("c", Some(&buffers.c), mn, "m * n"),
    ];
    for (name, info, len, formula) in expected {
        let Some(info) = info else { continue };
        info.check_device(name, device)?;
        if info.len != len {
            return Err(Error::invalid(
                name,
                format!(
                    "holds {} elements but m = {m}, n = {n}, k = {k} need {formula} = {len}",
                    info.len
                ),
            ));
        }
    }
    Ok(())
}

/// The scratch: 16-byte aligned, and disjoint from every buffer of the call (it is written).
fn check_scratch(addr: u64, len: usize, buffers: &GemmBuffers) -> Result<()> {
    let scratch = BufferInfo::new(addr, len, 0);
    scratch.check_aligned16("scratch")?;
    let end = addr.saturating_add(len as u64);
    let elem = std::mem::size_of::<u16>() as u64; // GEMM elements are 16-bit
    let named = [
        ("a", Some(&buffers.a)),
        ("b", Some(&buffers.b)),
        ("bias", buffers.bias.as_ref()),
        ("residual", buffers.residual.as_ref()),
        ("c", Some(&buffers.c)),
    ];
    for (name, info) in named {
        let Some(info) = info else { continue };
        let info_end = info.addr.saturating_add(info.len as u64 * elem);
        if len > 0 && info.len > 0 && addr < info_end && info.addr < end {
            return Err(Error::invalid(
                "scratch",
                format!("overlaps {name}, and the scratch is written"),
            ));
        }
    }
    Ok(())
}

/// 16-byte alignment of every buffer; `c` disjoint from every input except a residual that is
/// exactly `c`.
fn check_layout<T: GemmElement>(buffers: &GemmBuffers) -> Result<()> {
    let all = [
        ("a", Some(&buffers.a)),
        ("b", Some(&buffers.b)),
        ("bias", buffers.bias.as_ref()),
        ("residual", buffers.residual.as_ref()),
        ("c", Some(&buffers.c)),
    ];
    for (name, info) in all {
        if let Some(info) = info {
            info.check_aligned16(name)?;
        }
    }
    let c = &buffers.c;
    check_disjoint::<T>("a", &buffers.a, "c", c)?;
    check_disjoint::<T>("b", &buffers.b, "c", c)?;
    if let Some(bias) = &buffers.bias {
        check_disjoint::<T>("bias", bias, "c", c)?;
    }
    if let Some(residual) = &buffers.residual {
        let same = residual.addr == c.addr && residual.len == c.len;
        if !same && check_disjoint::<T>("c", c, "residual", residual).is_err() {
            return Err(Error::invalid(
                "residual",
                "overlaps c without being c exactly: in-place accumulation passes c itself as \
                 the residual (gemm_accumulate); any other overlap is a race",
            ));
        }
    }
    Ok(())
}
