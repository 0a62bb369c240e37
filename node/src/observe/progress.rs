//! Progress on a terminal, through `indicatif`: bars and spinners drawn on stdout
//! when it is a terminal and hidden otherwise (a log file or a pipe gets plain
//! lines, and `--events` has the same facts for machines).

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar of `len` steps, or a hidden one when stdout is not a terminal.
pub(crate) fn bar(len: u64) -> ProgressBar {
    if !std::io::stdout().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stdout());
    if let Ok(style) = ProgressStyle::with_template("[{bar:30}] {pos}/{len} {msg} ({elapsed}, eta {eta})") {
        bar.set_style(style.progress_chars("#>."));
    }
    bar
}

/// A spinner saying `message` with the time elapsed, or a hidden one when stdout
/// is not a terminal. It ticks on its own thread until finished.
pub(crate) fn spinner(message: String) -> ProgressBar {
    if !std::io::stdout().is_terminal() {
        return ProgressBar::hidden();
    }
    let spinner = ProgressBar::with_draw_target(None, ProgressDrawTarget::stdout());
    if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} ({elapsed})") {
        spinner.set_style(style);
    }
    spinner.set_message(message);
    spinner.enable_steady_tick(Duration::from_millis(120));
    spinner
}
