//! What a volunteer sees when something is wrong: an unreachable seed, a port already
//! in use, and help that lists only the flags a command has.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::process::{Child, ChildStdout, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_pcp-node");

/// A node process whose output lines arrive on a channel; killed (by its own pid)
/// when dropped.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    /// Starts `pcp-node args…` with its stdout and stderr read line by line.
    fn spawn(args: &[&str]) -> anyhow::Result<Self> {
        let mut child = Command::new(BIN)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawning pcp-node")?;
        let (tx, lines) = mpsc::channel();
        let stdout: ChildStdout = child.stdout.take().context("stdout")?;
        let stderr = child.stderr.take().context("stderr")?;
        for stream in [Box::new(stdout) as Box<dyn Read + Send>, Box::new(stderr)] {
            let tx = tx.clone();
            // each reader ends when the child's pipe closes
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Self { child, lines })
    }

    /// Waits (at most `within`) for a line containing `needle`.
    fn line_with(&self, needle: &str, within: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + within;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return Ok(line),
                Ok(line) => seen.push(line),
                Err(_) => bail!("no line with {needle:?} within {within:?}; got:\n{}", seen.join("\n")),
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(BIN).args(args).stdin(Stdio::null()).output()?)
}

/// A loopback TCP port that nothing listens on (bound, then closed).
fn closed_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

#[test]
fn an_unreachable_seed_is_reported_with_its_reason_and_retried_with_backoff() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // a real peer id, so that the address is exactly what a volunteer would paste
    let seed_identity = pcp_bootstrap::load_or_create(&dir.path().join("seed"))?;
    let seed_peer = pcp_bootstrap::keypair(&seed_identity).public().to_peer_id();
    let seed = format!("/ip4/127.0.0.1/tcp/{}/p2p/{seed_peer}", closed_port()?);
    let events = dir.path().join("events.jsonl");
    let data = dir.path().join("worker");
    let node = Proc::spawn(&[
        "--bootstrap",
        &seed,
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--data-dir",
        data.to_str().context("utf8")?,
        "--events",
        events.to_str().context("utf8")?,
    ])?;
    let first = node.line_with(&format!("bootstrap {seed}: "), Duration::from_secs(30))?;
    ensure!(first.contains("WARN"), "logged at warn level: {first}");
    ensure!(first.ends_with(&format!("bootstrap {seed}: connection refused; retrying in 2 s")), "{first}");
    // the next attempt comes 2 s later and fails again: the wait doubles
    let second = node.line_with(&format!("bootstrap {seed}: "), Duration::from_secs(10))?;
    ensure!(second.ends_with("connection refused; retrying in 4 s"), "{second}");

    // the log line is written by the swarm's task, the event right after by the node's
    let failures = |events: &std::path::Path| -> Vec<Value> {
        std::fs::read_to_string(events)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["event"] == "bootstrap_failed")
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while failures(&events).len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(node);
    let failures = failures(&events);
    ensure!(failures.len() >= 2, "two bootstrap_failed events: {failures:?}");
    for (event, wait) in failures.iter().zip([2.0, 4.0]) {
        ensure!(event["addr"] == seed.as_str(), "{event}");
        ensure!(event["reason"] == "connection refused", "{event}");
        ensure!(event["retry_in_s"].as_f64() == Some(wait), "{event}");
    }
    Ok(())
}

/// Runs `pcp-node args…` to completion; a process still running after `within` (a
/// node that listens after all) is killed and is an error, not a hang.
fn run_within(args: &[&str], within: Duration) -> anyhow::Result<Output> {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawning pcp-node")?;
    let deadline = Instant::now() + within;
    while child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output()?;
            bail!("{args:?} still running after {within:?}: {}", String::from_utf8_lossy(&out.stdout));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(child.wait_with_output()?)
}

