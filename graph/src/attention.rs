//! Attention that never keeps the `T × T` tensor: a forward that saves only its
//! output and the rows' log-sum-exp, and a flash-attention backward that
//! recomputes the probabilities from them.
//!
//! [`fuse`] finds the standard pattern in a forward function — a batched
//! `q · kᵀ`, an optional scale by a constant, an optional mask
//! (`select(mask, s, -∞)`), a max-shifted softmax over the keys and the
//! probabilities' product with `v` — and replaces it with one `pcp.attention`
//! op (the built-in models' attention is that pattern, and so is an imported
//! module's when it is written the same way; anything else keeps its ops).
//! Autodiff treats the op as a unit ([`vjp`]), and [`expand`] lowers it to
//! StableHLO before compilation.
//!
//! The forward works in *strips* of query rows. A causal strip `i` of `s`
//! rows only meets keys `0 .. (i+1)·s` (and the backward's key strip `j` only
//! rows `j·s ..`), so the masked upper triangle is never computed: with 8 strips, 56% of the naive form's score work. Each strip's
//! softmax sees all of its row's keys at once, so no online rescaling is
//! needed; the strip's scores are transient (IREE frees them when the strip's
//! product with `v` is done), and only `o` and `lse = max + log Σ exp` are kept
//! for the backward, which rebuilds `p = exp(s − lse)` by strips of *keys*
//! (strip `j` meets the query rows that see it), transposed, so that `dv` and
//! `dk` contract over the long dimension of rows:
//!
//! ```text
//! sᵀ = k_j·qᵀ    pᵀ = exp(sᵀ − lse)    dv_j = pᵀ·do    dpᵀ = v_j·doᵀ
//! dsᵀ = pᵀ ∘ (dpᵀ − rowsum(do ∘ o)) · scale    dk_j = dsᵀ·q    dq += ds·k_j
//! ```
//!
//! The op's operands are in a canonical layout, `q: [batch…, Tq, D]`,
//! `k: [batch…, Tk, D]`, `v: [batch…, Tk, Dv]` and, for a general mask,
//! `mask: [batch…, Tq, Tk]` (`i1`, true where a key is seen); its results are
//! `o: [batch…, Tq, Dv]` and `lse: [batch…, Tq]`. Transposes into that layout
//! are ordinary ops before it.

mod blocks;
mod fuse;

use std::fmt;
use std::str::FromStr;

pub use blocks::{expand, vjp};
pub use fuse::fuse;
pub(crate) use fuse::splat_value;

use crate::ir::Op;
use crate::ir::attr::lookup;

/// The op [`fuse`] creates and [`expand`] lowers.
pub const OP: &str = "pcp.attention";

/// Query rows per strip of a causal attention; a sequence of at most twice
/// this is one strip.
pub const STRIP_ROWS: i64 = 128;

/// The strip height [`fuse`] uses: [`STRIP_ROWS`], or `PCP_ATTENTION_STRIP_ROWS`
/// for experiments (`bench/gpu_profile.sh` compiles a variant with taller strips).
/// The strip is part of the module's text, so of the artifact cache's key.
pub fn strip_rows() -> i64 {
    std::env::var("PCP_ATTENTION_STRIP_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|r: &i64| *r > 0)
        .unwrap_or(STRIP_ROWS)
}

/// How a step computes attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Attention {
    /// Fused ([`fuse`]): strips, causal blocks skipped, probabilities recomputed.
    #[default]
    Fused,
    /// As the model writes it: the `T × T` probabilities kept for the backward.
    Naive,
}

impl Attention {
    /// The name `parse` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fused => "fused",
            Self::Naive => "naive",
        }
    }
}

impl fmt::Display for Attention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An attention name other than `fused` or `naive`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown attention {0:?}; expected fused or naive")]
pub struct UnknownAttention(pub String);

impl FromStr for Attention {
    type Err = UnknownAttention;

    /// `fused` or `naive`; the empty string (a file from before the field) is `fused`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fused" | "" => Ok(Self::Fused),
            "naive" => Ok(Self::Naive),
            other => Err(UnknownAttention(other.to_owned())),
        }
    }
}

/// What a `pcp.attention` op computes, read from its properties.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Spec {
    /// The scores' factor (`1/√d` in GPT-2).
    scale: f64,
    /// Keys after the query are masked (no mask operand).
    causal: bool,
    /// The op has a fourth operand, a general mask.
    masked: bool,
    /// The matmuls read bf16 operands ([`crate::precision`]).
    bf16: bool,
    /// Query rows per strip.
    strip: i64,
}

impl Spec {
    fn props(self) -> Vec<(String, String)> {
        vec![
            ("scale".to_owned(), format!("{:e}", self.scale)),
            ("causal".to_owned(), self.causal.to_string()),
            ("masked".to_owned(), self.masked.to_string()),
            ("matmul".to_owned(), if self.bf16 { "bf16" } else { "f32" }.to_owned()),
            ("strip".to_owned(), self.strip.to_string()),
        ]
    }

    fn of(op: &Op) -> Option<Self> {
        let get = |key: &str| lookup(&op.props, key);
        Some(Self {
            scale: get("scale")?.parse().ok()?,
            causal: get("causal")? == "true",
            masked: get("masked")? == "true",
            bf16: get("matmul")? == "bf16",
            strip: get("strip")?.parse().ok()?,
        })
    }
}

/// Marks every attention op of `f` to run its matmuls on bf16 operands, as
/// [`crate::mixed_precision`] does to the matmuls it sees; returns how many.
pub(crate) fn use_bf16(f: &mut crate::ir::Function) -> usize {
    let mut changed = 0;
    for op in f.ops.iter_mut().filter(|op| op.name == OP) {
        if let Some(slot) = op.props.iter_mut().find(|(k, _)| k == "matmul") {
            slot.1 = "bf16".to_owned();
            changed += 1;
        }
    }
    changed
}

#[cfg(test)]
mod tests;
