//! Finding the standard attention pattern and replacing it with `pcp.attention`.

use std::collections::HashMap;

use super::{OP, Spec, strip_rows};
use crate::ir::attr::{lookup, parse_ints, struct_fields};
use crate::ir::{Builder, ElementType, Function, Op, TensorType, ValueId};

/// Replaces every standard attention in `f` (see [the module](super)) with one
/// `pcp.attention` op; returns how many. The replaced ops become dead and are
/// dropped; ops the rest of `f` still reads stay.
pub fn fuse(f: &mut Function) -> usize {
    let producers: HashMap<ValueId, usize> =
        f.ops.iter().enumerate().flat_map(|(i, op)| op.results.iter().map(move |r| (*r, i))).collect();
    let found: HashMap<usize, Found> =
        (0..f.ops.len()).filter_map(|i| Matcher { f, producers: &producers }.attention(i).map(|m| (i, m))).collect();
    if found.is_empty() {
        return 0;
    }
    let ops = std::mem::take(&mut f.ops);
    let mut renamed: HashMap<ValueId, ValueId> = HashMap::new();
    for (i, mut op) in ops.into_iter().enumerate() {
        for o in &mut op.operands {
            if let Some(r) = renamed.get(o) {
                *o = *r;
            }
        }
        let Some(m) = found.get(&i) else {
            f.ops.push(op);
            continue;
        };
        let rename = |v: ValueId| renamed.get(&v).copied().unwrap_or(v);
        let out = op.results[0];
        let out_ty = f.ty(out).clone();
        let mut b = Builder::new(f, op.loc.clone());
        let q = b.transpose(rename(m.q.0), &m.q.1);
        let k = b.transpose(rename(m.k.0), &m.k.1);
        let v = b.transpose(rename(m.v.0), &m.v.1);
        let mut operands = vec![q, k, v];
        if let Some(mask) = &m.mask {
            let mut keep = rename(mask.value);
            if mask.negated {
                keep = b.unary_op("stablehlo.not", keep);
            }
            operands.push(
                b.reshape(keep, &out_ty.shape[..out_ty.rank() - 1].iter().copied().chain([m.tk]).collect::<Vec<_>>()),
            );
        }
        let nb = out_ty.rank() - 2;
        let tq = out_ty.shape[nb];
        let rows = strip_rows();
        let spec = Spec {
            scale: m.scale,
            causal: m.causal,
            masked: m.mask.is_some(),
            bf16: false,
            strip: if m.causal && tq > 2 * rows && tq % rows == 0 { rows } else { tq },
        };
        let o = b.op(OP, &operands, spec.props(), None, out_ty.clone());
        let lse = f.new_value(TensorType::new(out_ty.shape[..=nb].to_vec(), out_ty.element.clone()));
        if let Some(last) = f.ops.last_mut() {
            last.results.push(lse);
        }
        renamed.insert(out, o);
    }
    for r in &mut f.results {
        if let Some(n) = renamed.get(r) {
            *r = *n;
        }
    }
    f.eliminate_dead_code();
    found.len()
}

/// One attention: its operands (value, permutation into the canonical layout),
/// its mask, its scale and its number of keys.
struct Found {
    q: (ValueId, Vec<i64>),
    k: (ValueId, Vec<i64>),
    v: (ValueId, Vec<i64>),
    mask: Option<Mask>,
    causal: bool,
    scale: f64,
    tk: i64,
}

/// A general mask: true where a key is seen, or (`negated`) where it is not.
struct Mask {
    value: ValueId,
    negated: bool,
}

struct Matcher<'a> {
    f: &'a Function,
    producers: &'a HashMap<ValueId, usize>,
}

