//! Recomputation inside the backward walk ([`super::backward_recomputing`]).

use std::collections::{HashMap, HashSet};

use crate::ir::{Builder, Function, Op, ValueId};
use crate::recompute::Recompute;

/// The groups of a forward to recompute, and the copies made so far.
pub(super) struct Remat {
    forward: Vec<Op>,
    /// Values a recomputation reads as they are: arguments and constants.
    kept: HashSet<ValueId>,
    groups: Vec<Vec<usize>>,
    group_of: HashMap<ValueId, usize>,
    /// Groups without a matmul, which another group's recomputation may
    /// recompute first rather than keep their values.
    cheap: Vec<bool>,
    recomputed: Vec<bool>,
    copies: HashMap<ValueId, ValueId>,
}

impl Remat {
    /// The groups `mode` names in `f`; `active` as [`super::activity`] gives it.
    pub(super) fn new(f: &Function, active: &[bool], mode: Recompute) -> Self {
        let forward = f.ops.clone();
        let kept = f
            .args
            .iter()
            .copied()
            .chain(forward.iter().filter(|op| op.operands.is_empty()).flat_map(|op| op.results.iter().copied()))
            .collect();
        let groups = crate::recompute::groups(f, active, mode);
        let mut group_of = HashMap::new();
        for (g, ops) in groups.iter().enumerate() {
            for i in ops {
                for r in &forward[*i].results {
                    group_of.insert(*r, g);
                }
            }
        }
        let cheap = groups
            .iter()
            .map(|ops| {
                !ops.iter().any(|i| matches!(forward[*i].name.as_str(), "stablehlo.dot_general" | "stablehlo.dot"))
            })
            .collect();
        let recomputed = vec![false; groups.len()];
        Self { forward, kept, groups, group_of, cheap, recomputed, copies: HashMap::new() }
    }

    /// Before `op`'s rule runs: recomputes its own group and, unless its rule
    /// reads no values, the groups of its operands and results; `gate` is a
    /// cotangent of `op`.
    pub(super) fn prepare(&mut self, b: &mut Builder<'_>, op: &Op, gate: ValueId) {
        let own = op.results.first().and_then(|r| self.group_of.get(r)).copied();
        let read_values = !reads_no_values(&op.name);
        for v in op.operands.iter().chain(&op.results) {
            if let Some(&group) = self.group_of.get(v)
                && !self.recomputed[group]
                && (read_values || own == Some(group))
            {
                self.recompute(b, group, gate);
            }
        }
    }

    /// `op` reading and defining the copies of recomputed values.
    pub(super) fn local(&self, op: &Op) -> Op {
        let read = |v: &ValueId| self.copies.get(v).copied().unwrap_or(*v);
        Op {
            operands: op.operands.iter().map(read).collect(),
            results: op.results.iter().map(read).collect(),
            ..op.clone()
        }
    }

    /// Copies the ops of `group`. An input from a cheap group not yet
    /// recomputed is recomputed first; an input already recomputed is read as
    /// its copy; any other floating-point input but `kept` is read plus
    /// `0 · gate[0…]`.
    fn recompute(&mut self, b: &mut Builder<'_>, group: usize, gate: ValueId) {
        self.recomputed[group] = true;
        let ops = self.groups[group].clone();
        let defined: HashSet<ValueId> = ops.iter().flat_map(|i| self.forward[*i].results.iter().copied()).collect();
        let mut inputs: Vec<ValueId> = Vec::new();
        for i in &ops {
            for o in &self.forward[*i].operands {
                if !defined.contains(o) && !inputs.contains(o) {
                    inputs.push(*o);
                }
            }
        }
        for input in &inputs {
            if let Some(&other) = self.group_of.get(input)
                && !self.recomputed[other]
                && self.cheap[other]
            {
                self.recompute(b, other, gate);
            }
        }
        let gate_type = b.ty(gate);
        let zero = gate_type.is_float().then(|| {
            let rank = gate_type.rank();
            let first = b.slice(gate, &vec![0; rank], &vec![1; rank], &vec![1; rank]);
            let first = b.reshape(first, &[]);
            b.scale(first, 0.0)
        });
        let mut local: HashMap<ValueId, ValueId> = HashMap::new();
        for input in &inputs {
            let t = b.ty(*input);
            let read = match (self.copies.get(input), zero) {
                (Some(copy), _) => *copy,
                (None, Some(zero)) if t.is_float() && !self.kept.contains(input) => {
                    let zero = if t.element == gate_type.element { zero } else { b.convert(zero, &t.element) };
                    let zeros = b.broadcast_in_dim(zero, &[], &t.shape);
                    b.add(*input, zeros)
                }
                _ => *input,
            };
            local.insert(*input, read);
        }
        for i in &ops {
            let op = &self.forward[*i];
            let operands = op.operands.iter().map(|o| local[o]).collect();
            let results = b.copy_op(op, operands);
            for (r, c) in op.results.iter().zip(results) {
                local.insert(*r, c);
                self.copies.insert(*r, c);
            }
        }
    }
}

/// Ops whose gradient rule reads neither operands nor results (linear in
/// their operands): reaching one does not recompute a group it reads from.
fn reads_no_values(name: &str) -> bool {
    matches!(
        name,
        "stablehlo.add"
            | "stablehlo.subtract"
            | "stablehlo.negate"
            | "stablehlo.reshape"
            | "stablehlo.broadcast_in_dim"
            | "stablehlo.transpose"
            | "stablehlo.slice"
            | "stablehlo.convert"
            | "stablehlo.concatenate"
            | "stablehlo.pad"
            | "stablehlo.reverse"
    )
}
