//! Vector-Jacobian products, one per StableHLO op.
//!
//! Where `jax.grad` makes a choice (ties in max/min, the derivative of
//! `abs` at 0, `pow` at 0), we make the same one.

use super::GradError;
use crate::ir::attr::{int_list, lookup, parse_int, parse_ints, parse_pairs, struct_fields};
use crate::ir::{Builder, Op, TensorType, ValueId};

/// Ops whose gradient is zero or that carry no gradient (integer results).
const ZERO_GRADIENT: &[&str] = &[
    "stablehlo.constant",
    "stablehlo.iota",
    "stablehlo.dynamic_iota",
    "stablehlo.compare",
    "stablehlo.and",
    "stablehlo.or",
    "stablehlo.xor",
    "stablehlo.not",
    "stablehlo.round_nearest_even",
    "stablehlo.round_nearest_afz",
    "stablehlo.floor",
    "stablehlo.ceil",
    "stablehlo.sign",
    "stablehlo.is_finite",
    "arith.constant",
];

/// Ops with a gradient rule.
const DIFFERENTIABLE: &[&str] = &[
    "stablehlo.add",
    "stablehlo.subtract",
    "stablehlo.multiply",
    "stablehlo.divide",
    "stablehlo.negate",
    "stablehlo.abs",
    "stablehlo.exponential",
    "stablehlo.exponential_minus_one",
    "stablehlo.log",
    "stablehlo.log_plus_one",
    "stablehlo.logistic",
    "stablehlo.tanh",
    "stablehlo.sqrt",
    "stablehlo.rsqrt",
    "stablehlo.cbrt",
    "stablehlo.power",
    "stablehlo.sine",
    "stablehlo.cosine",
    "stablehlo.tan",
    "stablehlo.maximum",
    "stablehlo.minimum",
    "stablehlo.select",
    "stablehlo.clamp",
    "stablehlo.convert",
    "stablehlo.reshape",
    "stablehlo.transpose",
    "stablehlo.broadcast_in_dim",
    "stablehlo.broadcast",
    "stablehlo.slice",
    "stablehlo.dynamic_slice",
    "stablehlo.dynamic_update_slice",
    "stablehlo.concatenate",
    "stablehlo.pad",
    "stablehlo.reverse",
    "stablehlo.dot_general",
    "stablehlo.dot",
    "stablehlo.reduce",
    "stablehlo.reduce_window",
    "stablehlo.gather",
    "stablehlo.optimization_barrier",
    crate::attention::OP,
    crate::gelu::OP,
    "chlo.square",
    "chlo.erf",
    "chlo.erfc",
];

/// Whether pcp can differentiate through `op` (or knows its gradient is zero).
pub fn has_rule(op: &str) -> bool {
    ZERO_GRADIENT.contains(&op) || DIFFERENTIABLE.contains(&op)
}

type Contributions = Vec<Option<ValueId>>;

struct Ctx<'o> {
    op: &'o Op,
}

impl Ctx<'_> {
    fn unsupported(&self, reason: impl Into<String>) -> GradError {
        GradError::Unsupported { op: self.op.name.clone(), location: self.op.location(), reason: reason.into() }
    }

    fn ints(&self, key: &str) -> Result<Vec<i64>, GradError> {
        self.op
            .attr(key)
            .and_then(parse_ints)
            .ok_or_else(|| self.unsupported(format!("missing or unreadable attribute {key}")))
    }

    fn ints_or(&self, key: &str, default: Vec<i64>) -> Result<Vec<i64>, GradError> {
        match self.op.attr(key) {
            None => Ok(default),
            Some(_) => self.ints(key),
        }
    }

    fn field(&self, fields: &[(String, String)], key: &str) -> Vec<i64> {
        lookup(fields, key).and_then(parse_ints).unwrap_or_default()
    }
}

