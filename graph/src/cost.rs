//! What a module costs to run: floating-point operations, counted from the IR
//! (as DistIR's cost inference does), for throughput figures and simulations.

use crate::ir::{Function, Module, Op};

/// Floating-point operations of one call of `function` in `module`: 2·b·m·n·k per
/// matmul (`stablehlo.dot_general`, `stablehlo.dot`) with static shapes, plus one per
/// output element of every other op (elementwise work, reductions, softmax). For a
/// `train_step` that is forward, backward and optimizer together. `None` when the
/// module has no such function.
pub fn flops(module: &Module, function: &str) -> Option<f64> {
    let f = module.functions.iter().find(|f| f.name == function)?;
    Some(f.ops.iter().map(|op| op_flops(f, op)).sum())
}

fn op_flops(f: &Function, op: &Op) -> f64 {
    if let Some((batch, m, n, k)) = matmul_dims(f, op) {
        return 2.0 * [batch, m, n, k].iter().map(|d| *d as f64).product::<f64>();
    }
    match op.name.as_str() {
        "stablehlo.constant"
        | "stablehlo.reshape"
        | "stablehlo.broadcast_in_dim"
        | "stablehlo.transpose"
        | "stablehlo.slice"
        | "stablehlo.concatenate"
        | "stablehlo.iota"
        | "func.return"
        | "func.call" => 0.0,
        _ => op.results.iter().map(|r| f.ty(*r).elements().max(0) as f64).sum(),
    }
}

/// (batch, rows, columns, contraction) of a `stablehlo.dot_general` or `stablehlo.dot`
/// with static shapes.
pub fn matmul_dims(f: &Function, op: &Op) -> Option<(i64, i64, i64, i64)> {
    use crate::ir::attr::{lookup, parse_ints, struct_fields};
    let (lhs, rhs) = (f.ty(*op.operands.first()?), f.ty(*op.operands.get(1)?));
    let (lb, rb, lc, rc) = match op.name.as_str() {
        "stablehlo.dot" => (vec![], vec![], vec![lhs.rank() as i64 - 1], vec![0]),
        "stablehlo.dot_general" => {
            let fields = struct_fields(op.attr("dot_dimension_numbers")?);
            let ints = |key: &str| lookup(&fields, key).and_then(parse_ints).unwrap_or_default();
            (
                ints("lhs_batching_dimensions"),
                ints("rhs_batching_dimensions"),
                ints("lhs_contracting_dimensions"),
                ints("rhs_contracting_dimensions"),
            )
        }
        _ => return None,
    };
    // the product of `shape`'s sizes at `dims` (`None` for a dynamic size)
    let product = |shape: &[i64], dims: &[usize]| -> Option<i64> {
        dims.iter().map(|d| shape.get(*d).copied().filter(|n| *n >= 0)).product()
    };
    let free = |rank: usize, batch: &[i64], contract: &[i64]| -> Vec<usize> {
        (0..rank).filter(|d| !batch.contains(&(*d as i64)) && !contract.contains(&(*d as i64))).collect()
    };
    let at = |dims: &[i64]| -> Vec<usize> { dims.iter().map(|d| *d as usize).collect() };
    let batch = product(&lhs.shape, &at(&lb))?;
    let k = product(&lhs.shape, &at(&lc))?;
    let m = product(&lhs.shape, &free(lhs.rank(), &lb, &lc))?;
    let n = product(&rhs.shape, &free(rhs.rank(), &rb, &rc))?;
    Some((batch, m, n, k))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_matmul_costs_two_flops_per_multiply_add() -> anyhow::Result<()> {
        let text = r#"func.func @main(%a: tensor<8x16xf32>, %b: tensor<16x4xf32>) -> tensor<8x4xf32> {
  %0 = "stablehlo.dot_general"(%a, %b) {dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>} : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
  %1 = stablehlo.add %0, %0 : tensor<8x4xf32>
  return %1 : tensor<8x4xf32>
}"#;
        let module = crate::import_str("mm", text)?;
        assert_eq!(flops(&module, "main"), Some(2.0 * 8.0 * 16.0 * 4.0 + 32.0));
        assert_eq!(flops(&module, "absent"), None);
        Ok(())
    }

    /// The train step of nanoGPT costs about 6 FLOPs per parameter per token (forward
    /// 2, backward 4) in its matmuls, plus attention.
    #[test]
    fn nanogpt_step_is_about_six_flops_per_parameter_token() -> anyhow::Result<()> {
        let config = crate::NanoGptConfig::medium();
        let built = crate::nanogpt(&config)?;
        let step = crate::train_step(&built.module, "main", &crate::StepConfig::default())?;
        let params: f64 = built.params.iter().map(|p| p.ty.elements() as f64).sum();
        let tokens = (config.batch_size * config.block_size) as f64;
        let ratio = flops(&step.module, "train_step").unwrap_or(0.0) / (params * tokens);
        assert!((6.0..9.0).contains(&ratio), "{ratio} FLOPs per parameter-token");
        Ok(())
    }
}
