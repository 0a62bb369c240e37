//! Weights & Biases: a Python child process (`tools/wandb_bridge.py`) fed every
//! event, as PCP reports to wandb.
//!
//! It is on, as in PCP, when there is an API key: `wandb_api_key` in the
//! experiment file or `WANDB_API_KEY` in the environment; without one nothing
//! is started. `WANDB_MODE=disabled` turns it off; `WANDB_MODE=offline` keeps
//! the run on disk (`wandb sync` uploads it later). The experiment's
//! `wandb_project` (default `pcp-distributed`), `wandb_entity` and
//! `wandb_run_name` name the run. `pcp-node train`, `pcp-node sim` and a node
//! started with `--shepherd` or `--candidate` report; workers do not.
//!
//! The bridge runs on `PCP_PYTHON`, else the `.venv/bin/python` found in the
//! working directory, the executable's directory or one of their parents, else
//! `python3`. Its script is built into `pcp-node`; `PCP_WANDB_BRIDGE` names
//! another. A key from the experiment file reaches it in its environment, never
//! on its command line.
//!
//! Every event passes through [`send`] (see [`crate::observe::events::Events::emit`])
//! into a bounded queue that a thread writes to the bridge's stdin: events are
//! dropped (and counted) when the bridge falls behind, and a bridge that cannot
//! start or dies costs one warning; training never waits for it. When the
//! [`Bridge`] is dropped its stdin closes and it has [`FINISH_TIMEOUT`] to
//! finish the run before it is killed.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::training::config::Experiment;

/// Events queued for the bridge; more are dropped until it catches up.
const QUEUE: usize = 4096;
/// How long the bridge may take to finish the run once its input ends.
pub(crate) const FINISH_TIMEOUT: Duration = Duration::from_secs(30);
/// The bridge, built in.
const SCRIPT: &str = include_str!("../../../tools/wandb_bridge.py");

/// The queue to the running bridge, if one runs in this process.
static SINK: Mutex<Option<SyncSender<String>>> = Mutex::new(None);
/// Whether [`SINK`] holds a queue (saves the lock when none does).
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// Events dropped because the queue was full.
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// Whether a warning about the bridge's end was logged.
static WARNED: AtomicBool = AtomicBool::new(false);

/// An API key; never shown.
#[derive(Clone, PartialEq, Eq)]
struct ApiKey(String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(…)")
    }
}

/// What the bridge is started with.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Settings {
    project: Option<String>,
    entity: Option<String>,
    name: Option<String>,
    /// The experiment file's key; one from the environment is inherited as it is.
    key: Option<ApiKey>,
}

/// The settings when wandb is on for `experiment`, reading the environment
/// through `env`; `None` when it is off.
fn settings(experiment: &Experiment, env: impl Fn(&str) -> Option<String>) -> Option<Settings> {
    let var = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    let set = |v: &Option<String>| v.clone().filter(|v| !v.trim().is_empty());
    if var("WANDB_MODE").is_some_and(|m| m.trim() == "disabled")
        || var("WANDB_DISABLED").is_some_and(|d| matches!(d.trim().to_lowercase().as_str(), "true" | "1" | "yes"))
    {
        return None;
    }
    let key = set(&experiment.wandb_api_key);
    if key.is_none() && var("WANDB_API_KEY").is_none() {
        return None;
    }
    Some(Settings {
        project: set(&experiment.wandb_project),
        entity: set(&experiment.wandb_entity),
        name: set(&experiment.wandb_run_name),
        key: key.map(ApiKey),
    })
}

/// `PCP_PYTHON`, else the first `.venv/bin/python` in the working directory,
/// the executable's directory or their parents, else `python3`.
fn python() -> OsString {
    if let Some(python) = std::env::var_os("PCP_PYTHON").filter(|p| !p.is_empty()) {
        return python;
    }
    let starts = [std::env::current_dir().ok(), std::env::current_exe().ok()];
    starts
        .iter()
        .flatten()
        .flat_map(|s| s.ancestors())
        .map(|dir| dir.join(".venv/bin/python"))
        .find(|p| p.is_file())
        .map_or_else(|| "python3".into(), PathBuf::into_os_string)
}

/// The running bridge: finishes the wandb run when dropped.
#[derive(Debug)]
pub(crate) struct Bridge {
    child: Child,
    writer: Option<JoinHandle<()>>,
}