impl Matcher<'_> {
    fn def(&self, v: ValueId) -> Option<&Op> {
        self.producers.get(&v).map(|i| &self.f.ops[*i])
    }

    /// The single-result op named `name` that produces `v`.
    fn def_named(&self, v: ValueId, name: &str) -> Option<&Op> {
        self.def(v).filter(|op| op.name == name && op.results.len() == 1)
    }

    /// `o = dot_general(softmax(mask(scale · dot_general(q, k))), v)` at op `i`.
    fn attention(&self, i: usize) -> Option<Found> {
        let pv = &self.f.ops[i];
        if pv.name != "stablehlo.dot_general" || pv.operands.len() != 2 {
            return None;
        }
        let out = self.f.ty(pv.results[0]);
        let (p, va) = (pv.operands[0], pv.operands[1]);
        let pt = self.f.ty(p);
        let rank = pt.rank();
        if rank < 3 || !pt.is_float() || out.rank() != rank {
            return None;
        }
        let nb = rank - 2;
        let batch: Vec<i64> = (0..nb as i64).collect();
        let (lb, rb, lc, rc) = dot_dims(pv)?;
        if lb != batch || lc != [nb as i64 + 1] || rc.len() != 1 || rb.len() != nb {
            return None;
        }
        let v_free = free(self.f.ty(va).rank(), &rb, &rc);
        if v_free.len() != 1 {
            return None;
        }
        // the softmax may run in another batch layout (PyTorch exports split B·H into
        // B, H around it): reshapes that keep the last two dimensions
        let p = self.batch_reshape_of(p).unwrap_or(p);
        let x = self.softmax(p)?;
        let nb_softmax = self.f.ty(p).rank() - 2;
        let (x, mask, causal) = self.masked(x, nb_softmax);
        let (s, scale) = self.scaled(self.identity_of(x));
        let s = self.batch_reshape_of(s).unwrap_or(s);
        let qk = self.def_named(s, "stablehlo.dot_general")?;
        let (qb, kb, qc, kc) = dot_dims(qk)?;
        let (qa, ka) = (qk.operands[0], qk.operands[1]);
        let (q_free, k_free) = (free(self.f.ty(qa).rank(), &qb, &qc), free(self.f.ty(ka).rank(), &kb, &kc));
        let st = self.f.ty(s);
        if qc.len() != 1 || q_free.len() != 1 || k_free.len() != 1 || qb.len() != nb || st.shape != pt.shape {
            return None;
        }
        let same_type = |v: ValueId| self.f.ty(v).element == pt.element;
        if !(same_type(qa) && same_type(ka) && same_type(va)) {
            return None;
        }
        let perm = |batch: &[i64], a: i64, b: i64| batch.iter().copied().chain([a, b]).collect::<Vec<i64>>();
        Some(Found {
            q: (qa, perm(&qb, q_free[0], qc[0])),
            k: (ka, perm(&kb, k_free[0], kc[0])),
            v: (va, perm(&rb, rc[0], v_free[0])),
            mask,
            causal,
            scale,
            tk: pt.shape[nb + 1],
        })
    }

    /// `x` when `v` is `reshape(x)` and both end in the same two dimensions.
    fn batch_reshape_of(&self, v: ValueId) -> Option<ValueId> {
        let op = self.def_named(v, "stablehlo.reshape")?;
        let (a, b) = (&self.f.ty(op.operands[0]).shape, &self.f.ty(v).shape);
        (a.len() >= 3 && b.len() >= 3 && a[a.len() - 2..] == b[b.len() - 2..]).then_some(op.operands[0])
    }

    /// `x` when `v` is a broadcast of `x` to its own shape (an identity).
    fn identity_of(&self, v: ValueId) -> ValueId {
        match self.def_named(v, "stablehlo.broadcast_in_dim") {
            Some(op) if self.f.ty(op.operands[0]).shape == self.f.ty(v).shape => {
                let rank = self.f.ty(v).rank() as i64;
                let dims = lookup(&op.props, "broadcast_dimensions").and_then(parse_ints);
                if dims == Some((0..rank).collect()) { op.operands[0] } else { v }
            }
            _ => v,
        }
    }

    /// `x` of `p = softmax(x)` over the last dimension, max-shifted.
    fn softmax(&self, p: ValueId) -> Option<ValueId> {
        let div = self.def_named(p, "stablehlo.divide")?;
        let (e, sum) = (div.operands[0], self.row_broadcast_of(div.operands[1])?);
        let last = self.f.ty(p).rank() as i64 - 1;
        let reduce = self.def_named(sum, "stablehlo.reduce")?;
        if !is_row_reduce(reduce, "stablehlo.add", last) || reduce.operands[0] != e {
            return None;
        }
        let exp = self.def_named(e, "stablehlo.exponential")?;
        let sub = self.def_named(exp.operands[0], "stablehlo.subtract")?;
        let (x, max) = (sub.operands[0], self.row_broadcast_of(sub.operands[1])?);
        let reduce = self.def_named(max, "stablehlo.reduce")?;
        (is_row_reduce(reduce, "stablehlo.maximum", last) && reduce.operands[0] == x).then_some(x)
    }

    /// `r` when `v` is `r: [.., T]` broadcast along a new last dimension
    /// (directly, or through a reshape to `[.., T, 1]`).
    fn row_broadcast_of(&self, v: ValueId) -> Option<ValueId> {
        let bc = self.def_named(v, "stablehlo.broadcast_in_dim")?;
        let rank = self.f.ty(v).rank();
        let dims = lookup(&bc.props, "broadcast_dimensions").and_then(parse_ints)?;
        let src = bc.operands[0];
        let st = self.f.ty(src);
        let prefix = self.f.ty(v).shape[..rank - 1].to_vec();
        if st.rank() == rank - 1 && dims == (0..rank as i64 - 1).collect::<Vec<_>>() && st.shape == prefix {
            return Some(src);
        }
        let reshape = self.def_named(src, "stablehlo.reshape")?;
        let inner = reshape.operands[0];
        let ok = st.shape.last() == Some(&1)
            && st.shape[..rank - 1] == prefix[..]
            && dims == (0..rank as i64).collect::<Vec<_>>()
            && self.f.ty(inner).shape == prefix;
        ok.then_some(inner)
    }

    /// `(s, mask, causal)` for `x = select(mask, s, -∞)` (or with the
    /// branches swapped, the mask negated); `(x, None, false)` otherwise.
    fn masked(&self, x: ValueId, nb: usize) -> (ValueId, Option<Mask>, bool) {
        let Some(select) = self.def_named(x, "stablehlo.select") else {
            return (x, None, false);
        };
        let (pred, a, b) = (select.operands[0], select.operands[1], select.operands[2]);
        let neg_inf = |v| self.splat_value(v) == Some(f64::NEG_INFINITY);
        if self.f.ty(pred).shape != self.f.ty(x).shape {
            return (x, None, false);
        }
        if neg_inf(b) && !neg_inf(a) {
            let causal = self.is_causal(pred, nb);
            (a, (!causal).then_some(Mask { value: pred, negated: false }), causal)
        } else if neg_inf(a) && !neg_inf(b) {
            (b, Some(Mask { value: pred, negated: true }), false)
        } else {
            (x, None, false)
        }
    }

    /// Whether `pred` is `key ≤ query` over the last two dimensions, broadcast.
    fn is_causal(&self, pred: ValueId, nb: usize) -> bool {
        let Some(bc) = self.def_named(pred, "stablehlo.broadcast_in_dim") else {
            return false;
        };
        let dims = lookup(&bc.props, "broadcast_dimensions").and_then(parse_ints);
        if dims != Some(vec![nb as i64, nb as i64 + 1]) {
            return false;
        }
        let Some(cmp) = self.def_named(bc.operands[0], "stablehlo.compare") else {
            return false;
        };
        let t = self.f.ty(bc.operands[0]);
        if t.rank() != 2 || t.shape[0] != t.shape[1] {
            return false;
        }
        let iota = |v| {
            self.def_named(v, "stablehlo.iota")
                .and_then(|op| lookup(&op.props, "iota_dimension"))
                .and_then(|d| d.split(':').next().and_then(|d| d.trim().parse::<i64>().ok()))
        };
        let direction = lookup(&cmp.props, "comparison_direction").unwrap_or_default();
        let (a, b) = (iota(cmp.operands[0]), iota(cmp.operands[1]));
        (direction.contains("LE") && a == Some(1) && b == Some(0))
            || (direction.contains("GE") && a == Some(0) && b == Some(1))
    }

    /// `(s, c)` for `x = s · c` (or `c · s`, or `s / (1/c)`) with `c` a splat
    /// constant; `(x, 1)` otherwise.
    fn scaled(&self, x: ValueId) -> (ValueId, f64) {
        if let Some(mul) = self.def_named(x, "stablehlo.multiply") {
            let (a, b) = (mul.operands[0], mul.operands[1]);
            if let Some(c) = self.splat_value(b) {
                return (a, c);
            }
            if let Some(c) = self.splat_value(a) {
                return (b, c);
            }
        }
        if let Some(div) = self.def_named(x, "stablehlo.divide")
            && let Some(c) = self.splat_value(div.operands[1])
        {
            return (div.operands[0], 1.0 / c);
        }
        (x, 1.0)
    }

    fn splat_value(&self, v: ValueId) -> Option<f64> {
        splat_value(self.f, self.producers, v)
    }
}

