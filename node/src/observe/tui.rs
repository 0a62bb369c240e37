//! `--tui`: a live dashboard of the run in the terminal (ratatui), for a shepherd, a
//! worker and `pcp-node sim`.
//!
//! It is fed like `--metrics-addr`: every event the node emits (see
//! [`crate::observe::events::Events::emit`]) passes through [`observe`] into a [`State`], and
//! a `tracing` layer ([`Capture`]) puts log lines into a bounded ring instead of the
//! terminal's stderr. A thread of its own redraws at 4 Hz and reads the keys: `q`
//! or Ctrl-C stops the node as a Ctrl-C would without the dashboard (a second press
//! exits at once). While the dashboard is up it owns stdout: the round table and
//! the worker's per-round lines are not printed ([`owns_stdout`]); when it closes,
//! the terminal is restored (also on a panic) and the rounds are printed as the
//! table would have shown them.

mod app;
mod log;
mod render;
mod state;

use std::io::IsTerminal as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio_util::sync::CancellationToken;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::fmt::writer::OptionalWriter;

pub(crate) use log::Capture;
use log::Ring;
pub(crate) use state::Mode;
use state::State;

use crate::observe::events::kinds::Event;

/// The smallest terminal on which the dashboard is shown without `--tui`.
const DEFAULT_SIZE: (u16, u16) = (80, 24);

/// The dashboard flags, for the commands that have one.
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub(crate) struct TuiArgs {
    /// Show the live dashboard (run, rounds, workers, loss chart, bandwidth, log)
    /// [default: when stdout is a terminal of at least 80×24]
    #[arg(long, overrides_with = "no_tui")]
    pub(crate) tui: bool,
    /// Print plain lines instead of the dashboard.
    #[arg(long, overrides_with = "tui")]
    pub(crate) no_tui: bool,
}

impl TuiArgs {
    /// Whether either flag was given.
    pub(crate) fn given(self) -> bool {
        self.tui || self.no_tui
    }

    /// These flags where given, else `outer` (the flags before the subcommand).
    pub(crate) fn or(self, outer: Self) -> Self {
        if self.given() { self } else { outer }
    }

    /// Whether to show the dashboard: as asked, or where stdout is a large enough terminal.
    pub(crate) fn wanted(self) -> bool {
        if self.given() {
            return self.tui;
        }
        let dumb = std::env::var_os("TERM").is_some_and(|t| t == "dumb");
        let big = ratatui::crossterm::terminal::size().is_ok_and(|(w, h)| w >= DEFAULT_SIZE.0 && h >= DEFAULT_SIZE.1);
        std::io::stdout().is_terminal() && !dumb && big
    }
}

/// What the dashboard thread and the event and log hooks share.
#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    logs: Mutex<Ring>,
}

static SHARED: OnceLock<Shared> = OnceLock::new();
/// A dashboard is up: events go to its state, logs to its ring, and stdout is its.
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// A poisoned lock still holds a usable state: a panic elsewhere must not stop the dashboard.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Shows an emitted event on the dashboard, if one is up.
pub(crate) fn observe(event: &Event) {
    if !ACTIVE.load(Ordering::Acquire) {
        return;
    }
    if let Some(shared) = SHARED.get() {
        lock(&shared.state).apply(event, unix_ms());
    }
}

/// Whether a dashboard is drawn on stdout now: nothing else may print there.
pub(crate) fn owns_stdout() -> bool {
    ACTIVE.load(Ordering::Acquire)
}

/// The log ring, while a dashboard is up.
fn capturing() -> Option<&'static Mutex<Ring>> {
    if !ACTIVE.load(Ordering::Acquire) {
        return None;
    }
    SHARED.get().map(|s| &s.logs)
}

/// stderr for the plain log, except while a dashboard is up (its log pane shows
/// the lines then).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Stderr;

impl<'a> MakeWriter<'a> for Stderr {
    type Writer = OptionalWriter<std::io::Stderr>;

    fn make_writer(&'a self) -> Self::Writer {
        if owns_stdout() { OptionalWriter::none() } else { OptionalWriter::some(std::io::stderr()) }
    }
}

/// A dashboard on the terminal; dropping it closes it, restores the terminal and
/// prints the rounds on stdout.
#[derive(Debug)]
pub(crate) struct Dashboard {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<std::io::Result<()>>>,
}

impl Dashboard {
    /// Takes over the terminal; `q` or Ctrl-C cancels `quit`.
    pub(crate) fn start(mode: Mode, quit: CancellationToken) -> anyhow::Result<Self> {
        let shared = SHARED.get_or_init(|| Shared { state: Mutex::new(State::new(mode)), logs: Mutex::default() });
        *lock(&shared.state) = State::new(mode);
        *lock(&shared.logs) = Ring::default();
        let terminal =
            app::enter().map_err(|e| anyhow::anyhow!("cannot start the dashboard: {e} (run with --no-tui)"))?;
        ACTIVE.store(true, Ordering::Release);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("pcp-dashboard".into())
                .spawn(move || app::run(terminal, shared, &stop, &quit))
        };
        match thread {
            Ok(thread) => Ok(Self { stop, thread: Some(thread) }),
            Err(e) => {
                ACTIVE.store(false, Ordering::Release);
                app::restore();
                Err(anyhow::anyhow!("cannot start the dashboard's thread: {e}"))
            }
        }
    }
}

impl Drop for Dashboard {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let ended = self.thread.take().map(JoinHandle::join);
        ACTIVE.store(false, Ordering::Release);
        app::restore();
        match ended {
            Some(Ok(Err(e))) => tracing::warn!("the dashboard stopped: {e}"),
            Some(Err(_)) => tracing::warn!("the dashboard's thread panicked"),
            _ => {}
        }
        if let Some(shared) = SHARED.get() {
            print!("{}", render::summary(&lock(&shared.state)));
        }
    }
}