impl Bridge {
    /// Starts the bridge when wandb is on for `experiment` (see the module
    /// docs), which becomes the run's config; `None` for a candidate, which
    /// learns the experiment only when it leads. `role` (`train`, `sim`,
    /// `shepherd`) becomes the run's job type. `None`, after one warning, when
    /// it cannot start or another runs in this process already.
    pub(crate) fn start(experiment: Option<&Experiment>, role: &str) -> Option<Self> {
        let default = Experiment::default();
        let settings = settings(experiment.unwrap_or(&default), |name| std::env::var(name).ok())?;
        let Ok(mut sink) = SINK.lock() else { return None };
        if sink.is_some() {
            return None;
        }
        let python = python();
        let mut command = Command::new(&python);
        match std::env::var_os("PCP_WANDB_BRIDGE").filter(|p| !p.is_empty()) {
            Some(script) => command.arg(script),
            None => command.arg("-c").arg(SCRIPT),
        };
        let config = experiment.and_then(|e| serde_json::to_string(e).ok()).unwrap_or_else(|| "{}".into());
        command.args(["--job-type", role, "--config", &config]);
        for (flag, value) in
            [("--project", &settings.project), ("--entity", &settings.entity), ("--name", &settings.name)]
        {
            if let Some(value) = value {
                command.arg(flag).arg(value);
            }
        }
        if let Some(ApiKey(key)) = &settings.key {
            command.env("WANDB_API_KEY", key);
        }
        // stdout belongs to the user: wandb's own lines go to stderr with the logs.
        // Its own process group: a Ctrl-C for pcp-node does not cut the run short,
        // pcp-node ends it by closing stdin.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        command.stdin(Stdio::piped()).stdout(Stdio::from(std::io::stderr())).stderr(Stdio::inherit());
        if crate::observe::tui::owns_stdout() {
            // the dashboard owns the terminal: wandb's lines would draw over it
            command.stdout(Stdio::null()).stderr(Stdio::null());
        }
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                let python = Path::new(&python).display();
                tracing::warn!("wandb: cannot start {python} ({e}); set PCP_PYTHON; not reporting to wandb");
                return None;
            }
        };
        let Some(stdin) = child.stdin.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let writer = match std::thread::Builder::new().name("wandb-bridge".into()).spawn(move || write(rx, stdin)) {
            Ok(writer) => writer,
            Err(e) => {
                tracing::warn!("wandb: cannot start the bridge's writer thread ({e}); not reporting to wandb");
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        };
        *sink = Some(tx);
        DROPPED.store(0, Ordering::Relaxed);
        WARNED.store(false, Ordering::Relaxed);
        ACTIVE.store(true, Ordering::Release);
        tracing::info!("wandb: reporting through {} (pid {})", Path::new(&python).display(), child.id());
        Some(Self { child, writer: Some(writer) })
    }

    /// Closes the bridge's input and waits up to [`FINISH_TIMEOUT`] for it to
    /// finish the run, then kills it.
    fn finish(&mut self) {
        ACTIVE.store(false, Ordering::Release);
        // dropping the sender ends the writer once the queue is written, and its
        // end closes the bridge's stdin
        if let Ok(mut sink) = SINK.lock() {
            sink.take();
        }
        let deadline = Instant::now() + FINISH_TIMEOUT;
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                Ok(None) => {
                    tracing::warn!(
                        "wandb: the bridge did not finish within {} s; stopping it",
                        FINISH_TIMEOUT.as_secs()
                    );
                    let _ = self.child.kill();
                    break self.child.wait().ok();
                }
                Err(e) => {
                    tracing::warn!("wandb: cannot wait for the bridge: {e}");
                    let _ = self.child.kill();
                    break None;
                }
            }
        };
        // the bridge is gone: a write blocked on its pipe fails, and the writer ends
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
        if let Some(status) = status
            && !status.success()
            && !WARNED.swap(true, Ordering::Relaxed)
        {
            tracing::warn!("wandb: the bridge exited with {status}; the wandb run may be incomplete");
        }
        let dropped = DROPPED.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            tracing::warn!("wandb: {dropped} events were dropped while the bridge was behind");
        }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        // a bounded wait; on tokio's multi-thread runtime other tasks move off this thread
        match tokio::runtime::Handle::try_current() {
            Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| self.finish());
            }
            _ => self.finish(),
        }
    }
}

/// Writes queued lines to the bridge until the queue closes or the bridge stops
/// reading.
fn write(rx: Receiver<String>, mut stdin: ChildStdin) {
    for line in rx {
        if let Err(e) = stdin.write_all(line.as_bytes()) {
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!("wandb: the bridge stopped reading events ({e}); not reporting to wandb any more");
            }
            break;
        }
    }
    // dropping stdin closes it: the bridge finishes the run
}

/// Whether a bridge takes events (cheap; [`send`] needs a line only then).
pub(crate) fn active() -> bool {
    ACTIVE.load(Ordering::Acquire)
}

