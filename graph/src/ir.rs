//! pcp's own, owned view of a StableHLO module.
//!
//! Import reads a module through melior into these types; autodiff and the
//! optimizer append ops; [`Module::to_mlir`] prints generic-form MLIR that
//! both melior and IREE parse. Nothing here holds an MLIR context, so a
//! [`Module`] is `Send` and cheap to clone.

pub mod attr;
mod builder;
pub mod types;

use std::collections::BTreeMap;
use std::fmt::Write as _;

pub use builder::{Builder, binary_region};
pub use types::{ElementType, FloatType, TensorType, TypeError};

/// An SSA value inside one [`Function`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

impl ValueId {
    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }
}

/// One operation in generic form.
#[derive(Clone, Debug, PartialEq)]
pub struct Op {
    /// Fully qualified name, e.g. `stablehlo.add`.
    pub name: String,
    /// Operand values.
    pub operands: Vec<ValueId>,
    /// Result values.
    pub results: Vec<ValueId>,
    /// Inherent attributes (printed as `<{…}>`), as `(name, text)` pairs.
    pub props: Vec<(String, String)>,
    /// Discardable attributes (printed as `{…}`).
    pub attrs: Vec<(String, String)>,
    /// Region text, including the outer parentheses, with region-local names.
    pub regions: Option<String>,
    /// The MLIR location, as printed (`loc("model.mlir":3:10)`).
    pub loc: Option<String>,
}

impl Op {
    /// The text of attribute `key` (inherent first, then discardable).
    pub fn attr(&self, key: &str) -> Option<&str> {
        attr::lookup(&self.props, key).or_else(|| attr::lookup(&self.attrs, key))
    }

    /// A human-readable location (`model.mlir:3:10`), or `unknown location`.
    pub fn location(&self) -> String {
        self.loc.as_deref().map_or_else(|| "unknown location".to_owned(), human_location)
    }

    /// The names of the ops inside this op's regions, terminators excluded.
    pub fn body_ops(&self) -> Vec<&str> {
        let Some(regions) = &self.regions else {
            return Vec::new();
        };
        // In generic form every op is a quoted name directly followed by `(`.
        let mut names = Vec::new();
        let mut rest = regions.as_str();
        while let Some(open) = rest.find('"') {
            let after = &rest[open + 1..];
            let Some(close) = after.find('"') else { break };
            let name = &after[..close];
            if after[close + 1..].starts_with('(') && !name.ends_with(".return") {
                names.push(name);
            }
            rest = &after[close + 1..];
        }
        names
    }
}

/// Turns `loc("a.mlir":3:10)` into `a.mlir:3:10`, keeping other forms readable.
pub fn human_location(loc: &str) -> String {
    let inner = loc.strip_prefix("loc(").and_then(|l| l.strip_suffix(')')).unwrap_or(loc);
    // Prefer the innermost file:line:col of a fused or named location.
    if let Some(q) = inner.rfind("\":") {
        let start = inner[..q].rfind('"').map_or(0, |s| s + 1);
        let tail: String = inner[q + 1..].chars().take_while(|c| c.is_ascii_digit() || *c == ':').collect();
        return format!("{}{}", &inner[start..q], tail);
    }
    inner.to_owned()
}

/// A function with a single block.
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    /// Symbol name, without `@`.
    pub name: String,
    /// Whether the function is public (the default in MLIR).
    pub public: bool,
    /// Block arguments.
    pub args: Vec<ValueId>,
    /// Returned values.
    pub results: Vec<ValueId>,
    /// Operations, in order; the terminator is implicit.
    pub ops: Vec<Op>,
    types: Vec<TensorType>,
}

impl Function {
    /// An empty function with arguments of `arg_types`.
    pub fn new(name: impl Into<String>, arg_types: &[TensorType]) -> Self {
        let mut f = Self {
            name: name.into(),
            public: true,
            args: Vec::new(),
            results: Vec::new(),
            ops: Vec::new(),
            types: Vec::new(),
        };
        f.args = arg_types.iter().map(|t| f.new_value(t.clone())).collect();
        f
    }

