//! The terminal: raw mode and the alternate screen on the way in, both undone on
//! the way out and on a panic; the loop that redraws and reads keys.

use std::io;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ratatui::DefaultTerminal;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::crossterm::{cursor, execute, terminal};
use tokio_util::sync::CancellationToken;

use super::log::{MAX_LINES, Ring};
use super::{ACTIVE, Shared, lock, render, unix_ms};

/// A redraw every 250 ms.
const FRAME: Duration = Duration::from_millis(250);
/// Log lines copied for a frame: more than any terminal is high.
const SHOWN_LINES: usize = 300;

/// The terminal is in raw mode on the alternate screen.
static ENTERED: AtomicBool = AtomicBool::new(false);
static PANIC_HOOK: Once = Once::new();

/// Raw mode, the alternate screen, and a panic hook that restores the terminal
/// before the panic's message is printed.
pub(super) fn enter() -> io::Result<DefaultTerminal> {
    PANIC_HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            ACTIVE.store(false, Ordering::Release);
            restore();
            previous(info);
        }));
    });
    terminal::enable_raw_mode()?;
    ENTERED.store(true, Ordering::Release);
    let entered = execute!(io::stdout(), terminal::EnterAlternateScreen, cursor::Hide)
        .and_then(|()| ratatui::Terminal::new(ratatui::backend::CrosstermBackend::new(io::stdout())));
    if entered.is_err() {
        restore();
    }
    entered
}

/// Leaves raw mode and the alternate screen, once, whoever calls first.
pub(super) fn restore() {
    if ENTERED.swap(false, Ordering::AcqRel) {
        let _ = terminal::disable_raw_mode();
        let _ = execute!(io::stdout(), terminal::LeaveAlternateScreen, cursor::Show);
    }
}

/// Redraws until `stop` is set (or a panic took the terminal back); `q` or Ctrl-C
/// cancels `quit`, and a second one exits the process at once.
pub(super) fn run(
    mut terminal: DefaultTerminal,
    shared: &Shared,
    stop: &AtomicBool,
    quit: &CancellationToken,
) -> io::Result<()> {
    while !stop.load(Ordering::Acquire) && ACTIVE.load(Ordering::Acquire) {
        // draw from copies: a slow terminal must not hold up the node's events
        let state = {
            let mut state = lock(&shared.state);
            state.tick(unix_ms());
            state.quitting = quit.is_cancelled();
            state.clone()
        };
        let logs = {
            let logs = lock(&shared.logs);
            let mut shown = Ring::default();
            for line in logs.last(SHOWN_LINES.min(MAX_LINES)) {
                shown.push(line.level, line.text.clone());
            }
            shown
        };
        terminal.draw(|frame| render::render(frame, &state, &logs))?;
        if !event::poll(FRAME)? {
            continue;
        }
        if let Event::Key(key) = event::read()?
            && key.kind != KeyEventKind::Release
        {
            let ctrl_c = key.code == KeyCode::Char('c') && key.modifiers.contains(KeyModifiers::CONTROL);
            if key.code == KeyCode::Char('q') || ctrl_c {
                if quit.is_cancelled() {
                    restore();
                    eprintln!("pcp-node: stopped at once (a second q or Ctrl-C)");
                    std::process::exit(130);
                }
                quit.cancel();
            }
        }
    }
    Ok(())
}
