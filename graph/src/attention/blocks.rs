//! `pcp.attention` in StableHLO, by strips: the forward ([`expand`]) and
//! the flash-attention backward ([`vjp`]).

use super::{OP, Spec};
use crate::autodiff::GradError;
use crate::ir::{Builder, ElementType, FloatType, Function, Op, TensorType, ValueId};

/// Replaces every `pcp.attention` op of `f` with StableHLO; returns how many.
pub fn expand(f: &mut Function) -> usize {
    if !f.ops.iter().any(|op| op.name == OP) {
        return 0;
    }
    f.lower_ops(|b, op| {
        let spec = if op.name == OP { Spec::of(op) } else { None }?;
        let (o, lse) = Strips::new(b, &op.operands, spec).forward(b);
        Some(vec![o, lse])
    })
}

/// The cotangents of a `pcp.attention` op's `q`, `k` and `v` (and none for a
/// mask), given those of its output and log-sum-exp.
pub fn vjp(
    b: &mut Builder<'_>,
    op: &Op,
    g: &[Option<ValueId>],
    active: &[bool],
) -> Result<Vec<Option<ValueId>>, GradError> {
    let spec = Spec::of(op).ok_or_else(|| GradError::Unsupported {
        op: op.name.clone(),
        location: op.location(),
        reason: "malformed properties".to_owned(),
    })?;
    let a = Strips::new(b, &op.operands, spec);
    let (o, lse) = (op.results[0], op.results[1]);
    let d_o = match g[0] {
        Some(d) => d,
        None => b.splat_like(0.0, o),
    };
    let (dq, dk, dv) = a.backward(b, o, lse, d_o, g.get(1).copied().flatten());
    let mut out = vec![active[0].then_some(dq), active[1].then_some(dk), active[2].then_some(dv)];
    out.extend(std::iter::repeat_n(None, op.operands.len() - 3));
    Ok(out)
}

/// One attention's operands, shapes and strips.
struct Strips {
    q: ValueId,
    k: ValueId,
    v: ValueId,
    mask: Option<ValueId>,
    spec: Spec,
    /// Batch dimensions (`0 .. nb`).
    nb: usize,
    batch: Vec<i64>,
    tq: i64,
    tk: i64,
    d: i64,
    dv: i64,
    element: ElementType,
}

/// A strip's probabilities for the matmuls and for the rest ([`Strips::rounded`]).
struct Rounded {
    narrow: ValueId,
    wide: ValueId,
}

/// One strip of query rows `rows.0 .. rows.1` and the keys `0 .. keys` it meets.
struct Strip {
    rows: (i64, i64),
    keys: i64,
}

impl Strips {
    fn new(b: &mut Builder<'_>, operands: &[ValueId], spec: Spec) -> Self {
        let (qt, kt, vt) = (b.ty(operands[0]), b.ty(operands[1]), b.ty(operands[2]));
        let nb = qt.rank() - 2;
        // q, k and v are only ever matmul operands: in bf16, convert them once,
        // not each strip's slice of them.
        let bf16 = ElementType::Float(FloatType::Bf16);
        let mut narrow = |x: ValueId| if spec.bf16 { b.convert(x, &bf16) } else { x };
        Self {
            q: narrow(operands[0]),
            k: narrow(operands[1]),
            v: narrow(operands[2]),
            mask: operands.get(3).copied(),
            spec,
            nb,
            batch: qt.shape[..nb].to_vec(),
            tq: qt.shape[nb],
            tk: kt.shape[nb],
            d: qt.shape[nb + 1],
            dv: vt.shape[nb + 1],
            element: qt.element.clone(),
        }
    }

    fn strips(&self) -> Vec<Strip> {
        let s = self.spec.strip.clamp(1, self.tq.max(1));
        let causal = self.spec.causal && self.tq == self.tk;
        (0..self.tq)
            .step_by(s as usize)
            .map(|r0| {
                let r1 = (r0 + s).min(self.tq);
                Strip { rows: (r0, r1), keys: if causal { r1 } else { self.tk } }
            })
            .collect()
    }