/// The contributions of `op` to its operands' cotangents, given its results'
/// cotangents `g`. Only `active` operands need one.
pub(super) fn vjp(
    b: &mut Builder<'_>,
    op: &Op,
    g: &[Option<ValueId>],
    active: &[bool],
) -> Result<Contributions, GradError> {
    let cx = Ctx { op };
    if ZERO_GRADIENT.contains(&op.name.as_str()) {
        return Ok(vec![None; op.operands.len()]);
    }
    if !DIFFERENTIABLE.contains(&op.name.as_str()) {
        return Err(GradError::NoRule { op: op.name.clone(), location: op.location() });
    }
    if op.name == "stablehlo.optimization_barrier" {
        // The identity on each operand (a fusion fence, not a computation).
        return Ok(g.to_vec());
    }
    if op.name == crate::attention::OP {
        return crate::attention::vjp(b, op, g, active);
    }
    if op.results.len() != 1 {
        return Err(cx.unsupported(format!("{} results", op.results.len())));
    }
    let g = g[0].ok_or_else(|| cx.unsupported("missing cotangent"))?;
    if op.name == crate::gelu::OP {
        return Ok(vec![Some(crate::gelu::vjp(b, op.operands[0], g))]);
    }
    let out = op.results[0];
    let x = &op.operands;
    let one = |b: &mut Builder<'_>, like| b.splat_like(1.0, like);
    Ok(match op.name.as_str() {
        "stablehlo.add" => vec![Some(g), Some(g)],
        "stablehlo.subtract" => vec![Some(g), active[1].then(|| b.neg(g))],
        "stablehlo.multiply" => vec![active[0].then(|| b.mul(g, x[1])), active[1].then(|| b.mul(g, x[0]))],
        "stablehlo.divide" => {
            let ga = b.div(g, x[1]);
            let gb = active[1].then(|| {
                let t = b.mul(ga, out);
                b.neg(t)
            });
            vec![Some(ga), gb]
        }
        "stablehlo.negate" => vec![Some(b.neg(g))],
        "stablehlo.abs" => {
            let zero = b.splat_like(0.0, x[0]);
            let nonneg = b.compare(x[0], zero, "GE");
            let ng = b.neg(g);
            vec![Some(b.select(nonneg, g, ng))]
        }
        "stablehlo.exponential" => vec![Some(b.mul(g, out))],
        "stablehlo.exponential_minus_one" => {
            let o = one(b, out);
            let e = b.add(out, o);
            vec![Some(b.mul(g, e))]
        }
        "stablehlo.log" => vec![Some(b.div(g, x[0]))],
        "stablehlo.log_plus_one" => {
            let o = one(b, x[0]);
            let d = b.add(x[0], o);
            vec![Some(b.div(g, d))]
        }
        "stablehlo.logistic" => {
            let o = one(b, out);
            let c = b.sub(o, out);
            let t = b.mul(g, out);
            vec![Some(b.mul(t, c))]
        }
        "stablehlo.tanh" => {
            let o = one(b, out);
            let sq = b.mul(out, out);
            let d = b.sub(o, sq);
            vec![Some(b.mul(g, d))]
        }
        "stablehlo.sqrt" => {
            let h = b.scale(g, 0.5);
            vec![Some(b.div(h, out))]
        }
        "stablehlo.rsqrt" => {
            let r = b.div(out, x[0]);
            let t = b.mul(g, r);
            vec![Some(b.scale(t, -0.5))]
        }
        "stablehlo.cbrt" => {
            let sq = b.mul(out, out);
            let d = b.scale(sq, 3.0);
            vec![Some(b.div(g, d))]
        }
        "stablehlo.power" => power(b, x[0], x[1], out, g, active),
        "chlo.square" => {
            let t = b.mul(g, x[0]);
            vec![Some(b.scale(t, 2.0))]
        }
        "chlo.erf" | "chlo.erfc" => {
            // d/dx erf(x) = 2/sqrt(pi) * exp(-x^2) = -d/dx erfc(x)
            let sq = b.mul(x[0], x[0]);
            let nsq = b.neg(sq);
            let e = b.unary_op("stablehlo.exponential", nsq);
            let t = b.mul(g, e);
            let sign = if op.name == "chlo.erf" { 1.0 } else { -1.0 };
            vec![Some(b.scale(t, sign * std::f64::consts::FRAC_2_SQRT_PI))]
        }
        "stablehlo.sine" => {
            let c = b.unary_op("stablehlo.cosine", x[0]);
            vec![Some(b.mul(g, c))]
        }
        "stablehlo.cosine" => {
            let s = b.unary_op("stablehlo.sine", x[0]);
            let t = b.mul(g, s);
            vec![Some(b.neg(t))]
        }
        "stablehlo.tan" => {
            let o = one(b, out);
            let sq = b.mul(out, out);
            let d = b.add(o, sq);
            vec![Some(b.mul(g, d))]
        }
        "stablehlo.maximum" | "stablehlo.minimum" => {
            // Ties split the gradient evenly, as jax.grad does.
            let ea = b.compare(x[0], out, "EQ");
            let eb = b.compare(x[1], out, "EQ");
            let (zero, half, o) = (b.splat_like(0.0, g), b.splat_like(0.5, g), one(b, g));
            let share = |b: &mut Builder<'_>, mine, other| {
                let w = b.select(other, half, o);
                let w = b.select(mine, w, zero);
                b.mul(g, w)
            };
            vec![active[0].then(|| share(b, ea, eb)), active[1].then(|| share(b, eb, ea))]
        }
        "stablehlo.select" => {
            let zero = b.splat_like(0.0, g);
            vec![None, active[1].then(|| b.select(x[0], g, zero)), active[2].then(|| b.select(x[0], zero, g))]
        }
        "stablehlo.clamp" => clamp(b, x, g, active),
        "stablehlo.convert" => vec![Some(b.convert(g, &b.ty(x[0]).element))],
        "stablehlo.reshape" => vec![Some(b.reshape(g, &b.ty(x[0]).shape))],
        "stablehlo.transpose" => {
            let perm = cx.ints("permutation")?;
            let mut inverse = vec![0; perm.len()];
            for (i, p) in perm.iter().enumerate() {
                inverse[*p as usize] = i as i64;
            }
            vec![Some(b.transpose(g, &inverse))]
        }
        "stablehlo.broadcast_in_dim" => vec![Some(unbroadcast(b, g, &b.ty(x[0]), &cx.ints("broadcast_dimensions")?))],
        "stablehlo.broadcast" => {
            let added = cx.ints("broadcast_sizes")?.len() as i64;
            vec![Some(b.reduce_sum(g, &(0..added).collect::<Vec<_>>()))]
        }
        "stablehlo.slice" => {
            let t = b.ty(x[0]);
            let (start, strides) = (cx.ints("start_indices")?, cx.ints("strides")?);
            let out_shape = b.ty(g).shape;
            if out_shape.contains(&0) {
                return Ok(vec![Some(b.splat(0.0, &t))]);
            }
            let high: Vec<i64> =
                (0..t.rank()).map(|i| t.shape[i] - (start[i] + (out_shape[i] - 1) * strides[i] + 1)).collect();
            let interior: Vec<i64> = strides.iter().map(|s| s - 1).collect();
            let zero = b.splat(0.0, &TensorType::scalar(t.element.clone()));
            vec![Some(b.pad(g, zero, &start, &high, &interior))]
        }
        "stablehlo.dynamic_slice" => {
            let zeros = b.splat(0.0, &b.ty(x[0]));
            let mut operands = vec![zeros, g];
            operands.extend_from_slice(&x[1..]);
            let t = b.ty(x[0]);
            let mut contributions = vec![Some(b.op("stablehlo.dynamic_update_slice", &operands, Vec::new(), None, t))];
            contributions.extend(std::iter::repeat_n(None, x.len() - 1));
            contributions
        }
        "stablehlo.dynamic_update_slice" => {
            let update = b.ty(x[1]);
            let mut contributions = vec![None; x.len()];
            if active[0] {
                let zeros = b.splat(0.0, &update);
                let mut operands = vec![g, zeros];
                operands.extend_from_slice(&x[2..]);
                contributions[0] = Some(b.op("stablehlo.dynamic_update_slice", &operands, Vec::new(), None, b.ty(g)));
            }
            if active[1] {
                let mut operands = vec![g];
                operands.extend_from_slice(&x[2..]);
                let props = vec![("slice_sizes".to_owned(), crate::ir::attr::i64_array(&update.shape))];
                contributions[1] = Some(b.op("stablehlo.dynamic_slice", &operands, props, None, update));
            }
            contributions
        }
        "stablehlo.concatenate" => {
            let dim =
                op.attr("dimension").and_then(parse_int).ok_or_else(|| cx.unsupported("missing dimension"))? as usize;
            let gt = b.ty(g);
            let mut offset = 0;
            let mut contributions = Vec::new();
            for (operand, is_active) in x.iter().zip(active) {
                let t = b.ty(*operand);
                let mut start = vec![0; gt.rank()];
                let mut limit = gt.shape.clone();
                start[dim] = offset;
                limit[dim] = offset + t.shape[dim];
                offset += t.shape[dim];
                let strides = vec![1; gt.rank()];
                contributions.push(is_active.then(|| b.slice(g, &start, &limit, &strides)));
            }
            contributions
        }
        "stablehlo.pad" => {
            let (low, high, interior) =
                (cx.ints("edge_padding_low")?, cx.ints("edge_padding_high")?, cx.ints("interior_padding")?);
            let t = b.ty(x[0]);
            let zero = b.splat(0.0, &TensorType::scalar(t.element.clone()));
            let neg = |v: &[i64]| v.iter().map(|p| -p).collect::<Vec<_>>();
            let unpadded = b.pad(g, zero, &neg(&low), &neg(&high), &vec![0; t.rank()]);
            let limit = b.ty(unpadded).shape;
            let strides: Vec<i64> = interior.iter().map(|i| i + 1).collect();
            let go = b.slice(unpadded, &vec![0; t.rank()], &limit, &strides);
            let gv = active[1].then(|| {
                let total = b.sum_all(g);
                let inner = b.sum_all(go);
                b.sub(total, inner)
            });
            vec![Some(go), gv]
        }
        "stablehlo.reverse" => vec![Some(b.reverse(g, &cx.ints("dimensions")?))],
        "stablehlo.dot_general" | "stablehlo.dot" => dot_general(b, &cx, g, active)?,
        "stablehlo.reduce" => reduce(b, &cx, g, active)?,
        "stablehlo.reduce_window" => reduce_window(b, &cx, g, active)?,
        "stablehlo.gather" => gather(b, &cx, g)?,
        other => {
            return Err(GradError::NoRule { op: other.to_owned(), location: op.location() });
        }
    })
}

