//! Draws a [`State`] and the log ring: a pure function of them, so a test renders
//! it into a `TestBackend` and compares the text.

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style, Stylize as _};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Axis, Block, Borders, Cell, Chart, Dataset, Gauge, GraphType, Paragraph, Row, Table, Wrap};
use tracing::Level;

use super::log::Ring;
use super::state::{Mode, Outcome, Phase, State, Status, WorkerRow};

/// The smallest terminal the dashboard is drawn in.
pub(crate) const MIN_WIDTH: u16 = 60;
pub(crate) const MIN_HEIGHT: u16 = 16;

const MEAN: Color = Color::Cyan;
const VAL: Color = Color::Yellow;

/// `…` and the last 8 characters of a peer id (they differ; the first ones do not).
pub(crate) fn short_peer(peer: &str) -> String {
    let n = peer.chars().count();
    if n <= 10 { peer.to_owned() } else { format!("…{}", peer.chars().skip(n - 8).collect::<String>()) }
}

/// A multiaddr as `host:port` (`/quic` for QUIC), or as it is when it is not one
/// of those: `/ip4/10.0.0.7/tcp/4001` is `10.0.0.7:4001`.
pub(crate) fn short_addr(addr: &str) -> String {
    let parts: Vec<&str> = addr.split('/').collect();
    match parts.as_slice() {
        ["", "ip4" | "dns" | "dns4" | "dns6", host, "tcp", port, rest @ ..] if !rest.contains(&"p2p-circuit") => {
            format!("{host}:{port}")
        }
        ["", "ip6", host, "tcp", port, rest @ ..] if !rest.contains(&"p2p-circuit") => format!("[{host}]:{port}"),
        ["", "ip4" | "dns" | "dns4" | "dns6", host, "udp", port, "quic-v1", ..] => format!("{host}:{port}/quic"),
        ["", "ip6", host, "udp", port, "quic-v1", ..] => format!("[{host}]:{port}/quic"),
        _ => addr.to_owned(),
    }
}

/// A run id's first 12 hex digits.
fn short_run(run: &str) -> &str {
    run.get(..12).unwrap_or(run)
}

/// Bytes in decimal units: `950 B`, `12.3 kB`, `0.88 MB`.
pub(crate) fn bytes(n: u64) -> String {
    let n = n as f64;
    if n < 1e3 {
        format!("{n} B")
    } else if n < 1e6 {
        format!("{:.1} kB", n / 1e3)
    } else if n < 1e9 {
        format!("{:.2} MB", n / 1e6)
    } else {
        format!("{:.2} GB", n / 1e9)
    }
}

/// A count: `950`, `10.2k`, `1.20M`.
fn count(n: f64) -> String {
    if n < 1e3 {
        format!("{n:.0}")
    } else if n < 1e6 {
        format!("{:.1}k", n / 1e3)
    } else {
        format!("{:.2}M", n / 1e6)
    }
}

/// Seconds: `4.1 s`, `2m05s`, `1h02m`.
fn seconds(s: f64) -> String {
    if s < 60.0 {
        format!("{s:.1} s")
    } else if s < 3600.0 {
        format!("{}m{:02}s", (s / 60.0) as u64, (s % 60.0) as u64)
    } else {
        format!("{}h{:02}m", (s / 3600.0) as u64, (s % 3600.0 / 60.0) as u64)
    }
}