    /// Allocates a fresh value of type `ty`.
    pub fn new_value(&mut self, ty: TensorType) -> ValueId {
        let id = ValueId(u32::try_from(self.types.len()).unwrap_or(u32::MAX));
        self.types.push(ty);
        id
    }

    /// The type of `v`.
    pub fn ty(&self, v: ValueId) -> &TensorType {
        &self.types[v.index()]
    }

    /// Number of values allocated so far.
    pub fn value_count(&self) -> usize {
        self.types.len()
    }

    /// Types of the arguments.
    pub fn arg_types(&self) -> Vec<TensorType> {
        self.args.iter().map(|a| self.ty(*a).clone()).collect()
    }

    /// Types of the results.
    pub fn result_types(&self) -> Vec<TensorType> {
        self.results.iter().map(|a| self.ty(*a).clone()).collect()
    }

    /// Ops by name, for an op histogram.
    pub fn histogram(&self) -> BTreeMap<&str, usize> {
        let mut h = BTreeMap::new();
        for op in &self.ops {
            *h.entry(op.name.as_str()).or_insert(0) += 1;
        }
        h
    }

    /// Gives `v` another type (a rewrite that changes an element type in place).
    pub fn retype(&mut self, v: ValueId, ty: TensorType) {
        self.types[v.index()] = ty;
    }

    /// Lowers ops in place: for each op, in order, `lower` may build replacement
    /// ops with a [`Builder`] at the op's location and return the values that
    /// stand for its results; later ops and the function's results then read
    /// those. An op for which it returns `None` stays. Returns how many ops were
    /// replaced.
    pub fn lower_ops(&mut self, mut lower: impl FnMut(&mut Builder<'_>, &Op) -> Option<Vec<ValueId>>) -> usize {
        let ops = std::mem::take(&mut self.ops);
        let mut renamed: std::collections::HashMap<ValueId, ValueId> = std::collections::HashMap::new();
        let mut count = 0;
        for mut op in ops {
            for o in &mut op.operands {
                if let Some(r) = renamed.get(o) {
                    *o = *r;
                }
            }
            let mut b = Builder::new(self, op.loc.clone());
            match lower(&mut b, &op) {
                Some(values) => {
                    renamed.extend(op.results.iter().copied().zip(values));
                    count += 1;
                }
                None => self.ops.push(op),
            }
        }
        for r in &mut self.results {
            if let Some(n) = renamed.get(r) {
                *r = *n;
            }
        }
        count
    }

    /// Drops ops whose results are unused and that have no side effects.
    pub fn eliminate_dead_code(&mut self) {
        let mut live = vec![false; self.types.len()];
        for r in &self.results {
            live[r.index()] = true;
        }
        let mut keep = vec![false; self.ops.len()];
        for (i, op) in self.ops.iter().enumerate().rev() {
            if op.results.iter().any(|r| live[r.index()]) || op.results.is_empty() {
                keep[i] = true;
                for o in &op.operands {
                    live[o.index()] = true;
                }
            }
        }
        let mut i = 0;
        self.ops.retain(|_| {
            i += 1;
            keep[i - 1]
        });
    }

    fn print(&self, out: &mut String, region_counter: &mut usize) {
        let sig = |types: Vec<TensorType>| types.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        let _ = write!(
            out,
            "  \"func.func\"() <{{function_type = ({}) -> ({}), sym_name = \"{}\"{}}}> ({{\n  ^bb0(",
            sig(self.arg_types()),
            sig(self.result_types()),
            self.name,
            if self.public { "" } else { ", sym_visibility = \"private\"" }
        );
        let args: Vec<String> = self.args.iter().map(|a| format!("%v{}: {}", a.0, self.ty(*a))).collect();
        out.push_str(&args.join(", "));
        out.push_str("):\n");
        for op in &self.ops {
            out.push_str("    ");
            self.print_op(op, out, region_counter);
            out.push('\n');
        }
        let _ = writeln!(
            out,
            "    \"func.return\"({}) : ({}) -> ()\n  }}) : () -> ()",
            names(&self.results),
            sig(self.result_types())
        );
    }

    fn print_op(&self, op: &Op, out: &mut String, region_counter: &mut usize) {
        if !op.results.is_empty() {
            let _ = write!(out, "{} = ", names(&op.results));
        }
        let _ = write!(out, "\"{}\"({})", op.name, names(&op.operands));
        if !op.props.is_empty() {
            let _ = write!(out, " <{{{}}}>", dict(&op.props));
        }
        if let Some(regions) = &op.regions {
            *region_counter += 1;
            out.push(' ');
            out.push_str(&rename_region_values(regions, *region_counter));
        }
        if !op.attrs.is_empty() {
            let _ = write!(out, " {{{}}}", dict(&op.attrs));
        }
        let operand_types: Vec<String> = op.operands.iter().map(|o| self.ty(*o).to_string()).collect();
        let result_types: Vec<String> = op.results.iter().map(|o| self.ty(*o).to_string()).collect();
        let results =
            if result_types.len() == 1 { result_types[0].clone() } else { format!("({})", result_types.join(", ")) };
        let _ = write!(out, " : ({}) -> {}", operand_types.join(", "), results);
        if let Some(loc) = &op.loc {
            let _ = write!(out, " {loc}");
        }
    }
}

fn names(values: &[ValueId]) -> String {
    values.iter().map(|v| format!("%v{}", v.0)).collect::<Vec<_>>().join(", ")
}

fn dict(pairs: &[(String, String)]) -> String {
    pairs.iter().map(|(k, v)| if v == "unit" { k.clone() } else { format!("{k} = {v}") }).collect::<Vec<_>>().join(", ")
}

/// Prefixes every SSA name in region text so that regions never clash with
/// each other or with the enclosing function's `%vN` names.
fn rename_region_values(text: &str, region: usize) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len() + 64);
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                let mut j = i + 1;
                while j < bytes.len() && bytes[j] != b'"' {
                    j += if bytes[j] == b'\\' { 2 } else { 1 };
                }
                let end = (j + 1).min(bytes.len());
                out.push_str(&text[i..end]);
                i = end;
            }
            b'%' => {
                let _ = write!(out, "%r{region}_");
                i += 1;
            }
            _ => {
                let len = text[i..].chars().next().map_or(1, char::len_utf8);
                out.push_str(&text[i..i + len]);
                i += len;
            }
        }
    }
    out
}