fn power(b: &mut Builder<'_>, a: ValueId, e: ValueId, out: ValueId, g: ValueId, active: &[bool]) -> Contributions {
    let zero = b.splat_like(0.0, g);
    let ga = active[0].then(|| {
        // d/da a^e = e * a^(e-1), and 0 where e == 0.
        let one = b.splat_like(1.0, e);
        let em1 = b.sub(e, one);
        let p = b.pow(a, em1);
        let jac = b.mul(e, p);
        let e_zero = b.compare(e, zero, "EQ");
        let jac = b.select(e_zero, zero, jac);
        b.mul(g, jac)
    });
    let gb = active[1].then(|| {
        // d/de a^e = log(a) * a^e, with log(0) replaced by log(1).
        let one = b.splat_like(1.0, a);
        let a_zero = b.compare(a, zero, "EQ");
        let safe = b.select(a_zero, one, a);
        let log = b.unary_op("stablehlo.log", safe);
        let t = b.mul(log, out);
        b.mul(g, t)
    });
    vec![ga, gb]
}

fn clamp(b: &mut Builder<'_>, x: &[ValueId], g: ValueId, active: &[bool]) -> Contributions {
    let shape = b.ty(g).shape;
    let full = |b: &mut Builder<'_>, v: ValueId| {
        if b.ty(v).rank() == 0 && !shape.is_empty() { b.broadcast_in_dim(v, &[], &shape) } else { v }
    };
    let (lo, hi) = (full(b, x[0]), full(b, x[2]));
    let zero = b.splat_like(0.0, g);
    let fold = |b: &mut Builder<'_>, v: ValueId, orig: ValueId| {
        if b.ty(orig).rank() == 0 { b.sum_all(v) } else { v }
    };
    let glo = active[0].then(|| {
        let c1 = b.compare(lo, x[1], "GT");
        let c2 = b.compare(lo, hi, "LT");
        let m = b.and(c1, c2);
        let s = b.select(m, g, zero);
        fold(b, s, x[0])
    });
    let gx = active[1].then(|| {
        let c1 = b.compare(x[1], lo, "GT");
        let c2 = b.compare(x[1], hi, "LT");
        let m = b.and(c1, c2);
        b.select(m, g, zero)
    });
    let ghi = active[2].then(|| {
        let c = b.compare(hi, x[1], "LT");
        let s = b.select(c, g, zero);
        fold(b, s, x[2])
    });
    vec![glo, gx, ghi]
}

