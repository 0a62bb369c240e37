//! `pcp-node graph …` from the outside: outputs, exit codes and one-line errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn pcp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pcp-node")).args(args).output().expect("pcp-node runs")
}

fn shared(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/models").join(name).display().to_string()
}

fn assert_one_line_error(out: &Output, needle: &str) {
    assert_eq!(out.status.code(), Some(2), "exit code; stderr: {}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(lines[0].starts_with("error: ") && lines[0].contains(needle), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn inspect_prints_signature_histogram_and_rules() {
    let out = pcp(&["graph", "inspect", &shared("nanogpt_small.mlir")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("entry       @main("), "{stdout}");
    assert!(stdout.contains("parameters  22 tensors, 109377 elements"), "{stdout}");
    assert!(stdout.contains("data        2 inputs"), "{stdout}");
    assert!(stdout.contains("stablehlo.dot_general"), "{stdout}");
    assert!(stdout.contains("every op has a rule"), "{stdout}");
}

#[test]
fn grad_writes_a_module_with_entry_grad() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out_path = dir.path().join("g.mlir");
    let out = pcp(&["graph", "grad", &shared("nanogpt_small.mlir"), "-o", out_path.to_str().expect("utf8")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&out_path).expect("written");
    assert!(text.contains("sym_name = \"main_grad\""));
    // It reimports: the output is valid MLIR that pcp itself accepts.
    let module = pcp_graph::import_file(&out_path).expect("reimports");
    let grad = module.function("main_grad").expect("main_grad");
    assert_eq!(grad.results.len(), 23);
}

#[test]
fn step_builds_a_preset_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out_path = dir.path().join("step.mlir");
    let out = pcp(&["graph", "step", "nanogpt-small", "-o", out_path.to_str().expect("utf8")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let module = pcp_graph::import_file(&out_path).expect("reimports");
    let step = module.function("train_step").expect("train_step");
    let params = pcp_graph::models::nanogpt(&pcp_graph::NanoGptConfig::small()).expect("builds").params.len();
    // params, AdamW m and v, step, lr, two data inputs
    assert_eq!(step.args.len(), 3 * params + 4);
    assert!(module.function("eval_loss").is_some() && module.function("logits").is_some());
    // params, a delta as large, its scale, two data inputs
    assert_eq!(module.function("eval_moved").expect("eval_moved").args.len(), 2 * params + 3);
    let inspect = pcp(&["graph", "inspect", "nanogpt-medium"]);
    assert!(inspect.status.success(), "{}", String::from_utf8_lossy(&inspect.stderr));
    assert!(String::from_utf8_lossy(&inspect.stdout).contains("every op has a rule"));
}

#[test]
fn bad_inputs_exit_2_with_one_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let write = |name: &str, text: &str| -> String {
        let p = dir.path().join(name);
        std::fs::write(&p, text).expect("write");
        p.display().to_string()
    };
    let o = dir.path().join("o.mlir").display().to_string();

    let garbage = write("garbage.mlir", "this is not mlir {");
    assert_one_line_error(&pcp(&["graph", "grad", &garbage, "-o", &o]), "does not parse");

    let missing = dir.path().join("nope.mlir").display().to_string();
    assert_one_line_error(&pcp(&["graph", "inspect", &missing]), "cannot read");

    let ok = write(
        "ok.mlir",
        "func.func @main(%a: tensor<f32>) -> tensor<f32> {\n  %0 = stablehlo.multiply %a, %a : tensor<f32>\n  return %0 : tensor<f32>\n}",
    );
    assert_one_line_error(&pcp(&["graph", "grad", &ok, "--entry", "loss", "-o", &o]), "no function @loss");

    let vector =
        write("vec.mlir", "func.func @main(%a: tensor<3xf32>) -> tensor<3xf32> {\n  return %a : tensor<3xf32>\n}");
    assert_one_line_error(&pcp(&["graph", "grad", &vector, "-o", &o]), "one scalar floating-point loss");

    let dynamic =
        write("dyn.mlir", "func.func @main(%a: tensor<?xf32>) -> tensor<?xf32> {\n  return %a : tensor<?xf32>\n}");
    assert_one_line_error(&pcp(&["graph", "inspect", &dynamic]), "dynamic shape");
    assert!(!Path::new(&o).exists(), "no output written on failure");
}