fn block(title: impl Into<Line<'static>>) -> Block<'static> {
    Block::bordered().title(title)
}

/// Draws the dashboard of `state` with the newest lines of `logs`.
pub(crate) fn render(frame: &mut Frame<'_>, state: &State, logs: &Ring) {
    let area = frame.area();
    if area.width < MIN_WIDTH || area.height < MIN_HEIGHT {
        let text = format!(
            "The terminal ({}×{}) is too small for the dashboard: it needs {MIN_WIDTH}×{MIN_HEIGHT} (80×24 to look \
             right). Enlarge it, or run with --no-tui. q quits.",
            area.width, area.height
        );
        frame.render_widget(Paragraph::new(text).wrap(Wrap { trim: true }), area);
        return;
    }
    let [header, body, footer] =
        Layout::vertical([Constraint::Length(4), Constraint::Min(0), Constraint::Length(1)]).areas(area);
    render_header(frame, header, state);
    let rest = body.height;
    let panel_rows = match state.mode {
        Mode::Worker => state.mine.recent.len().max(1) as u16 + 4,
        Mode::Shepherd | Mode::Sim => state.workers.len().max(1) as u16 + 3,
    };
    let panel = panel_rows.clamp(4, (rest / 3).max(4));
    let log = (rest / 4).max(4);
    let [top, middle, bottom] =
        Layout::vertical([Constraint::Length(panel), Constraint::Min(6), Constraint::Length(log)]).areas(body);
    match state.mode {
        Mode::Worker => render_mine(frame, top, state),
        Mode::Shepherd | Mode::Sim => render_workers(frame, top, state),
    }
    let [chart, traffic] = Layout::horizontal([Constraint::Min(30), Constraint::Length(30)]).areas(middle);
    render_chart(frame, chart, state);
    render_traffic(frame, traffic, state);
    render_logs(frame, bottom, logs);
    let mut keys = vec![" q".bold(), " quit".into()];
    if state.quitting {
        keys.push("  ·  stopping… (q again to force)".yellow());
    }
    frame.render_widget(Line::from(keys), footer);
}

fn render_header(frame: &mut Frame<'_>, area: Rect, state: &State) {
    let title = match state.mode {
        Mode::Sim => format!(" pcp · sim · {} nodes ", 1 + state.workers.values().filter(|w| w.node.is_some()).count()),
        mode => format!(" pcp · {} ", mode.name()),
    };
    let outer = Block::new().borders(Borders::TOP).title(Line::from(title).bold());
    let inner = outer.inner(area);
    frame.render_widget(outer, area);
    let [run_line, phase_line, gauge_line] = Layout::vertical([Constraint::Length(1); 3]).areas(inner);

    let dim = Style::new().fg(Color::DarkGray);
    let sep = || Span::styled(" · ", dim);
    let mut spans = vec![Span::styled("run ", dim), Span::raw(state.run.as_deref().map_or("—", short_run).to_owned())];
    if let Some(model) = &state.model {
        spans.extend([sep(), Span::raw(model.clone())]);
    }
    if let Some(backend) = &state.backend {
        spans.extend([sep(), Span::raw(backend.clone())]);
    }
    if let Some(shepherd) = &state.shepherd {
        spans.extend([sep(), Span::styled("shepherd ", dim), Span::raw(short_peer(shepherd))]);
    }
    let total = state.rounds_total.map_or_else(String::new, |t| format!("/{t}"));
    spans.extend([sep(), Span::styled("round ", dim), Span::raw(format!("{}{total}", state.round))]);
    if let Some(tau) = state.tau {
        spans.extend([sep(), Span::raw(format!("τ={tau}"))]);
    }
    if let Some(encoding) = &state.encoding {
        spans.extend([sep(), Span::raw(encoding.clone())]);
    }
    if let Some(term) = state.term {
        spans.extend([sep(), Span::styled("term ", dim), Span::raw(term.to_string())]);
    }
    spans.extend([sep(), Span::styled("peers ", dim), Span::raw(state.peers.len().to_string())]);
    frame.render_widget(Line::from(spans), run_line);

    let phase_style = match state.phase {
        Phase::Training(_) => Style::new().fg(Color::Green).bold(),
        Phase::Finished => Style::new().fg(Color::Cyan).bold(),
        Phase::Left(_) => Style::new().fg(Color::Red),
        _ => Style::new().bold(),
    };
    let mut spans = vec![Span::styled(state.phase.to_string(), phase_style)];
    if let Some(me) = &state.me {
        let who = if state.mode == Mode::Sim { "shepherd " } else { "me " };
        spans.extend([sep(), Span::styled(who, dim), Span::raw(short_peer(me))]);
        if let Some(listen) = &state.listen {
            spans.extend([Span::styled(" on ", dim), Span::raw(listen.clone())]);
        }
    }
    let nat = &state.nat;
    if nat.known() {
        let reach = nat.reachability.clone().unwrap_or_else(|| "unknown".into());
        spans.extend([sep(), Span::styled("reachability ", dim), Span::raw(reach)]);
        if let Some(relay) = &nat.relay {
            spans.extend([Span::styled(" via relay ", dim), Span::raw(short_peer(relay))]);
        }
        if nat.relayed + nat.punched + nat.punch_failed > 0 {
            let text = format!("{} relayed, {} punched, {} punches failed", nat.relayed, nat.punched, nat.punch_failed);
            spans.extend([sep(), Span::raw(text)]);
        }
    }
    frame.render_widget(Line::from(spans), phase_line);

    let (ratio, label) = match (state.round_progress(), &state.phase) {
        (Some(ratio), _) => {
            let elapsed = state.now_ms.saturating_sub(state.opened_ms) as f64 / 1e3;
            let span = state.deadline_ms.unwrap_or(state.opened_ms).saturating_sub(state.opened_ms) as f64 / 1e3;
            (ratio, format!("round {}: {} of {} to the deadline", state.round, seconds(elapsed), seconds(span)))
        }
        (None, Phase::Finished) => (1.0, format!("run finished after {} rounds", state.completed())),
        (None, _) => (0.0, "no round open".to_owned()),
    };
    let gauge = Gauge::default().ratio(ratio).label(label).gauge_style(Style::new().fg(Color::Green).bg(Color::Black));
    frame.render_widget(gauge, gauge_line);
}

fn status_style(status: Status) -> Style {
    match status {
        Status::Training => Style::new().fg(Color::Yellow),
        Status::Sent => Style::new().fg(Color::Green),
        Status::Missed => Style::new().fg(Color::Red),
        Status::Left | Status::TimedOut | Status::Killed => Style::new().fg(Color::DarkGray),
        Status::Starting | Status::Joined => Style::new(),
    }
}

fn verdict(row: &WorkerRow) -> Span<'static> {
    let Some(v) = &row.last else { return Span::raw("—") };
    match v.accepted {
        None => Span::raw(format!("r{} sent", v.round)),
        Some(true) if v.reason.is_empty() => Span::styled(format!("r{} accepted", v.round), Color::Green),
        Some(true) => Span::styled(format!("r{} accepted, {}", v.round, v.reason), Color::Yellow),
        Some(false) => Span::styled(format!("r{} rejected: {}", v.round, v.reason), Color::Red),
    }
}

