//! Sums over many rows in two stages.

use super::{is_reduce_with, op, set_dimensions};
use crate::ir::Function;
use crate::ir::attr::parse_ints;

/// Partial sums the first stage leaves; fewer than [`MIN_ROWS`], so that a
/// second legalization leaves the result alone.
const PARTIALS: i64 = 256;

/// The fewest rows for which the split pays off (groups of 16 rows or more).
const MIN_ROWS: i64 = 4096;

/// Rewrites every single-input sum over the leading dimensions of a tensor
/// (`[rows, …] → […]`, rows ≥ [`MIN_ROWS`] and a multiple of [`PARTIALS`]) as a
/// reshape to `[PARTIALS, rows / PARTIALS, …]`, a sum over the second
/// dimension from zero, and the original sum (with its own initial value)
/// over the [`PARTIALS`] partial sums.
///
/// These are the gradients of every broadcast along the tokens: biases,
/// LayerNorm's scale and shift (8,192 tokens by 768 to 3,072 features in
/// gpt2-124m). IREE 3.13's llvm-cpu backend reduces the leading dimension of
/// such a tensor at about 7 GB/s on this machine's two cores (17 ms for
/// `8192 × 3072` f32), where a sum along rows streams at 20 GB/s; the two
/// stages (256 × 32 rows) give every worker contiguous tiles and take 8 ms
/// (`iree-benchmark-module`, the tuned cpu flags). The same elements are summed
/// with the same body, in another order, as IREE itself does when it splits a
/// reduction over workgroups; the initial value is added once.
pub(super) fn split_leading_sums(f: &mut Function) {
    let ops = std::mem::take(&mut f.ops);
    for mut reduce in ops {
        let split = is_reduce_with(&reduce, "stablehlo.add")
            .then(|| leading_rows(f, &reduce))
            .flatten()
            .filter(|rows| *rows >= MIN_ROWS && rows % PARTIALS == 0);
        let Some(rows) = split else {
            f.ops.push(reduce);
            continue;
        };
        let input = f.ty(reduce.operands[0]).clone();
        let output = f.ty(reduce.results[0]).clone();
        let loc = reduce.loc.clone();
        let grouped = f.new_value(input.with_shape([&[PARTIALS, rows / PARTIALS], output.shape.as_slice()].concat()));
        f.ops.push(op("stablehlo.reshape", vec![reduce.operands[0]], grouped, loc.clone()));
        let scalar = f.ty(reduce.operands[1]).clone();
        let zero = f.new_value(scalar.clone());
        let literal = scalar.element.float().map_or_else(|| "0".to_owned(), |t| t.hex_literal(0.0));
        let mut constant = op("stablehlo.constant", Vec::new(), zero, loc.clone());
        constant.props.push(("value".to_owned(), format!("dense<{literal}> : {scalar}")));
        f.ops.push(constant);
        let partial = f.new_value(output.with_shape([&[PARTIALS], output.shape.as_slice()].concat()));
        let mut first = reduce.clone();
        first.operands = vec![grouped, zero];
        first.results = vec![partial];
        set_dimensions(&mut first.props, &[1]);
        f.ops.push(first);
        reduce.operands[0] = partial;
        set_dimensions(&mut reduce.props, &[0]);
        f.ops.push(reduce);
    }
}

/// The number of rows `reduce` sums when it sums exactly the leading
/// dimensions of its input and keeps at least one.
fn leading_rows(f: &Function, reduce: &crate::ir::Op) -> Option<i64> {
    let input = f.ty(reduce.operands[0]);
    let dims = parse_ints(reduce.attr("dimensions")?)?;
    let leading = dims.iter().enumerate().all(|(i, d)| *d == i as i64);
    (leading && !dims.is_empty() && dims.len() < input.rank()).then(|| input.shape[..dims.len()].iter().product())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Builder, Op, TensorType};

    #[test]
    fn sums_over_many_rows_run_in_two_stages() {
        let t = TensorType::parse("tensor<8x1024x48xf32>").expect("type");
        let mut f = Function::new("f", &[t]);
        let x = f.args[0];
        let mut b = Builder::new(&mut f, None);
        let columns = b.reduce_sum(x, &[0, 1]);
        let rows = b.reduce_sum(x, &[2]);
        let few = b.reduce_sum(x, &[0]);
        f.results = vec![columns, rows, few];
        split_leading_sums(&mut f);
        let once = f.clone();
        split_leading_sums(&mut f);
        assert_eq!(f, once, "idempotent");
        let reduces: Vec<&Op> = f.ops.iter().filter(|o| o.name == "stablehlo.reduce").collect();
        assert_eq!(reduces.len(), 4, "only the sum over 8,192 rows is split");
        let (first, second) = (reduces[0], reduces[1]);
        assert_eq!(f.ty(first.operands[0]).to_string(), "tensor<256x32x48xf32>");
        assert_eq!(first.attr("dimensions"), Some("array<i64: 1>"));
        assert_eq!(f.ty(second.operands[0]).to_string(), "tensor<256x48xf32>");
        assert_eq!(second.attr("dimensions"), Some("array<i64: 0>"));
        assert_eq!(second.results[0], columns, "the result keeps its value");
        assert_ne!(first.operands[1], second.operands[1], "the first stage starts from zero");
        assert_eq!(reduces[2].attr("dimensions"), Some("array<i64: 2>"));
        assert_eq!(reduces[3].attr("dimensions"), Some("array<i64: 0>"));
        assert_eq!(f.ty(reduces[3].operands[0]).to_string(), "tensor<8x1024x48xf32>");
    }
}
