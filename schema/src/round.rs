//! Round announcements, pseudo-gradient contributions and heartbeats.

use crate::codec::{self, DecodeError, MAX_CONTROL_MESSAGE, Message, fixed, list_len, malformed};
use crate::run::ParameterRef;
use crate::wire::pcp_capnp::{contribution, heartbeat, round_announcement};

/// The shepherd opens a round: the parameters to start from and a deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundAnnouncement {
    /// Run id.
    pub run: [u8; 32],
    /// Round number.
    pub round: u64,
    /// Parameters at the start of the round.
    pub parameters: Vec<ParameterRef>,
    /// Contributions after this time are not counted.
    pub deadline_unix_ms: u64,
}

/// A worker's pseudo-gradient for a round, stored as a blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contribution {
    /// Run id.
    pub run: [u8; 32],
    /// Round number.
    pub round: u64,
    /// Inner steps actually taken.
    pub inner_steps: u32,
    /// Training samples seen.
    pub samples: u64,
    /// The pseudo-gradient blob.
    pub pseudo_gradient: ParameterRef,
}

/// A liveness signal from a participant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heartbeat {
    /// Run id.
    pub run: [u8; 32],
    /// The round the sender is in.
    pub round: u64,
    /// Sender's clock.
    pub unix_ms: u64,
    /// Free device memory.
    pub free_memory_bytes: u64,
}

impl Message for RoundAnnouncement {
    const NAME: &'static str = "RoundAnnouncement";
    const MAX_SIZE: usize = MAX_CONTROL_MESSAGE;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<round_announcement::Builder<'_>>();
        root.set_run(&self.run[..]);
        root.set_round(self.round);
        root.set_deadline_unix_ms(self.deadline_unix_ms);
        ParameterRef::write_list(&self.parameters, root.init_parameters(list_len(self.parameters.len())));
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = RoundAnnouncement::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<round_announcement::Reader<'_>>().map_err(|e| malformed(W, e))?;
            Ok(Self {
                run: fixed(W, "run", r.get_run().map_err(|e| malformed(W, e))?)?,
                round: r.get_round(),
                parameters: ParameterRef::read_list(W, r.get_parameters())?,
                deadline_unix_ms: r.get_deadline_unix_ms(),
            })
        })
    }
}

impl Message for Contribution {
    const NAME: &'static str = "Contribution";
    const MAX_SIZE: usize = MAX_CONTROL_MESSAGE;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<contribution::Builder<'_>>();
        root.set_run(&self.run[..]);
        root.set_round(self.round);
        root.set_inner_steps(self.inner_steps);
        root.set_samples(self.samples);
        self.pseudo_gradient.write(root.init_pseudo_gradient());
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = Contribution::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<contribution::Reader<'_>>().map_err(|e| malformed(W, e))?;
            Ok(Self {
                run: fixed(W, "run", r.get_run().map_err(|e| malformed(W, e))?)?,
                round: r.get_round(),
                inner_steps: r.get_inner_steps(),
                samples: r.get_samples(),
                pseudo_gradient: ParameterRef::read(W, r.get_pseudo_gradient().map_err(|e| malformed(W, e))?)?,
            })
        })
    }
}

impl Message for Heartbeat {
    const NAME: &'static str = "Heartbeat";
    const MAX_SIZE: usize = MAX_CONTROL_MESSAGE;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<heartbeat::Builder<'_>>();
        root.set_run(&self.run[..]);
        root.set_round(self.round);
        root.set_unix_ms(self.unix_ms);
        root.set_free_memory_bytes(self.free_memory_bytes);
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = Heartbeat::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<heartbeat::Reader<'_>>().map_err(|e| malformed(W, e))?;
            Ok(Self {
                run: fixed(W, "run", r.get_run().map_err(|e| malformed(W, e))?)?,
                round: r.get_round(),
                unix_ms: r.get_unix_ms(),
                free_memory_bytes: r.get_free_memory_bytes(),
            })
        })
    }
}