fn render_workers(frame: &mut Frame<'_>, area: Rect, state: &State) {
    let rows = state.worker_rows();
    let live = rows.iter().filter(|r| !r.status.gone()).count();
    let sim = state.mode == Mode::Sim;
    let mut header = vec!["peer", "backend", "address", "status", "tok/s", "contribution"];
    let mut widths = vec![
        Constraint::Length(9),
        Constraint::Length(10),
        Constraint::Length(21),
        Constraint::Length(9),
        Constraint::Length(5),
        Constraint::Fill(1),
    ];
    if sim {
        header.insert(0, "#");
        widths.insert(0, Constraint::Length(2));
    }
    let outer = block(format!(" workers ({live} live of {}) ", rows.len()));
    if rows.is_empty() {
        let text = Paragraph::new("no worker has joined yet").style(Style::new().fg(Color::DarkGray)).block(outer);
        frame.render_widget(text, area);
        return;
    }
    let body: Vec<Row<'_>> = rows
        .iter()
        .map(|r| {
            let mut cells = vec![
                Cell::from(short_peer(&r.peer)),
                Cell::from(if r.backend.is_empty() { "—".to_owned() } else { r.backend.clone() }),
                Cell::from(state.addrs.get(&r.peer).map_or_else(|| "—".into(), |a| short_addr(a))),
                Cell::from(Span::styled(r.status.name(), status_style(r.status))),
                Cell::from(r.tokens_per_s.map_or_else(|| "—".to_owned(), count)),
                Cell::from(verdict(r)),
            ];
            if sim {
                cells.insert(0, Cell::from(r.node.map_or_else(String::new, |n| n.to_string())));
            }
            Row::new(cells)
        })
        .collect();
    let table = Table::new(body, widths)
        .header(Row::new(header).style(Style::new().add_modifier(Modifier::BOLD)))
        .column_spacing(1)
        .block(outer);
    frame.render_widget(table, area);
}

