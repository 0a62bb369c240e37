//! Rewrites that keep IREE 3.13's backends away from their known
//! miscompiles and codegen failures, using exactly equivalent StableHLO.
//!
//! [`legalize`] runs for every target: pcp compiles one module for many
//! (backend, target) pairs, and its forms compile on all of them. What only
//! some backends need, and would cost the others, is applied per target when
//! compiling: [`legalize_for_spirv`] and [`legalize_for_gpu`].

mod barrier;
mod bf16;
mod columns;
mod flatten;
mod negate;
mod scatter;
mod slices;

pub use bf16::Bf16ConstantError;

use crate::ir::{Function, Op};

/// Rewrites `f` in place into forms IREE compiles for llvm-cpu, CUDA, ROCm
/// and SPIR-V (Vulkan, Metal); [`legalize_for_spirv`] adds what SPIR-V alone
/// needs.
///
/// * A sum of a negation, `reduce_add(negate(x))`, becomes
///   `negate(reduce_add(x))` ([`negate`]). IREE folds the negation into the
///   reduction body as `acc - x`, a combiner with no neutral element, and its
///   GPU backends then fail with "failed to get neutral element for
///   reduction".
/// * A reduction of a rank ≥ 2 tensor to a scalar becomes a reshape to 1-D
///   and a reduction over dimension 0 ([`flatten`]). IREE's llvm-cpu backend
///   otherwise turns `sum(broadcast(a) * b)` into a rank-0 `vector.contract`
///   and fails with "invalid accumulator/result vector shape".
/// * A sum over the leading 1,024 or more rows of a tensor (the gradient of a
///   bias or a LayerNorm scale) runs in two stages, 32 rows and then the rest
///   ([`columns`]): IREE's llvm-cpu backend sums a leading dimension at about a
///   third of the memory's speed.
///
/// Fused attention ([`crate::attention`]) and GELU ([`crate::gelu`]) are lowered
/// to StableHLO first.
///
/// The rewrites are idempotent: legalizing twice changes nothing more.
pub fn legalize(f: &mut Function) {
    crate::attention::expand(f);
    crate::gelu::expand(f);
    negate::hoist_negations(f);
    flatten::flatten_full_reductions(f);
    columns::split_leading_sums(f);
    f.eliminate_dead_code();
}

/// Rewrites `f` for IREE's SPIR-V backends (Vulkan, Metal), after [`legalize`].
///
/// Every gather, iota and dynamic iota is read through a
/// `stablehlo.optimization_barrier` ([`barrier`]). The SPIR-V backend
/// otherwise fails on a reduction whose dispatch recomputes one (LayerNorm of
/// an embedding lookup, softmax under an iota-built causal mask) with "failed
/// to legalize operation 'memref.alloc'". The barriers make IREE materialise
/// those values, which costs llvm-cpu 14–23% more peak memory on
/// nanogpt-medium at the same speed, so only SPIR-V modules get them.
/// Autodiff treats a barrier as the identity, so such modules can still be
/// differentiated.
///
/// bf16 constants of every form (dense, splat, hex, and `dense_resource`, whose
/// blobs `resources`, the module's `{-# … #-}` section, holds) become f32 constants
/// converted to bf16 ([`bf16::widen_constants`]). Then bf16 values (mixed
/// precision's matmul operands, those constants) become f32 values rounded to bf16
/// ([`bf16::emulate_bf16`]); the result is `Ok(false)` when a function's bf16 use is
/// one that rewrite leaves alone, and the caller then asks IREE to promote bf16 to
/// f32 (`--iree-input-promote-bf16-to-f32`). A bf16 constant that cannot be read (a
/// missing or malformed resource) is an error naming it.
pub fn legalize_for_spirv(f: &mut Function, resources: Option<&str>) -> Result<bool, Bf16ConstantError> {
    bf16::widen_constants(f, resources)?;
    barrier::isolate_index_producers(f);
    Ok(bf16::emulate_bf16(f))
}

/// Rewrites `f` for IREE's CUDA and ROCm backends, after [`legalize`]: a value
/// whose slices are converted (fused attention's strips in bf16) is converted
/// once and then sliced ([`slices::convert_before_slicing`]); IREE's GPU
/// backends refuse a dispatch the other form leads to. The cpu keeps that
/// form, which is faster there. A scatter-add of whole rows into a table of at
/// most 8,192 rows (an embedding's gradient) becomes a one-hot matmul
/// ([`scatter::scatter_adds_as_matmuls`]): IREE runs such a scatter on one GPU thread.
pub fn legalize_for_gpu(f: &mut Function) {
    slices::convert_before_slicing(f);
    scatter::scatter_adds_as_matmuls(f);
    f.eliminate_dead_code();
}

/// Whether `op` is a single-input `stablehlo.reduce` whose body is `body`.
fn is_reduce_with(op: &Op, body: &str) -> bool {
    op.name == "stablehlo.reduce" && op.operands.len() == 2 && op.results.len() == 1 && op.body_ops() == [body]
}

/// Sets a reduction's `dimensions` to `dims`.
fn set_dimensions(props: &mut Vec<(String, String)>, dims: &[i64]) {
    props.retain(|(k, _)| k != "dimensions");
    props.push(("dimensions".to_owned(), crate::ir::attr::i64_array(dims)));
}

/// A new op with one operand list and one result, at `loc`.
fn op(name: &str, operands: Vec<crate::ir::ValueId>, result: crate::ir::ValueId, loc: Option<String>) -> Op {
    Op {
        name: name.to_owned(),
        operands,
        results: vec![result],
        props: Vec::new(),
        attrs: Vec::new(),
        regions: None,
        loc,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Builder, TensorType};

    #[test]
    fn legalize_applies_every_rewrite_and_drops_dead_ops() {
        let t = TensorType::parse("tensor<4x3xf32>").expect("type");
        let mut f = Function::new("f", &[t]);
        let x = f.args[0];
        let mut b = Builder::new(&mut f, None);
        let n = b.neg(x);
        let rows = b.reduce_sum(n, &[1]);
        let total = b.sum_all(x);
        f.results = vec![rows, total];
        legalize(&mut f);
        let names: Vec<&str> = f.ops.iter().map(|o| o.name.as_str()).collect();
        // The negation moved after the row sums; the full sum is 1-D.
        assert_eq!(names.iter().filter(|n| **n == "stablehlo.negate").count(), 2);
        assert!(names.contains(&"stablehlo.reshape"));
        let first_reduce = f.ops.iter().find(|o| o.name == "stablehlo.reduce").expect("reduce");
        assert_eq!(first_reduce.operands[0], x);
    }
}
