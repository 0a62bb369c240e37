//! Reverse-mode automatic differentiation of StableHLO.
//!
//! Calls are inlined first; then the forward function is walked backwards
//! and each op on the path from the parameters to the loss contributes its
//! vector-Jacobian product as new StableHLO ops. Rules are exact: no
//! epsilons, no clamping. An op without a rule is an error naming the op and
//! its location, never a silently wrong gradient.

mod remat;
mod rules;

use std::collections::HashMap;

use crate::ir::{Builder, Function, Module, Op, TensorType, ValueId};
use crate::recompute::Recompute;

pub use rules::has_rule;

/// Why a gradient could not be derived.
#[derive(Debug, thiserror::Error)]
pub enum GradError {
    /// The entry function does not exist.
    #[error("no function @{entry} in the module (functions: {available})")]
    MissingEntry {
        /// The requested entry.
        entry: String,
        /// The functions that exist.
        available: String,
    },
    /// The entry does not return a single floating-point scalar.
    #[error("@{entry} must return one scalar floating-point loss, but returns ({results})")]
    NotScalarLoss {
        /// The entry.
        entry: String,
        /// Its result types.
        results: String,
    },
    /// An op on the gradient path has no rule.
    #[error("no gradient rule for {op} at {location}")]
    NoRule {
        /// The op name.
        op: String,
        /// Its source location.
        location: String,
    },
    /// An op on the gradient path is used in a way pcp cannot differentiate.
    #[error("cannot differentiate {op} at {location}: {reason}")]
    Unsupported {
        /// The op name.
        op: String,
        /// Its source location.
        location: String,
        /// What is unsupported.
        reason: String,
    },
    /// A call names a function that does not exist, or recurses.
    #[error("cannot inline call to @{callee} at {location}: {reason}")]
    Call {
        /// The callee.
        callee: String,
        /// The call's location.
        location: String,
        /// What went wrong.
        reason: String,
    },
}

/// The entry's arguments split into parameters and data.
#[derive(Clone, Debug, PartialEq)]
pub struct Signature {
    /// Floating-point arguments (argument index, type): the parameters.
    pub params: Vec<(usize, TensorType)>,
    /// Integer arguments: the data inputs.
    pub data: Vec<(usize, TensorType)>,
    /// The scalar loss type.
    pub loss: TensorType,
}

impl Signature {
    /// Total number of parameter elements.
    pub fn parameter_count(&self) -> i64 {
        self.params.iter().map(|(_, t)| t.elements()).sum()
    }
}

/// Reads the signature of `f`, which must return one floating-point scalar.
pub fn signature(f: &Function) -> Result<Signature, GradError> {
    let results = f.result_types();
    let loss = match results.as_slice() {
        [t] if t.rank() == 0 && t.is_float() => t.clone(),
        _ => {
            let results = results.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
            return Err(GradError::NotScalarLoss { entry: f.name.clone(), results });
        }
    };
    let (mut params, mut data) = (Vec::new(), Vec::new());
    for (i, t) in f.arg_types().into_iter().enumerate() {
        if t.is_float() { params.push((i, t)) } else { data.push((i, t)) }
    }
    Ok(Signature { params, data, loss })
}

fn lookup<'m>(module: &'m Module, entry: &str) -> Result<&'m Function, GradError> {
    module.function(entry).ok_or_else(|| GradError::MissingEntry {
        entry: entry.to_owned(),
        available: module.functions.iter().map(|f| format!("@{}", f.name)).collect::<Vec<_>>().join(", "),
    })
}

/// Copies `entry` (calls inlined) into `out`, its arguments bound to `args`;
/// returns the values it returns.
pub fn inline_with_args(
    module: &Module,
    entry: &str,
    args: &[ValueId],
    out: &mut Function,
) -> Result<Vec<ValueId>, GradError> {
    let callee = lookup(module, entry)?;
    let mut stack = vec![entry.to_owned()];
    inline_into(module, callee, args, out, &mut stack)
}

