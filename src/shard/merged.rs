//! Merged column-parallel: QKV and gate_up, sections stacked along the rows, each split
//! by whole heads.

use super::{
    check_divisible, check_gemm, check_host_bias, check_host_weight, check_len, check_positive,
    check_rank, check_world, describe, elements, take_rows, LayerKind,
};
use super::{check_weight_shape, HostWeight};
use crate::error::{Error, Result};
use std::ops::Range;

/// One section of a merged column-parallel weight: `heads · head_dim` consecutive rows of the
/// full weight, split across the ranks by whole heads.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Section {
    /// Its name in errors and splits, e.g. `"q"`, `"k"`, `"gate"`.
    pub name: String,
    /// Heads in the full weight (for gate_up, rows: `head_dim` 1).
    pub heads: usize,
    /// Rows per head.
    pub head_dim: usize,
    /// Whether a section with fewer heads than ranks is replicated (KV heads of
    /// grouped-query attention): rank `r` then holds head `r / (world / heads)`, and
    /// `world` must be a multiple of `heads`. Without it, `heads` must be a multiple of
    /// `world`.
    pub replicate: bool,
}

impl Section {
    /// Rows of this section in the full weight, `heads · head_dim`.
    pub fn rows(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Heads one rank holds of this section on `world` ranks.
    fn heads_per_rank(&self, world: usize) -> usize {
        (self.heads / world).max(1)
    }

    /// The rows of this section (counted from its first) that rank `rank` holds: its heads
    /// times `head_dim`.
    fn rows_of(&self, rank: usize, world: usize) -> Range<usize> {
        let heads = self.heads_of(rank, world);
        heads.start * self.head_dim..heads.end * self.head_dim
    }

    /// The heads rank `rank` holds.
    fn heads_of(&self, rank: usize, world: usize) -> Range<usize> {
        if self.heads >= world {
            let per = self.heads / world;
            rank * per..(rank + 1) * per
        } else {
            let h = rank / (world / self.heads);
            h..h + 1
        }
    }
}

/// What a merged weight holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Merged {
    Qkv,
    GateUp,
    Sections,
}

/// Where the sections of a QKV layer's output lie in one rank's output row, and how many
/// heads of each the rank holds. A rank's output is `[m, q + k + v]` row-major, so for
/// `m = 1` each section is a contiguous range of the output; for `m > 1` section `s` of row
/// `i` is `i·width + s.start .. i·width + s.end`, `width` = [`QkvSplit::width`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct QkvSplit {
    /// Columns of the query heads.
    pub q: Range<usize>,
    /// Columns of the key heads.
    pub k: Range<usize>,
    /// Columns of the value heads.
    pub v: Range<usize>,
    /// Elements per query head and per key head.
    pub head_dim: usize,
    /// Elements per value head (`head_dim` unless the layer was built with another, see
    /// [`MergedColumnSpec::qkv_with_v_head_dim`]).
    pub v_head_dim: usize,
    /// Query heads of this rank, `q_heads / world`.
    pub q_heads: usize,
    /// KV heads of this rank: `kv_heads / world`, or 1 where KV heads are replicated.
    pub kv_heads: usize,
}

impl QkvSplit {
    /// Columns of one output row, `q + k + v`.
    pub fn width(&self) -> usize {
        self.v.end
    }
}

/// Where gate and up lie in one rank's output row `[gate_r | up_r]` of a gate_up layer
/// (`m > 1`: row `i` starts at `i·width`, `width` = `up.end`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GateUpSplit {
    /// Columns of the gate projection.
    pub gate: Range<usize>,
    /// Columns of the up projection.
    pub up: Range<usize>,
}

/// The shape of a merged column-parallel layer: sections stacked along the rows of a full
/// weight `[Σ rows of the sections, in_features]`, each split across the ranks by whole heads
/// (see [`Section`]); rank `r`'s weight is its part of each section, in section order.
///
/// ```
/// use tpfuse::shard::MergedColumnSpec;
/// # fn main() -> tpfuse::Result<()> {
/// // 8 query heads, 2 KV heads of 128 on 4 ranks: KV heads replicated on 2 ranks each.
/// let spec = MergedColumnSpec::qkv("qkv_proj", 1024, 128, 8, 2, 4)?;
/// let split = spec.qkv_split().unwrap();
/// assert_eq!((split.q, split.k, split.v), (0..256, 256..384, 384..512));
/// assert_eq!(spec.heads_of(1, 3)?, 1..2); // rank 3 holds k head 3 / (4 / 2) = 1
/// // Rows of the full weight [q 1024 | k 256 | v 256, 1024] that rank 3 takes:
/// assert_eq!(spec.rows(3)?, vec![768..1024, 1152..1280, 1408..1536]);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MergedColumnSpec {
    name: String,
    in_features: usize,
    sections: Vec<Section>,
    world: usize,
    merged: Merged,
}

