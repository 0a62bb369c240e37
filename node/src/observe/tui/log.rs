//! The log pane: a `tracing` layer that formats each event as one line into a
//! bounded ring shared with the dashboard, instead of the terminal's stderr.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

/// Log lines kept for the pane.
pub(crate) const MAX_LINES: usize = 1000;
/// A line longer than this is cut (a pane is never wider).
const MAX_LINE: usize = 400;

/// The last [`MAX_LINES`] log lines, oldest first.
#[derive(Debug, Clone, Default)]
pub(crate) struct Ring {
    lines: VecDeque<Line>,
}

/// A formatted log line and its level.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Line {
    pub(crate) level: Level,
    pub(crate) text: String,
}

impl Ring {
    pub(crate) fn push(&mut self, level: Level, mut text: String) {
        if text.len() > MAX_LINE {
            let mut end = MAX_LINE;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
        }
        if self.lines.len() >= MAX_LINES {
            self.lines.pop_front();
        }
        self.lines.push_back(Line { level, text });
    }

    /// The newest `n` lines, oldest first.
    pub(crate) fn last(&self, n: usize) -> impl Iterator<Item = &Line> {
        self.lines.iter().skip(self.lines.len().saturating_sub(n))
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lines.len()
    }
}

/// Collects an event's message and fields as `message key=value …`.
#[derive(Debug, Default)]
struct Fields {
    message: String,
    rest: String,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.rest, " {}={value}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.rest, " {}={value:?}", field.name());
        }
    }
}

/// `HH:MM:SS` (UTC) of `unix_s`.
pub(crate) fn clock(unix_s: u64) -> String {
    let s = unix_s % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

/// One line for `event`: `HH:MM:SS LEVEL target: message fields`, newlines flattened.
fn format(event: &Event<'_>, unix_s: u64) -> String {
    let mut fields = Fields::default();
    event.record(&mut fields);
    let meta = event.metadata();
    let line = format!("{} {:<5} {}: {}{}", clock(unix_s), meta.level(), meta.target(), fields.message, fields.rest);
    line.replace(['\n', '\r', '\t'], " ")
}

/// The layer that feeds the log pane while a dashboard is up; it does nothing otherwise.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Capture;

impl<S: Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let Some(logs) = super::capturing() else { return };
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let line = format(event, now);
        super::lock(logs).push(*event.metadata().level(), line);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    #[test]
    fn the_ring_keeps_the_newest_lines() {
        let mut ring = Ring::default();
        for i in 0..(MAX_LINES + 5) {
            ring.push(Level::INFO, format!("line {i}"));
        }
        assert_eq!(ring.len(), MAX_LINES);
        let last: Vec<&str> = ring.last(2).map(|l| l.text.as_str()).collect();
        assert_eq!(last, [format!("line {}", MAX_LINES + 3), format!("line {}", MAX_LINES + 4)]);
        ring.push(Level::WARN, "é".repeat(MAX_LINE));
        assert!(ring.last(1).all(|l| l.text.len() <= MAX_LINE && l.level == Level::WARN));
    }

    /// Formats events the way [`Capture`] does, into a ring of its own.
    struct Collect(Arc<Mutex<Ring>>);

    impl<S: Subscriber> Layer<S> for Collect {
        fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
            let line = format(event, 86_400 * 3 + 3600 * 9 + 60 * 5 + 7);
            self.0.lock().expect("lock").push(*event.metadata().level(), line);
        }
    }

    #[test]
    fn events_become_one_line_each() {
        let ring = Arc::new(Mutex::new(Ring::default()));
        let subscriber = tracing_subscriber::registry().with(Collect(ring.clone()));
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(peer = "12D3KooW", round = 2, "contribution rejected:\nno improvement");
        });
        let ring = ring.lock().expect("lock");
        let lines: Vec<&Line> = ring.last(5).collect();
        assert_eq!(lines.len(), 1);
        assert_eq!(
            lines[0].text,
            "09:05:07 WARN  pcp_node::observe::tui::log::tests: contribution rejected: no improvement peer=12D3KooW round=2"
        );
    }
}