/// The transpose of `broadcast_in_dim`: sums `g` back to `operand`'s shape.
fn unbroadcast(b: &mut Builder<'_>, g: ValueId, operand: &TensorType, dims: &[i64]) -> ValueId {
    let result = b.ty(g).shape;
    let mut sum: Vec<i64> = (0..result.len() as i64).filter(|d| !dims.contains(d)).collect();
    for (i, d) in dims.iter().enumerate() {
        if operand.shape[i] == 1 && result[*d as usize] != 1 {
            sum.push(*d);
        }
    }
    sum.sort_unstable();
    let reduced = b.reduce_sum(g, &sum);
    // Kept result dims appear in increasing order; put them in operand order.
    let kept: Vec<i64> = (0..result.len() as i64).filter(|d| !sum.contains(d)).collect();
    let order: Vec<(usize, i64)> =
        dims.iter().enumerate().filter(|(_, d)| kept.contains(d)).map(|(i, d)| (i, *d)).collect();
    let perm: Vec<i64> = order.iter().map(|(_, d)| kept.iter().position(|k| k == d).unwrap_or(0) as i64).collect();
    let t = b.transpose(reduced, &perm);
    b.reshape(t, &operand.shape)
}

fn dot_general(b: &mut Builder<'_>, cx: &Ctx<'_>, g: ValueId, active: &[bool]) -> Result<Contributions, GradError> {
    let (lhs, rhs) = (cx.op.operands[0], cx.op.operands[1]);
    let (lt, rt) = (b.ty(lhs), b.ty(rhs));
    let (lb, rb, lc, rc) = if cx.op.name == "stablehlo.dot" {
        (vec![], vec![], vec![lt.rank() as i64 - 1], vec![0])
    } else {
        let fields = struct_fields(
            cx.op.attr("dot_dimension_numbers").ok_or_else(|| cx.unsupported("missing dot_dimension_numbers"))?,
        );
        (
            cx.field(&fields, "lhs_batching_dimensions"),
            cx.field(&fields, "rhs_batching_dimensions"),
            cx.field(&fields, "lhs_contracting_dimensions"),
            cx.field(&fields, "rhs_contracting_dimensions"),
        )
    };
    let free = |rank: usize, batch: &[i64], contract: &[i64]| -> Vec<i64> {
        (0..rank as i64).filter(|d| !batch.contains(d) && !contract.contains(d)).collect()
    };
    let (lf, rf) = (free(lt.rank(), &lb, &lc), free(rt.rank(), &rb, &rc));
    let nb = lb.len() as i64;
    let g_batch: Vec<i64> = (0..nb).collect();
    let g_lhs_free: Vec<i64> = (nb..nb + lf.len() as i64).collect();
    let g_rhs_free: Vec<i64> = (nb + lf.len() as i64..nb + (lf.len() + rf.len()) as i64).collect();

    // Contract g with the other operand, then permute into this operand's layout.
    let transpose_into = |b: &mut Builder<'_>,
                          other: ValueId,
                          other_batch: &[i64],
                          g_contract: &[i64],
                          other_free: &[i64],
                          my: (&TensorType, &[i64], &[i64], &[i64]),
                          other_contract: &[i64]| {
        let (my_t, my_batch, my_free, my_contract) = my;
        // Mixed precision (bf16 operands, f32 result): g meets the other operand in
        // its type, the product accumulates in the result's type, and the
        // contribution takes this operand's type.
        let accumulate = b.ty(g).element;
        let other_element = b.ty(other).element;
        let g_in = b.convert(g, &other_element);
        let raw = b.dot_general(g_in, other, &g_batch, other_batch, g_contract, other_free, accumulate);
        // Positions of raw: batch, my free dims, then other's contracting dims ascending.
        let mut sorted: Vec<i64> = other_contract.to_vec();
        sorted.sort_unstable();
        let mut source: Vec<i64> = my_batch.to_vec();
        source.extend_from_slice(my_free);
        for c in &sorted {
            let k = other_contract.iter().position(|x| x == c).unwrap_or(0);
            source.push(my_contract[k]);
        }
        let perm: Vec<i64> =
            (0..my_t.rank() as i64).map(|d| source.iter().position(|s| *s == d).unwrap_or(0) as i64).collect();
        let t = b.transpose(raw, &perm);
        b.convert(t, &my_t.element)
    };
    let gl = active[0].then(|| transpose_into(b, rhs, &rb, &g_rhs_free, &rf, (&lt, &lb, &lf, &lc), &rc));
    let gr = active[1].then(|| transpose_into(b, lhs, &lb, &g_lhs_free, &lf, (&rt, &rb, &rf, &rc), &lc));
    Ok(vec![gl, gr])
}

