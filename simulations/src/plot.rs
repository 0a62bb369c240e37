//! PNG plots with plotters. Text needs a font: DejaVu Sans from Debian's
//! `fonts-dejavu-core` is loaded from disk; without it the plots are drawn
//! without any text.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;

use crate::error::Error;
use crate::report::Report;

/// Where the font is looked for.
pub const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Registers DejaVu Sans as "sans-serif" once; whether text can be drawn.
fn font() -> bool {
    static LOADED: OnceLock<bool> = OnceLock::new();
    *LOADED.get_or_init(|| {
        let Ok(bytes) = std::fs::read(FONT) else { return false };
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
    })
}

struct Line {
    name: String,
    points: Vec<(f64, f64)>,
}

struct Chart<'a> {
    title: &'a str,
    x: &'a str,
    y: &'a str,
    log_x: bool,
    log_y: bool,
    lines: Vec<Line>,
}

fn range(values: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite() && (!log || *v > 0.0)) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (1.0, 10.0);
    }
    if log {
        (lo / 1.5, hi * 1.5)
    } else {
        let pad = ((hi - lo) * 0.05).max(1e-9);
        (lo.min(0.0), hi + pad)
    }
}

fn draw(path: &Path, chart: &Chart<'_>, labels: bool) -> Result<(), String> {
    let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (x0, x1) = range(chart.lines.iter().flat_map(|l| l.points.iter().map(|p| p.0)), chart.log_x);
    let (y0, y1) = range(chart.lines.iter().flat_map(|l| l.points.iter().map(|p| p.1)), chart.log_y);
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if labels {
        builder.caption(chart.title, ("sans-serif", 24)).x_label_area_size(50).y_label_area_size(80);
    }
    macro_rules! body {
        ($ctx:expr) => {{
            let mut ctx = $ctx.map_err(|e| e.to_string())?;
            let mut mesh = ctx.configure_mesh();
            if labels {
                mesh.x_desc(chart.x).y_desc(chart.y);
            } else {
                mesh.x_labels(0).y_labels(0);
            }
            mesh.draw().map_err(|e| e.to_string())?;
            for (i, line) in chart.lines.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                let pts = line.points.iter().copied().filter(|p| p.0.is_finite() && p.1.is_finite());
                let series =
                    ctx.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2))).map_err(|e| e.to_string())?;
                if labels {
                    series
                        .label(line.name.as_str())
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
                }
                ctx.draw_series(pts.map(|p| Circle::new(p, 3, color.filled()))).map_err(|e| e.to_string())?;
            }
            if labels {
                ctx.configure_series_labels()
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK)
                    .position(SeriesLabelPosition::UpperLeft)
                    .draw()
                    .map_err(|e| e.to_string())?;
            }
        }};
    }
    match (chart.log_x, chart.log_y) {
        (true, true) => body!(builder.build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())),
        (true, false) => body!(builder.build_cartesian_2d((x0..x1).log_scale(), y0..y1)),
        (false, true) => body!(builder.build_cartesian_2d(x0..x1, (y0..y1).log_scale())),
        (false, false) => body!(builder.build_cartesian_2d(x0..x1, y0..y1)),
    }
    root.present().map_err(|e| e.to_string())
}

/// Draws every plot of `report` into `dir`; how many were written.
pub fn all(report: &Report, dir: &Path) -> Result<usize, Error> {
    let mut charts: Vec<(PathBuf, Chart<'_>)> = Vec::new();
    let per_round = report
        .strategies
        .iter()
        .map(|s| Line {
            name: s.strategy.clone(),
            points: s.rounds.iter().map(|r| (r.round as f64, r.wall_s)).collect(),
        })
        .collect();
    charts.push((
        dir.join("round_time.png"),
        Chart { title: "wall-clock per round", x: "round", y: "seconds", log_x: false, log_y: true, lines: per_round },
    ));
    if !report.sweep.is_empty() {
        let mut names: Vec<String> = Vec::new();
        for p in &report.sweep {
            if !names.contains(&p.strategy) {
                names.push(p.strategy.clone());
            }
        }
        let lines = |f: fn(&crate::report::SweepPoint) -> f64| -> Vec<Line> {
            names
                .iter()
                .map(|n| Line {
                    name: n.clone(),
                    points: report.sweep.iter().filter(|p| &p.strategy == n).map(|p| (p.nodes as f64, f(p))).collect(),
                })
                .collect()
        };
        charts.push((
            dir.join("sweep_round_time.png"),
            Chart {
                title: "round time vs nodes",
                x: "nodes",
                y: "seconds per round",
                log_x: true,
                log_y: true,
                lines: lines(|p| p.mean_round_s),
            },
        ));
        charts.push((
            dir.join("sweep_utilization.png"),
            Chart {
                title: "compute utilization vs nodes",
                x: "nodes",
                y: "utilization (%)",
                log_x: true,
                log_y: false,
                lines: lines(|p| 100.0 * p.utilization),
            },
        ));
    }
    let labels = font();
    for (path, chart) in &charts {
        draw(path, chart, labels).map_err(|reason| Error::Plot { path: path.clone(), reason })?;
    }
    Ok(charts.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_font_plots_have_no_text_but_are_drawn() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.png");
        let lines = vec![Line { name: "a".into(), points: vec![(10.0, 1.0), (100.0, 5.0), (1000.0, f64::NAN)] }];
        let chart = Chart { title: "t", x: "x", y: "y", log_x: true, log_y: true, lines };
        draw(&path, &chart, false).expect("draws");
        let bytes = std::fs::read(&path).expect("png");
        assert_eq!(&bytes[1..4], b"PNG");
    }
}
