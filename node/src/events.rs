//! The `--events FILE` stream: one JSON object per line, each with `"t"`
//! (unix seconds) and `"event"`, flushed as it is written.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use pcp_bootstrap::{Event, PeerId, Reachability, RelayService};
use serde_json::{Map, Value, json};

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

    /// Writes `{"t":…,"event":name,…fields}`; `fields` must be a JSON object.
    /// The same line goes to the wandb bridge when one runs ([`crate::wandb`]),
    /// whether or not an events file was given.
    pub(crate) fn emit(&self, name: &str, fields: Value) {
        crate::metrics::observe(name, &fields);
        crate::tui::observe(name, &fields);
        let to_wandb = crate::wandb::active();
        if self.out.is_none() && !to_wandb {
            return;
        }
        let mut object = Map::new();
        let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        object.insert("t".into(), t.into());
        object.insert("event".into(), name.into());
        if let Value::Object(fields) = fields {
            object.extend(fields);
        }
        let mut line = Value::Object(object).to_string();
        line.push('\n');
        let Some(out) = &self.out else {
            crate::wandb::send(line);
            return;
        };
        if to_wandb {
            crate::wandb::send(line.clone());
        }
        let Ok(mut out) = out.lock() else { return };
        // An events file that stops accepting writes must not stop training.
        let written = out.write_all(line.as_bytes()).and_then(|()| out.flush());
        if let Err(e) = written {
            tracing::warn!("cannot write event {name}: {e}");
        }
    }
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

    /// The event name and fields for `event`, or `None` for events that are
    /// not part of the stream.
    pub(crate) fn fields(&self, event: &Event) -> Option<(&'static str, Value)> {
        Some(match event {
            Event::Listening { addr } => {
                ("listening", json!({"peer": self.local.to_string(), "addr": addr.to_string()}))
            }
            Event::PeerConnected { peer, addr } => {
                ("peer_connected", json!({"peer": peer.to_string(), "addr": addr.to_string()}))
            }
            Event::BootstrapFailed { addr, reason, retry_in } => (
                "bootstrap_failed",
                json!({"addr": addr.to_string(), "reason": reason, "retry_in_s": retry_in.as_secs_f64()}),
            ),
            Event::PeerDiscovered { peer } => ("peer_discovered", json!({"peer": peer.to_string()})),
            Event::BlobFetched { hash, bytes, providers, seconds, chunks, chunks_relayed } => (
                "blob_fetched",
                json!({"hash": hash.to_hex(), "bytes": bytes, "providers": providers, "seconds": seconds,
                       "chunks": chunks, "chunks_relayed": chunks_relayed}),
            ),
            Event::MessageRejected { peer, reason } => {
                ("message_rejected", json!({"peer": peer.to_string(), "reason": reason}))
            }
            Event::Reachability(r) => {
                let addr = match r {
                    Reachability::Public(a) => Some(a.to_string()),
                    _ => None,
                };
                ("reachability_changed", json!({"reachability": r.name(), "addr": addr}))
            }
            Event::RelayReserved { relay, addr, renewal, limit_bytes, limit_seconds } => (
                "relay_reserved",
                json!({"relay": relay.to_string(), "addr": addr.to_string(), "renewal": renewal,
                       "limit_bytes": limit_bytes, "limit_s": limit_seconds}),
            ),
            Event::RelayLost { relay, reason } => ("relay_lost", json!({"relay": relay.to_string(), "reason": reason})),
            Event::RelayedConnection { peer, relay, addr, inbound } => (
                "relayed_connection",
                json!({"peer": peer.to_string(), "relay": relay.map(|r| r.to_string()), "addr": addr.to_string(),
                       "inbound": inbound}),
            ),
            Event::HolePunched { peer, result } => (
                "hole_punched",
                match result {
                    Ok(addr) => json!({"peer": peer.to_string(), "result": "ok", "addr": addr.to_string()}),
                    Err(reason) => json!({"peer": peer.to_string(), "result": "failed", "reason": reason}),
                },
            ),
            Event::Relayed(RelayService::Status { enabled }) => ("relay_service", json!({"enabled": enabled})),
            Event::Relayed(RelayService::Reservation { peer, refused }) => (
                "relay_reservation",
                json!({"peer": peer.to_string(), "accepted": refused.is_none(), "reason": refused}),
            ),
            Event::Relayed(RelayService::Circuit { src, dst, state, reason }) => (
                "relay_circuit",
                json!({"src": src.to_string(), "dst": dst.to_string(), "state": state, "reason": reason}),
            ),
            Event::PortMapping { result } => (
                "port_mapping",
                match result {
                    Ok(addr) => json!({"result": "ok", "addr": addr.to_string()}),
                    Err(reason) => json!({"result": "failed", "reason": reason}),
                },
            ),
            Event::Gossip { .. } | Event::Request { .. } => return None,
        })
    }

    /// Appends `event`.
    pub(crate) fn write(&mut self, event: &Event) -> anyhow::Result<()> {
        if let Some((name, fields)) = self.fields(event) {
            self.events.emit(name, fields);
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
        events.emit("step", serde_json::json!({"step": 1, "loss": 4.5}));
        events.clone().emit("eval", serde_json::json!({"step": 1, "val_loss": 4.4}));
        let text = std::fs::read_to_string(&path).expect("read");
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["event"], "step");
        assert_eq!(lines[0]["loss"], 4.5);
        assert!(lines[1]["t"].as_f64().expect("t") > 1.7e9);
        Events::default().emit("ignored", Value::Null);
    }
}