/// Returns `entry` with every `func.call` inlined.
pub fn inline_calls(module: &Module, entry: &str) -> Result<Function, GradError> {
    let mut out = Function::new(entry, &lookup(module, entry)?.arg_types());
    let args = out.args.clone();
    out.results = inline_with_args(module, entry, &args, &mut out)?;
    Ok(out)
}

fn inline_into(
    module: &Module,
    callee: &Function,
    args: &[ValueId],
    out: &mut Function,
    stack: &mut Vec<String>,
) -> Result<Vec<ValueId>, GradError> {
    let mut map: HashMap<ValueId, ValueId> = callee.args.iter().copied().zip(args.iter().copied()).collect();
    for op in &callee.ops {
        let operands: Vec<ValueId> = op.operands.iter().map(|o| map[o]).collect();
        if op.name == "func.call" {
            let name = op.attr("callee").unwrap_or_default().trim_start_matches('@').trim_matches('"').to_owned();
            let call_error = |reason: &str| GradError::Call {
                callee: name.clone(),
                location: op.location(),
                reason: reason.to_owned(),
            };
            let target = module.function(&name).ok_or_else(|| call_error("no such function"))?;
            if stack.contains(&name) {
                return Err(call_error("recursion is not supported"));
            }
            stack.push(name.clone());
            let results = inline_into(module, target, &operands, out, stack)?;
            stack.pop();
            for (r, v) in op.results.iter().zip(results) {
                map.insert(*r, v);
            }
            continue;
        }
        let results: Vec<ValueId> = op.results.iter().map(|r| out.new_value(callee.ty(*r).clone())).collect();
        for (r, v) in op.results.iter().zip(&results) {
            map.insert(*r, *v);
        }
        out.ops.push(Op { operands, results, ..op.clone() });
    }
    Ok(callee.results.iter().map(|r| map[r]).collect())
}

/// Which values of `f` lie on a path from `wrt` to `loss` (indexed by value).
pub fn activity(f: &Function, loss: ValueId, wrt: &[ValueId]) -> Vec<bool> {
    let n = f.value_count();
    let mut varied = vec![false; n];
    for w in wrt {
        varied[w.0 as usize] = true;
    }
    for op in &f.ops {
        if op.operands.iter().any(|o| varied[o.0 as usize]) {
            for r in &op.results {
                varied[r.0 as usize] = f.ty(*r).is_float();
            }
        }
    }
    let mut useful = vec![false; n];
    useful[loss.0 as usize] = true;
    for op in f.ops.iter().rev() {
        if op.results.iter().any(|r| useful[r.0 as usize]) {
            for o in &op.operands {
                useful[o.0 as usize] = true;
            }
        }
    }
    varied.iter().zip(&useful).map(|(v, u)| *v && *u).collect()
}

/// Appends to `f` the ops computing d`loss`/d`wrt`, returning one gradient
/// per `wrt` value (zeros where the loss does not depend on it).
pub fn backward(f: &mut Function, loss: ValueId, wrt: &[ValueId]) -> Result<Vec<ValueId>, GradError> {
    backward_recomputing(f, loss, wrt, Recompute::None)
}

