//! Conversions of a value's slices as slices of its conversion.

use std::collections::HashMap;

use super::op;
use crate::ir::{ElementType, Function, Op, ValueId};

/// Rewrites `convert(slice(x))` as `slice(convert(x))` wherever `x` has at
/// least two slices converted to the same element type, converting `x` once.
///
/// Fused attention's bf16 backward converts each strip's slice of the output's
/// cotangent `do` for its matmuls ([`crate::attention`]). IREE 3.13 turns that
/// into a dispatch that converts and transposes all of `do` (it comes from the
/// output projection's bf16 backward, a transpose of `extf(bf16)`) and stores
/// one strip's slice, and its CUDA and ROCm backends refuse it ("'vector.transfer_write'
/// op write affecting operations on global resources are restricted to workgroup
/// distributed contexts"; gpt2-124m's 128-row strips of 1024). Slicing the
/// converted value computes the same numbers, since a conversion is elementwise.
/// The llvm-cpu backend compiles the original form, and its step is faster with
/// it (gpt2-124m bf16: 17.8–18.4 s against 18.7–19.3 s with `do` converted once),
/// so only CUDA and ROCm modules get this. The original slices are left for
/// their other users or dead-code elimination.
pub(super) fn convert_before_slicing(f: &mut Function) {
    let mut sliced: HashMap<ValueId, Op> = HashMap::new();
    for o in f.ops.iter().filter(|o| is_slice(o)) {
        sliced.insert(o.results[0], o.clone());
    }
    let mut count: HashMap<(ValueId, ElementType), usize> = HashMap::new();
    for key in f.ops.iter().filter_map(|o| source(f, o, &sliced)) {
        *count.entry(key).or_default() += 1;
    }
    count.retain(|_, n| *n >= 2);
    if count.is_empty() {
        return;
    }
    let mut converted: HashMap<(ValueId, ElementType), ValueId> = HashMap::new();
    let ops = std::mem::take(&mut f.ops);
    for o in ops {
        let key = source(f, &o, &sliced).filter(|k| count.contains_key(k));
        let Some(key) = key else {
            f.ops.push(o);
            continue;
        };
        let x = key.0;
        let whole = match converted.get(&key) {
            Some(v) => *v,
            None => {
                let v = f.new_value(f.ty(x).with_element(key.1.clone()));
                f.ops.push(op("stablehlo.convert", vec![x], v, o.loc.clone()));
                converted.insert(key.clone(), v);
                v
            }
        };
        let mut slice = sliced[&o.operands[0]].clone();
        slice.operands = vec![whole];
        slice.results = o.results;
        slice.loc = o.loc;
        f.ops.push(slice);
    }
}

/// The sliced value and the element type, when `o` converts a slice.
fn source(f: &Function, o: &Op, sliced: &HashMap<ValueId, Op>) -> Option<(ValueId, ElementType)> {
    if o.name != "stablehlo.convert" || o.operands.len() != 1 || o.results.len() != 1 {
        return None;
    }
    let slice = sliced.get(&o.operands[0])?;
    Some((slice.operands[0], f.ty(o.results[0]).element.clone()))
}

fn is_slice(o: &Op) -> bool {
    o.name == "stablehlo.slice" && o.operands.len() == 1 && o.results.len() == 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Builder, TensorType};

    #[test]
    fn a_value_with_two_converted_slices_is_converted_once() {
        let t = TensorType::parse("tensor<4x8xf32>").expect("type");
        let mut f = Function::new("f", std::slice::from_ref(&t));
        let x = f.args[0];
        let mut b = Builder::new(&mut f, None);
        let bf16 = ElementType::parse("bf16");
        let top = b.slice(x, &[0, 0], &[2, 8], &[1, 1]);
        let bottom = b.slice(x, &[2, 0], &[4, 8], &[1, 1]);
        let (top16, bottom16) = (b.convert(top, &bf16), b.convert(bottom, &bf16));
        // a value with one converted slice keeps its form
        let y = b.add(x, x);
        let one = b.slice(y, &[0, 0], &[1, 8], &[1, 1]);
        let one16 = b.convert(one, &bf16);
        f.results = vec![top16, bottom16, one16, top];
        convert_before_slicing(&mut f);
        f.eliminate_dead_code();
        let converts: Vec<&Op> = f.ops.iter().filter(|o| o.name == "stablehlo.convert").collect();
        assert_eq!(converts.len(), 2, "x once, y's slice once");
        assert_eq!(converts[0].operands, [x]);
        assert_eq!(f.ty(converts[0].results[0]).to_string(), "tensor<4x8xbf16>");
        for (r, start) in [(top16, "0, 0"), (bottom16, "2, 0")] {
            let producer = f.ops.iter().find(|o| o.results == [r]).expect("producer");
            assert_eq!(producer.name, "stablehlo.slice");
            assert_eq!(producer.operands, converts[0].results);
            assert!(producer.attr("start_indices").is_some_and(|s| s.contains(start)), "{:?}", producer.props);
        }
        // the f32 slice another result reads stays
        assert!(f.ops.iter().any(|o| o.results == [top] && o.operands == [x]));
        assert_eq!(converts[1].operands, [one]);
        // running it again changes nothing
        let count = f.ops.len();
        convert_before_slicing(&mut f);
        assert_eq!(f.ops.len(), count);
    }
}
