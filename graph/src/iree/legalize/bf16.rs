//! bf16 matmul operands emulated in f32 for SPIR-V.

mod constants;

pub use constants::Bf16ConstantError;
pub(crate) use constants::widen_constants;

use crate::ir::{Builder, ElementType, FloatType, Function, ValueId};

/// Ops that only move bf16 values, so their results need no rounding.
const EXACT: &[&str] = &[
    "stablehlo.transpose",
    "stablehlo.reshape",
    "stablehlo.broadcast_in_dim",
    "stablehlo.slice",
    "stablehlo.concatenate",
    "stablehlo.optimization_barrier",
];

/// Rewrites `f`'s bf16 values as f32 values rounded to bf16's 8 significant bits
/// (round to nearest even), so IREE's SPIR-V backend, which has no bf16 matmuls
/// (3.13: "failed to legalize operation 'vector.bitcast'" on the default target,
/// bf16 `subgroup_mma_load_matrix` on RDNA3), computes what a bf16 backend does:
/// the product of two bf16 values is exact in f32, and the matmul accumulates in
/// f32 either way. A `convert` from f32 to bf16 becomes the rounding, one from
/// bf16 to f32 the identity, and so does one of an f32 constant that holds only
/// bf16 values (a bf16 constant [`widen_constants`] rewrote).
///
/// Returns false, changing nothing, when a bf16 value is an argument or result, or
/// is made by an op whose attributes or regions spell the type (a bf16 constant
/// [`widen_constants`] has not rewritten, a bf16 reduction): the caller then lets IREE
/// promote bf16 to f32 instead.
pub(crate) fn emulate_bf16(f: &mut Function) -> bool {
    let bf16 = ElementType::Float(FloatType::Bf16);
    let is_bf16 = |f: &Function, v: &ValueId| f.ty(*v).element == bf16;
    if f.args.iter().chain(&f.results).any(|v| is_bf16(f, v)) {
        return false;
    }
    let spelled = f.ops.iter().any(|op| {
        op.results.iter().any(|r| is_bf16(f, r))
            && (op.regions.is_some() || op.props.iter().chain(&op.attrs).any(|(_, v)| v.contains("bf16")))
    });
    if spelled {
        return false;
    }
    let f32 = ElementType::Float(FloatType::F32);
    let exact_constants: Vec<ValueId> =
        f.ops.iter().filter(|op| constants::is_bf16_exact(f, op)).flat_map(|op| op.results.clone()).collect();
    let ops = std::mem::take(&mut f.ops);
    for mut op in ops {
        let exact = EXACT.contains(&op.name.as_str())
            || (op.name == "stablehlo.convert"
                && op.operands.iter().all(|v| is_bf16(f, v) || exact_constants.contains(v)));
        let rounded: Vec<ValueId> = op.results.iter().copied().filter(|r| is_bf16(f, r)).collect();
        for r in &rounded {
            let t = f.ty(*r).with_element(f32.clone());
            f.retype(*r, t);
        }
        if exact || rounded.is_empty() {
            f.ops.push(op);
            continue;
        }
        // the op writes a fresh f32 value; the old one becomes its rounding
        let mut raw = Vec::new();
        for r in op.results.iter_mut() {
            if rounded.contains(r) {
                let fresh = f.new_value(f.ty(*r).clone());
                raw.push((fresh, *r));
                *r = fresh;
            }
        }
        let loc = op.loc.clone();
        f.ops.push(op);
        for (fresh, r) in raw {
            round_to_bf16(&mut Builder::new(f, loc.clone()), fresh);
            // the rounding's last op writes the old value, so its users read it rounded
            if let Some(last) = f.ops.last_mut() {
                last.results = vec![r];
            }
        }
    }
    true
}

/// `x` rounded to bf16 precision (nearest, ties to even), kept in f32:
/// `bits + 0x7FFF + ((bits >> 16) & 1)` with the low 16 bits cleared. The last op
/// appended makes the result.
fn round_to_bf16(b: &mut Builder<'_>, x: ValueId) -> ValueId {
    let t = b.ty(x);
    let int = t.with_element(ElementType::Int("i32".into()));
    let bits = b.op("stablehlo.bitcast_convert", &[x], Vec::new(), None, int.clone());
    let sixteen = b.splat(16.0, &int);
    let shifted = b.op("stablehlo.shift_right_logical", &[bits, sixteen], Vec::new(), None, int.clone());
    let one = b.splat(1.0, &int);
    let lsb = b.and(shifted, one);
    let half = b.splat(f64::from(0x7fff), &int);
    let bias = b.add(lsb, half);
    let biased = b.add(bits, bias);
    let mask = b.splat(-65536.0, &int);
    let cleared = b.and(biased, mask);
    b.op("stablehlo.bitcast_convert", &[cleared], Vec::new(), None, t)
}
