//! The `--events FILE` JSONL stream: one object per line with `t` (unix seconds) and
//! `event`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use pcp_bootstrap::{Event, PeerId};
use serde_json::{Value, json};

/// Writes network events as JSON lines; a no-op without a file.
#[derive(Debug)]
pub(crate) struct EventLog {
    out: Option<BufWriter<File>>,
    local: PeerId,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl EventLog {
    pub(crate) fn open(path: Option<&Path>, local: PeerId) -> anyhow::Result<Self> {
        let out = match path {
            Some(p) => {
                Some(BufWriter::new(File::create(p).with_context(|| {
                    format!("creating events file {}", p.display())
                })?))
            }
            None => None,
        };
        Ok(Self { out, local })
    }

    /// The JSON object for `event`, or `None` for events that are not part of the stream.
    pub(crate) fn to_json(&self, event: &Event) -> Option<Value> {
        let t = now();
        Some(match event {
            Event::Listening { addr } => json!({
                "t": t, "event": "listening", "peer": self.local.to_string(), "addr": addr.to_string(),
            }),
            Event::PeerConnected { peer, addr } => json!({
                "t": t, "event": "peer_connected", "peer": peer.to_string(), "addr": addr.to_string(),
            }),
            Event::PeerDiscovered { peer } => json!({
                "t": t, "event": "peer_discovered", "peer": peer.to_string(),
            }),
            Event::BlobFetched {
                hash,
                bytes,
                providers,
                seconds,
            } => json!({
                "t": t, "event": "blob_fetched", "hash": hash.to_hex(), "bytes": bytes,
                "providers": providers, "seconds": seconds,
            }),
            Event::MessageRejected { peer, reason } => json!({
                "t": t, "event": "message_rejected", "peer": peer.to_string(), "reason": reason,
            }),
            Event::Reachability(_) | Event::Gossip { .. } => return None,
        })
    }

    /// Appends `event` and flushes, so readers see whole lines.
    pub(crate) fn write(&mut self, event: &Event) -> anyhow::Result<()> {
        let Some(value) = self.to_json(event) else {
            return Ok(());
        };
        if let Some(out) = self.out.as_mut() {
            serde_json::to_writer(&mut *out, &value).context("writing events file")?;
            out.write_all(b"\n").context("writing events file")?;
            out.flush().context("writing events file")?;
        }
        Ok(())
    }
}
