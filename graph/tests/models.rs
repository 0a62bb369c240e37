//! PCP's exported models import and differentiate; bad modules fail with
//! errors that name the problem.

use std::path::PathBuf;

use pcp_graph::{GradError, differentiate, import_file, import_str};

fn shared_model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/models").join(name)
}

#[test]
fn nanogpt_models_import_and_differentiate() {
    for (name, params) in [("nanogpt_small.mlir", 22), ("nanogpt_medium.mlir", 38)] {
        let module = import_file(&shared_model(name)).expect("imports");
        let gradient = differentiate(&module, "main").expect("differentiates");
        assert_eq!(gradient.signature.params.len(), params, "{name}");
        assert_eq!(gradient.signature.data.len(), 2, "{name}");
        let grad = gradient.module.function("main_grad").expect("main_grad");
        assert_eq!(grad.args.len(), params + 2);
        assert_eq!(grad.results.len(), params + 1);
        for (k, (i, t)) in gradient.signature.params.iter().enumerate() {
            assert_eq!(grad.ty(grad.results[k + 1]), t, "gradient of %arg{i} has the parameter's type");
        }
        assert!(
            gradient.gradient_ops <= 3 * gradient.forward_ops,
            "{name}: {} gradient ops for {} forward ops",
            gradient.gradient_ops,
            gradient.forward_ops
        );
        pcp_graph::import::verify(name, &gradient.module).expect("output verifies with melior");
    }
}

fn module(body: &str, signature: &str) -> String {
    format!("func.func @main({signature}) {{\n{body}\n}}")
}

#[test]
fn missing_entry_is_named() {
    let text = module(
        "  %0 = stablehlo.add %arg0, %arg0 : tensor<f32>\n  return %0 : tensor<f32>",
        "%arg0: tensor<f32>) -> (tensor<f32>",
    );
    let m = import_str("m.mlir", &text).expect("imports");
    let err = differentiate(&m, "loss").expect_err("no such entry");
    assert!(matches!(err, GradError::MissingEntry { .. }));
    assert!(err.to_string().contains("@loss") && err.to_string().contains("@main"), "{err}");
}

#[test]
fn non_scalar_loss_is_refused() {
    let text = module(
        "  %0 = stablehlo.add %arg0, %arg0 : tensor<3xf32>\n  return %0 : tensor<3xf32>",
        "%arg0: tensor<3xf32>) -> (tensor<3xf32>",
    );
    let m = import_str("m.mlir", &text).expect("imports");
    let err = differentiate(&m, "main").expect_err("vector loss");
    assert!(err.to_string().contains("one scalar floating-point loss"), "{err}");
}

#[test]
fn op_without_rule_on_gradient_path_is_an_error_with_location() {
    let body = "  %0 = stablehlo.custom_call @mystery(%arg0) : (tensor<3xf32>) -> tensor<3xf32>\n  %c = stablehlo.constant dense<0.0> : tensor<f32>\n  %1 = stablehlo.reduce(%0 init: %c) applies stablehlo.add across dimensions = [0] : (tensor<3xf32>, tensor<f32>) -> tensor<f32>\n  return %1 : tensor<f32>";
    let text = module(body, "%arg0: tensor<3xf32>) -> (tensor<f32>");
    let m = import_str("m.mlir", &text).expect("imports");
    let err = differentiate(&m, "main").expect_err("no rule");
    let msg = err.to_string();
    assert!(msg.contains("stablehlo.custom_call") && msg.contains(":2:"), "{msg}");
}

#[test]
fn op_without_rule_off_the_gradient_path_is_fine() {
    let body = "  %i = stablehlo.custom_call @mystery(%arg1) : (tensor<3xi32>) -> tensor<3xi32>\n  %f = stablehlo.convert %i : (tensor<3xi32>) -> tensor<3xf32>\n  %0 = stablehlo.multiply %arg0, %f : tensor<3xf32>\n  %c = stablehlo.constant dense<0.0> : tensor<f32>\n  %1 = stablehlo.reduce(%0 init: %c) applies stablehlo.add across dimensions = [0] : (tensor<3xf32>, tensor<f32>) -> tensor<f32>\n  return %1 : tensor<f32>";
    let text = module(body, "%arg0: tensor<3xf32>, %arg1: tensor<3xi32>) -> (tensor<f32>");
    let m = import_str("m.mlir", &text).expect("imports");
    let gradient = differentiate(&m, "main").expect("differentiates");
    assert_eq!(gradient.signature.params.len(), 1);
    let report = pcp_graph::inspect::inspect(&m, "main").expect("inspects");
    assert_eq!(report.missing_rules.len(), 1);
    assert!(!report.missing_rules[0].2, "custom_call is off the gradient path");
}

#[test]
fn unparsable_input_is_one_line() {
    let err =
        import_str("broken.mlir", "func.func @main(%arg0: tensor<f32>) -> tensor<f32> {\n  %0 = stablehlo.bogus(\n}")
            .expect_err("parse error");
    let msg = err.to_string();
    assert!(msg.starts_with("broken.mlir does not parse"), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
}

#[test]
fn dynamic_shapes_are_refused() {
    let text = module("  return %arg0 : tensor<?xf32>", "%arg0: tensor<?xf32>) -> (tensor<?xf32>");
    let err = import_str("dyn.mlir", &text).expect_err("dynamic");
    assert!(err.to_string().contains("dynamic shape"), "{err}");
}

#[test]
fn private_helpers_are_inlined() {
    let text = "func.func @main(%arg0: tensor<3xf32>) -> tensor<f32> {\n  %0 = call @sq(%arg0) : (tensor<3xf32>) -> tensor<3xf32>\n  %c = stablehlo.constant dense<0.0> : tensor<f32>\n  %1 = stablehlo.reduce(%0 init: %c) applies stablehlo.add across dimensions = [0] : (tensor<3xf32>, tensor<f32>) -> tensor<f32>\n  return %1 : tensor<f32>\n}\nfunc.func private @sq(%x: tensor<3xf32>) -> tensor<3xf32> {\n  %0 = stablehlo.multiply %x, %x : tensor<3xf32>\n  return %0 : tensor<3xf32>\n}";
    let m = import_str("calls.mlir", text).expect("imports");
    let gradient = differentiate(&m, "main").expect("differentiates");
    let grad = gradient.module.function("main_grad").expect("grad");
    assert!(grad.ops.iter().all(|op| op.name != "func.call"));
    assert_eq!(
        grad.ops.iter().filter(|op| op.name == "stablehlo.multiply").count(),
        3,
        "x*x forward, g*x twice backward"
    );
}
