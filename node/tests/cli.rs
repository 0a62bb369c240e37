//! Multi-process tests: the built `pcp-node` binary on loopback.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_pcp-node");

/// A node process, killed (by its own pid) when dropped.
struct Proc {
    child: Child,
    events: PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(dir: &Path, name: &str, bootstrap: &[String]) -> anyhow::Result<Proc> {
    let data = dir.join(name);
    let events = dir.join(format!("{name}.jsonl"));
    let mut cmd = Command::new(BIN);
    cmd.arg("--data-dir").arg(&data).arg("--events").arg(&events).args([
        "--listen",
        "/ip4/127.0.0.1/udp/0/quic-v1",
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
    ]);
    for b in bootstrap {
        cmd.args(["--bootstrap", b]);
    }
    let child =
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().context("spawning pcp-node")?;
    Ok(Proc { child, events })
}

fn read_events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

fn field<'a>(e: &'a Value, k: &str) -> &'a str {
    e.get(k).and_then(Value::as_str).unwrap_or_default()
}

/// Waits for a node's listen addresses; returns (peer id, QUIC address with /p2p).
fn listening(p: &Proc) -> anyhow::Result<(String, String)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        for e in read_events(&p.events) {
            assert!(e.get("t").and_then(Value::as_f64).is_some(), "event without t: {e}");
            if field(&e, "event") == "listening" && field(&e, "addr").contains("quic") {
                let peer = field(&e, "peer").to_string();
                return Ok((peer.clone(), format!("{}/p2p/{peer}", field(&e, "addr"))));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("{} never reported a listen address", p.events.display())
}

#[test]
fn seed_and_five_processes_discover_each_other() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let seed = spawn(dir.path(), "seed", &[])?;
    let (seed_peer, seed_addr) = listening(&seed)?;
    let mut procs = vec![seed];
    let mut peers = vec![seed_peer];
    for i in 0..5 {
        let p = spawn(dir.path(), &format!("n{i}"), std::slice::from_ref(&seed_addr))?;
        peers.push(listening(&p)?.0);
        procs.push(p);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut missing = HashMap::new();
        for (p, me) in procs.iter().zip(&peers) {
            let found: HashSet<String> = read_events(&p.events)
                .iter()
                .filter(|e| field(e, "event") == "peer_discovered")
                .map(|e| field(e, "peer").to_string())
                .collect();
            let lacking = peers.iter().filter(|q| *q != me && !found.contains(*q)).count();
            if lacking > 0 {
                missing.insert(me.clone(), lacking);
            }
        }
        if missing.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            bail!("routing tables incomplete after 30 s: {missing:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // every process also logged its connections
    for p in &procs {
        assert!(read_events(&p.events).iter().any(|e| field(e, "event") == "peer_connected"));
    }
    Ok(())
}

fn run(args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(BIN).args(args).stdin(Stdio::null()).output()?)
}

#[test]
fn blob_put_then_get_from_another_process() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("input.bin");
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    std::fs::write(&file, &data)?;
    let a_dir = dir.path().join("a");
    let out =
        run(&["blob", "put", file.to_str().unwrap_or_default(), "--data-dir", a_dir.to_str().unwrap_or_default()])?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let hash = String::from_utf8(out.stdout)?.trim().to_string();
    assert_eq!(hash, blake3::hash(&data).to_hex().as_str());

    let seed = spawn(dir.path(), "seed", &[])?;
    let (_, seed_addr) = listening(&seed)?;
    // node A serves its store
    let a = spawn(dir.path(), "a", std::slice::from_ref(&seed_addr))?;
    listening(&a)?;
    let output = dir.path().join("out.bin");
    let events = dir.path().join("get.jsonl");
    let out = run(&[
        "blob",
        "get",
        &hash,
        "-o",
        output.to_str().unwrap_or_default(),
        "--bootstrap",
        &seed_addr,
        "--data-dir",
        dir.path().join("c").to_str().unwrap_or_default(),
        "--events",
        events.to_str().unwrap_or_default(),
        "--listen",
        "/ip4/127.0.0.1/udp/0/quic-v1",
        "--timeout",
        "60",
    ])?;
    assert!(out.status.success(), "blob get failed: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(&output)?, data);
    let fetched: Vec<Value> =
        read_events(&events).into_iter().filter(|e| field(e, "event") == "blob_fetched").collect();
    assert_eq!(fetched.len(), 1);
    assert_eq!(field(&fetched[0], "hash"), hash);
    assert_eq!(fetched[0].get("bytes").and_then(Value::as_u64), Some(3_000_000));
    assert_eq!(fetched[0].get("providers").and_then(Value::as_u64), Some(1));
    Ok(())
}

fn assert_usage_error(args: &[&str], needle: &str) -> anyhow::Result<()> {
    let out = run(args)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(stderr.contains(needle), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    Ok(())
}

#[test]
fn bad_input_gets_a_one_line_error_and_exit_code_2() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path().to_str().unwrap_or_default();
    assert_usage_error(&["--bootstrap", "not-a-multiaddr", "--data-dir", d], "not-a-multiaddr")?;
    assert_usage_error(&["blob", "get", "zz", "-o", "x", "--data-dir", d], "zz")?;
    assert_usage_error(&["blob", "put", "/nonexistent/file", "--data-dir", d], "/nonexistent/file")?;
    let hash = "00".repeat(32);
    assert_usage_error(&["blob", "get", &hash, "-o", "x", "--data-dir", d], "no --bootstrap")?;
    // worker and shepherd roles
    assert_usage_error(&["--backend", "rocm", "--data-dir", d], "backend rocm: ")?;
    assert_usage_error(&["--backend", "tpu", "--data-dir", d], "unknown backend `tpu`")?;
    assert_usage_error(&["--run", "zz", "--data-dir", d], "--run \"zz\"")?;
    assert_usage_error(&["--shepherd", "--resume", "--data-dir", d], "--resume: no checkpoint in")?;
    assert_usage_error(&["--shepherd", "--encoding", "fp8", "--data-dir", d], "unknown --encoding \"fp8\"")?;
    assert_usage_error(&["--shepherd", "--model", "/nonexistent.mlir", "--data-dir", d], "/nonexistent.mlir")?;
    let own = "the shepherd's own engine (--backend, --target): backend rocm: ";
    assert_usage_error(&["--shepherd", "--backend", "rocm", "--data-dir", d], own)?;
    let sim = "the shepherd's engine (--shepherd-backend): backend rocm: ";
    assert_usage_error(&["sim", "--shepherd-backend", "rocm", "--data-dir", d], sim)?;
    Ok(())
}

/// `bench blob` runs its rounds and reports medians for raw TCP and the chosen transport
/// (a smoke test of the command; speed is measured by hand, not asserted).
#[test]
fn bench_blob_reports_medians_of_its_rounds() -> anyhow::Result<()> {
    let out = Command::new(BIN)
        .args(["bench", "blob", "--size-mb", "3", "--repeat", "2", "--transport", "tcp"])
        .stdin(Stdio::null())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench blob failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("median of 2 rounds"), "{stdout}");
    let fetch = stdout.lines().find(|l| l.contains("TCP+TLS+yamux")).context("no TCP+TLS row")?;
    assert!(fetch.contains("% of raw TCP"), "{fetch}");
    assert!(!stdout.contains("QUIC") && !stdout.contains("noise"), "only the chosen transport runs: {stdout}");
    let bad = Command::new(BIN).args(["bench", "blob", "--repeat", "0"]).output()?;
    assert_eq!(bad.status.code(), Some(2), "--repeat 0 is refused by the parser");
    Ok(())
}

