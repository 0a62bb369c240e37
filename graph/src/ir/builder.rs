//! Appending StableHLO ops to a [`Function`].

use std::collections::HashMap;

use super::attr::{i64_array, int_list};
use super::{ElementType, FloatType, Function, Op, TensorType, ValueId};

/// Appends ops to a function, tagging them with one source location and
/// sharing splat constants.
#[derive(Debug)]
pub struct Builder<'f> {
    f: &'f mut Function,
    loc: Option<String>,
    constants: HashMap<String, ValueId>,
}

impl<'f> Builder<'f> {
    /// A builder appending to `f`; new ops carry `loc`.
    pub fn new(f: &'f mut Function, loc: Option<String>) -> Self {
        Self { f, loc, constants: HashMap::new() }
    }

    /// The function being built.
    pub fn function(&self) -> &Function {
        self.f
    }

    /// Sets the location of the ops appended next.
    pub fn set_loc(&mut self, loc: Option<String>) {
        self.loc = loc;
    }

    /// The type of `v`.
    pub fn ty(&self, v: ValueId) -> TensorType {
        self.f.ty(v).clone()
    }

    /// Appends a generic op with one result.
    pub fn op(
        &mut self,
        name: &str,
        operands: &[ValueId],
        props: Vec<(String, String)>,
        regions: Option<String>,
        result: TensorType,
    ) -> ValueId {
        let r = self.f.new_value(result);
        self.f.ops.push(Op {
            name: name.to_owned(),
            operands: operands.to_vec(),
            results: vec![r],
            props,
            attrs: Vec::new(),
            regions,
            loc: self.loc.clone(),
        });
        r
    }

    fn unary(&mut self, name: &str, x: ValueId) -> ValueId {
        let t = self.ty(x);
        self.op(name, &[x], Vec::new(), None, t)
    }

    fn binary(&mut self, name: &str, a: ValueId, b: ValueId) -> ValueId {
        let t = self.ty(a);
        self.op(name, &[a, b], Vec::new(), None, t)
    }

    /// `a + b`.
    pub fn add(&mut self, a: ValueId, b: ValueId) -> ValueId {
        self.binary("stablehlo.add", a, b)
    }
    /// `a - b`.
    pub fn sub(&mut self, a: ValueId, b: ValueId) -> ValueId {
        self.binary("stablehlo.subtract", a, b)
    }
    /// `a * b`.
    pub fn mul(&mut self, a: ValueId, b: ValueId) -> ValueId {
        self.binary("stablehlo.multiply", a, b)
    }
    /// `a / b`.
    pub fn div(&mut self, a: ValueId, b: ValueId) -> ValueId {
        self.binary("stablehlo.divide", a, b)
    }
    /// `max(a, b)`.
    pub fn max(&mut self, a: ValueId, b: ValueId) -> ValueId {
        self.binary("stablehlo.maximum", a, b)
    }
    /// `min(a, b)`.
    pub fn min(&mut self, a: ValueId, b: ValueId) -> ValueId {
        self.binary("stablehlo.minimum", a, b)
    }
    /// `a ** b`.
    pub fn pow(&mut self, a: ValueId, b: ValueId) -> ValueId {
        self.binary("stablehlo.power", a, b)
    }
    /// Bitwise/logical and.
    pub fn and(&mut self, a: ValueId, b: ValueId) -> ValueId {
        self.binary("stablehlo.and", a, b)
    }
    /// `-x`.
    pub fn neg(&mut self, x: ValueId) -> ValueId {
        self.unary("stablehlo.negate", x)
    }
    /// Any elementwise unary op by name (`stablehlo.sqrt`, …).
    pub fn unary_op(&mut self, name: &str, x: ValueId) -> ValueId {
        self.unary(name, x)
    }

    /// `pred ? a : b`, elementwise.
    pub fn select(&mut self, pred: ValueId, a: ValueId, b: ValueId) -> ValueId {
        let t = self.ty(a);
        self.op("stablehlo.select", &[pred, a, b], Vec::new(), None, t)
    }

    /// Elementwise comparison; `direction` is `EQ`, `NE`, `LT`, `LE`, `GT` or `GE`.
    pub fn compare(&mut self, a: ValueId, b: ValueId, direction: &str) -> ValueId {
        let t = self.ty(a);
        let kind = if t.is_float() { "FLOAT" } else { "SIGNED" };
        let props = vec![
            ("comparison_direction".to_owned(), format!("#stablehlo<comparison_direction {direction}>")),
            ("compare_type".to_owned(), format!("#stablehlo<comparison_type {kind}>")),
        ];
        self.op("stablehlo.compare", &[a, b], props, None, t.with_element(ElementType::Int("i1".into())))
    }

