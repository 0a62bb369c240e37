//! Activation recomputation: which forward values the backward recomputes
//! instead of keeping.
//!
//! A backward reads forward values (a matmul's inputs, a softmax's output…). By
//! default every one of them is kept from the forward until the backward uses it,
//! so a step's peak holds every layer's activations at once. [`Recompute`] trades
//! compute for that memory: the forward's ops are split into *groups*, and the
//! backward recomputes a group's values from the group's inputs just before it
//! needs them (see [`crate::autodiff::backward_recomputing`]). Only the inputs of
//! the groups stay alive through the step.
//!
//! * [`Recompute::Attention`]: one group per attention softmax: the ops from a
//!   batched matmul whose result is square in its last two dimensions (the
//!   `[batch, heads, T, T]` scores) through the softmax, up to the next matmul.
//!   The `T × T` tensors, the largest of a long-context step, are never kept: the
//!   backward recomputes one layer's at a time from the kept `q` and `k`, as a
//!   flash-attention backward does.
//! * [`Recompute::Elementwise`]: attention's groups, and everything else but the
//!   matmuls: the backward keeps the matmuls' outputs and recomputes the
//!   elementwise work between them (LayerNorm, GELU, bias adds) from them, one
//!   connected piece of a block at a time. Attention's groups here also hold
//!   the probabilities' matmul with `v`, whose output is as large as `q`. It
//!   costs a re-run of the cheap ops and of attention, never of a matmul with
//!   weights (JAX's `checkpoint_dots_with_no_batch_dims` policy).
//! * [`Recompute::Blocks`]: the forward is cut wherever a single differentiable
//!   value is alive (a transformer's residual stream between its attention and
//!   MLP branches), and every piece between two cuts is a group. What is kept is
//!   the residual stream at each cut; the backward recomputes one branch at a
//!   time (gradient checkpointing).
//!
//! Both work on any forward, built-in or imported, since they look at shapes
//! and liveness, never at names. A recomputed value is the same op on the same
//! inputs as the stored one, so on one device it is bit-identical.

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

use crate::ir::{Function, ValueId};

/// Which activations the backward recomputes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Recompute {
    /// Keep every activation the backward reads.
    #[default]
    None,
    /// Recompute attention's scores and softmax.
    Attention,
    /// Recompute attention and all elementwise work; keep the matmuls' outputs.
    Elementwise,
    /// Keep only the residual stream between blocks; recompute the rest.
    Blocks,
}

impl Recompute {
    /// Every mode, from the one that keeps the most activations to the one that keeps the fewest.
    pub const ALL: [Self; 4] = [Self::None, Self::Attention, Self::Elementwise, Self::Blocks];

    /// The modes that keep fewer activations than this one, the mildest first.
    pub fn stronger(self) -> impl Iterator<Item = Self> {
        Self::ALL.into_iter().skip_while(move |m| *m != self).skip(1)
    }

    /// The name `parse` takes and manifests record.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Attention => "attention",
            Self::Elementwise => "elementwise",
            Self::Blocks => "blocks",
        }
    }
}

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A recomputation name other than `none`, `attention` or `blocks`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown recompute mode {0:?}; expected none, attention, elementwise or blocks")]
pub struct UnknownRecompute(pub String);

impl FromStr for Recompute {
    type Err = UnknownRecompute;

    /// `none`, `attention`, `elementwise` or `blocks`; the empty string (a manifest from before
    /// the field) is `none`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" | "" => Ok(Self::None),
            "attention" => Ok(Self::Attention),
            "elementwise" => Ok(Self::Elementwise),
            "blocks" => Ok(Self::Blocks),
            other => Err(UnknownRecompute(other.to_owned())),
        }
    }
}

