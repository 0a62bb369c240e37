//! The `--events FILE` stream: one JSON object per line, each with `"t"`
//! (unix seconds) and `"event"`, flushed as it is written.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use pcp_bootstrap::{Event as SwarmEvent, PeerId, Reachability, RelayService as SwarmRelay};
use serde_json::Value;

pub(crate) mod kinds;

pub(crate) use kinds::*;

/// A cloneable JSONL sink; a no-op when no file was given.
#[derive(Clone, Debug, Default)]
pub(crate) struct Events {
    out: Option<Arc<Mutex<BufWriter<File>>>>,
}

impl Events {
    /// Appends to `path`, or discards events when `None`.
    pub(crate) fn open(path: Option<&Path>) -> anyhow::Result<Self> {
        let out = match path {
            Some(path) => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|e| anyhow::anyhow!("cannot open events file {}: {e}", path.display()))?;
                Some(Arc::new(Mutex::new(BufWriter::new(file))))
            }
            None => None,
        };
        Ok(Self { out })
    }

    /// Writes `{"t":…,"event":name,…fields}` (keys in serde_json's sorted order).
    /// The same line goes to the wandb bridge when one runs ([`crate::observe::wandb`]),
    /// whether or not an events file was given.
    pub(crate) fn emit(&self, event: Event) {
        crate::observe::metrics::observe(&event);
        crate::observe::tui::observe(&event);
        let to_wandb = crate::observe::wandb::active();
        if self.out.is_none() && !to_wandb {
            return;
        }
        let Some(mut line) = line(&event) else { return };
        line.push('\n');
        let Some(out) = &self.out else {
            crate::observe::wandb::send(line);
            return;
        };
        if to_wandb {
            crate::observe::wandb::send(line.clone());
        }
        let Ok(mut out) = out.lock() else { return };
        // An events file that stops accepting writes must not stop training.
        let written = out.write_all(line.as_bytes()).and_then(|()| out.flush());
        if let Err(e) = written {
            tracing::warn!("cannot write event {}: {e}", event.name());
        }
    }
}

/// The JSON line of `event` (without its newline), stamped now.
fn line(event: &Event) -> Option<String> {
    let Ok(Value::Object(mut object)) = serde_json::to_value(event) else {
        tracing::warn!("cannot serialize event {event:?}");
        return None;
    };
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    object.insert("t".into(), t.into());
    Some(Value::Object(object).to_string())
}

/// Network events from the swarm, written to an [`Events`] stream.
#[derive(Debug)]
pub(crate) struct EventLog {
    events: Events,
    local: PeerId,
}

impl EventLog {
    pub(crate) fn open(path: Option<&Path>, local: PeerId) -> anyhow::Result<Self> {
        Ok(Self { events: Events::open(path)?, local })
    }

