//! Index-computing ops (gathers, iotas) materialised behind an
//! optimisation barrier.

use super::op;
use crate::ir::Function;

/// The op that stops IREE fusing across a value.
pub(super) const BARRIER: &str = "stablehlo.optimization_barrier";

/// The ops whose IREE lowering computes element indices (`linalg.index`,
/// `tensor.extract` at a loaded index).
const INDEXING: &[&str] = &["stablehlo.gather", "stablehlo.iota", "stablehlo.dynamic_iota"];

/// Puts every gather, iota and dynamic iota result that other ops read
/// behind a `stablehlo.optimization_barrier`, so IREE materialises it instead
/// of recomputing it inside its consumers' dispatches.
///
/// IREE's SPIR-V backend (Vulkan, Metal) fails on a reduction dispatch whose
/// fused consumer recomputes such a value: LayerNorm of an embedding lookup
/// (`x - mean(x)` with `x = wte[ids]`), or the softmax backward under a
/// causal mask built from iotas. The reduction pipeline computes the
/// row-uniform index on lane 0 and shares it through a `memref<Nxindex>` in
/// workgroup memory, which SPIR-V cannot hold ("failed to legalize operation
/// 'memref.alloc'"). A barrier is the identity on values, so this changes no
/// result; the producer becomes its own dispatch (or a constant). Values
/// already read only through a barrier are left alone, so the rewrite is
/// idempotent.
pub(super) fn isolate_index_producers(f: &mut Function) {
    let mut read = vec![false; f.value_count()];
    for user in f.ops.iter().filter(|o| o.name != BARRIER) {
        for v in &user.operands {
            read[v.0 as usize] = true;
        }
    }
    let ops = std::mem::take(&mut f.ops);
    for mut producer in ops {
        let result = producer.results.first().copied();
        match result {
            Some(r)
                if INDEXING.contains(&producer.name.as_str()) && producer.results.len() == 1 && read[r.0 as usize] =>
            {
                let raw = f.new_value(f.ty(r).clone());
                producer.results = vec![raw];
                let loc = producer.loc.clone();
                f.ops.push(producer);
                f.ops.push(op(BARRIER, vec![raw], r, loc));
            }
            _ => f.ops.push(producer),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Builder, ElementType, TensorType};

    fn embedding_layer_norm() -> (Function, crate::ir::ValueId) {
        let table = TensorType::parse("tensor<10x8xf32>").expect("type");
        let ids = TensorType::parse("tensor<4xi32>").expect("type");
        let mut f = Function::new("f", &[table, ids]);
        let (w, i) = (f.args[0], f.args[1]);
        let mut b = Builder::new(&mut f, None);
        let props = vec![
            (
                "dimension_numbers".to_owned(),
                "#stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>"
                    .to_owned(),
            ),
            ("slice_sizes".to_owned(), "array<i64: 1, 8>".to_owned()),
        ];
        let x = b.op("stablehlo.gather", &[w, i], props, None, TensorType::new(vec![4, 8], ElementType::parse("f32")));
        let s = b.reduce_sum(x, &[1]);
        let m = b.broadcast_in_dim(s, &[0], &[4, 8]);
        let centred = b.sub(x, m);
        f.results = vec![centred];
        (f, x)
    }

    #[test]
    fn gathers_are_read_through_a_barrier() {
        let (mut f, x) = embedding_layer_norm();
        isolate_index_producers(&mut f);
        let gather = f.ops.iter().position(|o| o.name == "stablehlo.gather").expect("gather");
        let barrier = &f.ops[gather + 1];
        assert_eq!(barrier.name, BARRIER);
        assert_eq!(barrier.operands, f.ops[gather].results);
        assert_eq!(barrier.results, [x]);
        assert_ne!(f.ops[gather].results, [x]);
        assert_eq!(f.ty(f.ops[gather].results[0]), f.ty(x));
        // Running it again adds nothing.
        let count = f.ops.len();
        isolate_index_producers(&mut f);
        assert_eq!(f.ops.len(), count);
    }

    #[test]
    fn iotas_are_read_through_a_barrier_and_unread_values_are_not() {
        let t = TensorType::parse("tensor<4x4xf32>").expect("type");
        let mut f = Function::new("f", std::slice::from_ref(&t));
        let x = f.args[0];
        let mut b = Builder::new(&mut f, None);
        let props = vec![("iota_dimension".to_owned(), "1 : i64".to_owned())];
        let iota = b.op("stablehlo.iota", &[], props.clone(), None, t.clone());
        let unused = b.op("stablehlo.iota", &[], props, None, t);
        let masked = b.mul(x, iota);
        f.results = vec![masked, unused];
        isolate_index_producers(&mut f);
        let barriers: Vec<&crate::ir::Op> = f.ops.iter().filter(|o| o.name == BARRIER).collect();
        assert_eq!(barriers.len(), 1);
        assert_eq!(barriers[0].results, [iota]);
        let mul = f.ops.iter().find(|o| o.name == "stablehlo.multiply").expect("multiply");
        assert_eq!(mul.operands, [x, iota]);
    }
}