/// `bench screen` times a screen's host work and forward passes, a top-k sparse
/// contribution uploaded as its entries and the same made dense; an encoding
/// that is not sparse is uploaded dense alone.
#[test]
fn bench_screen_times_the_upload_of_a_contribution_sparse_and_dense() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path().to_str().unwrap_or_default();
    let cache = std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts");
    let run = |encoding: &str| -> anyhow::Result<String> {
        let out = Command::new(BIN)
            .env("PCP_ARTIFACT_CACHE", &cache)
            .args(["bench", "screen", "--screens", "1", "--encoding", encoding, "--data-dir", d])
            .stdin(Stdio::null())
            .output()?;
        anyhow::ensure!(out.status.success(), "bench screen failed: {}", String::from_utf8_lossy(&out.stderr));
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let rows = |stdout: &str| -> Vec<String> {
        stdout.lines().filter_map(|l| l.split("  ").next()).map(|n| n.trim().to_owned()).collect()
    };
    let sparse = run("sparse")?;
    assert!(sparse.starts_with("nanogpt-small: 110464 parameters"), "{sparse}");
    assert_eq!(rows(&sparse)[2..], ["sparse", "made dense"], "{sparse}");
    let dense = run("fp32")?;
    assert_eq!(rows(&dense)[2..], ["dense", "made dense"], "{dense}");
    Ok(())
}

/// `bench step --steps 0` times forward passes alone (the shepherd's screen and
/// validation), with their rate by the simulator's FLOP count, and a vocabulary
/// smaller than the corpus's is refused in one line.
#[test]
fn bench_step_times_forward_passes_alone() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path().to_str().unwrap_or_default();
    let cache = std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts");
    let out = Command::new(BIN)
        .env("PCP_ARTIFACT_CACHE", &cache)
        .args(["bench", "step", "--steps", "0", "--forwards", "2", "--vocab", "80", "--data-dir", d])
        .stdin(Stdio::null())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench step failed: {}", String::from_utf8_lossy(&out.stderr));
    let forward = stdout.lines().find(|l| l.starts_with("forward")).context("no forward line")?;
    assert!(forward.contains("2 passes") && forward.contains("GFLOP/s"), "{forward}");
    assert!(!stdout.contains("tokens/s") && !stdout.lines().any(|l| l.starts_with("steps")), "no step ran: {stdout}");
    assert_usage_error(&["bench", "step", "--vocab", "10", "--data-dir", d], "--vocab 10 is smaller")?;
    Ok(())
}
