//! Every event of the `--events FILE` stream, typed.
//!
//! [`Event`] is internally tagged by `"event"`, so an event serializes to the
//! JSON object it is on disk (less the `"t"` that [`super::Events::emit`] adds),
//! and a line of an events file parses back into one (`serde_json::from_str`;
//! its `"t"` is ignored). The
//! consumers (the TUI, the metrics) match on its variants: a field they read
//! cannot be renamed without a compile error, and the golden test
//! (`node/tests/events_golden.rs`) pins the names on disk.
//!
//! Each variant holds a struct of the event's fields. Fields absent from a line
//! take their default when it is parsed (an older file, a hand-written test);
//! floats that were not finite are written as `null` and read back as NaN.

use serde::{Deserialize, Deserializer, Serialize};

/// `null` (how serde_json writes a NaN or an infinity) as NaN.
fn nan_if_null<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Why a worker left a shepherd's run: `worker_left`'s `reason`, as written on disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Departure {
    /// It said it was leaving.
    #[default]
    #[serde(rename = "left")]
    Left,
    /// No heartbeat of it arrived within the heartbeat timeout.
    #[serde(rename = "heartbeat timeout")]
    HeartbeatTimeout,
}

/// Declares the field structs of the events: every field public, every struct
/// defaulted when parsed.
macro_rules! fields {
    ($($(#[$meta:meta])* $name:ident { $($(#[$fmeta:meta])* $field:ident: $ty:ty),* $(,)? })*) => {
        $(
            $(#[$meta])*
            #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
            #[serde(default)]
            pub(crate) struct $name {
                $($(#[$fmeta])* pub(crate) $field: $ty,)*
            }
        )*
    };
}

/// Every event of the stream, by its `"event"` name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub(crate) enum Event {
    // `pcp-node train`
    Step(Step),
    /// How a step's batch is split to fit the device (train, and a worker when it joins).
    MicroBatches(MicroBatches),
    Eval(Eval),
    /// A checkpoint of `pcp-node train` (by step) or of a shepherd (by round).
    Checkpoint(Checkpoint),
    // the supervisor (`--workers N`)
    WorkerSpawned(WorkerSpawned),
    WorkerExited(WorkerExited),
    SupervisorStopped(SupervisorStopped),
    // a shepherd
    RunStarted(RunStarted),
    Resumed(Resumed),
    ShepherdElected(ShepherdElected),
    SteppedDown(SteppedDown),
    CommitTimedOut(CommitTimedOut),
    RoundStarted(RoundStarted),
    HigherTermReported(HigherTermReported),
    ContributionReceived(ContributionReceived),
    CompileStarted(CompileStarted),
    ArtifactPublished(ArtifactPublished),
    CompileFailed(CompileFailed),
    ContributionRejected(ContributionRejected),
    /// A volunteer sums these parameter shards of a round (`--aggregators`).
    AggregatorAssigned(AggregatorAssigned),
    /// A shard's mean is in: its aggregators agreed on it, or the shepherd summed it.
    ShardAggregated(ShardAggregated),
    /// A shard's aggregators disagreed or fell silent: the shepherd summed the shard
    /// itself, and the `liars` never sum again.
    AggregateDisputed(AggregateDisputed),
    /// A contribution the per-tensor bounds changed (values clipped, tensors scaled down).
    ContributionBounded(ContributionBounded),
    /// A contribution counted at less than its samples: probation, or a rating below the median.
    ContributionDiscounted(ContributionDiscounted),
    /// A round's screening: its cost, and its committed (and now revealed) secret seed.
    ScreenRound(ScreenRound),
    /// A contribution's screening committee was drawn (`--screeners`).
    ScreenAssigned(ScreenAssigned),
    /// A committee member's losses for a contribution.
    ScreenReported(ScreenReported),
    /// A screener's losses contradict the shepherd's own: it loses its rating and
    /// never screens again.
    ScreenerCaught(ScreenerCaught),
    /// A contribution's screen decided: by its committee or the shepherd.
    ScreenDecided(ScreenDecided),
    WorkerJoined(WorkerJoined),
    WorkerLeft(WorkerLeft),
    AdmissionHeld(AdmissionHeld),
    DeadlineExtended(DeadlineExtended),
    ContributionClipped(ContributionClipped),
    RoundCompleted(RoundCompleted),
    /// A shepherd's (no `run`) or a worker's (with `run`).
    RunFinished(RunFinished),
    BlobsReleased(BlobsReleased),
    // a candidate
    Standby(Standby),
    Campaign(Campaign),
    Deferred(Deferred),
    StateReplicated(StateReplicated),
    // a worker
    RunJoined(RunJoined),
    RunLeft(RunLeft),
    RoundRefused(RoundRefused),
    RoundAnnounced(RoundAnnounced),
    ParamsFetched(ParamsFetched),
    UpdateLate(UpdateLate),
    UpdateMerged(UpdateMerged),
    ContributionSent(ContributionSent),
    /// A worker on a screening committee answered a screen request.
    ScreenAnswered(ScreenAnswered),
    RoundAbandoned(RoundAbandoned),
    /// A worker's or a candidate's: the leader's lease ran out.
    LeaseExpired(LeaseExpired),
    LeaderFollowed(LeaderFollowed),
    // `pcp-node sim`
    WorkerStarted(WorkerStarted),
    WorkerKilled(WorkerKilled),
    WorkerRestarted(WorkerRestarted),
    ShepherdKilled(ShepherdKilled),
    // the swarm ([`pcp_bootstrap::Event`], see [`super::EventLog`])
    Listening(Listening),
    PeerConnected(PeerConnected),
    BootstrapFailed(BootstrapFailed),
    PeerDiscovered(PeerDiscovered),
    BlobFetched(BlobFetched),
    /// A request the swarm refused (`peer`, `reason`), or a lease refused by
    /// the election (with `kind` and `term`).
    MessageRejected(MessageRejected),
    ReachabilityChanged(ReachabilityChanged),
    RelayReserved(RelayReserved),
    RelayLost(RelayLost),
    RelayedConnection(RelayedConnection),
    HolePunched(HolePunched),
    RelayService(RelayService),
    RelayReservation(RelayReservation),
    RelayCircuit(RelayCircuit),
    PortMapping(PortMapping),
}

impl Event {
    /// The event's `"event"` name.
    pub(crate) fn name(&self) -> String {
        match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(mut map)) => match map.remove("event") {
                Some(serde_json::Value::String(name)) => name,
                _ => String::new(),
            },
            _ => String::new(),
        }
    }

    /// The event `name` with `fields` (a JSON object), as a test writes it.
    #[cfg(test)]
    pub(crate) fn named(name: &str, fields: serde_json::Value) -> Self {
        let mut object = match fields {
            serde_json::Value::Object(map) => map,
            _ => serde_json::Map::new(),
        };
        object.insert("event".into(), name.into());
        serde_json::from_value(serde_json::Value::Object(object)).expect("a known event")
    }

    /// Whether `name` is an event's name.
    #[cfg(test)]
    pub(crate) fn known(name: &str) -> bool {
        serde_json::from_value::<Self>(serde_json::json!({ "event": name })).is_ok()
    }

    /// Whether the event `name` has a field `field` (for checks of what other
    /// programs read from the stream).
    #[cfg(test)]
    pub(crate) fn has_field(name: &str, field: &str) -> bool {
        use serde_json::json;
        let samples = [json!(1), json!(0.5), json!("x"), json!(true), json!(["x"]), json!([])];
        samples.iter().any(|sample| {
            let mut object = serde_json::Map::new();
            object.insert("event".into(), name.into());
            object.insert(field.into(), sample.clone());
            serde_json::from_value::<Self>(serde_json::Value::Object(object))
                .ok()
                .and_then(|e| serde_json::to_value(e).ok())
                .is_some_and(|out| out.get(field).is_some())
        })
    }
}

fields! {
    Step { step: u64, #[serde(deserialize_with = "nan_if_null")] loss: f64, lr: f64, tokens_per_s: f64 }
    Eval { step: u64, #[serde(deserialize_with = "nan_if_null")] val_loss: f64 }
    MicroBatches {
        /// Sequences per optimizer step.
        batch: u64,
        /// Micro-batches per step (1: the whole batch at once).
        micro_batches: u64,
        /// Sequences per micro-batch.
        micro_batch: u64,
        /// The memory the step may use, in bytes, and where that figure came from:
        /// `flag` (`--free-memory`), `host` (MemAvailable, cpu) or `unknown`.
        free_bytes: u64,
        free_from: String,
        /// The expected peak of a micro-batch's step, in bytes.
        estimate_bytes: u64,
        /// The activations the backward recomputes: the run's, or a stronger mode
        /// when not even one sequence fits without it.
        recompute: String,
        /// The cpu's L2 bytes the micro-batch was sized to fit, when the batch was
        /// split to keep its activations in cache rather than to fit memory; else 0.
        #[serde(default)]
        cache_bytes: u64,
    }
    Checkpoint {
        #[serde(skip_serializing_if = "Option::is_none")] step: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")] round: Option<u64>,
        path: String,
    }
    WorkerSpawned { index: u64, pid: Option<u32>, restarts: u64, data_dir: String }
    WorkerExited { index: u64, pid: Option<u32>, status: String, ran_s: f64, restart_in_s: f64 }
    SupervisorStopped { signal: String, workers: u64 }
    RunStarted {
        run: String, model: String, rounds: u64, tau: u64, resumed_round: u64, params_hash: String,
        encoding: String, encoding_spec: String, overlap: bool,
        /// The matmuls' precision: `f32` or `bf16`.
        precision: String,
        /// Activations the backward recomputes: `none`, `attention`, `elementwise` or `blocks`.
        recompute: String,
        /// How the candidates agree: `majority`, or `best-effort` (1–2 candidates, or
        /// `--failover best-effort`).
        #[serde(default)]
        failover: String,
        /// The coordinator candidates, this one included.
        #[serde(default)]
        candidates: u64,
        /// Where the shepherd's own engine screens and validates (`cpu`,
        /// `vulkan`, `cuda:sm_90`, …); empty when it runs no model.
        #[serde(default)]
        engine: String,
    }
    Resumed { round: u64, params_hash: String }
    ShepherdElected { term: u64, peer: String, round: u64, params_hash: String }
    /// `leader` is empty, and `reason` given, when it stepped aside.
    SteppedDown {
        term: u64, peer: String, newer: u64, leader: String,
        #[serde(skip_serializing_if = "Option::is_none")] reason: Option<String>,
    }
    CommitTimedOut { round: u64, waiting: Vec<String> }
    /// `waited_ms`: how long its release waited for the candidates.
    RoundStarted {
        round: u64, deadline_unix_ms: u64, params_hash: String, participants: Vec<String>, term: u64, waited_ms: u64,
    }
    HigherTermReported { term: u64, reported: u64, peer: String }
    ContributionReceived {
        round: u64, peer: String, tokens: u64, #[serde(deserialize_with = "nan_if_null")] loss: f64, bytes: u64,
        bytes_down: u64, accepted: bool, reason: String,
    }
    CompileStarted { backend: String, target: String }
    ArtifactPublished { backend: String, target: String, hash: String, bytes: u64 }
    CompileFailed { backend: String, target: String, reason: String }
    ContributionRejected { round: u64, peer: String, reason: String }
    AggregatorAssigned { round: u64, peer: String, shards: Vec<u64> }
    /// `recomputed`: the shepherd summed it from the committed slices.
    /// `seconds`: from the round's close to the mean.
    ShardAggregated {
        round: u64, shard: u64, hash: String, contributions: u64, recomputed: bool,
        #[serde(deserialize_with = "nan_if_null")] seconds: f64,
    }
    AggregateDisputed { round: u64, shard: u64, liars: Vec<String>, reason: String }
    ContributionBounded { round: u64, peer: String, elements: u64, tensors: u64 }
    ContributionDiscounted { round: u64, peer: String, factor: f64, reason: String }
    /// `seconds` scoring contributions, `share` of the round's; `hidden`: the batch came
    /// from the split workers never receive; `commit` was announced with the round and
    /// `seed` (blake3 of `pcp/screen-seed/v1` and it is `commit`) is revealed with the next.
    ScreenRound {
        round: u64, screened: u64, skipped: u64, over_budget: u64, seconds: f64, share: f64, hidden: bool,
        commit: String, seed: String,
    }
    /// `seconds` the worker's engine spent scoring it; `reason`: why it could not
    /// (empty when it answered with losses).
    ScreenAnswered { round: u64, contribution: String, seconds: f64, reason: String }
    /// `contribution`: the first 8 hex digits of its hash; `peer`: its sender.
    ScreenAssigned { round: u64, contribution: String, peer: String, screeners: Vec<String> }
    ScreenReported {
        round: u64, contribution: String, screener: String, before: f64, after: f64, reversed: f64,
    }
    /// `claimed`: its losses (before, after, reversed); `checked`: the shepherd's.
    ScreenerCaught { round: u64, contribution: String, screener: String, claimed: Vec<f64>, checked: Vec<f64> }
    /// `source`: `committee` or `shepherd`; `why` (the shepherd's): `no committee`,
    /// `spot check`, `disagreement` or `silence`; `silent`: members that never answered.
    ScreenDecided {
        round: u64, contribution: String, peer: String, source: String, why: String, passed: bool,
        silent: Vec<String>,
    }
    WorkerJoined { peer: String, backend: String }
    WorkerLeft { peer: String, reason: Departure }
    /// What a shepherd keeps of its workers' admission at a round's close: the hellos
    /// it holds (`live` workers, `waiting` for their first heartbeat, `left` recently),
    /// the new keys admitted over the last hour and the bits a new key's proof of work needs.
    AdmissionHeld { round: u64, hellos: u64, live: u64, waiting: u64, left: u64, joins_last_hour: u64, pow_bits: u64 }
    DeadlineExtended { round: u64, deadline_unix_ms: u64 }
    ContributionClipped {
        peer: String, round: u64, #[serde(deserialize_with = "nan_if_null")] norm: f64,
        #[serde(deserialize_with = "nan_if_null")] bound: f64, reason: String,
    }
    RoundCompleted {
        round: u64, contributors: u64, #[serde(deserialize_with = "nan_if_null")] mean_loss: f64,
        #[serde(deserialize_with = "nan_if_null")] val_loss: f64, bytes_in: u64, bytes_out: u64,
        #[serde(deserialize_with = "nan_if_null")] seconds: f64, params_hash: String, peers: Vec<String>,
        excluded: Vec<String>, clipped: u64, #[serde(deserialize_with = "nan_if_null")] norm_bound: f64,
        encoding: String, update_bytes: u64, workers: Vec<WorkerTraffic>, utilization: Option<f64>,
        /// Overlap: contributors whose contribution for the round before arrived late and was averaged here.
        carried: Vec<String>,
        /// Overlap: the round's compute budget, milliseconds of inner steps.
        budget_ms: Option<u64>,
    }
    /// One contributor of a completed round.
    WorkerTraffic { peer: String, bytes_up: u64, bytes_down: u64, utilization: Option<f64> }
    RunFinished {
        #[serde(skip_serializing_if = "Option::is_none")] run: Option<String>,
        rounds: u64,
        #[serde(skip_serializing_if = "Option::is_none")] val_loss: Option<f64>,
        #[serde(skip_serializing_if = "Option::is_none")] params_hash: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")] seconds: Option<f64>,
    }
    BlobsReleased { round: u64, count: u64, bytes: u64, deferred: u64, failed: u64 }
    Standby { run: String, term: u64, peer: Option<String>, aside: bool }
    /// A candidate whose turn came asks the others for votes (`pre`: pre-votes first).
    Campaign { term: u64, pre: bool }
    Deferred { term: u64, to: String, their_round: u64, round: Option<u64> }
    StateReplicated { round: u64, term: u64, params_hash: String }
    RunJoined {
        run: String, shepherd: String, backend: String, target: String, artifact: String, screen: String,
        trim: f64, rounds: u64, tau: u64, encoding: String, encoding_spec: String, overlap: bool,
    }
    RunLeft { run: String, reason: String }
    RoundRefused { round: u64, term: u64, reason: String }
    RoundAnnounced { round: u64, deadline_unix_ms: u64, participant: bool }
    ParamsFetched { round: u64, via: String, bytes: u64, shards: u64, of: u64 }
    UpdateLate { round: u64, waited_ms: u64 }
    UpdateMerged { round: u64, after_steps: u64, bytes: u64, via: String }
    ContributionSent {
        round: u64, #[serde(deserialize_with = "nan_if_null")] loss: f64, bytes: u64, param_bytes: u64,
        #[serde(deserialize_with = "nan_if_null")] ratio: f64, accepted: bool, reason: String, tokens: u64,
        #[serde(deserialize_with = "nan_if_null")] seconds: f64, bytes_up: u64, bytes_down: u64,
        utilization: Option<f64>, train_s: f64, wall_s: f64,
    }
    /// `reason` is absent when it was abandoned after `steps` steps.
    RoundAbandoned { round: u64, steps: u64, #[serde(skip_serializing_if = "Option::is_none")] reason: Option<String> }
    LeaseExpired { term: u64, peer: String }
    LeaderFollowed { term: u64, peer: String }
    WorkerStarted { worker: u64, peer: String, round: u64 }
    WorkerKilled { round: u64, worker: u64 }
    WorkerRestarted { round: u64, worker: u64 }
    ShepherdKilled { round: u64, node: u64 }
    Listening { peer: String, addr: String }
    PeerConnected { peer: String, addr: String }
    BootstrapFailed { addr: String, reason: String, retry_in_s: f64 }
    PeerDiscovered { peer: String }
    BlobFetched { hash: String, bytes: u64, providers: u64, seconds: f64, chunks: u64, chunks_relayed: u64 }
    MessageRejected {
        peer: String,
        #[serde(skip_serializing_if = "Option::is_none")] kind: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")] term: Option<u64>,
        reason: String,
    }
    ReachabilityChanged { reachability: String, addr: Option<String> }
    RelayReserved { relay: String, addr: String, renewal: bool, limit_bytes: Option<u64>, limit_s: Option<u64> }
    RelayLost { relay: String, reason: String }
    RelayedConnection { peer: String, relay: Option<String>, addr: String, inbound: bool }
    /// `result` is `ok` (with `addr`) or `failed` (with `reason`).
    HolePunched {
        peer: String, result: String,
        #[serde(skip_serializing_if = "Option::is_none")] addr: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")] reason: Option<String>,
    }
    RelayService { enabled: bool }
    RelayReservation { peer: String, accepted: bool, reason: Option<String> }
    RelayCircuit { src: String, dst: String, state: String, reason: Option<String> }
    /// `result` is `ok` (with `addr`) or `failed` (with `reason`).
    PortMapping {
        result: String,
        #[serde(skip_serializing_if = "Option::is_none")] addr: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")] reason: Option<String>,
    }
}