/// The value of a splat floating-point constant (possibly broadcast, reshaped
/// or converted); `producers` maps each value of `f` to the op defining it.
pub(crate) fn splat_value(f: &Function, producers: &HashMap<ValueId, usize>, v: ValueId) -> Option<f64> {
    let op = &f.ops[*producers.get(&v)?];
    match op.name.as_str() {
        "stablehlo.constant" | "arith.constant" => {
            let text = lookup(&op.props, "value")?;
            let (literal, ty) = text.strip_prefix("dense<")?.split_once("> :")?;
            let ty = TensorType::parse(ty.trim()).ok()?;
            parse_float(literal.trim(), &ty.element)
        }
        "stablehlo.broadcast_in_dim" | "stablehlo.reshape" | "stablehlo.convert" => {
            splat_value(f, producers, op.operands[0])
        }
        _ => None,
    }
}

/// A float literal as MLIR prints it: decimal, or hex bits of `element`.
fn parse_float(literal: &str, element: &ElementType) -> Option<f64> {
    if literal.starts_with('[') || literal.starts_with('"') {
        return None;
    }
    if let Some(hex) = literal.strip_prefix("0x") {
        let bits = u64::from_str_radix(hex, 16).ok()?;
        return match element.name() {
            "f32" => Some(f64::from(f32::from_bits(u32::try_from(bits).ok()?))),
            "f64" => Some(f64::from_bits(bits)),
            "bf16" => Some(f64::from(f32::from_bits(u32::try_from(bits).ok()? << 16))),
            _ => None,
        };
    }
    literal.parse().ok()
}

/// `(lhs batch, rhs batch, lhs contracting, rhs contracting)` of a dot_general.
type DotDims = (Vec<i64>, Vec<i64>, Vec<i64>, Vec<i64>);

fn dot_dims(op: &Op) -> Option<DotDims> {
    if op.name != "stablehlo.dot_general" || op.operands.len() != 2 {
        return None;
    }
    let fields = struct_fields(op.attr("dot_dimension_numbers")?);
    let field = |k: &str| lookup(&fields, k).and_then(parse_ints).unwrap_or_default();
    Some((
        field("lhs_batching_dimensions"),
        field("rhs_batching_dimensions"),
        field("lhs_contracting_dimensions"),
        field("rhs_contracting_dimensions"),
    ))
}

fn free(rank: usize, batch: &[i64], contract: &[i64]) -> Vec<i64> {
    (0..rank as i64).filter(|d| !batch.contains(d) && !contract.contains(d)).collect()
}

fn is_row_reduce(op: &Op, body: &str, last: i64) -> bool {
    op.operands.len() == 2
        && op.body_ops() == [body]
        && lookup(&op.props, "dimensions").and_then(parse_ints) == Some(vec![last])
}
