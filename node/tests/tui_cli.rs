//! `--tui`: the dashboard of a `pcp-node sim`, driven in a detached tmux session of
//! a fixed size and read back with `tmux capture-pane`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[path = "support/common.rs"]
mod common;

fn corpus() -> PathBuf {
    PathBuf::from(common::corpus())
}

/// `'s'`, for sh.
fn quoted(s: &Path) -> String {
    format!("'{}'", s.display().to_string().replace('\'', r"'\''"))
}

/// A tmux server of its own (its own socket) with one detached session; killed on drop.
struct Tmux {
    socket: String,
    /// The socket's file, which `kill-server` leaves behind.
    path: Option<PathBuf>,
}

impl Tmux {
    /// Runs `shell` (an sh command line) in a `width`×`height` pane.
    fn start(name: &str, width: u16, height: u16, shell: &str) -> Self {
        let mut tmux = Self { socket: format!("pcp-tui-{name}-{}", std::process::id()), path: None };
        let size = [width.to_string(), height.to_string()];
        let status = tmux
            .command()
            .args(["new-session", "-d", "-s", "pcp", "-x", &size[0], "-y", &size[1], shell])
            .status()
            .expect("tmux runs (scripts/setup.sh installs it)");
        assert!(status.success(), "tmux new-session failed");
        let path = tmux.command().args(["display-message", "-p", "#{socket_path}"]).output().expect("tmux display");
        tmux.path = Some(PathBuf::from(String::from_utf8_lossy(&path.stdout).trim())).filter(|p| p.is_absolute());
        tmux
    }

    fn command(&self) -> Command {
        let mut command = Command::new("tmux");
        command.args(["-L", &self.socket]);
        command
    }

