//! pcp's protocol core: identities, signed envelopes, replay guards, content
//! ids, admission to a run, the DiLoCo state machines, the shepherd election and
//! failover.
//!
//! Pure: no sockets, no clocks, no randomness. Keys are made from bytes the caller
//! supplies, and every time-dependent check takes `now` as an argument, so
//! simulations are deterministic.

pub mod admit;
pub mod diloco;
pub mod election;
mod envelope;
pub mod failover;
mod identity;
mod ids;
mod replay;

pub use envelope::{Binding, OpenError, PayloadError, Signable, Verified, head_of, open, seal, verify, verify_head};
pub use identity::{Identity, PublicKey};
pub use ids::{BlobHash, ParseIdError, RunId};
pub use replay::{ReplayError, ReplayGuard};