    /// Converts `x` to `element`, or returns `x` if it already has it.
    pub fn convert(&mut self, x: ValueId, element: &ElementType) -> ValueId {
        let t = self.ty(x);
        if &t.element == element {
            return x;
        }
        self.op("stablehlo.convert", &[x], Vec::new(), None, t.with_element(element.clone()))
    }

    /// A splat constant of type `ty`, shared within this builder.
    pub fn splat(&mut self, value: f64, ty: &TensorType) -> ValueId {
        let literal = match ty.element.float() {
            Some(f) => f.hex_literal(value),
            None if ty.element.name() == "i1" => (value != 0.0).to_string(),
            None => format!("{}", value as i64),
        };
        let key = format!("{literal}:{ty}");
        if let Some(v) = self.constants.get(&key) {
            return *v;
        }
        let props = vec![("value".to_owned(), format!("dense<{literal}> : {ty}"))];
        let v = self.op("stablehlo.constant", &[], props, None, ty.clone());
        self.constants.insert(key, v);
        v
    }

    /// A splat constant shaped like `like`.
    pub fn splat_like(&mut self, value: f64, like: ValueId) -> ValueId {
        let t = self.ty(like);
        self.splat(value, &t)
    }

    /// `x * value`, with a splat constant.
    pub fn scale(&mut self, x: ValueId, value: f64) -> ValueId {
        let c = self.splat_like(value, x);
        self.mul(x, c)
    }

    /// Reshapes `x` to `shape` (a no-op when the shape already matches).
    pub fn reshape(&mut self, x: ValueId, shape: &[i64]) -> ValueId {
        let t = self.ty(x);
        if t.shape == shape {
            return x;
        }
        self.op("stablehlo.reshape", &[x], Vec::new(), None, t.with_shape(shape.to_vec()))
    }

    /// Permutes the dimensions of `x` (a no-op for the identity).
    pub fn transpose(&mut self, x: ValueId, perm: &[i64]) -> ValueId {
        if perm.iter().enumerate().all(|(i, p)| *p == i as i64) {
            return x;
        }
        let t = self.ty(x);
        let shape = perm.iter().map(|p| t.shape[*p as usize]).collect();
        self.op("stablehlo.transpose", &[x], vec![("permutation".into(), i64_array(perm))], None, t.with_shape(shape))
    }

    /// Broadcasts `x` into `shape`, operand dimension `i` becoming `dims[i]`.
    pub fn broadcast_in_dim(&mut self, x: ValueId, dims: &[i64], shape: &[i64]) -> ValueId {
        let t = self.ty(x);
        if t.shape == shape && dims.iter().enumerate().all(|(i, d)| *d == i as i64) {
            return x;
        }
        let props = vec![("broadcast_dimensions".into(), i64_array(dims))];
        self.op("stablehlo.broadcast_in_dim", &[x], props, None, t.with_shape(shape.to_vec()))
    }

    /// A reduction of `x` over `dims` with the binary op `body` (`stablehlo.add`, …).
    pub fn reduce(&mut self, x: ValueId, dims: &[i64], body: &str, init: f64) -> ValueId {
        if dims.is_empty() {
            return x;
        }
        let t = self.ty(x);
        let scalar = TensorType::scalar(t.element.clone());
        let init = self.splat(init, &scalar);
        let shape = t.shape.iter().enumerate().filter(|(i, _)| !dims.contains(&(*i as i64))).map(|(_, d)| *d).collect();
        let region = binary_region(body, &scalar);
        self.op(
            "stablehlo.reduce",
            &[x, init],
            vec![("dimensions".into(), i64_array(dims))],
            Some(region),
            t.with_shape(shape),
        )
    }

    /// Sums `x` over `dims`.
    pub fn reduce_sum(&mut self, x: ValueId, dims: &[i64]) -> ValueId {
        self.reduce(x, dims, "stablehlo.add", 0.0)
    }

    /// Sums every element of `x` into a scalar.
    pub fn sum_all(&mut self, x: ValueId) -> ValueId {
        let dims: Vec<i64> = (0..self.ty(x).rank() as i64).collect();
        self.reduce_sum(x, &dims)
    }

