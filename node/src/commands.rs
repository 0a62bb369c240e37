//! The subcommands, one file each, and the command line that picks one.
//!
//! Without a subcommand `pcp-node` joins the network ([`join`]): as a worker, a
//! shepherd (`--shepherd`), a standby candidate or a relay. The rest are
//! [`train`], [`generate`], [`sim`] (a whole network here), [`simulate`] (a
//! planet, no sockets), [`blob`], [`graph`], [`bench`], [`devices`] and
//! [`status`]; [`supervisor`] runs `--scale N` workers.

pub(crate) mod bench;
pub(crate) mod blob;
pub(crate) mod certify;
pub(crate) mod devices;
pub(crate) mod generate;
pub(crate) mod graph;
pub(crate) mod join;
pub(crate) mod loadtest;
pub(crate) mod sim;
pub(crate) mod simulate;
pub(crate) mod status;
pub(crate) mod supervisor;
pub(crate) mod train;

use crate::Failure;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// What `pcp-node --help` shows under the options: one line per way to use it.
const EXAMPLES: &str = "\
Examples:
  pcp-node --bootstrap <multiaddr> --backend rocm --target gfx942    join a run with a GPU
  pcp-node --shepherd --model nanogpt-small --data corpus.txt        shepherd a run
  pcp-node sim --nodes 4                                             run a shepherd and 3 workers here
  pcp-node status --bootstrap <multiaddr>                            can peers reach this machine? (NAT, relay)";

/// A pcp peer. Without a subcommand it joins the network.
#[derive(Debug, Parser)]
#[command(name = "pcp-node", version, about, after_help = EXAMPLES)]
struct Cli {
    #[command(flatten)]
    net: join::NetFlags,
    #[command(flatten)]
    shepherd: crate::diloco::ShepherdArgs,
    #[command(flatten)]
    worker: crate::diloco::WorkerArgs,
    #[command(flatten)]
    retention: crate::diloco::RetentionArgs,
    #[command(flatten)]
    tui: crate::observe::tui::TuiArgs,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant, reason = "parsed once, at start")]