impl MergedColumnSpec {
    /// The QKV projection of grouped-query attention: a full weight
    /// `[(q_heads + 2·kv_heads)·head_dim, hidden]`, the query, key and value projections
    /// stacked in that order (vLLM's `qkv_proj`; Hugging Face's separate `q_proj`, `k_proj`
    /// and `v_proj` weights concatenated along the rows, see
    /// [`shard_weight_parts`](Self::shard_weight_parts)).
    ///
    /// Errors: a zero dimension or world; `q_heads` not divisible by `world`; `q_heads` not a
    /// multiple of `kv_heads`; `kv_heads` neither a multiple nor a divisor of `world`.
    pub fn qkv(
        name: impl Into<String>,
        hidden: usize,
        head_dim: usize,
        q_heads: usize,
        kv_heads: usize,
        world: usize,
    ) -> Result<Self> {
        Self::qkv_with_v_head_dim(name, hidden, head_dim, head_dim, q_heads, kv_heads, world)
    }

    /// The QKV projection of an attention whose value heads are `v_head_dim` wide while the
    /// query and key heads are `head_dim` wide (e.g. DeepSeek-V2/V3's `v_head_dim` 128 with
    /// `qk_head_dim` 192): a full weight
    /// `[q_heads·head_dim + kv_heads·head_dim + kv_heads·v_head_dim, hidden]`, q, k and v
    /// stacked in that order. Sharded as [`qkv`](Self::qkv) (which is this with
    /// `v_head_dim = head_dim`); [`qkv_split`](Self::qkv_split) gives both head sizes.
    ///
    /// ```
    /// use tpfuse::shard::MergedColumnSpec;
    /// # fn main() -> tpfuse::Result<()> {
    /// // 8 query heads and 2 KV heads, q/k heads of 192, v heads of 128, on 2 ranks.
    /// let spec = MergedColumnSpec::qkv_with_v_head_dim("qkv_proj", 1024, 192, 128, 8, 2, 2)?;
    /// assert_eq!(spec.out_features(), 8 * 192 + 2 * 192 + 2 * 128);
    /// let split = spec.qkv_split().unwrap();
    /// assert_eq!((split.q, split.k, split.v), (0..768, 768..960, 960..1088));
    /// assert_eq!((split.head_dim, split.v_head_dim), (192, 128));
    /// # Ok(()) }
    /// ```
    ///
    /// Errors: as [`qkv`](Self::qkv), and a zero `v_head_dim`.
    pub fn qkv_with_v_head_dim(
        name: impl Into<String>,
        hidden: usize,
        head_dim: usize,
        v_head_dim: usize,
        q_heads: usize,
        kv_heads: usize,
        world: usize,
    ) -> Result<Self> {
        let name = name.into();
        let label = describe(LayerKind::MergedColumnParallel, &name);
        check_world(&label, world)?;
        check_positive(&label, "hidden", hidden)?;
        check_positive(&label, "head_dim", head_dim)?;
        check_positive(&label, "v_head_dim", v_head_dim)?;
        check_positive(&label, "q_heads", q_heads)?;
        check_positive(&label, "kv_heads", kv_heads)?;
        check_divisible(&label, "q_heads", q_heads, world)?;
        if q_heads % kv_heads != 0 {
            return Err(Error::invalid(
                &label,
                format!(
                    "q_heads {q_heads} is not a multiple of kv_heads {kv_heads} (grouped-query \
                     attention shares each KV head among a whole group of query heads)"
                ),
            ));
        }
        if kv_heads % world != 0 && world % kv_heads != 0 {
            return Err(Error::invalid(
                &label,
                format!(
                    "kv_heads {kv_heads} neither is divisible by world {world} (split) nor \
                     divides it (replicated)"
                ),
            ));
        }
        let section = |name: &str, heads| Section {
            name: name.to_string(),
            heads,
            head_dim,
            replicate: true,
        };
        let sections = vec![
            Section {
                replicate: false,
                ..section("q", q_heads)
            },
            section("k", kv_heads),
            Section {
                head_dim: v_head_dim,
                ..section("v", kv_heads)
            },
        ];
        Self::build(name, hidden, sections, world, Merged::Qkv)
    }

