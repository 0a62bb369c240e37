//! The event loop's DHT part: announcing the blob store's hashes as a provider, and
//! the Kademlia events (new peers, finished announcements, provider lookups).

use libp2p::kad;
use pcp_protocol::BlobHash;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{EventLoop, Lookup, LookupReply, kad_key};
use crate::events::Event;

impl EventLoop {
    pub(super) fn provide_store(&mut self) {
        match self.transfers.store().list() {
            Ok(hashes) => {
                for hash in hashes {
                    if !self.provided.contains(&hash) && !self.transfers.is_deferred(&hash) {
                        self.provide(hash, None);
                    }
                }
            }
            Err(e) => tracing::warn!("scanning the blob store: {e}"),
        }
    }

    /// Announces `hash` in the DHT; `reply` is answered when the announcement is done.
    pub(super) fn provide(&mut self, hash: BlobHash, reply: Option<oneshot::Sender<()>>) {
        self.provided.insert(hash);
        match self.swarm.behaviour_mut().kad.start_providing(kad_key(&hash)) {
            Ok(id) => {
                if let Some(reply) = reply {
                    self.provide_replies.insert(id, reply);
                }
            }
            Err(e) => {
                self.provided.remove(&hash);
                tracing::warn!(%hash, "providing: {e}");
            }
        }
    }

    pub(super) fn on_kad(&mut self, event: kad::Event) {
        match event {
            kad::Event::RoutingUpdated { peer, is_new_peer, .. } if is_new_peer => {
                self.emit(Event::PeerDiscovered { peer });
            }
            kad::Event::OutboundQueryProgressed {
                id, result: kad::QueryResult::StartProviding(result), step, ..
            } => {
                if let Err(e) = result {
                    tracing::debug!("provider announcement: {e:?}");
                }
                if step.last
                    && let Some(reply) = self.provide_replies.remove(&id)
                {
                    let _ = reply.send(());
                }
            }
            kad::Event::OutboundQueryProgressed {
                id, result: kad::QueryResult::GetProviders(result), step, ..
            } if self.lookups.contains_key(&id) => {
                let local = self.peer_id();
                let done = match (self.lookups.get_mut(&id), result) {
                    (Some(Lookup { reply: LookupReply::Peer(..), .. }), _) => false,
                    (Some(lookup), Ok(kad::GetProvidersOk::FoundProviders { providers, .. })) => {
                        for p in providers {
                            if p != local && !self.banned.contains_key(&p) && !lookup.found.contains(&p) {
                                lookup.found.push(p);
                            }
                        }
                        lookup.found.len() >= lookup.max
                    }
                    _ => false,
                };
                if (done || step.last)
                    && let Some(lookup) = self.lookups.remove(&id)
                {
                    if !step.last
                        && let Some(mut query) = self.swarm.behaviour_mut().kad.query_mut(&id)
                    {
                        query.finish();
                    }
                    if let LookupReply::Providers(reply) = lookup.reply {
                        let _ = reply.send(lookup.found);
                    }
                }
            }
            kad::Event::OutboundQueryProgressed {
                id, result: kad::QueryResult::GetClosestPeers(result), step, ..
            } if self.lookups.contains_key(&id) => {
                let Some(LookupReply::Peer(peer, _)) = self.lookups.get(&id).map(|l| &l.reply) else { return };
                let peer = *peer;
                let peers = match result {
                    Ok(ok) => ok.peers,
                    Err(kad::GetClosestPeersError::Timeout { peers, .. }) => peers,
                };
                let mut found = false;
                for info in peers.into_iter().filter(|i| i.peer_id == peer) {
                    for addr in info.addrs {
                        self.swarm.add_peer_address(peer, addr);
                        found = true;
                    }
                }
                if (found || step.last)
                    && let Some(Lookup { reply: LookupReply::Peer(_, reply), .. }) = self.lookups.remove(&id)
                {
                    if !step.last
                        && let Some(mut query) = self.swarm.behaviour_mut().kad.query_mut(&id)
                    {
                        query.finish();
                    }
                    let _ = reply.send(found);
                }
            }
            kad::Event::OutboundQueryProgressed {
                id, result: kad::QueryResult::GetProviders(result), step, ..
            } => {
                let Some(hash) = self.provider_queries.get(&id).copied() else {
                    return;
                };
                if step.last {
                    self.provider_queries.remove(&id);
                }
                let local = self.peer_id();
                let found = match result {
                    Ok(kad::GetProvidersOk::FoundProviders { providers, .. }) => providers,
                    _ => Default::default(),
                };
                let found = found.into_iter().filter(|p| *p != local && !self.banned.contains_key(p));
                self.transfers.providers_found(hash, found, step.last, Instant::now());
                self.poll_transfers();
            }
            _ => {}
        }
    }
}
