//! Sums of negations as negations of sums.

use super::{is_reduce_with, op};
use crate::ir::{Function, ValueId};

/// Rewrites `reduce_add(negate(x), init)` as
/// `negate(reduce_add(x, negate(init)))`.
///
/// IREE fuses the negation into the reduction and canonicalises the body
/// `acc + (-x)` to `acc - x`, which has no neutral element: the CUDA, ROCm
/// and SPIR-V backends then fail with "failed to get neutral element for
/// reduction" / "Failed to get an identity value for the reduction
/// operation" / "tiling of level PartialReduction failed". pcp's own
/// gradients produce this form wherever a `subtract` feeds a broadcast (the
/// mean in LayerNorm, the max and log-sum-exp in softmax and cross-entropy).
///
/// The rewrite is exact: IEEE negation is exact and rounding is symmetric,
/// so `init + Σ(-xᵢ) = -((-init) + Σxᵢ)` term by term in any order; only the
/// sign of an exactly-zero sum can differ (`+0` versus `-0`), which compares
/// equal. The negation now runs on the (smaller) reduced tensor, and the
/// original `negate` is left for its other users or dead-code elimination.
pub(super) fn hoist_negations(f: &mut Function) {
    let mut negated: Vec<Option<ValueId>> = vec![None; f.value_count()];
    let ops = std::mem::take(&mut f.ops);
    for mut reduce in ops {
        if reduce.name == "stablehlo.negate" && reduce.operands.len() == 1 && reduce.results.len() == 1 {
            negated[reduce.results[0].0 as usize] = Some(reduce.operands[0]);
        }
        let source = reduce.operands.first().and_then(|v| negated.get(v.0 as usize).copied().flatten());
        match source {
            Some(x) if is_reduce_with(&reduce, "stablehlo.add") => {
                let init = reduce.operands[1];
                let neg_init = f.new_value(f.ty(init).clone());
                f.ops.push(op("stablehlo.negate", vec![init], neg_init, reduce.loc.clone()));
                let sum = f.new_value(f.ty(reduce.results[0]).clone());
                let result = reduce.results[0];
                reduce.operands = vec![x, neg_init];
                reduce.results = vec![sum];
                let loc = reduce.loc.clone();
                f.ops.push(reduce);
                f.ops.push(op("stablehlo.negate", vec![sum], result, loc));
            }
            _ => f.ops.push(reduce),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Builder, TensorType};

    #[test]
    fn sums_of_negations_become_negated_sums() {
        let t = TensorType::parse("tensor<8x5xf32>").expect("type");
        let mut f = Function::new("f", &[t]);
        let x = f.args[0];
        let mut b = Builder::new(&mut f, None);
        let n = b.neg(x);
        let rows = b.reduce_sum(n, &[1]);
        let top = b.reduce(n, &[1], "stablehlo.maximum", f64::NEG_INFINITY);
        f.results = vec![rows, top, n];
        hoist_negations(&mut f);
        let names: Vec<&str> = f.ops.iter().map(|o| o.name.as_str()).collect();
        // negate(x) stays for its other users; the sum reads x and is negated after.
        let sum = f.ops.iter().position(|o| o.name == "stablehlo.reduce" && o.operands[0] == x).expect("sum of x");
        assert_eq!(f.ops[sum].body_ops(), ["stablehlo.add"]);
        assert_eq!(f.ty(f.ops[sum].operands[1]).to_string(), "tensor<f32>");
        let init_negation = f.ops.iter().find(|o| o.results == [f.ops[sum].operands[1]]).expect("init");
        assert_eq!(init_negation.name, "stablehlo.negate");
        assert_eq!(f.ops[sum + 1].name, "stablehlo.negate");
        assert_eq!(f.ops[sum + 1].operands, f.ops[sum].results);
        assert_eq!(f.ops[sum + 1].results, [rows]);
        // A max of a negation has a neutral element and is left alone.
        let max = f.ops.iter().find(|o| o.results == [top]).expect("max");
        assert_eq!(max.operands[0], n);
        assert_eq!(names.iter().filter(|n| **n == "stablehlo.negate").count(), 3);
    }
}
