//! DiLoCo over the network: the shepherd and worker roles of `pcp-node`.
//!
//! The pure state machines live in `pcp_protocol::diloco`; this module connects them
//! to a swarm, the compiler and the device:
//!
//! * A worker finds a run through the DHT (every shepherd provides a well-known key
//!   and its run id), asks the shepherd to join with its backend and target, and gets
//!   back the signed run manifest with an artifact compiled for it. It fetches the
//!   artifact and the corpus as blobs, then heartbeats; each heartbeat's answer is the
//!   shepherd's signed round announcement. For each round it fetches the parameters
//!   blob, runs τ inner steps with AdamW state that persists across rounds, and sends
//!   its signed pseudo-gradient back by request-response.
//! * The shepherd compiles on demand for each (backend, target), publishes artifacts
//!   and each round's parameters as blobs, gossips announcements and heartbeats on the
//!   run's topic, aggregates contributions, applies the outer Nesterov step, and
//!   checkpoints every round.
//! * Every role keeps the blobs of its last `--keep-rounds` rounds and what it pins,
//!   and releases the rest as rounds complete (see [`retention`]).

mod candidate;
mod consensus;
pub(crate) mod inbox;
pub(crate) mod participants;
mod refusal;
mod retention;
pub(crate) mod scoring;
mod shepherd;
pub(crate) mod wire;
mod worker;

/// What a role gets from the node it runs on.
#[derive(Debug)]
pub(crate) struct RoleIo {
    /// The swarm.
    pub(crate) node: pcp_bootstrap::Node,
    /// The node's key, for signing.
    pub(crate) identity: pcp_protocol::Identity,
    /// The node's data directory.
    pub(crate) data_dir: std::path::PathBuf,
    /// The `--events` stream.
    pub(crate) events: crate::observe::events::Events,
}

pub(crate) use candidate::{Begin, STANDBY, run as candidate_run};
pub(crate) use refusal::Refusal;
pub(crate) use retention::{Retention, RetentionArgs};
pub(crate) use shepherd::{
    SPARSE_OUTER_LR, Screen, ShepherdArgs, ShepherdHooks, ShepherdPlan, Trust, TrustArgs, parse_encoding, parse_key,
    parse_share, parse_trim,
};
pub(crate) use worker::{
    Attack, HOSTILE_KINDS, Hostile, ReplaySlot, Standalone, WorkerArgs, WorkerPlan, commit_slices, cut_slices,
    run as worker_run, screen_request_overhead, send_slices,
};
