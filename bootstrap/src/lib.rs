//! Joining the pcp network: the libp2p swarm and content-addressed blob transfer.
//!
//! A [`Node`] is a Clone handle to an [`EventLoop`] that owns the swarm: QUIC first and
//! TCP as fallback (TLS 1.3 preferred, with AES-GCM on CPUs that have AES instructions,
//! then noise; yamux), identify, ping, Kademlia (one DHT, `/pcp/kad/1.0.0`),
//! gossipsub (one topic per run, signed, every message validated), AutoNAT dial-back for
//! the reachability self-test, and request-response blob transfer with a capnp codec.
//! Queues, inbound streams and connections per peer are bounded.
//!
//! Behind NATs (see [`NatConfig`]): AutoNAT v2 decides whether peers can dial this
//! node; a private node reserves a slot on relays (circuit relay v2: found among its
//! peers, or given), and every public node relays for others within [`RelayLimits`];
//! DCUtR hole punching turns relayed connections into direct ones where the NATs allow
//! it, and blob requests wait briefly for the punch rather than going through a relay;
//! UPnP port mapping is optional. A node's public address may also be declared
//! ([`NatConfig::external_addresses`]), as the only public node of a network must:
//! no peer can test it.
//!
//! Blobs are fetched in [`pcp_schema::CHUNK_SIZE`] chunks from every provider found in
//! the DHT in parallel. Each chunk is verified against its blake3 chaining value; the
//! chaining values are verified once against the content id (see [`outboard`]). A peer
//! that sends a bad chunk is banned. Downloads resume from `<data-dir>/blobs/partial/`.
//! [`Node::release`] deletes blobs the owner no longer needs, deferring those that a
//! transfer (to a peer or from one) still reads.
//!
//! DiLoCo control messages (join, heartbeat, contribution) travel as signed envelopes
//! over a request-response protocol (see [`RPC_PROTOCOL`]); the event loop verifies
//! every signature and refuses replays before the owner sees a request.

pub mod admission;
mod behaviour;
mod blocking;
mod codec;
mod command;
mod config;
mod error;
mod event_loop;
mod events;
mod fetch;
#[cfg(test)]
mod fuzz;
mod identity_file;
mod ids;
mod ip_limits;
mod mux;
mod nat;
mod node;
pub mod outboard;
mod rpc;
mod seeds;
mod store;
pub mod testnet;
mod tls;
mod transfers;

pub use admission::{Admission, AdmitError, Hold};
pub use behaviour::{BLOB_PROTOCOL, IDENTIFY_PROTOCOL, KAD_PROTOCOL};
pub use codec::CapnpCodec;
pub use command::{FetchReport, Released};
pub use config::{Config, DEFAULT_MAX_CONNECTIONS, NatConfig, RelayLimits};
pub use error::{DialError, ExternalAddrError, FetchError, GossipError, RequestError, StartError, Stopped};
pub use event_loop::EventLoop;
pub use events::{Event, NatMapping, NetStatus, Reachability, RelayService, Stats};
pub use identity_file::{IdentityError, keypair, load_or_create};
pub use ids::{InboundId, key_of, peer_of};
pub use libp2p::{Multiaddr, PeerId, multiaddr};
pub use nat::parse_external_address;
pub use node::Node;
pub use rpc::RPC_PROTOCOL;
pub use store::{BlobStore, Durability, Partial, StoreError};