/// [`backward`], recomputing the forward values `mode` names instead of
/// reading them ([`crate::recompute`]).
///
/// The walk goes through the forward in reverse. Before a rule reads a value of a
/// group not yet recomputed, the group's ops are copied, in order, reading the
/// group's activation inputs plus `0 · g`, where `g` is one element of a
/// cotangent of the op at hand. That dependence is what keeps the copy in the
/// backward: the compiler can neither compute it before the cotangent exists nor
/// merge it with the forward's originals (`x · 0` does not fold for floats, since
/// `∞ · 0` is NaN), and it stays in the same execution region, where IREE reuses
/// memory by lifetime (an optimization barrier would split the region and sync
/// with the host instead). `x + 0 = x` exactly, so the copies equal the originals
/// bit for bit. The rule then reads the copies.
pub fn backward_recomputing(
    f: &mut Function,
    loss: ValueId,
    wrt: &[ValueId],
    mode: Recompute,
) -> Result<Vec<ValueId>, GradError> {
    let forward: Vec<Op> = f.ops.clone();
    let active_values = activity(f, loss, wrt);
    let mut remat = remat::Remat::new(f, &active_values, mode);
    let mut b = Builder::new(f, None);
    let mut cotangents: HashMap<ValueId, ValueId> = HashMap::new();
    let seed = b.splat_like(1.0, loss);
    cotangents.insert(loss, seed);
    for op in forward.iter().rev() {
        let g: Vec<Option<ValueId>> = op.results.iter().map(|r| cotangents.get(r).copied()).collect();
        let Some(gate) = g.iter().flatten().next().copied() else {
            continue;
        };
        let active: Vec<bool> = op.operands.iter().map(|o| active_values[o.0 as usize]).collect();
        if !active.iter().any(|a| *a) {
            continue;
        }
        b.set_loc(op.loc.clone());
        remat.prepare(&mut b, op, gate);
        let contributions = rules::vjp(&mut b, &remat.local(op), &g, &active)?;
        for ((operand, contribution), is_active) in op.operands.iter().zip(contributions).zip(&active) {
            let (Some(c), true) = (contribution, is_active) else {
                continue;
            };
            let total = match cotangents.get(operand) {
                Some(previous) => b.add(*previous, c),
                None => c,
            };
            cotangents.insert(*operand, total);
        }
    }
    b.set_loc(None);
    Ok(wrt.iter().map(|w| cotangents.get(w).copied().unwrap_or_else(|| b.splat_like(0.0, *w))).collect())
}

/// A module holding the forward entry and its gradient function.
#[derive(Clone, Debug)]
pub struct Gradient {
    /// `@<entry>` (calls inlined) and `@<entry>_grad`.
    pub module: Module,
    /// The entry's signature.
    pub signature: Signature,
    /// Ops in the forward function.
    pub forward_ops: usize,
    /// Ops in the gradient function (forward included).
    pub gradient_ops: usize,
}

/// Differentiates `entry` (its attention and GELU fused, [`crate::attention`], [`crate::gelu`]): `@<entry>_grad` takes the forward's arguments and
/// returns the loss, then one gradient per floating-point argument.
pub fn differentiate(module: &Module, entry: &str) -> Result<Gradient, GradError> {
    differentiate_with(module, entry, crate::Attention::Fused)
}

/// [`differentiate`], with attention and GELU fused or as the module writes them.
pub fn differentiate_with(module: &Module, entry: &str, attention: crate::Attention) -> Result<Gradient, GradError> {
    let mut forward = inline_calls(module, entry)?;
    if attention == crate::Attention::Fused {
        crate::attention::fuse(&mut forward);
        crate::gelu::fuse(&mut forward);
    }
    let signature = signature(&forward)?;
    forward.eliminate_dead_code();
    let mut grad = forward.clone();
    grad.name = format!("{entry}_grad");
    let loss = grad.results[0];
    let wrt: Vec<ValueId> = signature.params.iter().map(|(i, _)| grad.args[*i]).collect();
    let grads = backward(&mut grad, loss, &wrt)?;
    grad.results = std::iter::once(loss).chain(grads).collect();
    grad.eliminate_dead_code();
    crate::iree::legalize(&mut forward);
    crate::iree::legalize(&mut grad);
    let (forward_ops, gradient_ops) = (forward.ops.len(), grad.ops.len());
    Ok(Gradient {
        module: Module { functions: vec![forward, grad], resources: module.resources.clone() },
        signature,
        forward_ops,
        gradient_ops,
    })
}
