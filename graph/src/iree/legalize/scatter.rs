//! Row scatter-adds (an embedding's gradient) as one-hot matmuls.

use std::collections::HashMap;

use crate::ir::attr::{lookup, parse_int, parse_ints, struct_fields};
use crate::ir::{Builder, Function, Op, TensorType, ValueId};

/// The most table rows a scatter-add may have to become a one-hot matmul. The
/// matmul does `2·N·V·D` work for `N` rows of width `D` into `V` rows, one more
/// head-sized matmul; past this many rows the scatter is kept.
pub(crate) const ONE_HOT_MAX_ROWS: i64 = 8192;

/// Rewrites `scatter(table, ids, rows)` with an add combiner that adds whole rows
/// of a `[V, D]` table (the gradient of an embedding lookup) as
/// `table + one_hot(ids)ᵀ · rows`, for tables of at most [`ONE_HOT_MAX_ROWS`] rows.
///
/// IREE 3.13's CUDA and ROCm backends run a scatter whose indices may repeat on
/// one GPU thread (a grid of one block of one thread): gpt2-124m's token-embedding
/// gradient (8,192 rows of 768 into 65) took 188.5 ms of a 313 ms bf16 step on an
/// H200, a grid and a block of one (`bench/gpu_profile.sh`, 2026-12-04). The one-hot
/// matmul is a dense contraction IREE tiles like any other, and sums the same
/// products (in another order). The cpu keeps the scatter, which one core runs
/// at memory speed.
pub(super) fn scatter_adds_as_matmuls(f: &mut Function) {
    let ops = std::mem::take(&mut f.ops);
    let mut zeros: Vec<ValueId> = Vec::new();
    let mut renamed: HashMap<ValueId, ValueId> = HashMap::new();
    for mut o in ops {
        o.operands.iter_mut().for_each(|v| *v = *renamed.get(v).unwrap_or(v));
        if is_zero_splat(&o) {
            zeros.push(o.results[0]);
        }
        match row_scatter(f, &o) {
            Some(rows) => {
                let mut b = Builder::new(f, o.loc.clone());
                let sum = one_hot_sum(&mut b, &rows);
                let out = if zeros.contains(&rows.table) { sum } else { b.add(rows.table, sum) };
                renamed.insert(o.results[0], out);
            }
            None => f.ops.push(o),
        }
    }
    f.results.iter_mut().for_each(|v| *v = *renamed.get(v).unwrap_or(v));
}

/// A scatter-add of rows: the table `[V, D]`, the row ids (`N` of them, any
/// batch shape) and the rows (the same batch shape, then `D`).
struct RowScatter {
    table: ValueId,
    ids: ValueId,
    rows: ValueId,
    n: i64,
    v: i64,
    d: i64,
}

fn row_scatter(f: &Function, o: &Op) -> Option<RowScatter> {
    if o.name != "stablehlo.scatter" || o.operands.len() != 3 || o.results.len() != 1 {
        return None;
    }
    if o.body_ops() != ["stablehlo.add"] {
        return None;
    }
    let (table, ids, rows) = (o.operands[0], o.operands[1], o.operands[2]);
    let (tt, it, rt) = (f.ty(table), f.ty(ids), f.ty(rows));
    if tt.rank() != 2 || !tt.is_float() || tt.shape.iter().any(|d| *d < 0) {
        return None;
    }
    let fields = struct_fields(o.attr("scatter_dimension_numbers")?);
    let ints = |k: &str| lookup(&fields, k).and_then(parse_ints).unwrap_or_default();
    let ivd = lookup(&fields, "index_vector_dim").and_then(parse_int)?;
    let batch_rank = rt.rank().checked_sub(1)?;
    if ints("update_window_dims") != [batch_rank as i64]
        || ints("inserted_window_dims") != [0]
        || ints("scatter_dims_to_operand_dims") != [0]
        || !ints("input_batching_dims").is_empty()
        || !ints("scatter_indices_batching_dims").is_empty()
    {
        return None;
    }
    // ids: the rows' batch shape, with a trailing index vector of one or none
    let id_batch: &[i64] = if ivd as usize == it.rank() {
        &it.shape
    } else if ivd as usize + 1 == it.rank() && it.shape.last() == Some(&1) {
        &it.shape[..it.rank() - 1]
    } else {
        return None;
    };
    if id_batch != &rt.shape[..batch_rank] || rt.shape[batch_rank] != tt.shape[1] || rt.element != tt.element {
        return None;
    }
    let n: i64 = id_batch.iter().product();
    let (v, d) = (tt.shape[0], tt.shape[1]);
    (n > 0 && v <= ONE_HOT_MAX_ROWS && it.element.name().starts_with('i')).then_some(RowScatter {
        table,
        ids,
        rows,
        n,
        v,
        d,
    })
}