fn reduce(b: &mut Builder<'_>, cx: &Ctx<'_>, g: ValueId, active: &[bool]) -> Result<Contributions, GradError> {
    if cx.op.operands.len() != 2 {
        return Err(cx.unsupported("variadic reduce (argmax and friends) on the gradient path"));
    }
    let (x, out) = (cx.op.operands[0], cx.op.results[0]);
    let xt = b.ty(x);
    let dims = cx.ints("dimensions")?;
    let kept: Vec<i64> = (0..xt.rank() as i64).filter(|d| !dims.contains(d)).collect();
    let body = cx.op.body_ops();
    match body.as_slice() {
        ["stablehlo.add"] => {
            let gx = active[0].then(|| b.broadcast_in_dim(g, &kept, &xt.shape));
            let gi = active[1].then(|| b.sum_all(g));
            Ok(vec![gx, gi])
        }
        ["stablehlo.maximum" | "stablehlo.minimum"] => {
            if active[1] {
                return Err(cx.unsupported("the init value of a max/min reduction depends on the parameters"));
            }
            // Ties share the gradient evenly, as jax.grad does.
            let outb = b.broadcast_in_dim(out, &kept, &xt.shape);
            let hit = b.compare(x, outb, "EQ");
            let ind = b.convert(hit, &xt.element);
            let counts = b.reduce_sum(ind, &dims);
            let share = b.div(g, counts);
            let shareb = b.broadcast_in_dim(share, &kept, &xt.shape);
            Ok(vec![Some(b.mul(shareb, ind)), None])
        }
        other => {
            Err(cx.unsupported(format!("reduce with body {other:?}; only add, maximum and minimum are differentiable")))
        }
    }
}