fn render_mine(frame: &mut Frame<'_>, area: Rect, state: &State) {
    let m = &state.mine;
    let outer = block(" my contribution ");
    let inner = outer.inner(area);
    frame.render_widget(outer, area);
    let [summary, list] = Layout::vertical([Constraint::Length(1), Constraint::Min(0)]).areas(inner);
    let dim = Style::new().fg(Color::DarkGray);
    let line = Line::from(vec![
        Span::styled("rounds ", dim),
        Span::raw(format!("{}", m.accepted + m.rejected)),
        Span::styled(" · accepted ", dim),
        Span::styled(m.accepted.to_string(), Color::Green),
        Span::styled(" · rejected ", dim),
        Span::styled(m.rejected.to_string(), if m.rejected > 0 { Color::Red } else { Color::Reset }),
        Span::styled(" · abandoned ", dim),
        Span::raw(m.abandoned.to_string()),
        Span::styled(" · tokens ", dim),
        Span::raw(count(m.tokens as f64)),
    ]);
    frame.render_widget(line, summary);
    if m.recent.is_empty() {
        frame.render_widget(Paragraph::new("no round trained yet").style(dim), list);
        return;
    }
    let rows: Vec<Row<'_>> = m
        .recent
        .iter()
        .rev()
        .map(|r| {
            let outcome = match &r.outcome {
                Outcome::Accepted => Span::styled("accepted", Color::Green),
                Outcome::Rejected(reason) => Span::styled(format!("rejected: {reason}"), Color::Red),
                Outcome::Abandoned(reason) => Span::styled(format!("abandoned: {reason}"), Color::Yellow),
            };
            Row::new([
                Cell::from(r.round.to_string()),
                Cell::from(count(r.tokens as f64)),
                Cell::from(r.tokens_per_s.map_or_else(|| "—".to_owned(), count)),
                Cell::from(r.loss.map_or_else(|| "—".to_owned(), |l| format!("{l:.4}"))),
                Cell::from(if r.bytes > 0 { bytes(r.bytes) } else { "—".to_owned() }),
                Cell::from(outcome),
            ])
        })
        .collect();
    let widths = [
        Constraint::Length(5),
        Constraint::Length(7),
        Constraint::Length(7),
        Constraint::Length(8),
        Constraint::Length(9),
        Constraint::Fill(1),
    ];
    let table = Table::new(rows, widths)
        .header(Row::new(["round", "tokens", "tok/s", "loss", "sent", "verdict"]).style(Style::new().bold()));
    frame.render_widget(table, list);
}