    /// The gate and up projections of a gated MLP: a full weight
    /// `[2·intermediate_size, hidden]`, gate rows first (vLLM's `gate_up_proj`; Hugging
    /// Face's `gate_proj` and `up_proj` concatenated). Rank `r`'s output row is
    /// `[gate_r | up_r]`, `intermediate_size / world` each.
    ///
    /// Errors: a zero dimension or world; `intermediate_size` not divisible by `world`.
    pub fn gate_up(
        name: impl Into<String>,
        hidden: usize,
        intermediate_size: usize,
        world: usize,
    ) -> Result<Self> {
        let name = name.into();
        let label = describe(LayerKind::MergedColumnParallel, &name);
        check_world(&label, world)?;
        check_positive(&label, "hidden", hidden)?;
        check_positive(&label, "intermediate_size", intermediate_size)?;
        check_divisible(&label, "intermediate_size", intermediate_size, world)?;
        let section = |name: &str| Section {
            name: name.to_string(),
            heads: intermediate_size,
            head_dim: 1,
            replicate: false,
        };
        Self::build(
            name,
            hidden,
            vec![section("gate"), section("up")],
            world,
            Merged::GateUp,
        )
    }

    /// Any sections (at least one), each checked as [`Section`] says.
    ///
    /// Three sections named `"q"`, `"k"` and `"v"`, in that order, with as many `k` as `v`
    /// heads and `q` heads as wide as `k` heads, make a QKV layer:
    /// [`qkv_split`](Self::qkv_split) gives their split (the value heads may be of another
    /// size). Built with `q` not replicated and `k`, `v` replicated, such a spec equals the one
    /// [`qkv_with_v_head_dim`](Self::qkv_with_v_head_dim) builds.
    pub fn new(
        name: impl Into<String>,
        in_features: usize,
        sections: Vec<Section>,
        world: usize,
    ) -> Result<Self> {
        let merged = match &sections[..] {
            [q, k, v]
                if (q.name.as_str(), k.name.as_str(), v.name.as_str()) == ("q", "k", "v")
                    && k.heads == v.heads
                    && q.head_dim == k.head_dim =>
            {
                Merged::Qkv
            }
            _ => Merged::Sections,
        };
        Self::build(name.into(), in_features, sections, world, merged)
    }

    fn build(
        name: String,
        in_features: usize,
        sections: Vec<Section>,
        world: usize,
        merged: Merged,
    ) -> Result<Self> {
        let label = describe(LayerKind::MergedColumnParallel, &name);
        check_world(&label, world)?;
        check_positive(&label, "in_features", in_features)?;
        if sections.is_empty() {
            return Err(Error::invalid(&label, "no sections"));
        }
        let mut rows = 0usize;
        for s in &sections {
            let what = format!("section '{}'", s.name);
            check_positive(&label, &format!("{what}: heads"), s.heads)?;
            check_positive(&label, &format!("{what}: head_dim"), s.head_dim)?;
            let split = s.heads % world == 0;
            let replicated = s.replicate && s.heads < world && world % s.heads == 0;
            if !split && !replicated {
                let reason = if s.replicate {
                    format!(
                        "{what}: {} heads neither are divisible by world {world} nor divide it",
                        s.heads
                    )
                } else {
                    format!(
                        "{what}: {} heads are not divisible by world {world}",
                        s.heads
                    )
                };
                return Err(Error::invalid(&label, reason));
            }
            rows = elements(&label, s.heads, s.head_dim)?
                .checked_add(rows)
                .ok_or_else(|| Error::invalid(&label, "the sections' rows overflow"))?;
        }
        elements(&label, rows, in_features)?;
        Ok(MergedColumnSpec {
            name,
            in_features,
            sections,
            world,
            merged,
        })
    }

    /// The layer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The layer's description, e.g. `merged-column-parallel 'layers.0.self_attn.qkv_proj'`.
    pub fn label(&self) -> String {
        describe(LayerKind::MergedColumnParallel, &self.name)
    }