    /// The stream's event for `event`, or `None` for events that are not part
    /// of the stream.
    pub(crate) fn event(&self, event: &SwarmEvent) -> Option<Event> {
        let (ok, failed) = ("ok".to_owned(), "failed".to_owned());
        Some(match event {
            SwarmEvent::Listening { addr } => {
                Event::Listening(Listening { peer: self.local.to_string(), addr: addr.to_string() })
            }
            SwarmEvent::PeerConnected { peer, addr } => {
                Event::PeerConnected(PeerConnected { peer: peer.to_string(), addr: addr.to_string() })
            }
            SwarmEvent::BootstrapFailed { addr, reason, retry_in } => Event::BootstrapFailed(BootstrapFailed {
                addr: addr.to_string(),
                reason: reason.clone(),
                retry_in_s: retry_in.as_secs_f64(),
            }),
            SwarmEvent::PeerDiscovered { peer } => Event::PeerDiscovered(PeerDiscovered { peer: peer.to_string() }),
            SwarmEvent::BlobFetched { hash, bytes, providers, seconds, chunks, chunks_relayed } => {
                Event::BlobFetched(BlobFetched {
                    hash: hash.to_hex(),
                    bytes: *bytes,
                    providers: *providers as u64,
                    seconds: *seconds,
                    chunks: u64::from(*chunks),
                    chunks_relayed: u64::from(*chunks_relayed),
                })
            }
            SwarmEvent::MessageRejected { peer, reason } => Event::MessageRejected(MessageRejected {
                peer: peer.to_string(),
                kind: None,
                term: None,
                reason: reason.clone(),
            }),
            SwarmEvent::Reachability(r) => {
                let addr = match r {
                    Reachability::Public(a) => Some(a.to_string()),
                    _ => None,
                };
                Event::ReachabilityChanged(ReachabilityChanged { reachability: r.name().to_string(), addr })
            }
            SwarmEvent::RelayReserved { relay, addr, renewal, limit_bytes, limit_seconds } => {
                Event::RelayReserved(RelayReserved {
                    relay: relay.to_string(),
                    addr: addr.to_string(),
                    renewal: *renewal,
                    limit_bytes: *limit_bytes,
                    limit_s: *limit_seconds,
                })
            }
            SwarmEvent::RelayLost { relay, reason } => {
                Event::RelayLost(RelayLost { relay: relay.to_string(), reason: reason.clone() })
            }
            SwarmEvent::RelayedConnection { peer, relay, addr, inbound } => {
                Event::RelayedConnection(RelayedConnection {
                    peer: peer.to_string(),
                    relay: relay.map(|r| r.to_string()),
                    addr: addr.to_string(),
                    inbound: *inbound,
                })
            }
            SwarmEvent::HolePunched { peer, result } => Event::HolePunched(match result {
                Ok(addr) => {
                    HolePunched { peer: peer.to_string(), result: ok, addr: Some(addr.to_string()), reason: None }
                }
                Err(reason) => {
                    HolePunched { peer: peer.to_string(), result: failed, addr: None, reason: Some(reason.clone()) }
                }
            }),
            SwarmEvent::Relayed(SwarmRelay::Status { enabled }) => {
                Event::RelayService(RelayService { enabled: *enabled })
            }
            SwarmEvent::Relayed(SwarmRelay::Reservation { peer, refused }) => {
                Event::RelayReservation(RelayReservation {
                    peer: peer.to_string(),
                    accepted: refused.is_none(),
                    reason: refused.clone(),
                })
            }
            SwarmEvent::Relayed(SwarmRelay::Circuit { src, dst, state, reason }) => Event::RelayCircuit(RelayCircuit {
                src: src.to_string(),
                dst: dst.to_string(),
                state: (*state).to_owned(),
                reason: reason.clone(),
            }),
            SwarmEvent::PortMapping { result } => Event::PortMapping(match result {
                Ok(addr) => PortMapping { result: ok, addr: Some(addr.to_string()), reason: None },
                Err(reason) => PortMapping { result: failed, addr: None, reason: Some(reason.clone()) },
            }),
            SwarmEvent::Gossip { .. } | SwarmEvent::Request { .. } => return None,
        })
    }

    /// Appends `event`.
    pub(crate) fn write(&mut self, event: &SwarmEvent) -> anyhow::Result<()> {
        if let Some(event) = self.event(event) {
            self.events.emit(event);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_one_object_per_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("events.jsonl");
        let events = Events::open(Some(&path)).expect("open");
        events.emit(Event::Step(Step { step: 1, loss: 4.5, lr: 0.001, tokens_per_s: 100.0 }));
        events.clone().emit(Event::Eval(Eval { step: 1, val_loss: 4.4 }));
        let text = std::fs::read_to_string(&path).expect("read");
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["event"], "step");
        assert_eq!(lines[0]["loss"], 4.5);
        assert!(lines[1]["t"].as_f64().expect("t") > 1.7e9);
        Events::default().emit(Event::Eval(Eval { step: 2, val_loss: 4.3 }));
        // a line of the file is the event again
        let again: Event = serde_json::from_str(text.lines().next().expect("a line")).expect("an event");
        assert_eq!(again, Event::Step(Step { step: 1, loss: 4.5, lr: 0.001, tokens_per_s: 100.0 }));
    }

