//! The composed libp2p behaviour and its construction.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use libp2p::swarm::NetworkBehaviour;
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::{
    StreamProtocol, allow_block_list, autonat, connection_limits, dcutr, gossipsub, identify, identity, kad, ping,
    relay, request_response, upnp,
};
use pcp_schema::MAX_CONTROL_MESSAGE;

use crate::admission::Admission;
use crate::codec::BlobCodec;
use crate::config::{Config, RelayLimits};
use crate::ip_limits::IpLimits;
use crate::rpc::RpcBehaviour;

/// Kademlia protocol name: one DHT for the whole pcp network.
pub const KAD_PROTOCOL: StreamProtocol = StreamProtocol::new("/pcp/kad/1.0.0");
/// Identify protocol version.
pub const IDENTIFY_PROTOCOL: &str = "/pcp/id/1.0.0";
/// Blob transfer request-response protocol.
pub const BLOB_PROTOCOL: StreamProtocol = StreamProtocol::new("/pcp/blob/1.0.0");

/// Established connections per peer (AutoNAT dial-backs and hole punches open extra
/// ones).
const MAX_CONNECTIONS_PER_PEER: u32 = 8;
/// Pending (handshaking) outbound connections; inbound ones are capped per transport
/// and per address by [`IpLimits`].
const MAX_PENDING: u32 = 64;
/// Concurrent inbound plus outbound blob streams per connection: room for two fetches'
/// chunk windows each way (a stream over the limit fails its request). Each holds at most
/// one chunk in memory.
const MAX_BLOB_STREAMS: usize = 32;
/// Concurrent inbound plus outbound DiLoCo control streams per connection.
const MAX_RPC_STREAMS: usize = 8;

/// Everything a pcp node speaks.
#[derive(NetworkBehaviour)]
#[allow(missing_debug_implementations)]
pub(crate) struct Behaviour {
    pub(crate) limits: connection_limits::Behaviour,
    pub(crate) ip_limits: IpLimits,
    pub(crate) blocked: allow_block_list::Behaviour<allow_block_list::BlockedPeers>,
    pub(crate) identify: identify::Behaviour,
    pub(crate) ping: ping::Behaviour,
    pub(crate) kad: kad::Behaviour<kad::store::MemoryStore>,
    pub(crate) gossipsub: gossipsub::Behaviour,
    /// AutoNAT v2: each address candidate is tested by a peer's dial-back on a fresh
    /// connection that must echo a nonce. (AutoNAT v1 is not used: its server counts
    /// any new outbound connection to the address as the dial-back, and a hole punch
    /// is one, so a node behind a NAT was confirmed public.)
    pub(crate) autonat_client: autonat::v2::client::Behaviour,
    pub(crate) autonat_server: autonat::v2::server::Behaviour,
    pub(crate) relay_client: relay::client::Behaviour,
    pub(crate) relay: relay::Behaviour,
    pub(crate) dcutr: Toggle<dcutr::Behaviour>,
    pub(crate) upnp: Toggle<upnp::tokio::Behaviour>,
    pub(crate) blob: request_response::Behaviour<BlobCodec>,
    pub(crate) rpc: RpcBehaviour,
}

