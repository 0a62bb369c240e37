//! `pcp-node` processes of a multi-process test and the JSONL events they write.
//! Each process is killed (SIGKILL) when dropped; its stdout and stderr go to
//! files beside its events, and when a test fails the tail of each log is printed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The `pcp-node` under test: `PCP_NODE` when set (another build of it), else
/// this workspace's.
pub(crate) fn pcp_node() -> PathBuf {
    std::env::var_os("PCP_NODE").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_pcp-node")), PathBuf::from)
}

/// The demo corpus.
pub(crate) use crate::common::corpus;

/// A child process, killed when dropped.
#[derive(Debug)]
pub(crate) struct Proc {
    child: Child,
    name: String,
    log: PathBuf,
}

impl Proc {
    /// Starts `command` with `args`; stdout goes to `<log>.out`, stderr to `log`.
    pub(crate) fn spawn(name: &str, mut command: Command, args: &[String], log: &Path) -> Self {
        let file = |path: &Path| std::fs::File::create(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let child = command
            .args(args)
            .env("PCP_ARTIFACT_CACHE", std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts"))
            .stdin(Stdio::null())
            .stdout(file(&log.with_extension("out")))
            .stderr(file(log))
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: {:?} does not start: {e}", command.get_program()));
        Self { child, name: name.to_owned(), log: log.to_owned() }
    }

    /// The process id (of `pcp-node` itself: `ip netns exec` execs it).
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// How it ended, once it has: a wait can stop there instead of at its timeout.
    pub(crate) fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(format!("{} exited ({status})", self.name)),
            Ok(None) => None,
            Err(e) => Some(format!("{}: {e}", self.name)),
        }
    }

    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(15)..].join("\n");
            eprintln!("--- the last lines {} wrote to stderr ({}):\n{tail}", self.name, self.log.display());
            // its events, when the test names their file after the log (`w3.log`, `w3.jsonl`)
            let events = self.log.with_extension("jsonl");
            if events.exists() {
                eprintln!("--- the last events of {} ({}):\n{}", self.name, events.display(), last_events(&events, 25));
            }
        }
    }
}

/// Every event in a JSONL file so far (none when it does not exist yet).
pub(crate) fn events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// The events named `name`, in order.
pub(crate) fn find(path: &Path, name: &str) -> Vec<Value> {
    events(path).into_iter().filter(|e| e["event"] == name).collect()
}

/// An event's time (unix seconds).
pub(crate) fn t(e: &Value) -> f64 {
    e["t"].as_f64().unwrap_or_else(|| panic!("an event without a time: {e}"))
}

/// The time now, as events write it.
pub(crate) fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs_f64()
}

/// The last `n` lines of a file's events, shortened, to debug a failure from CI's
/// log. A run of `message_rejected` events (a flood's refused gossip, reported per
/// peer every second) is one line with its count and last reason: unfolded, a flood
/// filled the dump and hid what the node did.
pub(crate) fn last_events(path: &Path, n: usize) -> String {
    let mut lines: Vec<String> = Vec::new();
    let mut rejected: Option<(usize, Value)> = None;
    let folded = |(count, e): (usize, Value)| match count {
        1 => short(&e),
        _ => format!("... {count} message_rejected, the last: {}", short(&e)),
    };
    for e in events(path) {
        if e["event"] == "message_rejected" {
            let count = rejected.take().map_or(0, |(c, _)| c);
            rejected = Some((count + 1, e));
        } else {
            lines.extend(rejected.take().map(folded));
            lines.push(short(&e));
        }
    }
    lines.extend(rejected.map(folded));
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// An event with only the fields a failure's dump needs.
fn short(e: &Value) -> String {
    let mut e = e.clone();
    if let Some(o) = e.as_object_mut() {
        o.retain(|k, _| {
            ["t", "event", "round", "term", "newer", "peer", "reason", "params_hash", "accepted", "contributors"]
                .contains(&k.as_str())
        });
        if let Some(h) = o.get_mut("params_hash")
            && let Some(s) = h.as_str()
        {
            *h = Value::from(&s[..s.len().min(12)]);
        }
    }
    e.to_string()
}

/// Waits until an event of `path` satisfies `pred` and returns it.
pub(crate) fn wait_for(path: &Path, what: &str, timeout: Duration, pred: impl Fn(&Value) -> bool) -> Value {
    wait_unless(path, what, timeout, pred, || None)
}

/// [`wait_for`], failing as soon as `wrong` says what went wrong.
pub(crate) fn wait_unless(
    path: &Path,
    what: &str,
    timeout: Duration,
    pred: impl Fn(&Value) -> bool,
    wrong: impl Fn() -> Option<String>,
) -> Value {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(e) = events(path).into_iter().find(&pred) {
            return e;
        }
        if let Some(wrong) = wrong() {
            panic!("while waiting for {what}: {wrong}");
        }
        if Instant::now() >= deadline {
            panic!(
                "timed out after {timeout:?} waiting for {what} in {}; its last events:\n{}",
                path.display(),
                last_events(path, 40)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `--shepherd` on the demo corpus with a 3 s heartbeat timeout, and `extra`.
pub(crate) fn shepherd_args(extra: &[&str]) -> Vec<String> {
    // the lockstep fp32 rounds these tests were written for, unless `extra` names its own
    let pinned: &[&str] =
        if extra.contains(&"--encoding") { &["--no-overlap"] } else { &["--no-overlap", "--encoding", "fp32"] };
    // the shepherd's own screen, unless `extra` names committees (open runs default to 3)
    let screen: &[&str] = if extra.contains(&"--screeners") { &[] } else { &["--screeners", "0"] };
    // no proof of work: the default asks a CPU-minute of each key
    let mut args: Vec<String> = ["--shepherd", "--pow-bits", "0", "--heartbeat-timeout-ms", "3000"]
        .iter()
        .chain(pinned)
        .chain(screen)
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
    args.extend(["--data".into(), corpus()]);
    args
}
