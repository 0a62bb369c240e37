//! GELU (tanh approximation) as one op in a training step, `pcp.gelu`, whose
//! backward reads only its input.
//!
//! Built from primitives, `x · σ(x · (k₁ + k₂·x²))` gives a backward that reads
//! three forward tensors (`x`, the gate `σ(…)` and `k₁ + k₂·x²`), each as large
//! as the MLP's hidden layer. With activations recomputed
//! ([`crate::Recompute::Elementwise`]) IREE then writes all three out in the
//! recomputing dispatch and reads them back in the next matmul's epilogue.
//! [`fuse`] replaces the pattern with one op whose gradient ([`vjp`]) is
//! `g · (σ(u) + x·σ(u)·(1 − σ(u))·(k₁ + 3k₂·x²))`, `u = x·(k₁ + k₂·x²)`,
//! computed from `x` alone, so the backward keeps one tensor instead of three
//! and IREE fuses the rest into the matmul's epilogue. [`expand`] lowers the op
//! back to the primitives ([`build`]) before compilation, so the forward is the
//! same ops as the model's. The derivative is the primitives' derivative
//! rearranged: the same function, rounded differently.
//!
//! The pattern is the form [`build`] emits (the built-in models'); an imported
//! module's GELU written another way keeps its ops.

use std::collections::HashMap;

use crate::ir::{Builder, Function, Op, ValueId};

/// The op [`fuse`] creates and [`expand`] lowers.
pub const OP: &str = "pcp.gelu";

/// `2·√(2/π)`: `(1 + tanh u)/2 = σ(2u)`.
fn k1() -> f64 {
    2.0 * (2.0 / std::f64::consts::PI).sqrt()
}

/// The cubic term's factor, `0.044715 · k₁`.
fn k2() -> f64 {
    0.044715 * k1()
}

/// GELU, tanh approximation: `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`,
/// computed as `x · σ(x · (k₁ + k₂·x²))` (the same function).
pub fn build(b: &mut Builder<'_>, x: ValueId) -> ValueId {
    let x2 = b.mul(x, x);
    let slope = b.scale(x2, k2());
    let k = b.splat_like(k1(), slope);
    let slope = b.add(slope, k);
    let inner = b.mul(x, slope);
    let gate = b.unary_op("stablehlo.logistic", inner);
    b.mul(x, gate)
}

/// The cotangent of `pcp.gelu`'s input `x`, given its output's, `g`.
///
/// The gate is computed in another order than [`build`]'s (`(k₂·x)·x`, not
/// `k₂·(x·x)`), so a compiler's common-subexpression elimination cannot merge it
/// with the forward's (or a recomputed forward's) and keep the merged tensors
/// for the backward, which is what this op exists to avoid.
pub fn vjp(b: &mut Builder<'_>, x: ValueId, g: ValueId) -> ValueId {
    let kx = b.scale(x, k2());
    let kx2 = b.mul(kx, x);
    let k = b.splat_like(k1(), kx2);
    let slope = b.add(kx2, k);
    let inner = b.mul(slope, x);
    let gate = b.unary_op("stablehlo.logistic", inner);
    // d/dx [x·(k₁ + k₂x²)] = k₁ + 3k₂x²
    let du = b.scale(kx2, 3.0);
    let du = b.add(du, k);
    let one = b.splat_like(1.0, gate);
    let rest = b.sub(one, gate);
    let dgate = b.mul(gate, rest);
    let t = b.mul(x, dgate);
    let t = b.mul(t, du);
    let d = b.add(gate, t);
    b.mul(g, d)
}

/// Replaces every GELU of the form [`build`] emits in `f` with one `pcp.gelu`
/// op; returns how many. Ops the rest of `f` still reads stay.
pub fn fuse(f: &mut Function) -> usize {
    let producers: HashMap<ValueId, usize> =
        f.ops.iter().enumerate().flat_map(|(i, op)| op.results.iter().map(move |r| (*r, i))).collect();
    let found: HashMap<usize, ValueId> =
        (0..f.ops.len()).filter_map(|i| Matcher { f, producers: &producers }.gelu(i).map(|x| (i, x))).collect();
    if found.is_empty() {
        return 0;
    }
    for (i, x) in &found {
        let op = &mut f.ops[*i];
        op.name = OP.to_owned();
        op.operands = vec![*x];
        op.props.clear();
    }
    f.eliminate_dead_code();
    found.len()
}

