//! Vocabulary-parallel: a `[vocab, hidden]` table (the token embedding, the LM head) split by
//! rows across the ranks, the vocabulary padded so that every rank holds the same number.

use super::HostWeight;
use super::{check_gemm, check_positive, check_weight_shape, check_world, describe, elements};
use super::{even_part, LayerKind};
use crate::error::{Error, Result};
use std::ops::Range;

/// The padding unit of the vocabulary: every rank holds a multiple of 64 rows (see
/// [`VocabParallelSpec`]).
pub const VOCAB_PADDING: usize = 64;

/// The shape of a vocabulary-parallel table (a token embedding or an LM head): a full
/// `[vocab, hidden]` weight, as safetensors stores `embed_tokens` and `lm_head`, split by rows
/// across `world` ranks.
///
/// # Padding
///
/// The vocabulary is padded to `padded_vocab`, the smallest multiple of
/// [`VOCAB_PADDING`]` · world` that holds it, and rank `r` holds the rows
/// `r·P .. (r+1)·P` with `P = padded_vocab / world` (a multiple of 64). Rows at or past
/// `vocab` are padding: zeros in the shards, never a valid token id, and never in the logits
/// [`ParallelLMHead::forward_gather`](crate::ops::linear::ParallelLMHead::forward_gather)
/// writes. The last ranks may hold padding only.
///
/// vLLM pads to a multiple of 64 and then divides by the world size, which must divide the
/// result (it refuses, e.g., world 3 with a vocabulary of 64 rows). The two rules give the same
/// split whenever `round_up(vocab, 64)` is a multiple of `64 · world`; otherwise tpfuse pads
/// up to `64 · (world - 1)` rows more, and works for every world size. The split is internal:
/// the embedding's output and the gathered logits do not depend on it.
///
/// ```
/// use tpfuse::shard::VocabParallelSpec;
/// # fn main() -> tpfuse::Result<()> {
/// // Llama 3: 128256 tokens on 8 ranks (128256 = 250.5 · 512).
/// let spec = VocabParallelSpec::new("lm_head", 128_256, 4096, 8)?;
/// assert_eq!(spec.padded_vocab(), 128_512);
/// assert_eq!(spec.rows_per_rank(), 16_064);
/// assert_eq!(spec.rows(7)?, 112_448..128_512);
/// assert_eq!(spec.valid_rows(7)?, 112_448..128_256); // 256 padding rows
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct VocabParallelSpec {
    name: String,
    vocab: usize,
    hidden: usize,
    world: usize,
}

impl VocabParallelSpec {
    /// Checks and describes a table `name` of `vocab` tokens by `hidden` features on `world`
    /// ranks. Errors (naming the layer): a zero dimension or world, `hidden` not a multiple
    /// of 8 (the GEMM's and the lookup's 16-byte vectors), a table too large to address or
    /// with more than 2^32 rows (token ids are `u32`).
    pub fn new(name: impl Into<String>, vocab: usize, hidden: usize, world: usize) -> Result<Self> {
        let name = name.into();
        let label = describe(LayerKind::VocabParallel, &name);
        check_world(&label, world)?;
        check_positive(&label, "vocab", vocab)?;
        check_positive(&label, "hidden", hidden)?;
        let unit = VOCAB_PADDING.checked_mul(world);
        let padded = unit.and_then(|u| vocab.div_ceil(u).checked_mul(u));
        match padded {
            Some(p) if p <= 1 << 32 => elements(&label, p, hidden)?,
            _ => {
                return Err(Error::invalid(
                    &label,
                    format!(
                        "vocab {vocab} padded for world {world} exceeds 2^32 rows (token ids \
                         are u32)"
                    ),
                ))
            }
        };
        let spec = VocabParallelSpec {
            name,
            vocab,
            hidden,
            world,
        };
        spec.check_gemm_dims()?;
        Ok(spec)
    }

    /// The layer's name, e.g. `model.embed_tokens`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The layer's description, e.g. `vocab-parallel 'lm_head'` (the `arg` of its errors).
    pub fn label(&self) -> String {
        describe(LayerKind::VocabParallel, &self.name)
    }

    /// Tokens of the vocabulary (the checkpoint's rows); valid ids are `0 .. vocab`.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Features per token (the table's columns).
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The vocabulary padded: the smallest multiple of `64 · world` at least `vocab`.
    pub fn padded_vocab(&self) -> usize {
        let unit = VOCAB_PADDING * self.world;
        self.vocab.div_ceil(unit) * unit
    }

    /// Rows per rank, `padded_vocab / world` (a multiple of 64).
    pub fn rows_per_rank(&self) -> usize {
        self.padded_vocab() / self.world
    }

    /// The rows of the padded table (token ids, for those below `vocab`) that rank `rank`
    /// holds: `rank·P .. (rank+1)·P`.
    pub fn rows(&self, rank: usize) -> Result<Range<usize>> {
        even_part(&self.label(), rank, self.world, self.rows_per_rank())
    }

    /// The real rows (token ids) of rank `rank`: [`rows`](Self::rows) less the padding; empty
    /// for a rank that holds only padding. In rank `rank`'s logits `[m, P]`, the columns
    /// `0 .. valid_rows(rank).len()` are real.
    pub fn valid_rows(&self, rank: usize) -> Result<Range<usize>> {
        let rows = self.rows(rank)?;
        Ok(rows.start.min(self.vocab)..rows.end.min(self.vocab))
    }

    /// Rank `rank`'s table `[P, hidden]`: its rows of the full host table `full`, which must
    /// be `[vocab, hidden]` (as the checkpoint stores it), then zeros for its padding rows.
    /// Errors (naming the layer): a rank out of range, a table of another shape (a transposed
    /// one says so), a table whose data does not fill its shape.
    pub fn shard_table<T: Copy + Default>(
        &self,
        rank: usize,
        full: HostWeight<'_, T>,
    ) -> Result<Vec<T>> {
        let valid = self.valid_rows(rank)?;
        check_weight_shape(
            &self.label(),
            "the host table",
            &full,
            (self.vocab, self.hidden),
            "[vocab, hidden]",
        )?;
        let mut out = Vec::with_capacity(self.rows_per_rank() * self.hidden);
        out.extend_from_slice(&full.data()[valid.start * self.hidden..valid.end * self.hidden]);
        out.resize(self.rows_per_rank() * self.hidden, T::default());
        Ok(out)
    }

    /// What the LM head's GEMM needs of a rank's table `[P, hidden]`: `hidden` a positive
    /// multiple of 8 and both at most 2^30 (`P` is a multiple of 64).
    pub fn check_gemm_dims(&self) -> Result<()> {
        check_gemm(
            &self.label(),
            ("rows per rank", self.rows_per_rank()),
            ("hidden", self.hidden),
        )
    }
}