    fn bdims(&self) -> Vec<i64> {
        (0..self.nb as i64).collect()
    }

    fn shape(&self, tail: &[i64]) -> Vec<i64> {
        self.batch.iter().copied().chain(tail.iter().copied()).collect()
    }

    /// `x[.., a..b, :]` along the sequence dimension.
    fn rows(&self, b: &mut Builder<'_>, x: ValueId, (a, z): (i64, i64)) -> ValueId {
        let t = b.ty(x);
        let mut start = vec![0; t.rank()];
        let mut limit = t.shape.clone();
        start[self.nb] = a;
        limit[self.nb] = z;
        b.slice(x, &start, &limit, &vec![1; t.rank()])
    }

    /// A batched matmul contracting `lhs`'s dimension `lc` with `rhs`'s `rc`,
    /// on bf16 operands when the op says so; the result in the op's type.
    fn matmul(&self, b: &mut Builder<'_>, lhs: ValueId, rhs: ValueId, lc: i64, rc: i64) -> ValueId {
        let (lhs, rhs) = if self.spec.bf16 {
            let bf16 = ElementType::Float(FloatType::Bf16);
            (b.convert(lhs, &bf16), b.convert(rhs, &bf16))
        } else {
            (lhs, rhs)
        };
        let bd = self.bdims();
        b.dot_general(lhs, rhs, &bd, &bd, &[lc], &[rc], self.element.clone())
    }

    /// Probabilities `p` as the matmuls read them (`narrow`: bf16 when the op's
    /// matmuls are) and as the rest of the strip reads them (`wide`: the same
    /// values in the op's type). In bf16 the row sums and `ds` read the rounded
    /// values, so only the bf16 tensor is ever written: a strip's probabilities
    /// are its largest tensor, and IREE fuses the rounding into the `exp`.
    fn rounded(&self, b: &mut Builder<'_>, p: ValueId) -> Rounded {
        if !self.spec.bf16 {
            return Rounded { narrow: p, wide: p };
        }
        let narrow = b.convert(p, &ElementType::Float(FloatType::Bf16));
        Rounded { narrow, wide: b.convert(narrow, &self.element) }
    }

    /// A strip's scaled, masked scores `[batch.., rows, keys]`, and its queries and keys.
    fn scores(&self, b: &mut Builder<'_>, strip: &Strip) -> (ValueId, ValueId, ValueId) {
        let n = self.nb as i64;
        let q = self.rows(b, self.q, strip.rows);
        let k = self.rows(b, self.k, (0, strip.keys));
        let s = self.matmul(b, q, k, n + 1, n + 1);
        let s = if self.spec.scale == 1.0 { s } else { b.scale(s, self.spec.scale) };
        let rows = strip.rows.1 - strip.rows.0;
        let shape = self.shape(&[rows, strip.keys]);
        let keep = if let Some(mask) = self.mask {
            let t = b.ty(mask);
            let mut start = vec![0; t.rank()];
            let mut limit = t.shape.clone();
            start[self.nb] = strip.rows.0;
            limit[self.nb] = strip.rows.1;
            limit[self.nb + 1] = strip.keys;
            Some(b.slice(mask, &start, &limit, &vec![1; t.rank()]))
        } else if self.spec.causal && strip.keys > strip.rows.0 + 1 {
            // key ≤ query, i.e. key ≤ row + the strip's first row
            Some(self.causal_keep(b, (rows, strip.keys), 1, strip.rows.0, &shape))
        } else {
            None
        };
        let s = match keep {
            Some(keep) => {
                let neg_inf = b.splat(f64::NEG_INFINITY, &TensorType::new(shape, self.element.clone()));
                b.select(keep, s, neg_inf)
            }
            None => s,
        };
        (s, q, k)
    }

