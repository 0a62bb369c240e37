//! The pcp wire schema.
//!
//! `capnp/pcp.capnp` defines every message that crosses the network; `build.rs` compiles
//! it with Debian's `capnp` and capnpc into [`wire`]. The plain Rust types here are what
//! the rest of pcp uses: each implements [`Message`], whose decoder refuses input over
//! the message's size limit before parsing it, validates capnp's segment table against
//! the input (so a claimed size never drives an allocation), and caps the words visited
//! at the input size with a traversal limit.

mod aggregation;
mod blob;
mod codec;
mod envelope;
mod node;
mod round;
mod run;
mod screen;
pub mod wire;

pub use aggregation::{
    AcceptEntry, Accepts, ShardAggregators, ShardFailure, ShardVote, Slice, SliceReportEntry, SliceReports,
};
pub use blob::{BlobRequest, BlobResponse, BlobWant, chunk_count};
pub use codec::{
    CHUNK_SIZE, DecodeError, MAX_BLOB_REQUEST, MAX_BLOB_RESPONSE, MAX_BLOB_SIZE, MAX_CONTRIBUTION, MAX_CONTROL_MESSAGE,
    Message,
};
pub use envelope::{EnvelopeHeader, FrameHead, MAX_FRAME_HEAD, MessageKind, SignedEnvelope};
pub use node::{Backend, Capabilities, NodeHello};
pub use round::{Ack, AckCode, Consensus, ConsensusKind, Contribution, Heartbeat, Held, RoundAnnouncement, Update};
pub use run::{Admission, ArtifactRef, DataSpec, ParameterRef, RunManifest, Schedule, TensorSpec};
pub use screen::{MAX_HOLDERS, ScreenReport, ScreenRequest};