impl Behaviour {
    pub(crate) fn new(
        key: &identity::Keypair,
        config: &Config,
        admission: Arc<Admission>,
        relay_client: relay::client::Behaviour,
        relay_open: Arc<AtomicBool>,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let peer_id = key.public().to_peer_id();
        let limits = connection_limits::ConnectionLimits::default()
            .with_max_established_per_peer(Some(MAX_CONNECTIONS_PER_PEER))
            .with_max_established(Some(config.max_connections.max(1)))
            .with_max_pending_outgoing(Some(MAX_PENDING));

        let mut kad_config = kad::Config::new(KAD_PROTOCOL);
        kad_config
            .set_query_timeout(Duration::from_secs(30))
            .set_periodic_bootstrap_interval(Some(config.rebootstrap_interval));
        let store = kad::store::MemoryStore::new(peer_id);
        let mut kad = kad::Behaviour::with_config(peer_id, store, kad_config);
        if config.bootstrap.is_empty() || config.dht_server {
            // a seed is the network's entry point: it must answer DHT queries (and a
            // candidate must be found by those it may lead)
            kad.set_mode(Some(kad::Mode::Server));
        }

        let gossip_config = gossipsub::ConfigBuilder::default()
            .validation_mode(gossipsub::ValidationMode::Strict)
            .validate_messages()
            .max_transmit_size(MAX_CONTROL_MESSAGE + 4096)
            .heartbeat_interval(Duration::from_secs(1))
            .message_id_fn(|m: &gossipsub::Message| {
                gossipsub::MessageId::from(blake3::hash(&m.data).as_bytes().to_vec())
            })
            .build()
            .map_err(|e| format!("gossipsub config: {e}"))?;
        let gossipsub = gossipsub::Behaviour::new(gossipsub::MessageAuthenticity::Signed(key.clone()), gossip_config)
            .map_err(|e| format!("gossipsub: {e}"))?;

        let blob = request_response::Behaviour::with_codec(
            BlobCodec,
            [(BLOB_PROTOCOL, request_response::ProtocolSupport::Full)],
            request_response::Config::default()
                .with_request_timeout(Duration::from_secs(30))
                .with_max_concurrent_streams(MAX_BLOB_STREAMS),
        );

        let rpc = RpcBehaviour::new(
            admission,
            request_response::Config::default()
                .with_request_timeout(crate::rpc::RPC_TIMEOUT)
                .with_max_concurrent_streams(MAX_RPC_STREAMS),
        );

        // The relay service is switched on or off once, here, before any connection:
        // libp2p-relay 0.22 tells every connection's handler when the status changes,
        // relayed ones too, whose handler is a placeholder that panics on it. Whether this
        // node is reachable enough to relay is `relay_open` (see `crate::nat`), checked
        // for every reservation and circuit.
        let mut relay = relay::Behaviour::new(peer_id, relay_config(&config.nat.relay_limits, relay_open));
        let status = if config.nat.relay_service { relay::Status::Enable } else { relay::Status::Disable };
        relay.set_status(Some(status));

        Ok(Self {
            limits: connection_limits::Behaviour::new(limits),
            ip_limits: IpLimits::default(),
            blocked: allow_block_list::Behaviour::default(),
            identify: identify::Behaviour::new(
                identify::Config::new(IDENTIFY_PROTOCOL.into(), key.public())
                    .with_agent_version(config.agent.clone())
                    .with_push_listen_addr_updates(true),
            ),
            ping: ping::Behaviour::new(ping::Config::new()),
            kad,
            gossipsub,
            autonat_client: autonat::v2::client::Behaviour::default(),
            autonat_server: autonat::v2::server::Behaviour::default(),
            relay_client,
            relay,
            dcutr: Toggle::from(config.nat.hole_punching.then(|| dcutr::Behaviour::new(peer_id))),
            upnp: Toggle::from(config.nat.upnp.then(upnp::tokio::Behaviour::default)),
            blob,
            rpc,
        })
    }
}

/// The relay service's configuration: `limits`, and libp2p's rate limits (per peer,
/// 30 reservations and 30 circuits, one more every 2 minutes; per IP address, 60 of
/// each, one more a minute), behind a gate that refuses everything while `open` is
/// false.
fn relay_config(limits: &RelayLimits, open: Arc<AtomicBool>) -> relay::Config {
    let defaults = relay::Config::default();
    let gate = |open: Arc<AtomicBool>| -> Box<dyn relay::RateLimiter> {
        Box::new(move |_: libp2p::PeerId, _: &libp2p::Multiaddr, _: std::time::Instant| open.load(Ordering::Relaxed))
    };
    let mut reservation_rate_limiters = vec![gate(open.clone())];
    reservation_rate_limiters.extend(defaults.reservation_rate_limiters);
    let mut circuit_src_rate_limiters = vec![gate(open)];
    circuit_src_rate_limiters.extend(defaults.circuit_src_rate_limiters);
    relay::Config {
        reservation_rate_limiters,
        circuit_src_rate_limiters,
        max_reservations: limits.max_reservations,
        max_reservations_per_peer: limits.max_reservations_per_peer,
        reservation_duration: limits.reservation_duration,
        max_circuits: limits.max_circuits,
        max_circuits_per_peer: limits.max_circuits_per_peer,
        // the wire carries whole seconds in a u32
        max_circuit_duration: limits.max_circuit_duration.min(Duration::from_secs(u64::from(u32::MAX))),
        max_circuit_bytes: limits.max_circuit_bytes,
    }
}
