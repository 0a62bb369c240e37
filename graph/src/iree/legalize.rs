//! Rewrites that keep IREE 3.13's llvm-cpu backend away from its known
//! miscompiles, using exactly equivalent StableHLO.

use crate::ir::attr::i64_array;
use crate::ir::{Function, Op};

/// Rewrites `f` in place into forms IREE compiles.
///
/// * A reduction of a rank ≥ 2 tensor to a scalar becomes a reshape to 1-D
///   and a reduction over dimension 0. IREE otherwise turns
///   `sum(broadcast(a) * b)` into a rank-0 `vector.contract` and fails with
///   "invalid accumulator/result vector shape".
pub fn legalize(f: &mut Function) {
    let ops = std::mem::take(&mut f.ops);
    for mut op in ops {
        if op.name == "stablehlo.reduce" && op.operands.len() == 2 && op.results.len() == 1 {
            let input = f.ty(op.operands[0]).clone();
            if input.rank() >= 2 && f.ty(op.results[0]).rank() == 0 {
                let flat = f.new_value(input.with_shape(vec![input.elements()]));
                f.ops.push(Op {
                    name: "stablehlo.reshape".to_owned(),
                    operands: vec![op.operands[0]],
                    results: vec![flat],
                    props: Vec::new(),
                    attrs: Vec::new(),
                    regions: None,
                    loc: op.loc.clone(),
                });
                op.operands[0] = flat;
                op.props.retain(|(k, _)| k != "dimensions");
                op.props.push(("dimensions".to_owned(), i64_array(&[0])));
            }
        }
        f.ops.push(op);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Builder, TensorType};

    #[test]
    fn full_reductions_become_one_dimensional() {
        let t = TensorType::parse("tensor<4x2x3xf32>").expect("type");
        let mut f = Function::new("f", &[t]);
        let x = f.args[0];
        let mut b = Builder::new(&mut f, None);
        let partial = b.reduce_sum(x, &[0]);
        let total = b.sum_all(x);
        f.results = vec![total, partial];
        legalize(&mut f);
        let reduces: Vec<&Op> = f.ops.iter().filter(|o| o.name == "stablehlo.reduce").collect();
        assert_eq!(reduces.len(), 2);
        assert_eq!(reduces[0].attr("dimensions"), Some("array<i64: 0>"));
        assert_eq!(f.ty(reduces[1].operands[0]).to_string(), "tensor<24xf32>");
        assert!(f.ops.iter().any(|o| o.name == "stablehlo.reshape"));
    }
}
