//! DiLoCo across processes on loopback: a shepherd (`pcp-node --shepherd`) and CPU
//! workers (`pcp-node --bootstrap …`), each its own process with its own swarm.
//! Workers die (`kill -9`), join late, and the shepherd restarts with `--resume`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

fn corpus() -> String {
    let shared = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/tiny_shakespeare.txt");
    let local = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.data/tiny_shakespeare.txt");
    let path = if shared.exists() { shared } else { local };
    path.display().to_string()
}

/// A child process killed (SIGKILL) when dropped, with its stdout lines on a channel.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    name: String,
}

impl Proc {
    fn spawn(name: &str, args: &[String]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pcp-node"))
            .args(args)
            .env("PCP_ARTIFACT_CACHE", std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts"))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("pcp-node starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, lines, name: name.to_owned() }
    }

    /// The first stdout line containing `needle`.
    fn line_with(&self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(e) => panic!("{}: no line with {needle:?} ({e})", self.name),
            }
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn wait_success(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                assert!(status.success(), "{} exited with {status}", self.name);
                return;
            }
            assert!(Instant::now() < deadline, "{} did not exit", self.name);
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// Waits until an event satisfies `pred` and returns it.
fn wait_for(path: &Path, what: &str, timeout: Duration, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(e) = events(path).into_iter().find(&pred) {
            return e;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what} in {}", path.display());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn completed(path: &Path, round: u64, timeout: Duration) -> Value {
    wait_for(path, &format!("round {round} completed"), timeout, |e| {
        e["event"] == "round_completed" && e["round"] == round
    })
}

fn peer_id(proc: &Proc) -> String {
    let line = proc.line_with("peer id:", Duration::from_secs(30));
    line.trim_start_matches("peer id:").trim().to_owned()
}

#[test]
fn shepherd_and_workers_survive_kills_joins_and_restarts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = |name: &str| dir.path().join(name).display().to_string();
    let shepherd_events = dir.path().join("shepherd.jsonl");
    let long = Duration::from_secs(240);
    let shepherd_args = |listen: &str, resume: bool| {
        let mut args: Vec<String> = [
            "--shepherd",
            "--rounds",
            "7",
            "--tau",
            "40",
            "--min-workers",
            "3",
            "--heartbeat-timeout-ms",
            "3000",
            "--data",
            &corpus(),
            "--listen",
            listen,
            "--data-dir",
            &d("shepherd"),
            "--events",
            shepherd_events.to_str().expect("utf8"),
        ]
        .map(String::from)
        .to_vec();
        if resume {
            args.push("--resume".into());
        }
        args
    };
    let mut shepherd = Proc::spawn("shepherd", &shepherd_args("/ip4/127.0.0.1/tcp/0", false));
    let shepherd_peer = peer_id(&shepherd);
    let listening = shepherd.line_with("listening on /ip4/127.0.0.1/tcp/", Duration::from_secs(30));
    let addr = listening.trim_start_matches("listening on ").trim().to_owned();
    let listen_addr = addr.split("/p2p/").next().expect("address").to_owned();

    let worker = |n: usize| {
        let args: Vec<String> = [
            "--bootstrap",
            &addr,
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--data-dir",
            &d(&format!("worker-{n}")),
            "--events",
            &d(&format!("worker-{n}.jsonl")),
        ]
        .map(String::from)
        .to_vec();
        Proc::spawn(&format!("worker {n}"), &args)
    };
    let mut w1 = worker(1);
    let mut w2 = worker(2);
    let mut w3 = worker(3);
    let victim = peer_id(&w1);

    // kill -9 a worker during round 2: the round completes with the others
    wait_for(&shepherd_events, "round 2 to start", long, |e| e["event"] == "round_started" && e["round"] == 2);
    w1.kill();
    let r2 = completed(&shepherd_events, 2, long);
    assert_eq!(r2["contributors"], 2, "{r2}");
    assert_eq!(r2["excluded"], serde_json::json!([victim]), "{r2}");
    let all = events(&shepherd_events);
    assert!(
        all.iter().any(|e| e["event"] == "worker_left" && e["peer"] == victim.as_str()),
        "the killed worker is reported as left"
    );

    // a worker that joins during round 3 contributes in round 4
    wait_for(&shepherd_events, "round 3 to start", long, |e| e["event"] == "round_started" && e["round"] == 3);
    let mut w4 = worker(4);
    let joiner = peer_id(&w4);
    let r4 = completed(&shepherd_events, 4, long);
    let all = events(&shepherd_events);
    let joined_at = all
        .iter()
        .position(|e| e["event"] == "worker_joined" && e["peer"] == joiner.as_str())
        .expect("the joiner joined");
    let open_round = all[..joined_at]
        .iter()
        .rev()
        .find(|e| e["event"] == "round_started")
        .and_then(|e| e["round"].as_u64())
        .expect("a round was open");
    assert_eq!(open_round, 3, "the new worker joined during round {open_round}");
    let r3 = completed(&shepherd_events, 3, long);
    assert!(!r3["peers"].as_array().expect("peers").iter().any(|p| p == joiner.as_str()), "{r3}");
    assert!(r4["peers"].as_array().expect("peers").iter().any(|p| p == joiner.as_str()), "{r4}");

    // the loss decreases over 5 rounds
    let r5 = completed(&shepherd_events, 5, long);
    let r1 = completed(&shepherd_events, 1, long);
    let val = |r: &Value| r["val_loss"].as_f64().expect("val_loss");
    assert!(val(&r5) < val(&r1) - 0.1, "val loss {} -> {}", val(&r1), val(&r5));

    // stop the shepherd and resume it: same round, identical parameters
    shepherd.kill();
    let mut shepherd = Proc::spawn("shepherd (resumed)", &shepherd_args(&listen_addr, true));
    assert_eq!(peer_id(&shepherd), shepherd_peer, "the shepherd keeps its identity");
    let resumed = wait_for(&shepherd_events, "the resume", long, |e| e["event"] == "resumed");
    assert_eq!(resumed["round"], 5, "{resumed}");
    assert_eq!(resumed["params_hash"], r5["params_hash"], "resumed parameters differ from round 5's");
    // the workers of round 5 come back in time for round 6
    let r6 = completed(&shepherd_events, 6, long);
    assert_eq!(r6["contributors"], r5["contributors"], "{r6}");
    let r7 = completed(&shepherd_events, 7, long);
    assert!(r7["contributors"].as_u64().expect("n") >= 1, "{r7}");
    wait_for(&shepherd_events, "the end of the run", long, |e| e["event"] == "run_finished");
    for w in [&mut w2, &mut w3, &mut w4] {
        w.wait_success(Duration::from_secs(60));
    }
    shepherd.wait_success(Duration::from_secs(60));

    // fp32 pseudo-gradients: at most 1.05x the parameter bytes on the wire per round
    let sent: Vec<Value> =
        events(&dir.path().join("worker-2.jsonl")).into_iter().filter(|e| e["event"] == "contribution_sent").collect();
    assert!(sent.len() >= 5, "worker 2 contributed {} times", sent.len());
    for s in &sent {
        let ratio = s["ratio"].as_f64().expect("ratio");
        assert!(ratio <= 1.05, "{s}");
    }
}
