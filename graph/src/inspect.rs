//! A summary of a loss module, for `pcp-node graph inspect`.

use std::collections::BTreeMap;
use std::fmt;

use crate::autodiff::{GradError, Signature, activity, has_rule, inline_calls, signature};
use crate::ir::{Module, TensorType};

/// What `graph inspect` prints.
#[derive(Clone, Debug)]
pub struct Report {
    /// The entry function.
    pub entry: String,
    /// Argument types, in order.
    pub args: Vec<TensorType>,
    /// Parameters, data and loss.
    pub signature: Signature,
    /// Op counts by name, after inlining calls.
    pub histogram: BTreeMap<String, usize>,
    /// Ops without a gradient rule: (name, location, on the gradient path).
    pub missing_rules: Vec<(String, String, bool)>,
}

/// Inspects `entry` of `module`.
pub fn inspect(module: &Module, entry: &str) -> Result<Report, GradError> {
    let f = inline_calls(module, entry)?;
    let signature = signature(&f)?;
    let wrt: Vec<_> = signature.params.iter().map(|(i, _)| f.args[*i]).collect();
    let active = activity(&f, f.results[0], &wrt);
    let missing_rules = f
        .ops
        .iter()
        .filter(|op| !has_rule(&op.name))
        .map(|op| (op.name.clone(), op.location(), op.operands.iter().any(|o| active[o.0 as usize])))
        .collect();
    let histogram = f.histogram().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    Ok(Report { entry: entry.to_owned(), args: f.arg_types(), signature, histogram, missing_rules })
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let args: Vec<String> = self.args.iter().map(ToString::to_string).collect();
        writeln!(f, "entry       @{}({}) -> {}", self.entry, args.join(", "), self.signature.loss)?;
        let bytes: usize = self
            .signature
            .params
            .iter()
            .map(|(_, t)| t.elements() as usize * t.element.float().map_or(0, |e| e.bytes()))
            .sum();
        writeln!(
            f,
            "parameters  {} tensors, {} elements ({:.1} KiB)",
            self.signature.params.len(),
            self.signature.parameter_count(),
            bytes as f64 / 1024.0
        )?;
        for (i, t) in &self.signature.params {
            writeln!(f, "  %arg{i:<4} {t}")?;
        }
        writeln!(f, "data        {} inputs", self.signature.data.len())?;
        for (i, t) in &self.signature.data {
            writeln!(f, "  %arg{i:<4} {t}")?;
        }
        let total: usize = self.histogram.values().sum();
        writeln!(f, "ops         {total}")?;
        let mut by_count: Vec<_> = self.histogram.iter().collect();
        by_count.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        for (name, count) in by_count {
            writeln!(f, "  {name:<34} {count:>5}")?;
        }
        if self.missing_rules.is_empty() {
            writeln!(f, "gradient    every op has a rule")
        } else {
            writeln!(f, "without a gradient rule:")?;
            for (name, loc, on_path) in &self.missing_rules {
                let path = if *on_path { " (on the gradient path)" } else { "" };
                writeln!(f, "  {name} at {loc}{path}")?;
            }
            Ok(())
        }
    }
}