    /// The pane's text as shown now.
    fn capture(&self) -> String {
        let out = self.command().args(["capture-pane", "-p", "-t", "pcp"]).output().expect("tmux capture-pane");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn keys(&self, keys: &str) {
        let status = self.command().args(["send-keys", "-t", "pcp", keys]).status().expect("tmux send-keys");
        assert!(status.success());
    }

    /// Polls the pane until `done` holds; panics with the last capture after `limit`.
    fn wait_for(&self, what: &str, limit: Duration, done: impl Fn(&str) -> bool) -> String {
        let started = Instant::now();
        loop {
            let pane = self.capture();
            if done(&pane) {
                return pane;
            }
            assert!(started.elapsed() < limit, "no {what} within {limit:?}; the pane shows:\n{pane}");
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.command().arg("kill-server").status();
        if let Some(path) = &self.path {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The sh line that runs `pcp-node sim` with `args`, then says how it exited and
/// keeps the pane open.
fn sim_line(dir: &Path, args: &str) -> String {
    let cache = std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts");
    format!(
        "env PCP_ARTIFACT_CACHE={} {} sim {args} --data {} --data-dir {}; echo pcp-exit=$?; sleep 600",
        quoted(&cache),
        quoted(Path::new(env!("CARGO_BIN_EXE_pcp-node"))),
        quoted(&corpus()),
        quoted(dir)
    )
}

/// The round in the loss chart's title (`loss · round N: …`), once a round completed.
fn charted_round(pane: &str) -> Option<u64> {
    let (_, rest) = pane.split_once("loss · round ")?;
    rest.split(':').next()?.trim().parse().ok()
}

#[test]
fn a_sim_dashboard_shows_workers_and_losses_then_leaves_the_round_table() {
    let dir = tempfile::tempdir().expect("tempdir");
    // lockstep rounds: an overlapped round of this model is time-boxed to about a
    // second, and on a loaded machine a late contribution is carried to the next
    let tmux = Tmux::start("run", 160, 48, &sim_line(dir.path(), "--nodes 3 --rounds 3 --tau 10 --no-overlap --tui"));
    let pane = tmux.wait_for("workers table and a charted round", Duration::from_secs(300), |pane| {
        pane.contains("workers (2 live of 2)") && charted_round(pane).is_some_and(|r| r >= 1)
            || pane.contains("pcp-exit=")
    });
    assert!(!pane.contains("pcp-exit="), "the sim ended before its dashboard showed a round:\n{pane}");
    for shown in ["pcp · sim · 3 nodes", "peer", "backend", "address", "tok/s", "contribution", "bandwidth", " log "]
    {
        assert!(pane.contains(shown), "{shown:?} missing from\n{pane}");
    }
    let rows: Vec<&str> = pane.lines().filter(|l| l.contains("127.0.0.1:") && l.contains("cpu")).collect();
    assert_eq!(rows.len(), 2, "one row per worker, with its backend and address:\n{pane}");
    assert!(pane.contains("─ mean ") && pane.contains("─ val "), "the chart's title names both losses:\n{pane}");
    assert!(pane.contains("accepted"), "a worker's last contribution was accepted:\n{pane}");
    assert!(!pane.contains("round contributors"), "the round table stays off the dashboard:\n{pane}");

    // the run ends: the terminal is restored and the rounds are printed as the table
    let pane = tmux.wait_for("the end of the sim", Duration::from_secs(300), |pane| pane.contains("pcp-exit="));
    assert!(pane.contains("pcp-exit=0"), "{pane}");
    assert!(!pane.contains("workers ("), "the dashboard is gone:\n{pane}");
    let table = pane.split_once("round contributors").map(|(_, t)| t).unwrap_or_else(|| panic!("no table:\n{pane}"));
    let rounds: Vec<&str> = table.lines().filter(|l| l.split_whitespace().count() == 7).collect();
    assert_eq!(rounds.len(), 3, "three rounds in the table:\n{pane}");
    assert!(rounds.iter().all(|l| l.split_whitespace().nth(1) == Some("2")), "two contributors each:\n{pane}");
}

#[test]
fn ctrl_c_on_the_dashboard_stops_the_sim_and_restores_the_terminal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tmux = Tmux::start("quit", 80, 24, &sim_line(dir.path(), "--nodes 3 --rounds 50 --tau 10"));
    // 80×24 is large enough for the dashboard without --tui
    let pane = tmux.wait_for("the workers", Duration::from_secs(300), |pane| {
        pane.contains("workers (2 live of 2)") || pane.contains("pcp-exit=")
    });
    assert!(pane.contains("pcp · sim · 3 nodes") && pane.contains(" log "), "{pane}");
    tmux.keys("C-c");
    let pressed = Instant::now();
    let pane = tmux.wait_for("the sim to stop", Duration::from_secs(60), |pane| pane.contains("pcp-exit="));
    assert!(pressed.elapsed() < Duration::from_secs(30), "stopping took {:?}", pressed.elapsed());
    assert!(pane.contains("error: interrupted") && pane.contains("pcp-exit=1"), "as Ctrl-C without it:\n{pane}");
    assert!(!pane.contains("workers ("), "the dashboard is gone:\n{pane}");
}

#[test]
fn commands_without_a_dashboard_refuse_the_flags() {
    for (args, flag, command) in [
        (&["--tui", "devices"][..], "--tui", "devices"),
        (&["--no-tui", "simulate"][..], "--no-tui", "simulate"),
        (&["--tui", "--scale", "2"][..], "--tui", "--scale"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_pcp-node")).args(args).output().expect("runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(&format!("{flag} is not an option of `pcp-node {command}")), "{stderr}");
    }
    for (args, listed) in [(&["--help"][..], true), (&["sim", "--help"][..], true), (&["train", "--help"][..], false)] {
        let out = Command::new(env!("CARGO_BIN_EXE_pcp-node")).args(args).output().expect("runs");
        let help = String::from_utf8_lossy(&out.stdout);
        assert_eq!(help.contains("--tui") && help.contains("--no-tui"), listed, "{args:?}:\n{help}");
    }
}
