//! pcp at planet scale, before anyone rents a GPU: a seeded discrete-event
//! simulator that drives pcp's real DiLoCo state machines
//! ([`pcp_protocol::diloco::shepherd::Shepherd`] and
//! [`pcp_protocol::diloco::worker::Worker`]) with simulated time, links and
//! compute, and compares DiLoCo (star, and hierarchical: the star with
//! parameter-shard aggregators), Streaming DiLoCo and
//! synchronous all-reduce.
//!
//! * [`model`]: parameter counts, wire sizes and FLOPs of the model presets.
//! * [`compute`]: step time from FLOPs and a device, or measured.
//! * [`calibration`]: the shepherd's CPU costs per unit of work, a committed table
//!   (`simulate --calibrate` re-measures it).
//! * [`decode`]: CPU-time stopwatches, and the old start-up measurement of decode, validate and add.
//! * [`network`]: link profiles and max-min fair flows through a shared link.
//! * [`world`]: the seeded world (links, regions, stragglers, hostile workers).
//! * [`diloco`]: DiLoCo in a star on the real state machines, with churn.
//! * [`aggregators`]: parameter-shard aggregators in the star, on the protocol's assignment and votes.
//! * [`analytic`]: Streaming DiLoCo, ring all-reduce.
//! * [`ceiling`]: what screening committees given whole contributions cost the
//!   volunteers' uplinks, and the utilization they leave at most.
//! * [`report`]: per-round statistics, summaries and the printed table.
//! * [`plot`]: PNG plots.
//! * [`faults`]: a deterministic fault simulator of shepherd failover: the real
//!   election, failover, shepherd and worker rules under crashes, partitions, lossy
//!   links and clock jumps, with invariants checked after every step.
//!
//! The entry point is [`run`] with [`SimulateArgs`] (a clap `Args`, so
//! `pcp-node simulate` flattens it), or [`run_with_model`] for a model the
//! caller has measured. The same seed gives the same
//! `report.json`, byte for byte.

pub mod aggregators;
pub mod analytic;
mod args;
pub mod calibration;
pub mod ceiling;
pub mod compute;
pub mod cpu;
pub mod decode;
pub mod diloco;
mod error;
pub mod faults;
pub mod model;
pub mod network;
pub mod plot;
pub mod report;
mod run;
pub mod world;

pub use args::{ScreenMode, SimulateArgs, Strategy, Topology, WireEncoding};
pub use calibration::Calibration;
pub use compute::{ComputeModel, Device, StepTimeSource};
pub use decode::DecodeCost;
pub use error::Error;
pub use model::{ModelPreset, ModelSpec};
pub use network::Profile;
pub use report::Report;
pub use run::{calibrate, run, run_faults, run_with_model, to_json};