/// `one_hot(ids)ᵀ · rows`, `[V, D]`, in the rows' element type.
fn one_hot_sum(b: &mut Builder<'_>, s: &RowScatter) -> ValueId {
    let element = b.ty(s.rows).element;
    let id_type = b.ty(s.ids).element;
    let ids = b.reshape(s.ids, &[s.n]);
    let ids = b.broadcast_in_dim(ids, &[0], &[s.n, s.v]);
    let grid = TensorType::new(vec![s.n, s.v], id_type);
    let columns = b.op("stablehlo.iota", &[], vec![("iota_dimension".into(), "1 : i64".into())], None, grid);
    let hit = b.compare(ids, columns, "EQ");
    let one_hot = b.convert(hit, &element);
    let rows = b.reshape(s.rows, &[s.n, s.d]);
    b.dot_general(one_hot, rows, &[], &[], &[0], &[0], element)
}

fn is_zero_splat(o: &Op) -> bool {
    o.name == "stablehlo.constant"
        && o.attr("value").is_some_and(|v| {
            let literal = v.strip_prefix("dense<").and_then(|r| r.split('>').next()).unwrap_or("");
            matches!(literal, "0.0" | "0.000000e+00" | "0x00000000" | "0x0000" | "0")
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autodiff::differentiate;

    /// An embedding lookup's loss: the gradient of the table is a row scatter-add.
    fn embedding(vocab: i64) -> crate::Module {
        let text = format!(
            r#"func.func @main(%table: tensor<{vocab}x8xf32>, %ids: tensor<2x3xi32>) -> tensor<f32> {{
  %rows = "stablehlo.gather"(%table, %ids) {{dimension_numbers = #stablehlo.gather<offset_dims = [2], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 2>, indices_are_sorted = false, slice_sizes = array<i64: 1, 8>}} : (tensor<{vocab}x8xf32>, tensor<2x3xi32>) -> tensor<2x3x8xf32>
  %sq = stablehlo.multiply %rows, %rows : tensor<2x3x8xf32>
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %sum = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [0, 1, 2] : (tensor<2x3x8xf32>, tensor<f32>) -> tensor<f32>
  return %sum : tensor<f32>
}}"#
        );
        crate::import_str("embedding", &text).expect("imports")
    }

    fn names(f: &Function) -> Vec<&str> {
        f.ops.iter().map(|o| o.name.as_str()).collect()
    }

    #[test]
    fn an_embedding_gradient_becomes_a_one_hot_matmul() -> anyhow::Result<()> {
        let grad = differentiate(&embedding(65), "main")?;
        let mut f = grad.module.functions.into_iter().find(|f| f.name == "main_grad").expect("main_grad");
        assert!(names(&f).contains(&"stablehlo.scatter"), "{:?}", names(&f));
        let results = f.results.clone();
        scatter_adds_as_matmuls(&mut f);
        f.eliminate_dead_code();
        let ops = names(&f);
        assert!(!ops.contains(&"stablehlo.scatter"), "{ops:?}");
        let dot = f.ops.iter().find(|o| o.name == "stablehlo.dot_general").expect("a matmul");
        assert_eq!(f.ty(dot.results[0]).to_string(), "tensor<65x8xf32>");
        assert_eq!(f.ty(dot.operands[0]).to_string(), "tensor<6x65xf32>", "one row per id");
        // the zero table is not added; the results keep their types
        assert!(
            !ops.contains(&"stablehlo.add")
                || f.ops.iter().filter(|o| o.name == "stablehlo.add").all(|o| o.results[0] != f.results[1])
        );
        assert_eq!(results.len(), f.results.len());
        assert_eq!(f.ty(f.results[1]).to_string(), "tensor<65x8xf32>");
        // running it again changes nothing
        let count = f.ops.len();
        scatter_adds_as_matmuls(&mut f);
        assert_eq!(f.ops.len(), count);
        Ok(())
    }

    #[test]
    fn a_wide_table_keeps_its_scatter() -> anyhow::Result<()> {
        let grad = differentiate(&embedding(ONE_HOT_MAX_ROWS + 1), "main")?;
        let mut f = grad.module.functions.into_iter().find(|f| f.name == "main_grad").expect("main_grad");
        scatter_adds_as_matmuls(&mut f);
        assert!(names(&f).contains(&"stablehlo.scatter"));
        Ok(())
    }
}