    /// The causal mask of a `dims` block whose dimension `key_dim` (0 or 1)
    /// numbers keys and the other query rows, `offset` ahead of the keys:
    /// true where key ≤ row + offset, broadcast to `shape` (`[batch.., dims]`).
    fn causal_keep(&self, b: &mut Builder<'_>, dims: (i64, i64), key_dim: i64, offset: i64, shape: &[i64]) -> ValueId {
        let n = self.nb as i64;
        let square = TensorType::new(vec![dims.0, dims.1], ElementType::Int("i32".into()));
        let iota = |b: &mut Builder<'_>, dim: i64| {
            b.op("stablehlo.iota", &[], vec![("iota_dimension".into(), format!("{dim} : i64"))], None, square.clone())
        };
        let (first, second) = (iota(b, 0), iota(b, 1));
        let (key, row) = if key_dim == 0 { (first, second) } else { (second, first) };
        let offset = b.splat(offset as f64, &square);
        let query = b.add(row, offset);
        let keep = b.compare(key, query, "LE");
        b.broadcast_in_dim(keep, &[n, n + 1], shape)
    }

    /// `x: [batch.., rows]` broadcast along a last dimension of `cols`.
    fn by_row(&self, b: &mut Builder<'_>, x: ValueId, rows: i64, cols: i64) -> ValueId {
        let dims: Vec<i64> = (0..=self.nb as i64).collect();
        b.broadcast_in_dim(x, &dims, &self.shape(&[rows, cols]))
    }

    /// `x: [batch.., cols]` broadcast along a new second-to-last dimension of `rows`.
    fn by_col(&self, b: &mut Builder<'_>, x: ValueId, rows: i64, cols: i64) -> ValueId {
        let dims: Vec<i64> = (0..self.nb as i64).chain([self.nb as i64 + 1]).collect();
        b.broadcast_in_dim(x, &dims, &self.shape(&[rows, cols]))
    }

    /// Joins per-strip pieces along the sequence dimension.
    fn concat(&self, b: &mut Builder<'_>, parts: Vec<ValueId>) -> ValueId {
        if parts.len() == 1 {
            return parts[0];
        }
        let mut ty = b.ty(parts[0]);
        ty.shape[self.nb] = parts.iter().map(|p| b.ty(*p).shape[self.nb]).sum();
        let props = vec![("dimension".into(), format!("{} : i64", self.nb))];
        b.op("stablehlo.concatenate", &parts, props, None, ty)
    }

    /// `(o, lse)`.
    fn forward(&self, b: &mut Builder<'_>) -> (ValueId, ValueId) {
        let n = self.nb as i64;
        let (mut outs, mut lses) = (Vec::new(), Vec::new());
        for strip in self.strips() {
            let rows = strip.rows.1 - strip.rows.0;
            let (s, _, _) = self.scores(b, &strip);
            let max = b.reduce(s, &[n + 1], "stablehlo.maximum", f64::NEG_INFINITY);
            let shift = self.by_row(b, max, rows, strip.keys);
            let shifted = b.sub(s, shift);
            let e = b.unary_op("stablehlo.exponential", shifted);
            let e = self.rounded(b, e);
            let sum = b.reduce_sum(e.wide, &[n + 1]);
            let v = self.rows(b, self.v, (0, strip.keys));
            let o = self.matmul(b, e.narrow, v, n + 1, n);
            let norm = self.by_row(b, sum, rows, self.dv);
            outs.push(b.div(o, norm));
            let log = b.unary_op("stablehlo.log", sum);
            lses.push(b.add(max, log));
        }
        (self.concat(b, outs), self.concat(b, lses))
    }

    /// `(dq, dk, dv)` from the kept `o` and `lse`, by strips of *keys*: key
    /// strip `j` meets the query rows `r0 ..` that see it (all rows unless
    /// causal), and the strip's scores are built transposed, `sᵀ = k_j·qᵀ`
    /// (`[batch.., keys, rows]`). Then `dv_j = pᵀ·do` and `dk_j = dsᵀ·q`
    /// contract over the rows, a long dimension, and read `pᵀ` and `dsᵀ` as
    /// they are; only `dq += ds·k_j`, which contracts over the strip's keys,
    /// reads `dsᵀ` transposed. (Query strips would contract both `dv` and `dk`
    /// over a strip's rows and transpose `p` and `ds` for them; IREE's cpu
    /// matmuls are half as fast on a short contraction.) An attention with a
    /// general mask takes [`Strips::backward_by_rows`].
    fn backward(
        &self,
        b: &mut Builder<'_>,
        o: ValueId,
        lse: ValueId,
        d_o: ValueId,
        d_lse: Option<ValueId>,
    ) -> (ValueId, ValueId, ValueId) {
        if self.mask.is_some() {
            return self.backward_by_rows(b, o, lse, d_o, d_lse);
        }
        let n = self.nb as i64;
        let rank = self.nb + 2;
        // Σⱼ pᵢⱼ dpᵢⱼ = Σ_d doᵢ_d oᵢ_d (less lse's own cotangent, ∂lseᵢ/∂sᵢⱼ = pᵢⱼ)
        let prod = b.mul(d_o, o);
        let mut delta = b.reduce_sum(prod, &[n + 1]);
        if let Some(g) = d_lse {
            delta = b.sub(delta, g);
        }
        let zero = b.splat(0.0, &TensorType::scalar(self.element.clone()));
        let causal = self.spec.causal && self.tq == self.tk;
        let s = self.spec.strip.clamp(1, self.tk.max(1));
        let (mut dq, mut dk, mut dv) = (None, Vec::new(), Vec::new());
        for k0 in (0..self.tk).step_by(s as usize) {
            let k1 = (k0 + s).min(self.tk);
            let keys = k1 - k0;
            let r0 = if causal { k0 } else { 0 };
            let rows = self.tq - r0;
            let shape = self.shape(&[keys, rows]);
            let q = self.rows(b, self.q, (r0, self.tq));
            let k = self.rows(b, self.k, (k0, k1));
            let v = self.rows(b, self.v, (k0, k1));
            let d_o_rows = self.rows(b, d_o, (r0, self.tq));
            let s_t = self.matmul(b, k, q, n + 1, n + 1);
            let s_t = if self.spec.scale == 1.0 { s_t } else { b.scale(s_t, self.spec.scale) };
            let keep = if causal && keys > 1 {
                // key ≤ query, i.e. k0 + key ≤ r0 + row
                Some(self.causal_keep(b, (keys, rows), 0, r0 - k0, &shape))
            } else {
                None
            };
            let s_t = match keep {
                Some(keep) => {
                    let neg_inf = b.splat(f64::NEG_INFINITY, &TensorType::new(shape.clone(), self.element.clone()));
                    b.select(keep, s_t, neg_inf)
                }
                None => s_t,
            };
            let lse_rows = self.rows(b, lse, (r0, self.tq));
            let shift = self.by_col(b, lse_rows, keys, rows);
            let shifted = b.sub(s_t, shift);
            let p_t = b.unary_op("stablehlo.exponential", shifted);
            let p_t = self.rounded(b, p_t);
            dv.push(self.matmul(b, p_t.narrow, d_o_rows, n + 1, n));
            let dp_t = self.matmul(b, v, d_o_rows, n + 1, n + 1);
            let delta_rows = self.rows(b, delta, (r0, self.tq));
            let delta_rows = self.by_col(b, delta_rows, keys, rows);
            let centered = b.sub(dp_t, delta_rows);
            let ds_t = b.mul(p_t.wide, centered);
            let ds_t = if self.spec.scale == 1.0 { ds_t } else { b.scale(ds_t, self.spec.scale) };
            dk.push(self.matmul(b, ds_t, q, n + 1, n));
            let dq_part = self.matmul(b, ds_t, k, n, n);
            let mut low = vec![0; rank];
            low[self.nb] = r0;
            let padded = if r0 == 0 { dq_part } else { b.pad(dq_part, zero, &low, &vec![0; rank], &vec![0; rank]) };
            dq = Some(match dq {
                Some(acc) => b.add(acc, padded),
                None => padded,
            });
        }
        let zeros = |b: &mut Builder<'_>, t: i64, last: i64| {
            b.splat(0.0, &TensorType::new(self.shape(&[t, last]), self.element.clone()))
        };
        let dq = dq.unwrap_or_else(|| zeros(b, self.tq, self.d));
        let dk = if dk.is_empty() { zeros(b, self.tk, self.d) } else { self.concat(b, dk) };
        let dv = if dv.is_empty() { zeros(b, self.tk, self.dv) } else { self.concat(b, dv) };
        (dq, dk, dv)
    }

    /// [`Strips::backward`] by strips of query rows, for a general mask: with
    /// the key strips' transposed mask, IREE 3.13's SPIR-V backend fails on
    /// PCP's exported nanogpt-small ("failed to legalize operation
    /// 'arith.constant'", vulkan rdna3), which compiles this way.
    fn backward_by_rows(
        &self,
        b: &mut Builder<'_>,
        o: ValueId,
        lse: ValueId,
        d_o: ValueId,
        d_lse: Option<ValueId>,
    ) -> (ValueId, ValueId, ValueId) {
        let n = self.nb as i64;
        let (mut dq, mut dk, mut dv) = (Vec::new(), None, None);
        let zero = b.splat(0.0, &TensorType::scalar(self.element.clone()));
        let accumulate = |b: &mut Builder<'_>, acc: Option<ValueId>, part: ValueId, keys: i64| {
            let rank = self.nb + 2;
            let mut high = vec![0; rank];
            high[self.nb] = self.tk - keys;
            let padded = b.pad(part, zero, &vec![0; rank], &high, &vec![0; rank]);
            Some(match acc {
                Some(acc) => b.add(acc, padded),
                None => padded,
            })
        };
        for strip in self.strips() {
            let rows = strip.rows.1 - strip.rows.0;
            let (s, q, k) = self.scores(b, &strip);
            let lse_rows = self.rows(b, lse, strip.rows);
            let shift = self.by_row(b, lse_rows, rows, strip.keys);
            let shifted = b.sub(s, shift);
            let p = b.unary_op("stablehlo.exponential", shifted);
            let p = self.rounded(b, p);
            let d_o_rows = self.rows(b, d_o, strip.rows);
            let o_rows = self.rows(b, o, strip.rows);
            let v = self.rows(b, self.v, (0, strip.keys));
            // Σⱼ pᵢⱼ dpᵢⱼ = Σ_d doᵢ_d oᵢ_d (less lse's own cotangent, ∂lseᵢ/∂sᵢⱼ = pᵢⱼ)
            let prod = b.mul(d_o_rows, o_rows);
            let mut delta = b.reduce_sum(prod, &[n + 1]);
            if let Some(g) = d_lse {
                let g_rows = self.rows(b, g, strip.rows);
                delta = b.sub(delta, g_rows);
            }
            let dv_part = self.matmul(b, p.narrow, d_o_rows, n, n);
            dv = accumulate(b, dv, dv_part, strip.keys);
            let dp = self.matmul(b, d_o_rows, v, n + 1, n + 1);
            let delta = self.by_row(b, delta, rows, strip.keys);
            let centered = b.sub(dp, delta);
            let ds = b.mul(p.wide, centered);
            let ds = if self.spec.scale == 1.0 { ds } else { b.scale(ds, self.spec.scale) };
            dq.push(self.matmul(b, ds, k, n + 1, n));
            let dk_part = self.matmul(b, ds, q, n, n);
            dk = accumulate(b, dk, dk_part, strip.keys);
        }
        let dq = self.concat(b, dq);
        let zeros = |b: &mut Builder<'_>, last: i64| {
            b.splat(0.0, &TensorType::new(self.shape(&[self.tk, last]), self.element.clone()))
        };
        let dk = dk.unwrap_or_else(|| zeros(b, self.d));
        let dv = dv.unwrap_or_else(|| zeros(b, self.dv));
        (dq, dk, dv)
    }
}