fn dilate(sizes: &[i64], by: &[i64]) -> Vec<i64> {
    sizes.iter().zip(by).map(|(s, d)| if *s == 0 { 0 } else { 1 + d * (s - 1) }).collect()
}

fn reduce_window(b: &mut Builder<'_>, cx: &Ctx<'_>, g: ValueId, active: &[bool]) -> Result<Contributions, GradError> {
    if cx.op.operands.len() != 2 || cx.op.body_ops() != ["stablehlo.add"] {
        return Err(cx.unsupported("only single-operand reduce_window with an add body is differentiable"));
    }
    if active[1] {
        return Err(cx.unsupported("the init value of reduce_window depends on the parameters"));
    }
    let x = cx.op.operands[0];
    let xt = b.ty(x);
    let rank = xt.rank();
    let window = cx.ints("window_dimensions")?;
    let strides = cx.ints_or("window_strides", vec![1; rank])?;
    let base = cx.ints_or("base_dilations", vec![1; rank])?;
    let wdil = cx.ints_or("window_dilations", vec![1; rank])?;
    if base.iter().any(|d| *d != 1) {
        return Err(cx.unsupported("base dilation"));
    }
    let padding = match cx.op.attr("padding") {
        Some(p) => parse_pairs(p, rank).ok_or_else(|| cx.unsupported("unreadable padding"))?,
        None => vec![(0, 0); rank],
    };
    let out_shape = b.ty(g).shape;
    let window_dilated = dilate(&window, &wdil);
    let out_dilated = dilate(&out_shape, &strides);
    let before: Vec<i64> = (0..rank).map(|i| window_dilated[i] - padding[i].0 - 1).collect();
    let after: Vec<i64> = (0..rank).map(|i| xt.shape[i] + window_dilated[i] - 1 - out_dilated[i] - before[i]).collect();
    let interior: Vec<i64> = strides.iter().map(|s| s - 1).collect();
    let zero = b.splat(0.0, &TensorType::scalar(xt.element.clone()));
    let padded = b.pad(g, zero, &before, &after, &interior);
    let pt = b.ty(padded);
    let shape: Vec<i64> = (0..rank).map(|i| pt.shape[i] - window_dilated[i] + 1).collect();
    let scalar = TensorType::scalar(xt.element.clone());
    let region = crate::ir::binary_region("stablehlo.add", &scalar);
    let mut props = vec![("window_dimensions".to_owned(), crate::ir::attr::i64_array(&window))];
    if wdil.iter().any(|d| *d != 1) {
        props.push(("window_dilations".to_owned(), crate::ir::attr::i64_array(&wdil)));
    }
    let gx = b.op("stablehlo.reduce_window", &[padded, zero], props, Some(region), xt.with_shape(shape));
    Ok(vec![Some(gx), None])
}