    /// Pads `x` with `value`; negative edges crop.
    pub fn pad(&mut self, x: ValueId, value: ValueId, low: &[i64], high: &[i64], interior: &[i64]) -> ValueId {
        if low.iter().chain(high).chain(interior).all(|p| *p == 0) {
            return x;
        }
        let t = self.ty(x);
        let shape = (0..t.rank())
            .map(|i| {
                let d = t.shape[i];
                low[i] + high[i] + d + if d > 0 { (d - 1) * interior[i] } else { 0 }
            })
            .collect();
        let props = vec![
            ("edge_padding_high".into(), i64_array(high)),
            ("edge_padding_low".into(), i64_array(low)),
            ("interior_padding".into(), i64_array(interior)),
        ];
        self.op("stablehlo.pad", &[x, value], props, None, t.with_shape(shape))
    }

    /// A strided slice.
    pub fn slice(&mut self, x: ValueId, start: &[i64], limit: &[i64], strides: &[i64]) -> ValueId {
        let t = self.ty(x);
        if start.iter().all(|s| *s == 0) && limit == t.shape.as_slice() && strides.iter().all(|s| *s == 1) {
            return x;
        }
        let shape = (0..t.rank()).map(|i| (limit[i] - start[i] + strides[i] - 1).max(0) / strides[i]).collect();
        let props = vec![
            ("limit_indices".into(), i64_array(limit)),
            ("start_indices".into(), i64_array(start)),
            ("strides".into(), i64_array(strides)),
        ];
        self.op("stablehlo.slice", &[x], props, None, t.with_shape(shape))
    }

    /// Reverses `x` along `dims`.
    pub fn reverse(&mut self, x: ValueId, dims: &[i64]) -> ValueId {
        if dims.is_empty() {
            return x;
        }
        let t = self.ty(x);
        self.op("stablehlo.reverse", &[x], vec![("dimensions".into(), i64_array(dims))], None, t)
    }

    /// A `dot_general` with the given dimension numbers; result elements are `element`.
    #[allow(clippy::too_many_arguments)]
    pub fn dot_general(
        &mut self,
        lhs: ValueId,
        rhs: ValueId,
        lhs_batch: &[i64],
        rhs_batch: &[i64],
        lhs_contract: &[i64],
        rhs_contract: &[i64],
        element: ElementType,
    ) -> ValueId {
        let (lt, rt) = (self.ty(lhs), self.ty(rhs));
        let free = |t: &TensorType, batch: &[i64], contract: &[i64]| -> Vec<i64> {
            (0..t.rank() as i64)
                .filter(|d| !batch.contains(d) && !contract.contains(d))
                .map(|d| t.shape[d as usize])
                .collect()
        };
        let mut shape: Vec<i64> = lhs_batch.iter().map(|d| lt.shape[*d as usize]).collect();
        shape.extend(free(&lt, lhs_batch, lhs_contract));
        shape.extend(free(&rt, rhs_batch, rhs_contract));
        let mut fields = Vec::new();
        for (name, dims) in [
            ("lhs_batching_dimensions", lhs_batch),
            ("rhs_batching_dimensions", rhs_batch),
            ("lhs_contracting_dimensions", lhs_contract),
            ("rhs_contracting_dimensions", rhs_contract),
        ] {
            if !dims.is_empty() {
                fields.push(format!("{name} = {}", int_list(dims)));
            }
        }
        let props = vec![("dot_dimension_numbers".into(), format!("#stablehlo.dot<{}>", fields.join(", ")))];
        self.op("stablehlo.dot_general", &[lhs, rhs], props, None, TensorType::new(shape, element))
    }

    /// Appends a copy of `op` reading `operands`, with fresh results of the same
    /// types; returns them.
    pub fn copy_op(&mut self, op: &Op, operands: Vec<ValueId>) -> Vec<ValueId> {
        let results: Vec<ValueId> = op.results.iter().map(|r| self.f.new_value(self.f.ty(*r).clone())).collect();
        self.f.ops.push(Op { operands, results: results.clone(), ..op.clone() });
        results
    }

    /// The float type of `x`, which callers have checked is a float tensor.
    pub fn float_of(&self, x: ValueId) -> Option<FloatType> {
        self.f.ty(x).element.float()
    }
}

/// The region of a reduction, window or scatter that combines two `scalar`s with
/// the binary op `body` (`stablehlo.add`, …).
pub fn binary_region(body: &str, scalar: &TensorType) -> String {
    format!(
        "({{\n    ^bb0(%a: {scalar}, %b: {scalar}):\n      %c = \"{body}\"(%a, %b) : ({scalar}, {scalar}) -> {scalar}\n      \"stablehlo.return\"(%c) : ({scalar}) -> ()\n    }})"
    )
}