/// A module: functions plus the `dialect_resources` blobs they reference.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Module {
    /// Functions, in order.
    pub functions: Vec<Function>,
    /// The trailing `{-# … #-}` resource section, verbatim.
    pub resources: Option<String>,
}

impl Module {
    /// The function named `name`.
    pub fn function(&self, name: &str) -> Option<&Function> {
        self.functions.iter().find(|f| f.name == name)
    }

    /// Generic-form MLIR text.
    pub fn to_mlir(&self) -> String {
        let mut out = String::from("\"builtin.module\"() ({\n");
        let mut regions = 0;
        for f in &self.functions {
            f.print(&mut out, &mut regions);
        }
        out.push_str("}) : () -> ()\n");
        if let Some(resources) = &self.resources {
            out.push_str(resources);
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renames_region_values_outside_strings() {
        let r = rename_region_values("({\n^bb0(%a: tensor<f32>):\n  \"x\"(%a) {s = \"%keep\"} : () -> ()\n})", 3);
        assert!(r.contains("%r3_a: tensor<f32>"));
        assert!(r.contains("\"x\"(%r3_a)"));
        assert!(r.contains("\"%keep\""));
    }

    #[test]
    fn human_locations() {
        assert_eq!(human_location("loc(\"m.mlir\":3:10)"), "m.mlir:3:10");
        assert_eq!(human_location("loc(\"jit(f)/add\"(\"/tmp/x.py\":7:2))"), "/tmp/x.py:7:2");
        assert_eq!(human_location("loc(unknown)"), "unknown");
    }

    #[test]
    fn dead_code_is_removed() {
        let t = TensorType::parse("tensor<f32>").expect("type");
        let mut f = Function::new("f", std::slice::from_ref(&t));
        let mut b = Builder::new(&mut f, None);
        let x = b.function().args[0];
        let used = b.neg(x);
        let _unused = b.add(x, x);
        f.results = vec![used];
        f.eliminate_dead_code();
        assert_eq!(f.ops.len(), 1);
        assert_eq!(f.ops[0].name, "stablehlo.negate");
    }
}
