//! `tools/export_model.py` end to end: a tiny GPT written in PyTorch and one
//! written in JAX are exported to StableHLO, imported by `pcp-node graph
//! inspect`, and trained 20 steps by `pcp-node train`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

#[path = "support/common.rs"]
mod common;
use common::corpus;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn ok(what: &str, out: &Output) {
    assert!(
        out.status.success(),
        "{what} failed\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn pcp(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_pcp-node")).args(args).output().expect("pcp-node runs");
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"), "{}", String::from_utf8_lossy(&out.stderr));
    ok(&format!("pcp-node {}", args.join(" ")), &out);
    out
}

/// Runs `tools/export_model.py` on `tools/examples/<example>.py`'s `TinyGPT`.
fn export(framework: &str, example: &str, out: &Path) {
    let python = root().join(".venv/bin/python");
    assert!(python.exists(), "no {}; run scripts/setup.sh", python.display());
    let result = Command::new(&python)
        .current_dir(root())
        .args(["tools/export_model.py", "--framework", framework, "--model-file"])
        .arg(format!("tools/examples/{example}.py"))
        .args(["--class-name", "TinyGPT", "--batch-size", "8", "--block-size", "32", "-o"])
        .arg(out)
        .output()
        .expect("python runs");
    ok(
        &format!("export_model.py --framework {framework} (scripts/setup.sh installs torch, torch-mlir and jax)"),
        &result,
    );
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(!stderr.contains("warning"), "pcp's initialisation should match the example's: {stderr}");
}

/// Exports `example`, checks pcp imports it with `token` data inputs, trains
/// it 20 steps and checks the loss starts near ln(65) and falls.
fn exports_and_trains(framework: &str, example: &str, token: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join(format!("{example}.mlir"));
    export(framework, example, &model);
    let model = model.to_str().expect("utf8");
    let text = std::fs::read_to_string(model).expect("exported module");
    assert!(text.starts_with("// Exported by pcp's tools/export_model.py"), "{}", &text[..200.min(text.len())]);

    let inspect = String::from_utf8_lossy(&pcp(&["graph", "inspect", model]).stdout).into_owned();
    assert!(inspect.contains("every op has a rule"), "{inspect}");
    assert!(inspect.contains(&format!("tensor<8x32x{token}>")), "data inputs should be {token}: {inspect}");

    // A short warmup and a high peak rate, so that 20 steps show learning.
    let config = dir.path().join("experiment.json");
    std::fs::write(&config, r#"{"learning_rate": 0.01, "warmup_steps": 2}"#).expect("config");
    let events = dir.path().join("events.jsonl");
    let data_dir = dir.path().join("pcp");
    pcp(&[
        "train",
        "--config",
        config.to_str().expect("utf8"),
        "--model",
        model,
        "--data",
        &corpus(),
        "--steps",
        "20",
        "--events",
        events.to_str().expect("utf8"),
        "--data-dir",
        data_dir.to_str().expect("utf8"),
    ]);
    let losses: Vec<f64> = std::fs::read_to_string(&events)
        .expect("events")
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("json line"))
        .filter(|e| e["event"] == "step")
        .map(|e| e["loss"].as_f64().expect("loss"))
        .collect();
    assert_eq!(losses.len(), 20, "{losses:?}");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    // pcp initialises the parameters (embeddings N(0, 0.02)): near-uniform predictions over the 65 characters
    assert!((losses[0] - 65f64.ln()).abs() < 0.3, "initial loss {} should be near ln(65): {losses:?}", losses[0]);
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let (first, last) = (mean(&losses[..5]), mean(&losses[15..]));
    assert!(last < first - 0.3, "loss should fall: first five {first:.3}, last five {last:.3}: {losses:?}");
}

#[test]
fn torch_model_exports_and_trains() {
    exports_and_trains("torch", "tiny_torch", "i64");
}

#[test]
fn jax_model_exports_and_trains() {
    exports_and_trains("jax", "tiny_jax", "i32");
}
