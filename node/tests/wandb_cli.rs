//! Weights & Biases: `pcp-node sim` and `train` report through
//! `tools/wandb_bridge.py` when a key is set (here in `WANDB_MODE=offline`,
//! read back with the bridge's `--dump`), and start nothing without one.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

#[path = "support/common.rs"]
mod common;
use common::corpus;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `pcp-node` with the shared artifact cache, wandb's directories under `dir`
/// and no wandb settings of the environment.
fn pcp_node(dir: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pcp-node"));
    cmd.env("PCP_ARTIFACT_CACHE", std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts"));
    for var in ["WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_NAME", "WANDB_DISABLED", "PCP_PYTHON"] {
        cmd.env_remove(var);
    }
    cmd.env_remove("PCP_WANDB_BRIDGE");
    cmd.env("WANDB_MODE", "offline").env("WANDB_DIR", dir.join("wb"));
    for (var, sub) in [("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")] {
        cmd.env(var, dir.join(sub));
    }
    std::fs::create_dir_all(dir.join("wb")).expect("wandb dir");
    cmd
}

fn ok(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "stdout: {}\nstderr: {stderr}", String::from_utf8_lossy(&out.stdout));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("wandb"), "wandb's lines go to stderr");
    stderr
}

fn events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).expect("events").lines().map(|l| serde_json::from_str(l).expect("json")).collect()
}

/// The one offline run under `dir/wb`, as the bridge's `--dump` reads it.
fn offline_run(dir: &Path) -> Value {
    let runs: Vec<PathBuf> = std::fs::read_dir(dir.join("wb/wandb"))
        .expect("WANDB_DIR/wandb exists")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("offline-run-")))
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let file = std::fs::read_dir(&runs[0])
        .expect("run dir")
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "wandb"))
        .expect("a .wandb file in the run");
    let out = Command::new(repo().join(".venv/bin/python"))
        .arg(repo().join("tools/wandb_bridge.py"))
        .arg("--dump")
        .arg(&file)
        .output()
        .expect("python runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("the dump is JSON")
}

fn f64_of(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{v} is not a number"))
}

#[test]
fn a_sim_with_a_key_logs_its_rounds_to_an_offline_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ev = dir.path().join("events.jsonl");
    let out = pcp_node(dir.path())
        .env("WANDB_API_KEY", "dummy-key")
        // lockstep rounds: an overlapped round of this model is time-boxed to about a
        // second, and on a loaded machine a late contribution is carried to the next
        .args(["sim", "--nodes", "3", "--rounds", "2", "--tau", "5", "--no-overlap", "--data", &corpus()])
        .args(["--events", ev.to_str().expect("utf8"), "--data-dir", dir.path().to_str().expect("utf8")])
        .output()
        .expect("runs");
    let stderr = ok(&out);
    assert!(!stderr.lines().any(|l| l.contains("WARN") && l.contains("wandb")), "{stderr}");
    let events = events(&ev);
    let rounds: Vec<&Value> = events.iter().filter(|e| e["event"] == "round_completed").collect();
    assert_eq!(rounds.len(), 2);

    let run = offline_run(dir.path());
    assert_eq!(run["project"], "pcp-distributed", "PCP's default project");
    assert_eq!(run["job_type"], "sim");
    assert_eq!((&run["config"]["tau"], &run["config"]["outer_loop_steps"]), (&5.into(), &2.into()));
    let logged: Vec<&Value> =
        run["history"].as_array().expect("history").iter().filter(|h| h["round"].is_u64()).collect();
    assert_eq!(logged.len(), 2, "{logged:?}");
    for (h, e) in logged.iter().zip(&rounds) {
        assert_eq!(h["round"], e["round"]);
        assert_eq!(h["round_contributors"], 2);
        assert_eq!(f64_of(&h["val_loss"]), f64_of(&e["val_loss"]), "the event's value, unchanged");
        assert_eq!(f64_of(&h["round_mean_loss"]), f64_of(&e["mean_loss"]));
        assert_eq!(h["round_bytes_in"], e["bytes_in"]);
        assert!(f64_of(&h["round_seconds"]) > 0.0);
    }
    let summary = &run["summary"];
    assert_eq!(summary["round"], 2);
    let last_val = f64_of(&rounds[1]["val_loss"]);
    assert!(last_val.is_finite() && last_val > 0.0);
    assert_eq!(f64_of(&summary["val_loss"]), last_val);
    let finished = events.iter().find(|e| e["event"] == "run_finished" && e.get("val_loss").is_some()).expect("end");
    assert_eq!(f64_of(&summary["final_val_loss"]), f64_of(&finished["val_loss"]));
    assert_eq!(summary["rounds_completed"], 2);
    assert_eq!(summary["workers"], 2, "worker_joined events counted");
}

