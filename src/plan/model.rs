//! The shapes of a dense Llama-style decoder layer: built-in models, or a Hugging Face
//! `config.json`.

use crate::error::{Error, Result};

/// The dimensions of a dense decoder layer (attention with grouped-query heads, then a gated
/// MLP), as a Hugging Face `config.json` gives them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// A name for reports, e.g. `"llama-3-70b"`.
    pub name: String,
    /// `hidden_size`.
    pub hidden: usize,
    /// `intermediate_size` (the MLP's inner width).
    pub intermediate: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `num_key_value_heads` (grouped-query attention; equal to `heads` without it).
    pub kv_heads: usize,
    /// `head_dim` (`hidden / heads` when the config has none).
    pub head_dim: usize,
    /// `num_hidden_layers`.
    pub layers: usize,
}

/// One GEMM of a decoder layer on one rank: `[m, k] · [n, k]ᵀ`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerGemm {
    /// `"qkv"`, `"o_proj"`, `"gate_up"` or `"down"`.
    pub layer: &'static str,
    /// Output features on this rank.
    pub n: usize,
    /// Input features on this rank.
    pub k: usize,
    /// Row-parallel (its output is all-reduced: `o_proj`, `down`), else column-parallel.
    pub row_parallel: bool,
}

/// The names [`ModelShape::builtin`] knows.
pub const BUILTIN_MODELS: [&str; 3] = ["llama-3-8b", "llama-3-70b", "qwen2.5-72b"];

impl ModelShape {
    /// A built-in model by name ([`BUILTIN_MODELS`]): the dimensions of its published
    /// `config.json`.
    pub fn builtin(name: &str) -> Option<ModelShape> {
        let shape = |hidden, intermediate, heads, kv_heads, layers| ModelShape {
            name: name.to_string(),
            hidden,
            intermediate,
            heads,
            kv_heads,
            head_dim: 128,
            layers,
        };
        match name {
            // meta-llama/Meta-Llama-3-8B config.json
            "llama-3-8b" => Some(shape(4096, 14336, 32, 8, 32)),
            // meta-llama/Meta-Llama-3-70B config.json
            "llama-3-70b" => Some(shape(8192, 28672, 64, 8, 80)),
            // Qwen/Qwen2.5-72B config.json
            "qwen2.5-72b" => Some(shape(8192, 29568, 64, 8, 80)),
            _ => None,
        }
    }

    /// A model from the text of a Hugging Face `config.json`: `hidden_size`,
    /// `intermediate_size`, `num_attention_heads` and `num_hidden_layers` are required;
    /// `num_key_value_heads` defaults to the heads, `head_dim` to `hidden_size / heads`.
    /// Errors name the missing or invalid field.
    pub fn from_hf_config(name: &str, json: &str) -> Result<ModelShape> {
        let value: serde_json::Value = serde_json::from_str(json)
            .map_err(|e| Error::invalid("config", format!("not JSON: {e}")))?;
        let field = |key: &str| -> Result<Option<usize>> {
            match value.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .filter(|&x| x > 0)
                    .and_then(|x| usize::try_from(x).ok())
                    .map(Some)
                    .ok_or_else(|| {
                        Error::invalid("config", format!("{key} = {v}: not a positive integer"))
                    }),
            }
        };
        let required = |key: &str| -> Result<usize> {
            field(key)?.ok_or_else(|| Error::invalid("config", format!("no {key}")))
        };
        let hidden = required("hidden_size")?;
        let heads = required("num_attention_heads")?;
        let shape = ModelShape {
            name: name.to_string(),
            hidden,
            intermediate: required("intermediate_size")?,
            heads,
            kv_heads: field("num_key_value_heads")?.unwrap_or(heads),
            head_dim: match field("head_dim")? {
                Some(d) => d,
                None if hidden % heads == 0 => hidden / heads,
                None => {
                    return Err(Error::invalid(
                        "config",
                        format!("no head_dim, and hidden_size {hidden} is not a multiple of num_attention_heads {heads}"),
                    ))
                }
            },
            layers: required("num_hidden_layers")?,
        };
        Ok(shape)
    }

    /// The four GEMMs of one layer on one rank of a tensor-parallel group of `tp` ranks:
    /// the merged q/k/v projection (column-parallel; key/value heads replicated when there are
    /// fewer than `tp`), `o_proj` (row-parallel), the merged gate/up projection
    /// (column-parallel) and `down` (row-parallel). Errors when a dimension does not split
    /// into `tp` equal parts, or a part is not a multiple of 8.
    pub fn layer_gemms(&self, tp: usize) -> Result<[LayerGemm; 4]> {
        if tp == 0 {
            return Err(Error::invalid("tp", "must be at least 1"));
        }
        let split = |what: &str, total: usize| -> Result<usize> {
            if total % tp != 0 {
                return Err(Error::invalid(
                    "tp",
                    format!(
                        "{}: {what} = {total} does not split into {tp} ranks",
                        self.name
                    ),
                ));
            }
            Ok(total / tp)
        };
        let heads = split("num_attention_heads", self.heads)?;
        // Fewer key/value heads than ranks: each rank holds one, replicated (vLLM's rule).
        let kv_heads = if self.kv_heads < tp && tp % self.kv_heads == 0 {
            1
        } else {
            split("num_key_value_heads", self.kv_heads)?
        };
        let gemms = [
            LayerGemm {
                layer: "qkv",
                n: (heads + 2 * kv_heads) * self.head_dim,
                k: self.hidden,
                row_parallel: false,
            },
            LayerGemm {
                layer: "o_proj",
                n: self.hidden,
                k: heads * self.head_dim,
                row_parallel: true,
            },
            LayerGemm {
                layer: "gate_up",
                n: 2 * split("intermediate_size", self.intermediate)?,
                k: self.hidden,
                row_parallel: false,
            },
            LayerGemm {
                layer: "down",
                n: self.hidden,
                k: split("intermediate_size", self.intermediate)?,
                row_parallel: true,
            },
        ];
        for g in &gemms {
            for (dim, value) in [("n", g.n), ("k", g.k)] {
                if value % 8 != 0 {
                    return Err(Error::invalid(
                        "tp",
                        format!(
                            "{}: {}'s {dim} = {value} at TP {tp} is not a multiple of 8",
                            self.name, g.layer
                        ),
                    ));
                }
            }
        }
        Ok(gemms)
    }
}
