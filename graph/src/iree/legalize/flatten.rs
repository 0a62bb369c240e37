//! Full reductions of rank ≥ 2 tensors as 1-D reductions.

use super::{op, set_dimensions};
use crate::ir::Function;

/// Rewrites every single-input reduction of a rank ≥ 2 tensor to a scalar
/// as a reshape to 1-D and a reduction over dimension 0.
///
/// IREE's llvm-cpu backend otherwise turns `sum(broadcast(a) * b)` into a
/// rank-0 `vector.contract` and fails with "invalid accumulator/result vector
/// shape". The same elements are combined by the same body, so the result is
/// the same reduction.
pub(super) fn flatten_full_reductions(f: &mut Function) {
    let ops = std::mem::take(&mut f.ops);
    for mut reduce in ops {
        if reduce.name == "stablehlo.reduce" && reduce.operands.len() == 2 && reduce.results.len() == 1 {
            let input = f.ty(reduce.operands[0]).clone();
            if input.rank() >= 2 && f.ty(reduce.results[0]).rank() == 0 {
                let flat = f.new_value(input.with_shape(vec![input.elements()]));
                f.ops.push(op("stablehlo.reshape", vec![reduce.operands[0]], flat, reduce.loc.clone()));
                reduce.operands[0] = flat;
                set_dimensions(&mut reduce.props, &[0]);
            }
        }
        f.ops.push(reduce);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Builder, Op, TensorType};

    #[test]
    fn full_reductions_become_one_dimensional() {
        let t = TensorType::parse("tensor<4x2x3xf32>").expect("type");
        let mut f = Function::new("f", &[t]);
        let x = f.args[0];
        let mut b = Builder::new(&mut f, None);
        let partial = b.reduce_sum(x, &[0]);
        let total = b.sum_all(x);
        f.results = vec![total, partial];
        flatten_full_reductions(&mut f);
        let reduces: Vec<&Op> = f.ops.iter().filter(|o| o.name == "stablehlo.reduce").collect();
        assert_eq!(reduces.len(), 2);
        assert_eq!(reduces[0].attr("dimensions"), Some("array<i64: 0>"));
        assert_eq!(f.ty(reduces[1].operands[0]).to_string(), "tensor<24xf32>");
        assert!(f.ops.iter().any(|o| o.name == "stablehlo.reshape"));
    }
}