/// Queues one JSONL event `line` (with its newline) for the bridge; drops it
/// when the queue is full or no bridge runs.
pub(crate) fn send(line: String) {
    let Ok(mut sink) = SINK.lock() else { return };
    let Some(tx) = sink.as_ref() else { return };
    match tx.try_send(line) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            if DROPPED.fetch_add(1, Ordering::Relaxed) == 0 {
                tracing::warn!("wandb: the bridge is behind; dropping events until it catches up");
            }
        }
        // the writer ended (and said why): stop queueing
        Err(TrySendError::Disconnected(_)) => {
            *sink = None;
            ACTIVE.store(false, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: BTreeMap<String, String> = vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        move |name| vars.get(name).cloned()
    }

    #[test]
    fn a_key_turns_it_on_and_nothing_else_does() {
        let mut e = Experiment { wandb_project: Some("p".into()), ..Experiment::default() };
        assert_eq!(settings(&e, env(&[])), None, "a project without a key is off");
        assert_eq!(settings(&e, env(&[("WANDB_MODE", "offline")])), None, "offline still needs a key");
        assert_eq!(settings(&e, env(&[("WANDB_API_KEY", " ")])), None, "a blank key is none");
        let on = settings(&e, env(&[("WANDB_API_KEY", "k")])).expect("on with the environment's key");
        assert_eq!((on.project.as_deref(), on.key), (Some("p"), None), "the environment's key is inherited");
        e.wandb_api_key = Some("secret".into());
        e.wandb_run_name = Some("run-1".into());
        e.wandb_entity = Some(String::new());
        let on = settings(&e, env(&[])).expect("on with the file's key");
        assert_eq!(on.key, Some(ApiKey("secret".into())));
        assert_eq!((on.name.as_deref(), on.entity.as_deref()), (Some("run-1"), None));
        assert!(!format!("{on:?}").contains("secret"), "the key is never shown");
        assert_eq!(settings(&e, env(&[("WANDB_MODE", "disabled")])), None);
        assert_eq!(settings(&e, env(&[("WANDB_DISABLED", "true")])), None);
    }

    #[test]
    fn the_key_is_not_in_the_config_the_bridge_gets() {
        let e = Experiment { wandb_api_key: Some("secret".into()), ..Experiment::default() };
        let config = serde_json::to_string(&e).expect("json");
        assert!(!config.contains("secret") && config.contains("learning_rate"), "{config}");
    }

    /// The quoted strings of `text` that `before` precedes and `after` follows.
    fn quoted(text: &str, before: &str, after: &str) -> Vec<String> {
        let mut found = Vec::new();
        for (i, _) in text.match_indices(before) {
            let rest = &text[i + before.len()..];
            if let Some(end) = rest.find('"')
                && rest[end + 1..].starts_with(after)
            {
                found.push(rest[..end].to_owned());
            }
        }
        found
    }

    /// The keys of the Python dict `NAME = {...}` in the bridge.
    fn dict_keys(name: &str) -> Vec<String> {
        let start = SCRIPT.find(&format!("{name} = {{")).expect("the dict");
        let body = &SCRIPT[start..start + SCRIPT[start..].find('}').expect("its end")];
        quoted(body, "\"", ":").into_iter().filter(|k| !k.contains(' ')).collect()
    }

    /// The bridge is Python and reads events by name: every handler it has is
    /// an event of [`Event`], and every field it reads is a field of that event,
    /// so renaming one in the enum fails here rather than blanking a dashboard.
    #[test]
    fn the_bridge_reads_events_and_fields_that_exist() {
        use crate::observe::events::Event;
        let mut checked = 0;
        for block in SCRIPT.split("\n    def on_").skip(1) {
            let name = block.split('(').next().expect("a name");
            let body = block.split("\n    def ").next().expect("a body");
            let body = body.split("\nclass ").next().expect("a body");
            if name == "peer_disconnected" {
                continue; // no node emits it (the swarm reports no disconnections)
            }
            let mut fields = quoted(body, "e.get(\"", ")");
            fields.extend(quoted(body, "e[\"", "]"));
            fields.extend(quoted(body, "\"", " not in e"));
            if let Some(keys) = body.lines().find(|l| l.trim_start().starts_with("keys = (")) {
                fields.extend(keys.split('"').skip(1).step_by(2).map(str::to_owned));
            }
            match name {
                "round_completed" => fields.extend(dict_keys("ROUND_FIELDS")),
                "step" => fields.extend(dict_keys("STEP_FIELDS")),
                _ => {}
            }
            assert!(Event::known(name), "the bridge handles {name}, which is no event");
            for field in fields {
                assert!(Event::has_field(name, &field), "the bridge reads {name}.{field}, which no event has");
                checked += 1;
            }
        }
        assert!(!Event::has_field("round_completed", "no_such_field"));
        assert!(checked >= 20, "only {checked} fields found: did the bridge change shape?");
    }

    #[test]
    fn without_a_bridge_events_go_nowhere() {
        assert!(!active());
        send("{\"event\":\"step\"}\n".into());
        assert_eq!(DROPPED.load(Ordering::Relaxed), 0);
    }
}
