//! The `pcp-node` processes of the trust tests (`trust_cli.rs`, `sybils_cli.rs`): a
//! shepherd and workers on loopback, optionally pinned to a core, their stdout and
//! events.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::corpus;

/// The binary under test: `$PCP_NODE` if set (`scripts/test.sh` runs the tests
/// ignored for the debug binary's slowness on the release one), else this build's.
pub(crate) fn pcp_node() -> PathBuf {
    std::env::var_os("PCP_NODE").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_pcp-node")), PathBuf::from)
}

/// The bound on every wait.
pub(crate) const LONG: Duration = Duration::from_secs(300);

/// A `pcp-node` process, killed when dropped, its stdout lines on a channel and its
/// stderr in a file.
pub(crate) struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    name: String,
    log: PathBuf,
}

impl Proc {
    pub(crate) fn spawn(name: &str, dir: &Path, args: &[String]) -> Self {
        Self::start(name, dir, Command::new(pcp_node()), args)
    }

    /// [`Proc::spawn`] on CPU `cpu` alone (`taskset`), at the lowest priority with
    /// `niced` (`nice -n 19`): separate machines, on one.
    pub(crate) fn spawn_on(name: &str, dir: &Path, cpu: usize, niced: bool, args: &[String]) -> Self {
        let mut command = Command::new("taskset");
        command.args(["-c", &cpu.to_string()]);
        if niced {
            command.args(["nice", "-n", "19"]);
        }
        command.arg(pcp_node());
        Self::start(name, dir, command, args)
    }

    fn start(name: &str, dir: &Path, mut command: Command, args: &[String]) -> Self {
        let log = dir.join(format!("{name}.log"));
        let mut child = command
            .args(args)
            .env("PCP_ARTIFACT_CACHE", std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("log file"))
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
        Self { child, lines, name: name.to_owned(), log }
    }

    /// The first stdout line containing `needle`.
    pub(crate) fn line_with(&self, needle: &str) -> String {
        let deadline = Instant::now() + LONG;
        loop {
            match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(e) => panic!("{}: no line with {needle:?} ({e})", self.name),
            }
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn wait(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + LONG;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "{} did not exit", self.name);
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Its stderr so far.
    pub(crate) fn stderr(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!("--- {} stderr:\n{}", self.name, lines[lines.len().saturating_sub(15)..].join("\n"));
        }
    }
}

pub(crate) fn events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

pub(crate) fn wait_for(path: &Path, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + LONG;
    loop {
        if let Some(e) = events(path).into_iter().find(&pred) {
            return e;
        }
        assert!(Instant::now() < deadline, "no {what} in {} within {LONG:?}", path.display());
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub(crate) fn completed(path: &Path, round: u64) -> Value {
    wait_for(path, &format!("round {round} completed"), |e| e["event"] == "round_completed" && e["round"] == round)
}

pub(crate) fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// A shepherd of nanogpt-small on the demo corpus listening on loopback TCP, with
/// `extra`; returns it, its address and its events file.
pub(crate) fn shepherd(dir: &Path, extra: &[&str]) -> (Proc, String, PathBuf) {
    shepherd_on(dir, None, extra)
}

/// [`shepherd`], on CPU `cpu` alone if given.
pub(crate) fn shepherd_on(dir: &Path, cpu: Option<usize>, extra: &[&str]) -> (Proc, String, PathBuf) {
    let events = dir.join("shepherd.jsonl");
    let mut args =
        s(&["--shepherd", "--seed", "7", "--heartbeat-timeout-ms", "3000", "--listen", "/ip4/127.0.0.1/tcp/0"]);
    // the lockstep fp32 rounds these tests were written for, unless `extra` names its own
    args.push("--no-overlap".into());
    // no proof of work (the default asks a CPU-minute of each key), unless `extra` names its own
    if !extra.contains(&"--pow-bits") {
        args.extend(s(&["--pow-bits", "0"]));
    }
    if !extra.contains(&"--encoding") {
        args.extend(s(&["--encoding", "fp32"]));
    }
    // the shepherd's own screen, unless `extra` names committees (open runs default to 3)
    if !extra.contains(&"--screeners") {
        args.extend(s(&["--screeners", "0"]));
    }
    args.extend(s(extra));
    args.extend(["--data".into(), corpus(), "--data-dir".into(), dir.join("shepherd").display().to_string()]);
    args.extend(["--events".into(), events.display().to_string()]);
    let p = match cpu {
        Some(cpu) => Proc::spawn_on("shepherd", dir, cpu, false, &args),
        None => Proc::spawn("shepherd", dir, &args),
    };
    let line = p.line_with("/ip4/127.0.0.1/tcp/");
    let addr = line.split_whitespace().find(|w| w.starts_with("/ip4/127.0.0.1/tcp/")).expect("an address").to_owned();
    (p, addr, events)
}

/// A CPU worker joining through `addr`, with `extra`.
pub(crate) fn worker(dir: &Path, name: &str, addr: &str, extra: &[&str]) -> Proc {
    worker_on(dir, name, None, addr, extra)
}

/// [`worker`], on CPU `cpu` alone if given.
pub(crate) fn worker_on(dir: &Path, name: &str, cpu: Option<usize>, addr: &str, extra: &[&str]) -> Proc {
    let mut args = s(&["--bootstrap", addr, "--listen", "/ip4/127.0.0.1/tcp/0"]);
    args.extend(s(extra));
    args.extend(["--data-dir".into(), dir.join(name).display().to_string()]);
    args.extend(["--events".into(), dir.join(format!("{name}.jsonl")).display().to_string()]);
    match cpu {
        Some(cpu) => Proc::spawn_on(name, dir, cpu, false, &args),
        None => Proc::spawn(name, dir, &args),
    }
}

/// The peer id of the node whose data directory is `dir` (made if new).
pub(crate) fn peer_of(dir: &Path) -> String {
    let identity = pcp_bootstrap::load_or_create(dir).expect("an identity");
    pcp_bootstrap::keypair(&identity).public().to_peer_id().to_string()
}