    /// Input features (every rank reads all of them).
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Rows of the full weight, the sum of the sections' rows.
    pub fn out_features(&self) -> usize {
        self.sections.iter().map(Section::rows).sum()
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The sections, in order.
    pub fn sections(&self) -> &[Section] {
        &self.sections
    }

    /// Output features of one rank (the same on every rank): the sum over the sections of
    /// the heads a rank holds times `head_dim`.
    pub fn out_per_rank(&self) -> usize {
        self.sections
            .iter()
            .map(|s| s.heads_per_rank(self.world) * s.head_dim)
            .sum()
    }

    /// The columns of section `section` in one rank's output row (the same on every rank).
    ///
    /// # Panics
    ///
    /// When `section` is not an index of [`sections`](Self::sections).
    pub fn section_columns(&self, section: usize) -> Range<usize> {
        let width = |s: &Section| s.heads_per_rank(self.world) * s.head_dim;
        let start: usize = self.sections[..section].iter().map(width).sum();
        start..start + width(&self.sections[section])
    }

    /// The index of the section named `name` (e.g. `"k"`, `"up"`) in
    /// [`sections`](Self::sections). Errors (naming the layer and its sections): no section
    /// has that name.
    pub fn section_index(&self, name: &str) -> Result<usize> {
        self.sections
            .iter()
            .position(|s| s.name == name)
            .ok_or_else(|| {
                let names: Vec<String> = self
                    .sections
                    .iter()
                    .map(|s| format!("'{}'", s.name))
                    .collect();
                Error::invalid(
                    self.label(),
                    format!(
                        "no section is named '{name}' (the sections are {})",
                        names.join(", ")
                    ),
                )
            })
    }

    /// Section `section`, or an error naming the layer.
    fn section(&self, section: usize) -> Result<&Section> {
        self.sections.get(section).ok_or_else(|| {
            Error::invalid(
                self.label(),
                format!(
                    "section {section} does not exist ({} sections)",
                    self.sections.len()
                ),
            )
        })
    }

    /// The heads of section `section` that rank `rank` holds (for a replicated section
    /// with fewer heads than ranks, the one head `rank / (world / heads)`).
    pub fn heads_of(&self, section: usize, rank: usize) -> Result<Range<usize>> {
        check_rank(&self.label(), rank, self.world)?;
        Ok(self.section(section)?.heads_of(rank, self.world))
    }

    /// The rows of the full weight that rank `rank` takes, one range per section, in order.
    pub fn rows(&self, rank: usize) -> Result<Vec<Range<usize>>> {
        check_rank(&self.label(), rank, self.world)?;
        let mut offset = 0;
        let mut out = Vec::with_capacity(self.sections.len());
        for s in &self.sections {
            let rows = s.rows_of(rank, self.world);
            out.push(offset + rows.start..offset + rows.end);
            offset += s.rows();
        }
        Ok(out)
    }

    /// Rank `rank`'s weight `[out_per_rank, in]`, cut from the full host weight `full`, which
    /// must be `[out_features, in_features]`, the sections stacked along the rows (see
    /// [`HostWeight`]; a Megatron checkpoint's interleaved QKV is converted first by
    /// [`qkv_from_megatron`](super::qkv_from_megatron)). Errors (naming the layer): a rank
    /// out of range, a weight of another shape (a transposed one says so), a weight whose
    /// data does not fill its shape.
    pub fn shard_weight<T: Copy>(&self, rank: usize, full: HostWeight<'_, T>) -> Result<Vec<T>> {
        let rows = self.rows(rank)?;
        check_host_weight(&self.label(), &full, self.out_features(), self.in_features)?;
        Ok(take_rows(full.data(), self.in_features, &rows))
    }

    /// Rank `rank`'s weight from one host weight per section, in section order (`parts[s]`
    /// is `[heads·head_dim, in_features]`, e.g. Hugging Face's `q_proj`, `k_proj`, `v_proj`,
    /// as stored): the same as [`shard_weight`](Self::shard_weight) of the parts stacked.
    /// Errors: as [`section_shard_weight`](Self::section_shard_weight) for each part, and a
    /// number of parts other than the number of sections.
    pub fn shard_weight_parts<T: Copy>(
        &self,
        rank: usize,
        parts: &[HostWeight<'_, T>],
    ) -> Result<Vec<T>> {
        self.check_parts(rank, parts.len(), "weight")?;
        let mut out = Vec::with_capacity(self.out_per_rank() * self.in_features);
        for (s, part) in parts.iter().enumerate() {
            out.extend_from_slice(self.section_shard_weight(rank, s, *part)?);
        }
        Ok(out)
    }

    /// Rank `rank`'s bias `[out_per_rank]`, cut from the full host bias `full`
    /// `[out_features]` (the sections' biases stacked).
    pub fn shard_bias<T: Copy>(&self, rank: usize, full: &[T]) -> Result<Vec<T>> {
        let rows = self.rows(rank)?;
        check_host_bias(
            &self.label(),
            full.len(),
            self.out_features(),
            "out_features",
        )?;
        Ok(take_rows(full, 1, &rows))
    }

    /// Rank `rank`'s bias from one host bias per section (`parts[s]` is `[heads·head_dim]`).
    pub fn shard_bias_parts<T: Copy>(&self, rank: usize, parts: &[&[T]]) -> Result<Vec<T>> {
        self.check_parts(rank, parts.len(), "bias")?;
        let mut out = Vec::with_capacity(self.out_per_rank());
        for (s, part) in parts.iter().enumerate() {
            out.extend_from_slice(self.section_shard_bias(rank, s, part)?);
        }
        Ok(out)
    }

    /// Errors unless `rank` is in range and `given` parts are one per section.
    fn check_parts(&self, rank: usize, given: usize, what: &str) -> Result<()> {
        let label = self.label();
        check_rank(&label, rank, self.world)?;
        if given != self.sections.len() {
            return Err(Error::invalid(
                &label,
                format!(
                    "{given} host {what} parts given for {} sections",
                    self.sections.len()
                ),
            ));
        }
        Ok(())
    }

    /// Rank `rank`'s rows of section `section`, `[its heads · head_dim, in_features]`, as a
    /// slice of that section's full host weight `weight`, which must be
    /// `[heads · head_dim, in_features]` (e.g. Hugging Face's `k_proj`, as stored). Nothing
    /// is copied. They are the rows [`section_columns(section)`](Self::section_columns) of
    /// the rank's weight shard. Errors (naming the layer and the section): a rank or section
    /// out of range, a weight of another shape (a transposed one says so), a weight whose
    /// data does not fill its shape.
    pub fn section_shard_weight<'a, T>(
        &self,
        rank: usize,
        section: usize,
        weight: HostWeight<'a, T>,
    ) -> Result<&'a [T]> {
        let label = self.label();
        check_rank(&label, rank, self.world)?;
        let s = self.section(section)?;
        let cols = self.in_features;
        check_weight_shape(
            &label,
            &format!("the host weight of section '{}'", s.name),
            &weight,
            (s.rows(), cols),
            "[heads · head_dim, in_features]",
        )?;
        let rows = s.rows_of(rank, self.world);
        Ok(&weight.data()[rows.start * cols..rows.end * cols])
    }