fn render_chart(frame: &mut Frame<'_>, area: Rect, state: &State) {
    let mean: Vec<(f64, f64)> = state.rounds.iter().filter_map(|r| Some((r.round as f64, r.mean_loss?))).collect();
    let val: Vec<(f64, f64)> = state.rounds.iter().filter_map(|r| Some((r.round as f64, r.val_loss?))).collect();
    let mut title = vec![Span::raw(" loss")];
    if let Some(last) = state.rounds.back() {
        title.push(Span::raw(format!(" · round {}:", last.round)));
        let name = if state.mode == Mode::Worker { "my inner" } else { "mean" };
        if let Some(v) = last.mean_loss {
            title.push(Span::styled(format!(" ─ {name} {v:.4}"), MEAN));
        }
        if let Some(v) = last.val_loss {
            title.push(Span::styled(format!(" ─ val {v:.4}"), VAL));
        }
    }
    title.push(Span::raw(" "));
    let outer = block(Line::from(title));
    if mean.is_empty() && val.is_empty() {
        let text = Paragraph::new("no completed round yet").style(Style::new().fg(Color::DarkGray)).block(outer);
        frame.render_widget(text, area);
        return;
    }
    let xs = mean.iter().chain(&val).map(|p| p.0);
    let (x0, x1) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
    let x1 = x1.max(x0 + 1.0);
    let ys = mean.iter().chain(&val).map(|p| p.1);
    let (y0, y1) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| (a.min(y), b.max(y)));
    let pad = ((y1 - y0) * 0.05).max(0.05);
    let (y0, y1) = (y0 - pad, y1 + pad);
    let datasets = vec![
        Dataset::default()
            .name("mean")
            .marker(Marker::Braille)
            .graph_type(GraphType::Line)
            .style(Style::new().fg(MEAN))
            .data(&mean),
        Dataset::default()
            .name("val")
            .marker(Marker::Braille)
            .graph_type(GraphType::Line)
            .style(Style::new().fg(VAL))
            .data(&val),
    ];
    let dim = Style::new().fg(Color::DarkGray);
    let chart = Chart::new(datasets)
        .block(outer)
        .legend_position(None)
        .x_axis(Axis::default().style(dim).bounds([x0, x1]).labels([format!("{x0:.0}"), format!("round {x1:.0}")]))
        .y_axis(Axis::default().style(dim).bounds([y0, y1]).labels([
            format!("{y0:.2}"),
            format!("{:.2}", (y0 + y1) / 2.0),
            format!("{y1:.2}"),
        ]));
    frame.render_widget(chart, area);
}

fn render_traffic(frame: &mut Frame<'_>, area: Rect, state: &State) {
    let t = &state.traffic;
    let dim = Style::new().fg(Color::DarkGray);
    let (last, what_in, what_out) = match state.mode {
        Mode::Worker => ("last ", "blobs fetched", "contributions"),
        Mode::Shepherd | Mode::Sim => ("round", "contributions", "blobs served"),
    };
    let row = |label: &'static str, value: u64| {
        Line::from(vec![Span::styled(format!("  {label} "), dim), Span::raw(format!("{:>10}", bytes(value)))])
    };
    let lines = vec![
        Line::from(vec![Span::raw("in: "), Span::styled(what_in, dim)]),
        row(last, t.last_in),
        row("total", t.total_in),
        Line::from(vec![Span::raw("out: "), Span::styled(what_out, dim)]),
        row(last, t.last_out),
        row("total", t.total_out),
        Line::from(vec![Span::styled("refused messages ", dim), Span::raw(state.messages_rejected.to_string())]),
        Line::from(vec![
            Span::styled("compute busy ", dim),
            Span::raw(state.traffic.utilization.map_or_else(|| "—".to_owned(), |u| format!("{:.1}%", u * 100.0))),
        ]),
    ];
    frame.render_widget(Paragraph::new(lines).block(block(" bandwidth ")), area);
}

fn render_logs(frame: &mut Frame<'_>, area: Rect, logs: &Ring) {
    let shown = usize::from(area.height.saturating_sub(2));
    let lines: Vec<Line<'_>> = logs
        .last(shown)
        .map(|l| {
            let style = match l.level {
                Level::ERROR => Style::new().fg(Color::Red),
                Level::WARN => Style::new().fg(Color::Yellow),
                Level::INFO => Style::new(),
                _ => Style::new().fg(Color::DarkGray),
            };
            Line::styled(l.text.as_str(), style)
        })
        .collect();
    frame.render_widget(Paragraph::new(lines).block(block(" log ")), area);
}

