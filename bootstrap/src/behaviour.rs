//! The composed libp2p behaviour and its construction.

use std::sync::Arc;
use std::time::Duration;

use libp2p::swarm::NetworkBehaviour;
use libp2p::{
    StreamProtocol, allow_block_list, autonat, connection_limits, gossipsub, identify, identity, kad, ping,
    request_response,
};
use pcp_schema::MAX_CONTROL_MESSAGE;

use crate::admission::Admission;
use crate::codec::BlobCodec;
use crate::config::Config;
use crate::ip_limits::IpLimits;
use crate::rpc::RpcBehaviour;

/// Kademlia protocol name: one DHT for the whole pcp network.
pub const KAD_PROTOCOL: StreamProtocol = StreamProtocol::new("/pcp/kad/1.0.0");
/// Identify protocol version.
pub const IDENTIFY_PROTOCOL: &str = "/pcp/id/1.0.0";
/// Blob transfer request-response protocol.
pub const BLOB_PROTOCOL: StreamProtocol = StreamProtocol::new("/pcp/blob/1.0.0");

/// Established connections per peer (AutoNAT dial-backs open extra ones).
const MAX_CONNECTIONS_PER_PEER: u32 = 8;
/// Established connections in all.
const MAX_CONNECTIONS: u32 = 512;
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
    pub(crate) autonat: autonat::Behaviour,
    pub(crate) blob: request_response::Behaviour<BlobCodec>,
    pub(crate) rpc: RpcBehaviour,
}

impl Behaviour {
    pub(crate) fn new(
        key: &identity::Keypair,
        config: &Config,
        admission: Arc<Admission>,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let peer_id = key.public().to_peer_id();
        let limits = connection_limits::ConnectionLimits::default()
            .with_max_established_per_peer(Some(MAX_CONNECTIONS_PER_PEER))
            .with_max_established(Some(MAX_CONNECTIONS))
            .with_max_pending_outgoing(Some(MAX_PENDING));

        let mut kad_config = kad::Config::new(KAD_PROTOCOL);
        kad_config
            .set_query_timeout(Duration::from_secs(30))
            .set_periodic_bootstrap_interval(Some(config.rebootstrap_interval));
        let store = kad::store::MemoryStore::new(peer_id);
        let mut kad = kad::Behaviour::with_config(peer_id, store, kad_config);
        if config.bootstrap.is_empty() {
            // a seed is the network's entry point: it must answer DHT queries
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

        let autonat = autonat::Behaviour::new(
            peer_id,
            autonat::Config {
                boot_delay: Duration::from_millis(500),
                retry_interval: Duration::from_secs(5),
                refresh_interval: Duration::from_secs(300),
                throttle_server_period: Duration::from_secs(1),
                only_global_ips: false,
                confidence_max: 1,
                ..Default::default()
            },
        );

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
                .with_request_timeout(Duration::from_secs(120))
                .with_max_concurrent_streams(MAX_RPC_STREAMS),
        );

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
            autonat,
            blob,
            rpc,
        })
    }
}
