//! Mixed precision: the matmuls of a forward function in bf16.
//!
//! [`mixed_precision`] rewrites every `dot_general` (and `dot`) whose operands are
//! f32 so that it reads them converted to bf16 and still returns f32 (IREE
//! accumulates in the result's type). Everything else stays as it was: the
//! parameters, the elementwise ops, softmax and the loss are f32, and so are the
//! gradients autodiff derives for the parameters, since the gradient of a
//! `convert` converts back to its operand's type. Attention's two batched
//! matmuls are `dot_general`s like the linear layers', so they run in bf16 too.
//!
//! The transform runs on the forward loss before autodiff (see
//! [`crate::train_step`]), so it applies to built-in and imported models alike.

use std::fmt;
use std::str::FromStr;

use crate::ir::{Builder, ElementType, FloatType, Function, Op, ValueId};

/// The precision of a training step's matmuls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// Matmul operands in bf16, accumulated in f32; the rest in f32.
    Bf16,
}

impl Precision {
    /// The name `parse` takes and manifests record.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A precision name other than `f32` or `bf16`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown precision {0:?}; expected f32 or bf16")]
pub struct UnknownPrecision(pub String);

impl FromStr for Precision {
    type Err = UnknownPrecision;

    /// `f32` or `bf16`; the empty string (a manifest from before the field) is `f32`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" | "" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            other => Err(UnknownPrecision(other.to_owned())),
        }
    }
}

/// Rewrites `f`'s f32 matmuls for `precision`; returns how many it changed.
pub fn mixed_precision(f: &mut Function, precision: Precision) -> usize {
    if precision == Precision::F32 {
        return 0;
    }
    let bf16 = ElementType::Float(FloatType::Bf16);
    let f32 = ElementType::Float(FloatType::F32);
    let ops = std::mem::take(&mut f.ops);
    let mut changed = 0;
    for mut op in ops {
        if is_f32_matmul(f, &op, &f32) {
            let mut b = Builder::new(f, op.loc.clone());
            let converted: Vec<ValueId> = op.operands.iter().map(|v| b.convert(*v, &bf16)).collect();
            op.operands = converted;
            changed += 1;
        }
        f.ops.push(op);
    }
    changed + crate::attention::use_bf16(f)
}

fn is_f32_matmul(f: &Function, op: &Op, f32: &ElementType) -> bool {
    matches!(op.name.as_str(), "stablehlo.dot_general" | "stablehlo.dot")
        && op.operands.len() == 2
        && op.results.len() == 1
        && f.ty(op.results[0]).element == *f32
        && op.operands.iter().all(|v| f.ty(*v).element == *f32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::TensorType;

    fn f32_matrix(rows: i64, cols: i64) -> TensorType {
        TensorType::new(vec![rows, cols], ElementType::Float(FloatType::F32))
    }

    #[test]
    fn names_parse_and_old_manifests_read_as_f32() {
        assert_eq!("bf16".parse::<Precision>(), Ok(Precision::Bf16));
        assert_eq!("f32".parse::<Precision>(), Ok(Precision::F32));
        assert_eq!("".parse::<Precision>(), Ok(Precision::F32));
        let err = "fp8".parse::<Precision>().expect_err("unknown").to_string();
        assert!(err.contains("fp8") && err.contains("bf16"), "{err}");
        assert_eq!(Precision::Bf16.to_string(), "bf16");
    }

    #[test]
    fn matmul_operands_become_bf16_and_the_result_stays_f32() {
        let mut f = Function::new("main", &[f32_matrix(4, 8), f32_matrix(8, 3)]);
        let (x, w) = (f.args[0], f.args[1]);
        let mut b = Builder::new(&mut f, None);
        let y = b.dot_general(x, w, &[], &[], &[1], &[0], ElementType::Float(FloatType::F32));
        let s = b.add(y, y);
        f.results = vec![s];
        assert_eq!(mixed_precision(&mut f.clone(), Precision::F32), 0);
        assert_eq!(mixed_precision(&mut f, Precision::Bf16), 1);
        let names: Vec<&str> = f.ops.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["stablehlo.convert", "stablehlo.convert", "stablehlo.dot_general", "stablehlo.add"]);
        let dot = &f.ops[2];
        for v in &dot.operands {
            assert_eq!(f.ty(*v).element, ElementType::Float(FloatType::Bf16));
        }
        assert_eq!(f.ty(dot.results[0]).element, ElementType::Float(FloatType::F32));
        // a second pass finds nothing left to convert
        assert_eq!(mixed_precision(&mut f, Precision::Bf16), 0);
    }

    /// nanogpt's step in bf16: every matmul reads bf16, the step's results (parameters,
    /// AdamW state, loss) are f32, and SPIR-V's emulation leaves no bf16 value.
    #[test]
    fn a_bf16_step_keeps_parameters_state_and_loss_in_f32() -> anyhow::Result<()> {
        let built = crate::nanogpt(&crate::NanoGptConfig::small())?;
        let config = crate::StepConfig { precision: Precision::Bf16, ..Default::default() };
        let step = crate::train_step(&built.module, "main", &config)?;
        let f32 = ElementType::Float(FloatType::F32);
        let bf16 = ElementType::Float(FloatType::Bf16);
        for f in &step.module.functions {
            assert!(f.result_types().iter().all(|t| t.element == f32), "@{}", f.name);
        }
        let train = step.module.function("train_step").expect("train_step");
        let dots: Vec<&Op> = train.ops.iter().filter(|o| o.name == "stablehlo.dot_general").collect();
        assert!(!dots.is_empty());
        for dot in dots {
            assert!(dot.operands.iter().all(|v| train.ty(*v).element == bf16), "{dot:?}");
        }
        let mut spirv = train.clone();
        assert!(crate::iree::legalize_for_spirv(&mut spirv, None)?);
        let ops = &spirv.ops;
        assert!(ops.iter().flat_map(|o| o.results.iter()).all(|r| spirv.ty(*r).element != bf16));
        assert!(ops.iter().any(|o| o.name == "stablehlo.shift_right_logical"));
        Ok(())
    }
}
