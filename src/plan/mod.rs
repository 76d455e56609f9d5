//! Plans: what tpfuse runs for a model's layers on a device, and what that costs.
//!
//! [`plan_model`] takes a model's shapes ([`ModelShape`]: built in, or a Hugging Face
//! `config.json`), a tensor-parallel size, the rows per step and a [`DeviceProfile`], and gives
//! one [`PlanRow`] per GEMM and collective of a layer: the tile configuration and algorithm
//! the launches would choose (the same functions they call: [`crate::ops::gemm::select_config`],
//! the all-reduce and fusion rules), how many SMs get work, the bytes each SM moves, the
//! bytes it keeps in flight, the synchronisation rounds, the bandwidth floor and a modelled
//! time. `tpfuse plan` prints them; `docs/performance.md` gives the model's formula and sets it
//! against published measurements. The model is a model: no GPU measured it.
//!
//! ```
//! use tpfuse::ops::linear::Fusion;
//! use tpfuse::plan::{plan_model, DeviceProfile, ModelShape};
//!
//! let model = ModelShape::builtin("llama-3-70b").unwrap();
//! let h100 = DeviceProfile::builtin("h100-sxm").unwrap();
//! let rows = plan_model(&model, 8, &[1], &h100, Fusion::Auto).unwrap();
//! let qkv = &rows[0];
//! assert_eq!((qkv.layer.as_str(), qkv.n, qkv.k), ("qkv", 1280, 8192));
//! assert!(qkv.floor_us <= qkv.model_us);
//! ```

mod collective;
mod fused;
mod model;
mod profile;
mod rows;

pub use collective::{all_reduce_row, CollectiveLaunch};
pub use fused::{fused_block_bytes, fused_norm_bytes, fused_row};
pub use model::{LayerGemm, ModelShape, BUILTIN_MODELS};
pub use profile::{DeviceProfile, Link, BUILTIN_DEVICES};
pub use rows::{
    gemm_block_bytes, gemm_row, gemm_split_block_bytes, plan_model, plan_model_with, PlanRow,
    ELEMENT_BYTES,
};
