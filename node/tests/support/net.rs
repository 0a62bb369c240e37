//! Where a multi-process test's nodes run ([`Net`]: on loopback or one per
//! namespace of a [`Lab`]), its directory, and the lock that runs its tests one at
//! a time.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::cluster::{Proc, pcp_node, wait_for};
use crate::netns::Lab;

/// Starting a node: joining, fetching the model, compiling (cached) and loading it.
pub(crate) const SETUP: Duration = Duration::from_secs(180);
/// A few rounds of τ=10 on two shared cores.
pub(crate) const LONG: Duration = Duration::from_secs(150);

/// Where a test's nodes run: on loopback, or node `i` in namespace `i` of a lab.
#[derive(Debug)]
pub(crate) struct Net<'a> {
    /// The test's directory: data directories, events and logs.
    pub(crate) dir: &'a Path,
    /// The lab, or `None` for loopback.
    pub(crate) lab: Option<&'a Lab>,
}

impl Net<'_> {
    /// Where node `name` writes its events.
    pub(crate) fn events(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.jsonl"))
    }

    /// Node `name`'s data directory.
    pub(crate) fn data(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// `pcp-node ARGS` as node `i` (ignored on loopback), listening on TCP at its
    /// address, with data directory and events named `name`.
    pub(crate) fn start(&self, i: usize, name: &str, args: &[&str]) -> Proc {
        let (command, host) = match self.lab {
            Some(lab) => (lab.cmd(i, pcp_node()), lab.addr(i).to_string()),
            None => (Command::new(pcp_node()), "127.0.0.1".to_owned()),
        };
        let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        args.extend(["--listen".into(), format!("/ip4/{host}/tcp/0"), "--data-dir".into(), self.data(name)]);
        args.extend(["--events".into(), self.events(name).display().to_string()]);
        Proc::spawn(name, command, &args, &self.dir.join(format!("{name}.log")))
    }

    /// The node's peer id and dialable address (with `/p2p/`), once it listens.
    pub(crate) fn address(&self, name: &str) -> (String, String) {
        let e = wait_for(&self.events(name), &format!("{name} to listen"), SETUP, |e| e["event"] == "listening");
        let (addr, peer) = (e["addr"].as_str().expect("addr"), e["peer"].as_str().expect("peer"));
        (peer.to_owned(), format!("{addr}/p2p/{peer}"))
    }

    /// The run `shepherd` started, once it has.
    pub(crate) fn run_id(&self, shepherd: &str) -> String {
        let e = wait_for(&self.events(shepherd), "the run to start", SETUP, |e| e["event"] == "run_started");
        e["run"].as_str().expect("run id").to_owned()
    }

    /// Waits until the events of `name` hold a completed round `>= round`.
    pub(crate) fn completed(&self, name: &str, round: u64, timeout: Duration) -> Value {
        wait_for(&self.events(name), &format!("round {round} to complete"), timeout, |e| {
            e["event"] == "round_completed" && e["round"].as_u64().is_some_and(|r| r >= round)
        })
    }
}

/// Held by each test: one at a time, so that two clusters do not share the two
/// cores and the lease timings stay those of one cluster.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Taken by each test for its whole length; see [`SERIAL`].
pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The test's directory (`<prefix>…` under the temporary directory): data
/// directories, events and logs; kept (and named on stderr) when
/// `PCP_KEEP_TEST_DIR=1`, to read after a failure.
pub(crate) fn workdir(prefix: &str) -> tempfile::TempDir {
    let keep = std::env::var("PCP_KEEP_TEST_DIR").is_ok_and(|v| v == "1");
    let dir = tempfile::Builder::new().prefix(prefix).disable_cleanup(keep).tempdir().expect("tempdir");
    if keep {
        eprintln!("keeping {}", dir.path().display());
    }
    dir
}