/// The groups of op indices of `f` whose values the backward recomputes, each in
/// ascending order; `active[v]` says whether value `v` lies between the
/// parameters and the loss ([`crate::autodiff::activity`]).
///
/// Constants are in no group: a builder shares a splat among layers, and a later
/// layer's backward reading it must not recompute an earlier layer's group.
pub fn groups(f: &Function, active: &[bool], mode: Recompute) -> Vec<Vec<usize>> {
    let mut groups = match mode {
        Recompute::None => Vec::new(),
        Recompute::Attention => attention_groups(f, active, false),
        Recompute::Elementwise => elementwise_groups(f, active),
        Recompute::Blocks => block_groups(f, active),
    };
    for g in &mut groups {
        g.retain(|i| !f.ops[*i].operands.is_empty());
    }
    groups.retain(|g| !g.is_empty());
    groups
}

/// Attention's groups, then, within each block group, the connected pieces of
/// the ops that are neither matmuls nor in an attention group.
fn elementwise_groups(f: &Function, active: &[bool]) -> Vec<Vec<usize>> {
    let mut groups = attention_groups(f, active, true);
    let taken: HashSet<usize> = groups.iter().flatten().copied().collect();
    let mut producer: Vec<Option<usize>> = vec![None; f.value_count()];
    for (i, op) in f.ops.iter().enumerate() {
        for r in &op.results {
            producer[r.index()] = Some(i);
        }
    }
    for block in block_groups(f, active) {
        let members: Vec<usize> =
            block.into_iter().filter(|i| !taken.contains(i) && !is_matmul(&f.ops[*i].name)).collect();
        let position: std::collections::HashMap<usize, usize> =
            members.iter().enumerate().map(|(k, i)| (*i, k)).collect();
        // union-find over the members, joined through the values they pass each other
        let mut parent: Vec<usize> = (0..members.len()).collect();
        fn root(parent: &mut [usize], mut k: usize) -> usize {
            while parent[k] != k {
                parent[k] = parent[parent[k]];
                k = parent[k];
            }
            k
        }
        for (k, i) in members.iter().enumerate() {
            for o in &f.ops[*i].operands {
                if let Some(p) = producer[o.index()].and_then(|p| position.get(&p).copied()) {
                    let (a, b) = (root(&mut parent, k), root(&mut parent, p));
                    parent[a] = b;
                }
            }
        }
        let mut pieces: std::collections::BTreeMap<usize, Vec<usize>> = std::collections::BTreeMap::new();
        for (k, i) in members.iter().enumerate() {
            let r = root(&mut parent, k);
            pieces.entry(r).or_default().push(*i);
        }
        groups.extend(pieces.into_values());
    }
    groups
}

/// Bytes of the values of `forward` (the values the forward's ops define) that
/// `f`'s other ops read: what a forward keeps for its backward. Values computed
/// from constants alone (a splat, a causal mask and its broadcasts) are left out:
/// compilers fuse them into their users rather than keep them.
pub fn saved_bytes(f: &Function, forward: &HashSet<ValueId>) -> u64 {
    let mut defined = vec![false; f.value_count()];
    let mut constant = vec![false; f.value_count()];
    let is_forward = |op: &crate::ir::Op| op.results.first().is_some_and(|r| forward.contains(r));
    for op in f.ops.iter().filter(|op| is_forward(op)) {
        let from_constants = op.operands.iter().all(|o| constant[o.index()]);
        for r in &op.results {
            constant[r.index()] = from_constants;
            defined[r.index()] = !from_constants;
        }
    }
    let mut saved = vec![false; f.value_count()];
    for op in f.ops.iter().filter(|op| !is_forward(op)) {
        for o in &op.operands {
            saved[o.index()] |= defined[o.index()];
        }
    }
    (0..f.value_count()).filter(|i| saved[*i]).map(|i| f.ty(ValueId(i as u32)).bytes()).sum()
}

fn is_matmul(name: &str) -> bool {
    matches!(name, "stablehlo.dot_general" | "stablehlo.dot" | crate::attention::OP)
}

