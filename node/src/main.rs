//! `pcp-node`: one binary for shepherds, workers and operators.
#![allow(clippy::print_stdout, reason = "stdout belongs to the user: the CLI prints results there")]

mod bench;
mod blob;
mod checkpoint;
mod config;
mod data;
mod devices;
mod diloco;
mod engine;
mod events;
mod generate;
mod graph;
mod join;
mod model;
mod sim;
mod simulate;
mod train;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// A pcp peer. Without a subcommand it joins the network.
#[derive(Debug, Parser)]
#[command(name = "pcp-node", version, about)]
struct Cli {
    #[command(flatten)]
    net: join::NetArgs,
    #[command(flatten)]
    shepherd: diloco::ShepherdArgs,
    #[command(flatten)]
    worker: diloco::WorkerArgs,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Add blobs to the store or fetch them from the network.
    Blob(blob::BlobArgs),
    /// Import, inspect and differentiate StableHLO models.
    #[command(subcommand)]
    Graph(graph::GraphCommand),
    /// Train a model on this node alone.
    Train(train::TrainArgs),
    /// Sample text from a checkpoint.
    Generate(generate::GenerateArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Run a shepherd and N-1 workers of DiLoCo on this machine.
    Sim(sim::SimArgs),
    /// List the backends in this build and the devices each can see.
    Devices,
    /// Simulate a network of thousands of volunteers (seeded discrete events; no sockets).
    Simulate(pcp_simulations::SimulateArgs),
}

/// An error with the exit code it maps to: 2 for bad input, 1 otherwise.
#[derive(Debug)]
pub(crate) struct Failure {
    code: u8,
    error: anyhow::Error,
}

impl Failure {
    /// Bad input from the user: exit code 2.
    pub(crate) fn input(error: impl Into<anyhow::Error>) -> Self {
        Self { code: 2, error: error.into() }
    }

    /// What went wrong.
    pub(crate) fn error(&self) -> &anyhow::Error {
        &self.error
    }
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(error: E) -> Self {
        let error = error.into();
        let code = if error.downcast_ref::<join::Usage>().is_some() { 2 } else { 1 };
        Self { code, error }
    }
}

/// Keeps the training step's large host blocks for the next step instead of
/// returning them to the kernel (see [`pcp_runtime::HostAllocator`]).
#[global_allocator]
static ALLOC: pcp_runtime::HostAllocator = pcp_runtime::HostAllocator::new();

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

fn main() -> ExitCode {
    keep_freed_memory();
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,libp2p_kad=error")),
        )
        .init();
    let result = match cli.command {
        Some(Command::Graph(command)) => graph::run(command),
        Some(Command::Devices) => devices::run(),
        Some(Command::Simulate(args)) => simulate::run(&args),
        command => match tokio::runtime::Runtime::new() {
            Ok(runtime) => runtime.block_on(async {
                match command {
                    None => {
                        let role = join::Role::from_args(&cli.net, &cli.shepherd, &cli.worker)?;
                        let cancel = tokio_util::sync::CancellationToken::new();
                        join::run_node(&cli.net, role, true, None, cancel).await
                    }
                    Some(Command::Blob(args)) => Ok(blob::run(&args, &cli.net).await?),
                    Some(Command::Train(args)) => train::run(args, &cli.net).await,
                    Some(Command::Generate(args)) => generate::run(args, &cli.net).await,
                    Some(Command::Bench(command)) => bench::run(command, &cli.net).await,
                    Some(Command::Sim(args)) => sim::run(args, &cli.net).await,
                    Some(Command::Graph(_) | Command::Devices | Command::Simulate(_)) => unreachable!("handled above"),
                }
            }),
            Err(e) => Err(Failure::from(anyhow::anyhow!("cannot start the async runtime: {e}"))),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            let chain: Vec<String> = failure.error.chain().map(ToString::to_string).collect();
            let mut message = chain.join(": ").replace('\n', " ");
            // anyhow's context often repeats its source; say each part once.
            for part in &chain[1..] {
                message = message.replace(&format!("{part}: {part}"), part);
            }
            eprintln!("error: {message}");
            ExitCode::from(failure.code)
        }
    }
}