/// Replaces every `pcp.gelu` op of `f` with [`build`]'s primitives; returns how many.
pub fn expand(f: &mut Function) -> usize {
    if !f.ops.iter().any(|op| op.name == OP) {
        return 0;
    }
    f.lower_ops(|b, op| (op.name == OP && op.operands.len() == 1).then(|| vec![build(b, op.operands[0])]))
}

struct Matcher<'a> {
    f: &'a Function,
    producers: &'a HashMap<ValueId, usize>,
}

impl Matcher<'_> {
    /// The op named `name`, with one result and `arity` operands, that produces `v`.
    fn def(&self, v: ValueId, name: &str, arity: usize) -> Option<&Op> {
        let op = &self.f.ops[*self.producers.get(&v)?];
        (op.name == name && op.results.len() == 1 && op.operands.len() == arity).then_some(op)
    }

    /// `out = x · σ(x · (k₂·(x·x) + k₁))` at op `i` (any operand order): `x`.
    fn gelu(&self, i: usize) -> Option<ValueId> {
        let out = &self.f.ops[i];
        if out.name != "stablehlo.multiply" || out.operands.len() != 2 || !self.f.ty(out.results[0]).is_float() {
            return None;
        }
        [(0, 1), (1, 0)].into_iter().find_map(|(a, g)| {
            let x = out.operands[a];
            let gate = self.def(out.operands[g], "stablehlo.logistic", 1)?;
            let slope = self.other(self.def(gate.operands[0], "stablehlo.multiply", 2)?, x)?;
            let add = self.def(slope, "stablehlo.add", 2)?;
            let cubic = add.operands.iter().find_map(|t| {
                let other = add.operands.iter().find(|o| *o != t)?;
                self.near(*other, k1()).then_some(*t)
            })?;
            let cubic = self.def(cubic, "stablehlo.multiply", 2)?;
            let square = cubic.operands.iter().find_map(|t| {
                let other = cubic.operands.iter().find(|o| *o != t)?;
                self.near(*other, k2()).then_some(*t)
            })?;
            let square = self.def(square, "stablehlo.multiply", 2)?;
            (square.operands == [x, x]).then_some(x)
        })
    }

    /// The operand of a binary `op` other than `x`, when one of them is `x`.
    fn other(&self, op: &Op, x: ValueId) -> Option<ValueId> {
        match op.operands.as_slice() {
            [a, b] if *a == x => Some(*b),
            [a, b] if *b == x => Some(*a),
            _ => None,
        }
    }

    /// Whether `v` is a splat constant within f32 rounding of `value`.
    fn near(&self, v: ValueId, value: f64) -> bool {
        crate::attention::splat_value(self.f, self.producers, v)
            .is_some_and(|c| (c - value).abs() <= 1e-6 * value.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{ElementType, FloatType, TensorType};

    fn gelu_function() -> Function {
        let t = TensorType::new(vec![4, 8], ElementType::Float(FloatType::F32));
        let mut f = Function::new("main", &[t]);
        let x = f.args[0];
        let mut b = Builder::new(&mut f, None);
        let y = build(&mut b, x);
        let y = b.mul(y, y);
        f.results = vec![y];
        f
    }

    #[test]
    fn the_built_form_fuses_into_one_op_and_expands_back() {
        let mut f = gelu_function();
        let before = f.ops.len();
        assert_eq!(fuse(&mut f), 1);
        assert_eq!(f.ops.iter().filter(|op| op.name == OP).count(), 1);
        assert!(f.ops.iter().all(|op| op.name != "stablehlo.logistic"), "the primitives are gone");
        assert_eq!(fuse(&mut f), 0, "nothing left to fuse");
        assert_eq!(expand(&mut f), 1);
        f.eliminate_dead_code();
        assert_eq!(f.ops.len(), before);
        assert!(f.ops.iter().all(|op| op.name != OP));
    }

    #[test]
    fn other_constants_are_not_gelu() {
        let t = TensorType::new(vec![4], ElementType::Float(FloatType::F32));
        let mut f = Function::new("main", &[t]);
        let x = f.args[0];
        let mut b = Builder::new(&mut f, None);
        let x2 = b.mul(x, x);
        let slope = b.scale(x2, 0.05);
        let k = b.splat_like(k1(), slope);
        let slope = b.add(slope, k);
        let inner = b.mul(x, slope);
        let gate = b.unary_op("stablehlo.logistic", inner);
        let y = b.mul(x, gate);
        f.results = vec![y];
        assert_eq!(fuse(&mut f), 0);
    }
}