/// Index of the last op that reads each value (`usize::MAX` for returned values).
fn last_uses(f: &Function) -> Vec<Option<usize>> {
    let mut last = vec![None; f.value_count()];
    for (i, op) in f.ops.iter().enumerate() {
        for o in &op.operands {
            last[o.index()] = Some(i);
        }
    }
    for r in &f.results {
        last[r.index()] = Some(usize::MAX);
    }
    last
}

/// Cuts where exactly one active value defined by an op is alive; the pieces
/// between cuts, holding at least one matmul, are the groups.
fn block_groups(f: &Function, active: &[bool]) -> Vec<Vec<usize>> {
    let last = last_uses(f);
    let mut alive: HashSet<ValueId> = HashSet::new();
    let mut groups = Vec::new();
    let mut current = Vec::new();
    for (i, op) in f.ops.iter().enumerate() {
        current.push(i);
        alive.retain(|v| last[v.index()].is_some_and(|l| l > i));
        for r in &op.results {
            if active[r.index()] && last[r.index()].is_some_and(|l| l > i) {
                alive.insert(*r);
            }
        }
        if alive.len() == 1 {
            let group = std::mem::take(&mut current);
            if group.iter().any(|j| is_matmul(&f.ops[*j].name)) {
                groups.push(group);
            }
        }
    }
    if current.iter().any(|j| is_matmul(&f.ops[*j].name)) {
        groups.push(current);
    }
    groups
}