    /// Rank `rank`'s part of section `section`'s bias, `[its heads · head_dim]`, as a slice of
    /// that section's full host bias `bias` `[heads · head_dim]`. Errors (naming the layer
    /// and the section): a rank or section out of range, a bias of another length.
    pub fn section_shard_bias<'a, T>(
        &self,
        rank: usize,
        section: usize,
        bias: &'a [T],
    ) -> Result<&'a [T]> {
        let label = self.label();
        check_rank(&label, rank, self.world)?;
        let s = self.section(section)?;
        check_len(
            &label,
            &format!("the host bias of section '{}'", s.name),
            bias.len(),
            s.rows(),
            &format!("heads · head_dim = {} · {}", s.heads, s.head_dim),
        )?;
        Ok(&bias[s.rows_of(rank, self.world)])
    }

    /// For a QKV layer (built by [`qkv`](Self::qkv) or
    /// [`qkv_with_v_head_dim`](Self::qkv_with_v_head_dim), or by [`new`](Self::new) with
    /// sections as [`new`](Self::new) says): where q, k and v lie in a rank's output row, how
    /// many heads of each it holds, and their head sizes. `None` for other layers.
    pub fn qkv_split(&self) -> Option<QkvSplit> {
        if self.merged != Merged::Qkv {
            return None;
        }
        let (q, k, v) = (&self.sections[0], &self.sections[1], &self.sections[2]);
        Some(QkvSplit {
            q: self.section_columns(0),
            k: self.section_columns(1),
            v: self.section_columns(2),
            head_dim: q.head_dim,
            v_head_dim: v.head_dim,
            q_heads: q.heads_per_rank(self.world),
            kv_heads: k.heads_per_rank(self.world),
        })
    }

    /// For a layer built by [`gate_up`](Self::gate_up): where gate and up lie in a rank's
    /// output row.
    pub fn gate_up_split(&self) -> Option<GateUpSplit> {
        (self.merged == Merged::GateUp).then(|| GateUpSplit {
            gate: self.section_columns(0),
            up: self.section_columns(1),
        })
    }

    /// How many ranks hold each head of section `section`: 1 where the heads are split,
    /// `world / heads` where they are replicated.
    ///
    /// # Panics
    ///
    /// When `section` is not an index of [`sections`](Self::sections).
    pub fn replicas(&self, section: usize) -> usize {
        let s = &self.sections[section];
        if s.heads >= self.world {
            1
        } else {
            self.world / s.heads
        }
    }

    /// What the GEMM needs of a rank's shard `[out_per_rank, in]`: both positive multiples
    /// of 8.
    pub fn check_gemm_dims(&self) -> Result<()> {
        check_gemm(
            &self.label(),
            ("out_per_rank", self.out_per_rank()),
            ("in_features", self.in_features),
        )
    }
}
