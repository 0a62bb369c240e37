//! `pcp-node --scale N`: a supervisor of N worker processes. A worker killed with
//! `kill -9` is restarted with its identity and contributes again; SIGTERM stops
//! the supervisor and every worker.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "support/common.rs"]
mod common;
use common::corpus;

/// A child killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

fn wait_for(path: &Path, what: &str, pred: impl Fn(&[Value], &Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let all = events(path);
        if let Some(e) = all.iter().find(|e| pred(&all, e)) {
            return e.clone();
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what} in {}", path.display());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn alive(pid: u64) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

fn peers(round: &Value) -> Vec<String> {
    let mut p: Vec<String> =
        round["peers"].as_array().into_iter().flatten().filter_map(|v| v.as_str().map(String::from)).collect();
    p.sort();
    p
}

#[test]
fn a_killed_worker_is_restarted_and_contributes_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = |name: &str| dir.path().join(name).display().to_string();
    let (shepherd_events, supervisor_events) = (dir.path().join("shepherd.jsonl"), dir.path().join("workers.jsonl"));
    let bin = env!("CARGO_BIN_EXE_pcp-node");
    let mut shepherd = Command::new(bin)
        .args(["--shepherd", "--rounds", "30", "--tau", "20", "--min-workers", "2", "--heartbeat-timeout-ms", "3000"])
        .args(["--data", &corpus(), "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", &d("shepherd")])
        .args(["--encoding", "fp32", "--no-overlap", "--pow-bits", "0", "--screeners", "0"])
        .args(["--events", shepherd_events.to_str().expect("utf8")])
        .stdout(Stdio::piped())
        .spawn()
        .expect("the shepherd starts");
    let stdout = shepherd.stdout.take().expect("piped stdout");
    let shepherd = Killed(shepherd);
    // the shepherd's stdout is read to its end, so that its round table never blocks
    let (tx, rx) = std::sync::mpsc::channel();
    let _reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.strip_prefix("listening on ").filter(|a| a.contains("/tcp/")) {
                let _ = tx.send(addr.to_owned());
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(60)).expect("the shepherd's address");

    let supervisor = Command::new(bin)
        .args(["--scale", "2", "--bootstrap", &addr, "--listen", "/ip4/127.0.0.1/tcp/0"])
        .args(["--data-dir", &d("workers"), "--events", supervisor_events.to_str().expect("utf8")])
        .stdout(Stdio::null())
        .spawn()
        .expect("the supervisor starts");
    let mut supervisor = Killed(supervisor);

    let first = wait_for(&shepherd_events, "a round with both workers", |_, e| {
        e["event"] == "round_completed" && e["contributors"] == 2
    });
    let spawned = wait_for(&supervisor_events, "worker 0", |_, e| e["event"] == "worker_spawned" && e["index"] == 0);
    let victim = spawned["pid"].as_u64().expect("pid");
    // SAFETY: SIGKILL to the worker process the supervisor reported.
    assert_eq!(unsafe { libc::kill(victim as libc::pid_t, libc::SIGKILL) }, 0);

    let exited =
        wait_for(&supervisor_events, "worker 0's exit", |_, e| e["event"] == "worker_exited" && e["index"] == 0);
    assert!(exited["status"].as_str().is_some_and(|s| s.contains('9')), "{exited}");
    assert_eq!(exited["restart_in_s"], 1.0, "the first restart waits a second: {exited}");
    let restarted = wait_for(&supervisor_events, "worker 0's restart", |_, e| {
        e["event"] == "worker_spawned" && e["index"] == 0 && e["restarts"] == 1
    });
    let new_pid = restarted["pid"].as_u64().expect("pid");
    assert_ne!(new_pid, victim);
    assert_eq!(restarted["data_dir"], spawned["data_dir"], "the same data directory, so the same identity");

    // after the restart, a round again has both workers: the same two identities
    let restarted_at = restarted["t"].as_f64().expect("t");
    let later = wait_for(&shepherd_events, "a round with both workers after the restart", |_, e| {
        e["event"] == "round_completed"
            && e["contributors"] == 2
            && e["t"].as_f64().is_some_and(|t| t > restarted_at + 1.0)
    });
    assert_eq!(peers(&later), peers(&first), "the restarted worker kept its identity and contributes");

    // SIGTERM stops the supervisor and both workers
    let pids: Vec<u64> = events(&supervisor_events)
        .iter()
        .filter(|e| e["event"] == "worker_spawned")
        .filter_map(|e| e["pid"].as_u64())
        .collect();
    let supervisor_pid = supervisor.0.id();
    // SAFETY: SIGTERM to the supervisor this test started.
    assert_eq!(unsafe { libc::kill(supervisor_pid as libc::pid_t, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = supervisor.0.try_wait().expect("wait") {
            break status;
        }
        assert!(Instant::now() < deadline, "the supervisor did not stop");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "{status}");
    assert!(pids.iter().all(|pid| !alive(*pid)), "every worker stopped: {pids:?}");
    let stopped = wait_for(&supervisor_events, "supervisor_stopped", |_, e| e["event"] == "supervisor_stopped");
    assert_eq!(stopped["signal"], "SIGTERM");
    drop(shepherd);
}