    /// The typed events write the objects the `json!` literals before them
    /// wrote: the same names, fields, JSON types, nulls and absences.
    #[test]
    fn events_serialize_as_they_always_did() {
        let loss = 0.1f32;
        let cases = [
            (
                Event::ContributionReceived(ContributionReceived {
                    round: 3,
                    peer: "p".into(),
                    tokens: 10,
                    loss: f64::from(loss),
                    bytes: 5,
                    bytes_down: 6,
                    accepted: false,
                    reason: "late".into(),
                }),
                serde_json::json!({"event": "contribution_received", "round": 3, "peer": "p", "tokens": 10,
                    "loss": loss, "bytes": 5, "bytes_down": 6, "accepted": false, "reason": "late"}),
            ),
            (
                Event::RoundCompleted(RoundCompleted {
                    round: 1,
                    val_loss: f64::NAN,
                    workers: vec![WorkerTraffic { peer: "p".into(), bytes_up: 1, bytes_down: 2, utilization: None }],
                    ..RoundCompleted::default()
                }),
                serde_json::json!({"event": "round_completed", "round": 1, "contributors": 0, "mean_loss": 0.0,
                    "val_loss": null, "bytes_in": 0, "bytes_out": 0, "seconds": 0.0, "params_hash": "", "peers": [],
                    "excluded": [], "clipped": 0, "norm_bound": 0.0, "encoding": "", "update_bytes": 0,
                    "workers": [{"peer": "p", "bytes_up": 1, "bytes_down": 2, "utilization": null}],
                    "utilization": null, "carried": [], "budget_ms": null}),
            ),
            (
                Event::RunFinished(RunFinished { run: Some("r".into()), rounds: 2, ..RunFinished::default() }),
                serde_json::json!({"event": "run_finished", "run": "r", "rounds": 2}),
            ),
            (
                Event::SteppedDown(SteppedDown {
                    term: 2,
                    peer: "a".into(),
                    newer: 3,
                    leader: "b".into(),
                    reason: None,
                }),
                serde_json::json!({"event": "stepped_down", "term": 2, "peer": "a", "newer": 3, "leader": "b"}),
            ),
            (
                Event::Checkpoint(Checkpoint { step: Some(7), round: None, path: "c".into() }),
                serde_json::json!({"event": "checkpoint", "step": 7, "path": "c"}),
            ),
            (
                Event::HolePunched(HolePunched {
                    peer: "p".into(),
                    result: "ok".into(),
                    addr: Some("/ip4/1.2.3.4/tcp/1".into()),
                    reason: None,
                }),
                serde_json::json!({"event": "hole_punched", "peer": "p", "result": "ok", "addr": "/ip4/1.2.3.4/tcp/1"}),
            ),
            (
                Event::Deferred(Deferred { term: 4, to: String::new(), their_round: 0, round: None }),
                serde_json::json!({"event": "deferred", "term": 4, "to": "", "their_round": 0, "round": null}),
            ),
        ];
        for (event, expected) in cases {
            let value = serde_json::to_value(&event).expect("serializes");
            assert_eq!(value.to_string(), expected.to_string(), "{}", event.name());
            // and parses back (a NaN comes back as NaN)
            let again: Event = serde_json::from_value(value.clone()).expect("parses");
            assert_eq!(serde_json::to_value(&again).expect("serializes"), value);
        }
    }

    #[test]
    fn the_swarm_events_keep_their_fields() {
        let local = PeerId::random();
        let log = EventLog { events: Events::default(), local };
        let addr: pcp_bootstrap::Multiaddr = "/ip4/127.0.0.1/tcp/4001".parse().expect("addr");
        let event = log.event(&SwarmEvent::Listening { addr: addr.clone() }).expect("in the stream");
        let expected = serde_json::json!({"event": "listening", "peer": local.to_string(), "addr": addr.to_string()});
        assert_eq!(serde_json::to_value(&event).expect("json"), expected);
        let event = log.event(&SwarmEvent::MessageRejected { peer: local, reason: "big".into() }).expect("in");
        let expected = serde_json::json!({"event": "message_rejected", "peer": local.to_string(), "reason": "big"});
        assert_eq!(serde_json::to_value(&event).expect("json"), expected);
        let event = log.event(&SwarmEvent::Reachability(Reachability::Private)).expect("in the stream");
        assert_eq!(serde_json::to_value(&event).expect("json")["addr"], Value::Null);
    }
}
