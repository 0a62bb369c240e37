//! `pcp-node bench gpu-plan`: a GPU step's dispatches, priced without a GPU.

use std::io::Write as _;
use std::path::Path;

use crate::Failure;
use crate::commands::graph::{OptimizerArgs, load_batch};

/// The training step's dispatches on a GPU target, with their work, bytes,
/// roofline time at the target's peak and whether they use its matrix
/// instructions; needs no GPU.
#[derive(Debug, clap::Args)]
pub(crate) struct GpuPlanArgs {
    /// A preset (nanogpt-small, nanogpt-medium, gpt2-124m; built for the demo corpus's
    /// 65 characters) or a StableHLO loss module (`.mlir`).
    #[arg(long, default_value = "gpt2-124m")]
    model: String,
    /// cuda or rocm.
    #[arg(long, default_value = "cuda")]
    backend: String,
    /// The device: `sm_80`, `h100`, `gfx942`, `mi300x`, … [default: IREE's for the backend]
    #[arg(long)]
    target: Option<String>,
    /// Sequences per batch of a preset [default: the preset's].
    #[arg(long)]
    batch: Option<usize>,
    /// Print every dispatch as tab-separated rows (for `bench/gpu_report.py --plan`).
    #[arg(long)]
    tsv: bool,
    /// Rows of the table, slowest first.
    #[arg(long, default_value_t = 25)]
    rows: usize,
    /// The step's settings, as `graph compile` and the shepherd take them.
    #[command(flatten)]
    step: OptimizerArgs,
}

/// Steps measured on a GPU, for the plan's comparison: (model, backend, precision,
/// milliseconds a step, where). `docs/gpus.md` has the runs.
const MEASURED: &[(&str, &str, &str, f64, &str)] = &[
    ("gpt2-124m", "cuda", "bf16", 125.6, "an NVIDIA H200, bench/gpu_profile.sh, 2026-12-04"),
    ("gpt2-124m", "cuda", "f32", 1641.9, "an NVIDIA H200, bench/gpu_profile.sh, 2026-12-04"),
];

pub(crate) fn run(args: &GpuPlanArgs) -> Result<(), Failure> {
    let backend: pcp_graph::Backend = args.backend.parse().map_err(Failure::input)?;
    let target = pcp_graph::Target::parse(backend, args.target.as_deref()).map_err(Failure::input)?;
    let module = load_batch(Path::new(&args.model), args.batch)?;
    let config = args.step.config().map_err(Failure::input)?;
    let step = pcp_graph::train_step(&module, "main", &config)
        .map_err(|e| Failure::input(anyhow::anyhow!("{}: {e}", args.model)))?;
    let plan = pcp_graph::plan::plan(&step.module, &target, "train_step").map_err(|e| match e {
        pcp_graph::plan::PlanError::Backend(_) => Failure::input(e),
        other => Failure::from(anyhow::Error::new(other)),
    })?;
    let mut out = std::io::stdout().lock();
    if args.tsv {
        writeln!(out, "dispatch\tlaunches\tflops\tbytes\troofline_s\tmatrix")?;
        for d in &plan.dispatches {
            let roofline = plan.peak.map_or(String::new(), |p| format!("{:.3e}", d.roofline_s(&p)));
            let matrix = d.matrix_instructions.map_or("unknown", |m| if m { "yes" } else { "no" });
            writeln!(out, "{}\t{}\t{}\t{}\t{roofline}\t{matrix}", d.name, d.launches, d.flops, d.bytes)?;
        }
        return Ok(());
    }
    write!(out, "{}", table(&plan, &args.model, &args.step.precision, args.rows))?;
    Ok(())
}

/// The plan as markdown: a summary, then the `rows` dispatches with the longest
/// roofline time a step.
fn table(plan: &pcp_graph::plan::Plan, model: &str, precision: &str, rows: usize) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let contractions: Vec<_> = plan.dispatches.iter().filter(|d| d.is_contraction()).collect();
    let low: Vec<_> = contractions.iter().filter(|d| d.low_precision).collect();
    let with_matrix = low.iter().filter(|d| d.matrix_instructions == Some(true)).count();
    let _ = writeln!(s, "gpu-plan: {model} {precision} step for {}, @{}", plan.target, plan.function);
    let _ = writeln!(
        s,
        "{} dispatches, {} launches a step; {} contractions, {} of them with bf16 operands, {with_matrix} of those on matrix instructions",
        plan.dispatches.len(),
        plan.launches(),
        contractions.len(),
        low.len(),
    );
    let Some(peak) = plan.peak else {
        let _ = writeln!(s, "no peak rates known for {}: no roofline", plan.target);
        return s;
    };
    let per_step = |d: &&pcp_graph::plan::Dispatch| d.roofline_s(&peak) * f64::from(d.launches);
    let total = plan.roofline_s().unwrap_or(0.0);
    let in_contractions: f64 = contractions.iter().map(per_step).sum();
    let _ = writeln!(
        s,
        "priced at an {} (datasheet, dense): bf16 {} TFLOP/s, f32 {} TFLOP/s, memory {} GB/s",
        peak.device, peak.bf16_tflops, peak.f32_tflops, peak.memory_gbs
    );
    let _ = writeln!(
        s,
        "roofline: {:.2} ms a step ({:.2} ms in contractions, {:.2} ms in the rest)",
        total * 1e3,
        in_contractions * 1e3,
        (total - in_contractions) * 1e3
    );
    let backend = plan.target.backend.name();
    if let Some((_, _, _, ms, where_)) =
        MEASURED.iter().find(|(m, b, p, _, _)| *m == model && *b == backend && *p == precision)
    {
        let _ = writeln!(s, "measured: {ms:.1} ms a step on {where_}: {:.1}× the roofline", ms / (total * 1e3));
    }
    let _ = writeln!(s);
    let _ = writeln!(s, "| dispatch | launches | GFLOP | MB | bound | µs a launch | ms a step | matrix instructions |");
    let _ = writeln!(s, "| --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut sorted: Vec<_> = plan.dispatches.iter().collect();
    sorted.sort_by(|a, b| per_step(b).total_cmp(&per_step(a)));
    for d in sorted.iter().take(rows) {
        let rate = if d.low_precision { peak.bf16_tflops } else { peak.f32_tflops } * 1e12;
        let bound = if d.flops / rate >= d.bytes / (peak.memory_gbs * 1e9) { "compute" } else { "memory" };
        let matrix = match (d.is_contraction(), d.matrix_instructions) {
            (false, _) => "",
            (true, Some(true)) => "yes",
            (true, Some(false)) => "no",
            (true, None) => "not found",
        };
        let name = d.name.split_once("_dispatch_").map_or(d.name.as_str(), |(_, n)| n);
        let _ = writeln!(
            s,
            "| `{name}` | {} | {:.2} | {:.1} | {bound} | {:.1} | {:.3} | {matrix} |",
            d.launches,
            d.flops / 1e9,
            d.bytes / 1e6,
            d.roofline_s(&peak) * 1e6,
            per_step(d) * 1e3
        );
    }
    if sorted.len() > rows {
        let rest: f64 = sorted[rows..].iter().map(per_step).sum();
        let _ = writeln!(s, "| {} others | | | | | | {:.3} | |", sorted.len() - rows, rest * 1e3);
    }
    s
}