/// Asserts exit code 2 and one line on stderr: `error: --listen ADDR: address already in use`.
fn assert_in_use(args: &[&str], addr: &str) -> anyhow::Result<()> {
    let out = run_within(args, Duration::from_secs(20))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(2), "{args:?}: exit {:?}: {stderr}", out.status.code());
    ensure!(stderr.trim_end() == format!("error: --listen {addr}: address already in use"), "{args:?}: {stderr}");
    ensure!(!String::from_utf8_lossy(&out.stdout).contains("listening on"), "nothing listens");
    Ok(())
}

#[test]
fn a_port_already_in_use_is_a_one_line_error_with_exit_code_2() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = |name: &str| dir.path().join(name).to_string_lossy().into_owned();

    // a port someone else holds
    let taken = TcpListener::bind("127.0.0.1:0")?;
    let addr = format!("/ip4/127.0.0.1/tcp/{}", taken.local_addr()?.port());
    assert_in_use(&["--no-train", "--listen", &addr, "--data-dir", &d("a")], &addr)?;
    drop(taken);

    // a port another pcp node listens on (libp2p sets SO_REUSEPORT, so without the
    // node's own check it would be shared); TCP and QUIC on the same port number
    // are two protocols: both fine
    let port = closed_port()?;
    let tcp = format!("/ip4/127.0.0.1/tcp/{port}");
    let quic = format!("/ip4/127.0.0.1/udp/{port}/quic-v1");
    let first = Proc::spawn(&["--no-train", "--listen", &tcp, "--listen", &quic, "--data-dir", &d("first")])?;
    first.line_with(&format!("listening on {tcp}/p2p/"), Duration::from_secs(30))?;
    first.line_with(&format!("listening on {quic}/p2p/"), Duration::from_secs(30))?;
    assert_in_use(&["--no-train", "--listen", &tcp, "--data-dir", &d("second")], &tcp)?;
    assert_in_use(&["--no-train", "--listen", &quic, "--data-dir", &d("third")], &quic)?;
    // every interface overlaps loopback
    let any = format!("/ip4/0.0.0.0/tcp/{port}");
    assert_in_use(&["--no-train", "--listen", &any, "--data-dir", &d("fourth")], &any)?;
    // `blob get` listens too
    let first_peer =
        pcp_bootstrap::keypair(&pcp_bootstrap::load_or_create(&dir.path().join("first"))?).public().to_peer_id();
    let seed = format!("{quic}/p2p/{first_peer}");
    let hash = "00".repeat(32);
    let get =
        ["blob", "get", &hash, "-o", &d("out"), "--bootstrap", &seed, "--listen", &tcp, "--data-dir", &d("fifth")];
    assert_in_use(&get, &tcp)?;
    Ok(())
}

fn help(args: &[&str]) -> anyhow::Result<String> {
    let out = run(args)?;
    ensure!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8(out.stdout)?)
}