enum Command {
    /// Add blobs to the store or fetch them from the network.
    Blob(blob::BlobArgs),
    /// Import, inspect and differentiate StableHLO models.
    #[command(subcommand)]
    Graph(graph::GraphCommand),
    /// Train a model on this node alone.
    Train {
        #[command(flatten)]
        args: train::TrainArgs,
        #[command(flatten)]
        local: join::LocalArgs,
    },
    /// Sample text from a checkpoint.
    Generate {
        #[command(flatten)]
        args: generate::GenerateArgs,
        #[command(flatten)]
        data_dir: join::DataDirArg,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Run a shepherd and N-1 workers of DiLoCo on this machine.
    Sim {
        #[command(flatten)]
        args: sim::SimArgs,
        #[command(flatten)]
        local: join::LocalArgs,
        #[command(flatten)]
        tui: crate::observe::tui::TuiArgs,
    },
    /// List the backends in this build and the devices each can see.
    Devices,
    /// Join for a few seconds and report whether peers can dial this node, its NAT's
    /// port mapping (can hole punching work?) and its address through a relay.
    Status(status::StatusArgs),
    /// Simulate a network of thousands of volunteers (seeded discrete events; no sockets).
    Simulate(pcp_simulations::SimulateArgs),
    /// Sign a worker's join certificate with this node's identity (the authorizer of a
    /// run started with `--admit authorizer KEY`).
    Certify {
        #[command(flatten)]
        args: certify::CertifyArgs,
        #[command(flatten)]
        data_dir: join::DataDirArg,
    },
    /// N synthetic workers against a real shepherd (`--shepherd ADDR`): real
    /// connections and signed contributions of the run's size, random values, a
    /// sleep in place of compute.
    Loadtest {
        #[command(flatten)]
        args: loadtest::LoadtestArgs,
        #[command(flatten)]
        data_dir: join::DataDirArg,
    },
}

/// Has glibc keep the memory a node frees for its next allocation rather than hand it
/// back to the kernel: trimmed arenas are faulted in again page by page, which cost a
/// blob transfer a tenth of its CPU time (yamux allocates every frame it sends and
/// receives). Blocks under 32 MiB come from the arenas, larger ones from `mmap`; arenas
/// shrink only once 256 MiB at their top is free.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it is called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

/// The dashboard a role shows, if any.
fn dashboard_mode(role: &join::Role) -> Option<crate::observe::tui::Mode> {
    match role {
        join::Role::Shepherd(..) | join::Role::Candidate(..) => Some(crate::observe::tui::Mode::Shepherd),
        join::Role::Worker(_) => Some(crate::observe::tui::Mode::Worker),
        join::Role::Relay => None,
    }
}

/// Whether the command shows the dashboard; `--tui` or `--no-tui` where it has
/// none is a usage error.
fn wants_dashboard(cli: &Cli) -> Result<bool, join::Usage> {
    let name = match &cli.command {
        None if cli.worker.scale.is_some() => "--scale",
        None => return Ok(cli.tui.wanted()),
        Some(Command::Sim { tui, .. }) => return Ok(tui.or(cli.tui).wanted()),
        Some(Command::Blob(_)) => "blob",
        Some(Command::Graph(_)) => "graph",
        Some(Command::Train { .. }) => "train",
        Some(Command::Generate { .. }) => "generate",
        Some(Command::Bench(_)) => "bench",
        Some(Command::Devices) => "devices",
        Some(Command::Status(_)) => "status",
        Some(Command::Simulate(_)) => "simulate",
        Some(Command::Loadtest { .. }) => "loadtest",
        Some(Command::Certify { .. }) => "certify",
    };
    if !cli.tui.given() {
        return Ok(false);
    }
    let flag = if cli.tui.tui { "--tui" } else { "--no-tui" };
    Err(join::Usage(if name == "--scale" {
        format!("{flag} is not an option of `pcp-node --scale` (its workers log to stderr)")
    } else {
        format!("{flag} is not an option of `pcp-node {name}` (see `pcp-node {name} --help`)")
    }))
}

/// Runs the command line's command, on the dashboard with `dashboard`.
fn run(cli: Cli, dashboard: bool) -> Result<(), Failure> {
    let root = cli.net;
    let retention = cli.retention;
    let offline = |command: &str| root.resolve(join::NetFlags::default(), command, join::Uses::Nothing);
    let command = match cli.command {
        Some(Command::Graph(command)) => {
            offline("graph")?;
            return graph::run(command);
        }
        Some(Command::Devices) => {
            offline("devices")?;
            return devices::run();
        }
        Some(Command::Simulate(args)) => {
            offline("simulate")?;
            return simulate::run(&args);
        }
        Some(Command::Certify { args, data_dir }) => {
            let net = root.resolve(data_dir.into(), "certify", join::Uses::DataDir)?;
            return certify::run(&args, &net.data_dir);
        }
        command => command,
    };
    let runtime = tokio::runtime::Runtime::new()
        .map_err(|e| Failure::from(anyhow::anyhow!("cannot start the async runtime: {e}")))?;
    runtime.block_on(async {
        match command {
            None if cli.worker.scale.is_some() => {
                let net = join::NetFlags::default().resolve(root, "", join::Uses::Network)?;
                let n = cli.worker.scale.unwrap_or(1);
                supervisor::run(n, net, cli.worker, retention).await
            }
            None => {
                let net = join::NetFlags::default().resolve(root, "", join::Uses::Network)?;
                let role = join::Role::from_args(&net, &cli.shepherd, &cli.worker, retention)?;
                let cancel = tokio_util::sync::CancellationToken::new();
                // `q` on the dashboard stops the node as Ctrl-C does; dropped, it restores the terminal
                // a relay (--no-train) has no run to show: it prints its plain lines
                let _dashboard = match dashboard_mode(&role) {
                    Some(mode) if dashboard => Some(crate::observe::tui::Dashboard::start(mode, cancel.clone())?),
                    _ => None,
                };
                join::run_node(&net, role, true, None, cancel).await
            }
            Some(Command::Blob(args)) => Ok(blob::run(&args, &root).await?),
            Some(Command::Status(args)) => Ok(status::run(&args, &root).await?),
            Some(Command::Train { args, local }) => {
                train::run(args, &root.resolve(local.into(), "train", join::Uses::Local)?).await
            }
            Some(Command::Generate { args, data_dir }) => {
                generate::run(args, &root.resolve(data_dir.into(), "generate", join::Uses::DataDir)?).await
            }
            Some(Command::Bench(command)) => bench::run(command, &root).await,
            Some(Command::Loadtest { args, data_dir }) => {
                let net = root.resolve(data_dir.into(), "loadtest", join::Uses::DataDir)?;
                loadtest::run(args, net.data_dir.join("loadtest")).await
            }
            Some(Command::Sim { mut args, local, .. }) => {
                args.retention = args.retention.or(retention);
                let net = root.resolve(local.into(), "sim", join::Uses::Local)?;
                let quit = tokio_util::sync::CancellationToken::new();
                let _dashboard = if dashboard {
                    Some(crate::observe::tui::Dashboard::start(crate::observe::tui::Mode::Sim, quit.clone())?)
                } else {
                    None
                };
                sim::run(args, &net, quit).await
            }
            Some(Command::Graph(_) | Command::Devices | Command::Simulate(_) | Command::Certify { .. }) => Ok(()),
        }
    })
}

/// Logs go to stderr through `tracing`; with the dashboard, to its log pane while it
/// is up (with pcp's own `info` lines), and to stderr again once it is closed.
fn init_logging(dashboard: bool) {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = |default: &str| {
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default))
    };
    let stderr = tracing_subscriber::fmt::layer()
        .with_writer(crate::observe::tui::Stderr)
        // colours only for a person reading a terminal, not in a log file
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(filter("warn,libp2p_kad=error"));
    let registry = tracing_subscriber::registry().with(stderr);
    if dashboard {
        registry.with(crate::observe::tui::Capture.with_filter(filter("warn,pcp_node=info,libp2p_kad=error"))).init();
    } else {
        registry.init();
    }
}

/// `pcp-node`'s entry point: parses the command line, runs it, and maps a
/// failure to a one-line error and its exit code.
pub fn main() -> ExitCode {
    keep_freed_memory();
    let cli = Cli::parse();
    if let Some(ordinal) = cli.worker.device_id {
        let ordinal = ordinal.to_string();
        for var in ["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"] {
            // SAFETY: no other thread exists yet (the runtime and logging start below).
            unsafe { std::env::set_var(var, &ordinal) };
        }
    }
    let dashboard = wants_dashboard(&cli);
    init_logging(dashboard.as_ref().is_ok_and(|d| *d));
    let result = dashboard.map_err(Failure::from).and_then(|dashboard| run(cli, dashboard));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            let chain: Vec<String> = failure.error().chain().map(ToString::to_string).collect();
            let mut message = chain.join(": ").replace('\n', " ");
            // anyhow's context often repeats its source; say each part once.
            for part in &chain[1..] {
                message = message.replace(&format!("{part}: {part}"), part);
            }
            eprintln!("error: {message}");
            ExitCode::from(failure.code())
        }
    }
}
