//! `pcp-node`: one binary for shepherds, workers and operators; this library is
//! all of it but `main`.
//!
//! * [`commands`]: the command line and one file per subcommand (`join` runs a
//!   node: worker, shepherd, candidate or relay).
//! * [`diloco`]: the DiLoCo roles over the network: shepherd, standby candidate,
//!   worker (and its overlapped rounds), the wire format, blob retention.
//! * [`training`]: what a step needs: the model, the data, the engine on a
//!   device, checkpoints and the experiment config.
//! * [`observe`]: what a run tells: the typed `--events` record, Prometheus
//!   metrics, the wandb bridge, the dashboard and progress bars.
#![allow(clippy::print_stdout, reason = "stdout belongs to the user: the CLI prints results there")]

pub mod commands;
pub(crate) mod diloco;
mod failure;
pub(crate) mod observe;
pub(crate) mod training;

pub use commands::main;
pub(crate) use failure::Failure;