#[test]
fn each_command_lists_only_the_flags_it_uses_and_the_root_help_has_examples() -> anyhow::Result<()> {
    let root = help(&["--help"])?;
    for example in [
        "pcp-node --bootstrap <multiaddr> --backend rocm --target gfx942",
        "pcp-node --shepherd",
        "pcp-node sim --nodes 4",
    ] {
        ensure!(root.contains(example), "root help lacks {example:?}:\n{root}");
    }
    for flag in ["--bootstrap", "--listen", "--data-dir", "--events"] {
        ensure!(root.contains(flag), "joining uses {flag}:\n{root}");
    }

    let has = |args: &[&str], yes: &[&str], no: &[&str]| -> anyhow::Result<()> {
        let text = help(args)?;
        for flag in yes {
            ensure!(text.contains(flag), "{args:?} lacks {flag}:\n{text}");
        }
        for flag in no {
            ensure!(!text.contains(flag), "{args:?} lists {flag}:\n{text}");
        }
        Ok(())
    };
    let network = ["--bootstrap", "--listen", "--events", "--data-dir"];
    has(&["graph", "step", "--help"], &[], &network)?;
    has(&["graph", "--help"], &[], &network)?;
    has(&["devices", "--help"], &[], &network)?;
    has(&["bench", "blob", "--help"], &[], &network)?;
    has(&["train", "--help"], &["--data-dir", "--events"], &["--bootstrap", "--listen"])?;
    has(&["sim", "--help"], &["--data-dir", "--events"], &["--bootstrap", "--listen"])?;
    has(&["generate", "--help"], &["--data-dir"], &["--bootstrap", "--listen", "--events"])?;
    has(&["bench", "step", "--help"], &["--data-dir"], &["--bootstrap", "--listen", "--events"])?;
    has(&["blob", "put", "--help"], &["--data-dir"], &["--bootstrap", "--listen", "--events"])?;
    has(&["blob", "get", "--help"], &network, &[])?;

    // a flag after a subcommand that lacks it is refused by the parser, and one before
    // it is refused by pcp-node: neither is silently ignored
    let out = run(&["graph", "step", "m.mlir", "--bootstrap", "/ip4/127.0.0.1/tcp/1"])?;
    ensure!(out.status.code() == Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    let out = run(&["--events", "e.jsonl", "graph", "inspect", "m.mlir"])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(2), "{stderr}");
    ensure!(stderr.trim_end() == "error: --events is not an option of `pcp-node graph` (see `pcp-node graph --help`)");

    // flags before the subcommand still apply to a command that has them
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("input.bin");
    std::fs::write(&file, b"hello")?;
    let store = dir.path().join("store");
    let out = run(&["--data-dir", store.to_str().context("utf8")?, "blob", "put", file.to_str().context("utf8")?])?;
    ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let hash = String::from_utf8(out.stdout)?.trim().to_owned();
    ensure!(store.join("blobs").exists(), "the blob went to --data-dir");
    ensure!(hash == blake3::hash(b"hello").to_hex().as_str());
    Ok(())
}

#[test]
fn candidate_flags_are_checked_with_one_line_errors() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path().to_string_lossy().into_owned();
    let cases: [(&[&str], &str); 3] = [
        (&["--candidate", "--data-dir", &d], "a standby candidate needs the run: --candidate --run RUN_ID"),
        (&["--shepherd", "--candidate", "--data-dir", &d], "with --shepherd, --candidate names a candidate"),
        (&["--shepherd", "--candidate", "not-a-peer", "--data-dir", &d], "--candidate \"not-a-peer\" is neither"),
    ];
    one_line_errors(&cases, Duration::from_secs(20))
}

/// Each of `cases` exits with code 2 and one line on stderr that contains its message.
fn one_line_errors(cases: &[(&[&str], &str)], within: Duration) -> anyhow::Result<()> {
    for (args, message) in cases {
        let out = run_within(args, within)?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(out.status.code() == Some(2), "{args:?}: exit {:?}: {stderr}", out.status.code());
        ensure!(stderr.contains(message), "{args:?}: {stderr}");
        ensure!(stderr.trim().lines().count() == 1, "{args:?}: not one line: {stderr}");
    }
    Ok(())
}

#[test]
fn encoding_flags_are_checked_with_one_line_errors() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path().to_string_lossy().into_owned();
    let cases: [(&[&str], &str); 4] = [
        (
            &["sim", "--encoding", "sparse", "--trim", "0.2", "--data-dir", &d],
            "--trim cannot be used with --encoding sparse",
        ),
        (&["sim", "--encoding", "sparse:k=0", "--data-dir", &d], "--encoding \"sparse:k=0\": k 0 is outside"),
        (&["sim", "--encoding", "sparse:what=1", "--data-dir", &d], "unknown sparse setting \"what\""),
        (&["--shepherd", "--encoding", "fp16", "--data-dir", &d], "unknown --encoding \"fp16\""),
    ];
    one_line_errors(&cases, Duration::from_secs(60))
}