/// One group per square batched matmul (attention scores): the ops that depend
/// on it up to the next matmul (`with_values`: up to the one after, the
/// probabilities' matmul with v is in the group), and the ops (a mask's
/// broadcast) whose values only those read.
fn attention_groups(f: &Function, active: &[bool], with_values: bool) -> Vec<Vec<usize>> {
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); f.value_count()];
    for (i, op) in f.ops.iter().enumerate() {
        for o in &op.operands {
            users[o.index()].push(i);
        }
    }
    let returned: HashSet<ValueId> = f.results.iter().copied().collect();
    let mut groups = Vec::new();
    for (start, op) in f.ops.iter().enumerate() {
        let square = op.results.first().is_some_and(|r| {
            let t = f.ty(*r);
            let n = t.rank();
            n >= 3 && t.shape[n - 1] == t.shape[n - 2] && t.shape[n - 1] >= 2 && active[r.index()]
        });
        if !is_matmul(&op.name) || !square {
            continue;
        }
        let mut members = vec![start];
        let mut values: HashSet<ValueId> = op.results.iter().copied().collect();
        // `with_values`: the probabilities' matmul with v is in the group too (its
        // output is what the next matmul, the projection, reads): recomputing it costs
        // T/(12·d) of a layer's forward, and keeping it keeps as much as q. A flash
        // attention backward keeps it, and so does `attention`.
        let mut weighted = !with_values;
        for (i, later) in f.ops.iter().enumerate().skip(start + 1) {
            if !later.operands.iter().any(|o| values.contains(o)) {
                continue;
            }
            if is_matmul(&later.name) {
                if weighted || later.results.first().is_none_or(|r| f.ty(*r).rank() < 3) {
                    continue;
                }
                weighted = true;
            }
            members.push(i);
            values.extend(later.results.iter().copied());
        }
        // ops inside the span whose every use is in the group (the mask's broadcast)
        let end = members.last().copied().unwrap_or(start);
        loop {
            let inside: HashSet<usize> = members.iter().copied().collect();
            let extra: Vec<usize> = (start..end)
                .filter(|i| !inside.contains(i) && !is_matmul(&f.ops[*i].name))
                .filter(|i| {
                    let results = &f.ops[*i].results;
                    !results.is_empty()
                        && results.iter().all(|r| {
                            !returned.contains(r)
                                && !users[r.index()].is_empty()
                                && users[r.index()].iter().all(|u| inside.contains(u))
                        })
                })
                .collect();
            if extra.is_empty() {
                break;
            }
            members.extend(extra);
        }
        members.sort_unstable();
        groups.push(members);
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_ones_are_named() {
        for mode in [Recompute::None, Recompute::Attention, Recompute::Elementwise, Recompute::Blocks] {
            assert_eq!(mode.name().parse::<Recompute>(), Ok(mode));
        }
        assert_eq!("".parse::<Recompute>(), Ok(Recompute::None));
        let err = "everything".parse::<Recompute>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown recompute mode \"everything\"; expected none, attention, elementwise or blocks"
        );
    }

    fn nanogpt_forward() -> anyhow::Result<(Function, Vec<bool>)> {
        let config = crate::NanoGptConfig { n_layer: 2, ..crate::NanoGptConfig::small() };
        let built = crate::nanogpt(&config)?;
        let f = crate::autodiff::inline_calls(&built.module, "main")?;
        let sig = crate::autodiff::signature(&f)?;
        let wrt: Vec<ValueId> = sig.params.iter().map(|(i, _)| f.args[*i]).collect();
        let active = crate::autodiff::activity(&f, f.results[0], &wrt);
        Ok((f, active))
    }

    /// nanoGPT's attention: one group per layer, from the scores' matmul through
    /// the softmax, with the mask but without any matmul after the scores'.
    #[test]
    fn attention_groups_hold_each_layers_scores_and_softmax() -> anyhow::Result<()> {
        let (f, active) = nanogpt_forward()?;
        let groups = groups(&f, &active, Recompute::Attention);
        assert_eq!(groups.len(), 2);
        for g in &groups {
            let names: Vec<&str> = g.iter().map(|i| f.ops[*i].name.as_str()).collect();
            assert_eq!(names.iter().filter(|n| is_matmul(n)).count(), 1, "{names:?}");
            for op in ["stablehlo.exponential", "stablehlo.select", "stablehlo.divide", "stablehlo.broadcast_in_dim"] {
                assert!(names.contains(&op), "{op} missing from {names:?}");
            }
        }
        Ok(())
    }

    /// Elementwise: attention's groups, then pieces without a matmul, none
    /// overlapping another.
    #[test]
    fn elementwise_groups_hold_no_matmul_but_attentions() -> anyhow::Result<()> {
        let (f, active) = nanogpt_forward()?;
        let groups = groups(&f, &active, Recompute::Elementwise);
        let matmuls: usize = groups.iter().map(|g| g.iter().filter(|i| is_matmul(&f.ops[**i].name)).count()).sum();
        assert_eq!(matmuls, 4, "only the two layers' attention scores and their matmuls with v");
        let mut seen = HashSet::new();
        for i in groups.iter().flatten() {
            assert!(seen.insert(*i), "op {i} is in two groups");
        }
        let gelu = groups.iter().any(|g| g.iter().any(|i| f.ops[*i].name == "stablehlo.logistic"));
        let layer_norm = groups.iter().any(|g| g.iter().any(|i| f.ops[*i].name == "stablehlo.rsqrt"));
        assert!(gelu && layer_norm, "GELU and LayerNorm are recomputed");
        Ok(())
    }

    /// nanoGPT's blocks: cut at each residual add, so an attention branch, an MLP
    /// branch per layer, and the head.
    #[test]
    fn block_groups_cut_at_the_residual_stream() -> anyhow::Result<()> {
        let (f, active) = nanogpt_forward()?;
        let groups = groups(&f, &active, Recompute::Blocks);
        // per layer: attention branch (4 matmuls), MLP branch (2); then the head (1)
        let matmuls: Vec<usize> =
            groups.iter().map(|g| g.iter().filter(|i| is_matmul(&f.ops[**i].name)).count()).collect();
        assert_eq!(matmuls, vec![4, 2, 4, 2, 1]);
        assert!(super::groups(&f, &active, Recompute::None).is_empty());
        Ok(())
    }
}