#[test]
fn train_reports_under_the_experiment_files_names_and_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ev = dir.path().join("events.jsonl");
    let config = dir.path().join("experiment.json");
    std::fs::write(
        &config,
        r#"{"wandb_project": "pcp-test", "wandb_run_name": "tiny-train", "wandb_entity": null,
            "wandb_api_key": "secret-key-123", "eval_interval": 4, "eval_batches": 2}"#,
    )
    .expect("config");
    let out = pcp_node(dir.path())
        .args(["train", "--config", config.to_str().expect("utf8"), "--steps", "8", "--data", &corpus()])
        .args(["--events", ev.to_str().expect("utf8"), "--data-dir", dir.path().to_str().expect("utf8")])
        .output()
        .expect("runs");
    ok(&out);
    let events = events(&ev);
    let run = offline_run(dir.path());
    assert_eq!(
        (&run["project"], &run["name"], &run["job_type"]),
        (&"pcp-test".into(), &"tiny-train".into(), &"train".into())
    );
    assert_eq!(run["config"]["steps"], 8);
    let history = run["history"].as_array().expect("history");
    let steps: Vec<&Value> = history.iter().filter(|h| h.get("train_loss").is_some()).collect();
    assert_eq!(steps.len(), 8);
    let last = events.iter().rfind(|e| e["event"] == "step").expect("steps");
    assert_eq!(steps[7]["step"], 8);
    assert_eq!(f64_of(&steps[7]["train_loss"]), f64_of(&last["loss"]));
    assert_eq!(f64_of(&steps[7]["lr"]), f64_of(&last["lr"]));
    assert!(f64_of(&steps[7]["tokens_per_second"]) > 0.0);
    let evals: Vec<&Value> = history.iter().filter(|h| h.get("val_loss").is_some()).collect();
    let logged_evals: Vec<&Value> = events.iter().filter(|e| e["event"] == "eval").collect();
    assert_eq!(evals.len(), 2);
    for (h, e) in evals.iter().zip(&logged_evals) {
        assert_eq!((&h["step"], f64_of(&h["val_loss"])), (&e["step"], f64_of(&e["val_loss"])));
    }
    assert_eq!(f64_of(&run["summary"]["train_loss"]), f64_of(&last["loss"]));
    // the key reaches wandb in the bridge's environment only: not in the run's config or files
    assert!(!run.to_string().contains("secret-key-123"));
    for entry in walk(&dir.path().join("wb")) {
        let bytes = std::fs::read(&entry).unwrap_or_default();
        assert!(!bytes.windows(14).any(|w| w == b"secret-key-123"), "the key is in {}", entry.display());
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() { files.extend(walk(&path)) } else { files.push(path) }
    }
    files
}

/// A stand-in for python that records how it was started, then exits 3.
fn fake_python(dir: &Path) -> PathBuf {
    let path = dir.join("fake-python");
    let script = format!(
        "#!/bin/sh\nprintf '%s\\n' \"$@\" > '{0}/args'\nprintf '%s' \"$WANDB_API_KEY\" > '{0}/key'\nexit 3\n",
        dir.display()
    );
    std::fs::write(&path, script).expect("write");
    let mut perms = std::fs::metadata(&path).expect("meta").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&path, perms).expect("chmod");
    path
}

#[test]
fn without_a_key_nothing_starts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let python = fake_python(dir.path());
    let ev = dir.path().join("events.jsonl");
    let out = pcp_node(dir.path())
        .env("PCP_PYTHON", &python)
        .args(["sim", "--nodes", "2", "--rounds", "1", "--tau", "2", "--data", &corpus()])
        .args(["--events", ev.to_str().expect("utf8"), "--data-dir", dir.path().to_str().expect("utf8")])
        .output()
        .expect("runs");
    let stderr = ok(&out);
    assert!(!stderr.to_lowercase().contains("wandb"), "{stderr}");
    assert!(!dir.path().join("args").exists(), "no bridge was started");
    assert_eq!(std::fs::read_dir(dir.path().join("wb")).expect("wb").count(), 0, "WANDB_DIR stays empty");
    assert_eq!(events(&ev).iter().filter(|e| e["event"] == "round_completed").count(), 1);

    let out = pcp_node(dir.path())
        .env("PCP_PYTHON", &python)
        .env("WANDB_API_KEY", "dummy-key")
        .env("WANDB_MODE", "disabled")
        .args(["sim", "--nodes", "2", "--rounds", "1", "--tau", "2", "--data", &corpus()])
        .args(["--data-dir", dir.path().to_str().expect("utf8")])
        .output()
        .expect("runs");
    ok(&out);
    assert!(!dir.path().join("args").exists(), "WANDB_MODE=disabled starts no bridge");
}

#[test]
fn a_bridge_that_dies_costs_one_warning_and_training_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let python = fake_python(dir.path());
    let ev = dir.path().join("events.jsonl");
    let config = dir.path().join("experiment.json");
    std::fs::write(&config, r#"{"wandb_api_key": "secret-key-456", "wandb_project": "p"}"#).expect("config");
    let out = pcp_node(dir.path())
        .env("PCP_PYTHON", &python)
        .args(["train", "--config", config.to_str().expect("utf8"), "--steps", "3", "--data", &corpus()])
        .args(["--events", ev.to_str().expect("utf8"), "--data-dir", dir.path().to_str().expect("utf8")])
        .output()
        .expect("runs");
    let stderr = ok(&out);
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("wandb")).collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(warnings[0].contains("WARN") && warnings[0].contains("bridge"), "{stderr}");
    assert_eq!(events(&ev).iter().filter(|e| e["event"] == "step").count(), 3, "training went on");
    let args = std::fs::read_to_string(dir.path().join("args")).expect("the bridge was started");
    assert!(args.contains("--project\np\n") && args.contains("--job-type\ntrain\n"), "{args}");
    assert!(!args.contains("secret-key-456"), "the key is not on the command line");
    assert_eq!(std::fs::read_to_string(dir.path().join("key")).expect("key"), "secret-key-456");
}