fn gather(b: &mut Builder<'_>, cx: &Ctx<'_>, g: ValueId) -> Result<Contributions, GradError> {
    let (operand, indices) = (cx.op.operands[0], cx.op.operands[1]);
    let fields =
        struct_fields(cx.op.attr("dimension_numbers").ok_or_else(|| cx.unsupported("missing dimension_numbers"))?);
    let ivd = lookup(&fields, "index_vector_dim")
        .and_then(parse_int)
        .ok_or_else(|| cx.unsupported("missing index_vector_dim"))?;
    let mut parts = Vec::new();
    for (scatter_key, gather_key) in [
        ("update_window_dims", "offset_dims"),
        ("inserted_window_dims", "collapsed_slice_dims"),
        ("input_batching_dims", "operand_batching_dims"),
        ("scatter_indices_batching_dims", "start_indices_batching_dims"),
        ("scatter_dims_to_operand_dims", "start_index_map"),
    ] {
        let v = cx.field(&fields, gather_key);
        if !v.is_empty() {
            parts.push(format!("{scatter_key} = {}", int_list(&v)));
        }
    }
    parts.push(format!("index_vector_dim = {ivd}"));
    let t = b.ty(operand);
    let zeros = b.splat(0.0, &t);
    let scalar = TensorType::scalar(t.element.clone());
    let region = crate::ir::binary_region("stablehlo.add", &scalar);
    let sorted = cx.op.attr("indices_are_sorted").unwrap_or("false").to_owned();
    let props = vec![
        ("indices_are_sorted".to_owned(), sorted),
        ("scatter_dimension_numbers".to_owned(), format!("#stablehlo.scatter<{}>", parts.join(", "))),
        ("unique_indices".to_owned(), "false".to_owned()),
    ];
    Ok(vec![Some(b.op("stablehlo.scatter", &[zeros, indices, g], props, Some(region), t)), None])
}