/// What stays on the terminal once the dashboard closes: the rounds as the
/// shepherd's round table (or a worker's lines) print them without it.
pub(crate) fn summary(state: &State) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let run = state.run.as_deref().map_or("—", short_run);
    match state.mode {
        Mode::Worker => {
            if !state.mine.recent.is_empty() {
                let _ = writeln!(out, "run {run}: {}", state.phase);
            }
            for r in &state.mine.recent {
                let verdict = match &r.outcome {
                    Outcome::Accepted => "accepted".to_owned(),
                    Outcome::Rejected(reason) => format!("rejected: {reason}"),
                    Outcome::Abandoned(reason) => format!("abandoned: {reason}"),
                };
                let loss = r.loss.map_or_else(|| "—".to_owned(), |l| format!("{l:.4}"));
                let _ = writeln!(
                    out,
                    "round {}: {} tokens, mean loss {loss}, sent {:.2} MB, {verdict}",
                    r.round,
                    r.tokens,
                    r.bytes as f64 / 1e6
                );
            }
        }
        Mode::Shepherd | Mode::Sim => {
            if state.rounds.is_empty() {
                return out;
            }
            let model = state.model.as_deref().map_or_else(String::new, |m| format!(" ({m})"));
            let _ = writeln!(out, "run {run}{model}: {}", state.phase);
            let _ = writeln!(
                out,
                "{:>5} {:>12} {:>10} {:>10} {:>8} {:>10} {:>10}",
                "round", "contributors", "mean loss", "val loss", "seconds", "kB up", "kB down"
            );
            for r in &state.rounds {
                let _ = writeln!(
                    out,
                    "{:>5} {:>12} {:>10.4} {:>10.4} {:>8.1} {:>10.1} {:>10.1}",
                    r.round,
                    r.contributors,
                    r.mean_loss.unwrap_or(f64::NAN),
                    r.val_loss.unwrap_or(f64::NAN),
                    r.seconds.unwrap_or(f64::NAN),
                    r.bytes_in as f64 / 1e3,
                    r.bytes_out as f64 / 1e3
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    use super::super::state::tests::{T0, shepherd, worker};
    use super::*;

    fn logs() -> Ring {
        let mut ring = Ring::default();
        ring.push(Level::INFO, "00:00:02 INFO  pcp_node::diloco::shepherd: worker joined peer=12D3…P2VqYhHa".into());
        ring.push(
            Level::WARN,
            "00:00:14 WARN  pcp_node::diloco::shepherd: contribution rejected: no improvement".into(),
        );
        ring.push(Level::INFO, "00:00:15 INFO  pcp_node::diloco::shepherd: compiling train_step for vulkan".into());
        ring
    }

    fn worker_logs() -> Ring {
        let mut ring = Ring::default();
        ring.push(
            Level::WARN,
            "00:00:09 WARN  pcp_node::diloco::worker: round 2: fetching the round parameters".into(),
        );
        ring.push(Level::ERROR, "00:00:10 ERROR libp2p_swarm: connection to 12D3…Uv3aDk5e reset".into());
        ring
    }

    fn draw(state: &State, logs: &Ring, width: u16, height: u16) -> String {
        let mut terminal = Terminal::new(TestBackend::new(width, height)).expect("a test terminal");
        terminal.draw(|frame| render(frame, state, logs)).expect("drawn");
        terminal.backend().to_string()
    }

    #[test]
    fn shepherd_view() {
        let text = draw(&shepherd(Mode::Shepherd), &logs(), 80, 24);
        for shown in ["pcp · shepherd", "training round 3", "round 3: 10.0 s of 40.0 s", "…P2VqYhHa", "r2 rejected"]
        {
            assert!(text.contains(shown), "{shown} in\n{text}");
        }
        insta::assert_snapshot!(text);
    }

    #[test]
    fn a_node_behind_a_nat_shows_its_relay_and_hole_punches() {
        let mut state = shepherd(Mode::Shepherd);
        let relay = "12D3KooWRelayRelayRelayRelayRelayRelayRelayRe1ay";
        let at = T0 + 30_000;
        state.apply_named("reachability_changed", &serde_json::json!({"reachability": "private"}), at);
        state.apply_named(
            "relay_reserved",
            &serde_json::json!({"relay": relay, "addr": "/ip4/198.18.0.1/udp/4001/quic-v1"}),
            at,
        );
        state.apply_named("relayed_connection", &serde_json::json!({"peer": relay}), at);
        state.apply_named("hole_punched", &serde_json::json!({"peer": relay, "result": "ok"}), at);
        let text = draw(&state, &logs(), 160, 48);
        for shown in ["reachability private via relay", "1 relayed, 1 punched, 0 punches failed"] {
            assert!(text.contains(shown), "{shown} in\n{text}");
        }
        state.apply_named("relay_lost", &serde_json::json!({"relay": relay, "reason": "gone"}), at);
        assert_eq!(state.nat.relay, None);
    }

    #[test]
    fn shepherd_view_large() {
        insta::assert_snapshot!(draw(&shepherd(Mode::Shepherd), &logs(), 160, 48));
    }

    #[test]
    fn worker_view() {
        let text = draw(&worker(), &worker_logs(), 80, 24);
        for shown in ["pcp · worker", "my contribution", "rejected: norm 9.1", "cuda:sm_90", "accepted 1"] {
            assert!(text.contains(shown), "{shown} in\n{text}");
        }
        insta::assert_snapshot!(text);
    }

    #[test]
    fn sim_view() {
        let mut state = shepherd(Mode::Sim);
        state.apply_named("worker_killed", &serde_json::json!({"round": 3, "worker": 2}), T0 + 30_000);
        state.quitting = true;
        let text = draw(&state, &logs(), 120, 32);
        for shown in ["pcp · sim · 3 nodes", "127.0.0.1:40124", "killed", "stopping…"] {
            assert!(text.contains(shown), "{shown} in\n{text}");
        }
        insta::assert_snapshot!(text);
    }

    #[test]
    fn a_fresh_dashboard_and_a_tiny_terminal() {
        let fresh = draw(&State::new(Mode::Shepherd), &Ring::default(), 80, 24);
        assert!(fresh.contains("no worker has joined yet") && fresh.contains("no completed round yet"), "{fresh}");
        let tiny = draw(&shepherd(Mode::Shepherd), &logs(), 40, 10);
        assert!(tiny.contains("too small"), "{tiny}");
    }

    #[test]
    fn the_summary_is_the_round_table() {
        let text = summary(&shepherd(Mode::Shepherd));
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "run 9f3b2c1d4e5f (nanogpt-small): training round 3");
        assert_eq!(lines[1], "round contributors  mean loss   val loss  seconds      kB up    kB down");
        assert_eq!(lines[3], "    2            1     3.4000     3.4500      5.0      880.0     1760.0");
        let text = summary(&worker());
        assert!(text.contains("round 2: 40960 tokens, mean loss 3.3000, sent 0.44 MB, rejected: norm 9.1"), "{text}");
        assert_eq!(summary(&State::new(Mode::Sim)), "");
    }

    #[test]
    fn units() {
        assert_eq!(bytes(950), "950 B");
        assert_eq!(bytes(441_856), "441.9 kB");
        assert_eq!(bytes(1_760_000), "1.76 MB");
        assert_eq!(count(10_240.0), "10.2k");
        assert_eq!(seconds(125.0), "2m05s");
        assert_eq!(short_addr("/ip4/10.0.0.7/tcp/4001"), "10.0.0.7:4001");
        assert_eq!(short_addr("/ip4/10.0.0.8/udp/4001/quic-v1/p2p/12D3KooW"), "10.0.0.8:4001/quic");
        assert_eq!(short_addr("/ip6/::1/tcp/4001"), "[::1]:4001");
        assert_eq!(short_addr("/memory/7"), "/memory/7");
        assert_eq!(short_peer("12D3KooWQm6U7mxrTKoEqGbF9JGTcL2Dey1rEKK9nDLGP2VqYhHa"), "…P2VqYhHa");
    }
}
