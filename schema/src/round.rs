//! Round announcements, pseudo-gradient contributions and heartbeats.

use crate::aggregation::ShardAggregators;
use crate::codec::{
    self, DecodeError, MAX_CONTRIBUTION, MAX_CONTROL_MESSAGE, Message, fixed, list_len, malformed, optional_hash,
};
use crate::run::ParameterRef;
use crate::wire::pcp_capnp::{ack, contribution, heartbeat, round_announcement};

/// The shepherd opens a round: the parameters to start from and a deadline.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundAnnouncement {
    /// Run id.
    pub run: [u8; 32],
    /// Round number.
    pub round: u64,
    /// Parameters at the start of the round.
    pub parameters: Vec<ParameterRef>,
    /// Contributions after this time are not counted.
    pub deadline_unix_ms: u64,
    /// The ed25519 keys of the workers expected to contribute (empty when
    /// `participants_blob` holds them).
    pub participants: Vec<[u8; 32]>,
    /// Past the shepherd's inline threshold, the participants as a blob of
    /// sorted 32-byte keys, which keeps a round of any size within the control cap.
    pub participants_blob: Option<ParameterRef>,
    /// The run is over and `parameters` are the final ones.
    pub finished: bool,
    /// The signer's term as leader (1: the creator's).
    pub term: u64,
    /// The leader's state after the last completed round (parameters, outer
    /// momentum, deadlines, exclusions): what a successor resumes from.
    pub state: Option<ParameterRef>,
    /// A sparse run's update from the previous round's parameters to these: a
    /// worker that holds them fetches this instead of the parameters.
    pub update: Option<Update>,
    /// Overlap: milliseconds of inner steps a round (0: no budget, τ steps).
    pub budget_ms: u64,
    /// Overlap: when the median worker's steps of this round end, Unix
    /// milliseconds (0: not known): a worker training it ahead stops by then.
    pub steps_end_unix_ms: u64,
    /// blake3 of the secret seed the shepherd screens this round's contributions
    /// with (`pcp/screen-seed/v1` ‖ seed; zeros: no screen): revealed next round.
    pub screen_commit: [u8; 32],
    /// The previous round's screen seed (zeros: none), which anyone can check
    /// against that round's commit.
    pub screen_reveal: [u8; 32],
    /// Parameter-shard aggregators, one entry a shard of the round's sum (the
    /// model's tensors cut into as many contiguous shards, balanced by size; empty: the
    /// shepherd sums alone).
    pub aggregators: Vec<ShardAggregators>,
}

/// A sparse update blob and the parameters it applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    /// The update blob (the sparse format of `pcp_protocol::diloco::sparse`).
    pub blob: ParameterRef,
    /// blake3 of the parameters blob it applies to.
    pub base: [u8; 32],
}

/// A worker's pseudo-gradient for a round, sent inline by request-response.
#[derive(Debug, Clone, PartialEq)]
pub struct Contribution {
    /// Run id.
    pub run: [u8; 32],
    /// Round number.
    pub round: u64,
    /// Inner steps actually taken.
    pub inner_steps: u32,
    /// Training samples seen.
    pub samples: u64,
    /// The content id and size of `delta`.
    pub pseudo_gradient: ParameterRef,
    /// The worker's mean inner loss.
    pub loss: f32,
    /// The encoded pseudo-gradient θ_start − θ_end.
    pub delta: Vec<u8>,
    /// Parameter bytes the worker fetched for this round, as it reports them.
    pub bytes_down: u64,
    /// The term of the announcement the worker trained from (0: not said).
    pub term: u64,
    /// blake3 of the parameters blob it trained from (zeros: not said).
    pub params_hash: [u8; 32],
    /// Milliseconds in inner steps since the worker's previous contribution (0: not said).
    pub train_ms: u64,
    /// Wall milliseconds since its previous contribution (0: not said); `train_ms /
    /// wall_ms` is its utilization.
    pub wall_ms: u64,
    /// When the worker sent it, Unix milliseconds by its clock (0: not said).
    pub sent_unix_ms: u64,
    /// An aggregated round: each shard's slice hash (`delta` is then empty and the
    /// slices go to the shards' aggregators).
    pub slice_hashes: Vec<[u8; 32]>,
}

/// The shepherd's answer to a contribution, or its refusal of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack {
    /// Run id.
    pub run: [u8; 32],
    /// Round number.
    pub round: u64,
    /// Whether the request was accepted.
    pub accepted: bool,
    /// Why not, for people: a program decides on [`Ack::code`].
    pub reason: String,
    /// Why not, for programs.
    pub code: AckCode,
    /// With [`AckCode::ProofOfWork`]: the leading zero bits the run needs.
    pub pow_bits: u8,
}

impl Ack {
    /// An acceptance of round `round` of `run`.
    pub fn accept(run: [u8; 32], round: u64) -> Self {
        Self { run, round, accepted: true, reason: String::new(), code: AckCode::None, pow_bits: 0 }
    }

    /// A refusal with its code and its reason for people.
    pub fn refuse(run: [u8; 32], round: u64, code: AckCode, reason: impl Into<String>) -> Self {
        Self { run, round, accepted: false, reason: reason.into(), code, pow_bits: 0 }
    }
}

macro_rules! ack_codes {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        /// Why a request was refused, on the wire as a capnp enum ([`Ack::code`]).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub enum AckCode {
            /// Accepted, or a refusal without a code of its own.
            #[default]
            None,
            $($(#[$doc])* $name,)*
        }

        impl AckCode {
            /// Every code.
            pub const ALL: &'static [AckCode] = &[AckCode::None, $(AckCode::$name,)*];

            fn to_wire(self) -> crate::wire::pcp_capnp::AckCode {
                match self {
                    Self::None => crate::wire::pcp_capnp::AckCode::None,
                    $(Self::$name => crate::wire::pcp_capnp::AckCode::$name,)*
                }
            }

            fn from_wire(code: crate::wire::pcp_capnp::AckCode) -> Self {
                match code {
                    crate::wire::pcp_capnp::AckCode::None => Self::None,
                    $(crate::wire::pcp_capnp::AckCode::$name => Self::$name,)*
                }
            }
        }
    };
}

ack_codes! {
    /// Refused; the reason says why.
    Other,
    /// A standby candidate, not the run's leader.
    Standby,
    /// The shepherd cannot compile for the hello's backend or target.
    NoArtifact,
    /// The hello's proof of work is short of [`Ack::pow_bits`].
    ProofOfWork,
    /// Admission refused the key (certificate, allowlist, address cap).
    NotAdmitted,
    /// The shepherd holds as many workers as it can.
    Full,
    /// For a run the shepherd does not run.
    WrongRun,
    /// For a round that is not open.
    WrongRound,
    /// For a round that already closed.
    Late,
    /// Not asked to take part in the round.
    NotParticipant,
    /// A second contribution for the round.
    Duplicate,
    /// Undecodable, the wrong shape, or a non-finite value.
    Malformed,
    /// Claims samples the manifest does not allow.
    Samples,
    /// An update of zeros.
    Empty,
    /// Refused by the shepherd's screen (its losses are not told).
    Screen,
    /// Not among the contributions the round aggregates.
    NotSelected,
    /// Trained under another term or from other parameters.
    Fenced,
    /// Past the round's screening budget while on probation.
    Unscreened,
    /// Too close to another contribution or to the last update.
    TooSimilar,
    /// The screen refused this key lately: it sits out some rounds.
    SitsOut,
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
    /// The leader's term when a leader sends it (its lease); 0 otherwise.
    pub term: u64,
    /// The highest term the sender follows (workers and standbys; 0: not said).
    pub follows: u64,
    /// A candidate's replicated state, if it holds one.
    pub held: Option<Held>,
    /// Between candidates: a failover message (`term` and `held` are its term and
    /// state).
    pub consensus: Option<Consensus>,
    /// A worker's: the blake3 hash of the round announcement's payload it holds; a
    /// leader's answer to it: the same hash, meaning that announcement is still
    /// current (see `known` in the schema).
    pub known: Option<[u8; 32]>,
    /// A leader's: its open round's deadline now, Unix milliseconds (0: no round
    /// open). It moves past the announced one when the round has no quorum then.
    pub deadline_unix_ms: u64,
}

/// What a failover message between candidates is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsensusKind {
    /// The leader's lease: `held` is its state.
    Lease,
    /// An answer to a lease: `held` is what the answerer holds.
    Answer,
    /// A (pre-)vote request: `held` is the campaigner's state.
    VoteRequest,
    /// A (pre-)vote.
    Vote,
}

/// A failover message's fields besides its term and state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Consensus {
    /// Which message.
    pub kind: ConsensusKind,
    /// A lease's send time on its leader's clock (an answer echoes it).
    pub sent_ms: u64,
    /// A vote: granted.
    pub granted: bool,
    /// A pre-vote (request or answer).
    pub pre: bool,
    /// A lease: the blob holding the leader's state (zeros: none).
    pub blob: [u8; 32],
}

/// A candidate's replicated state, as its heartbeats report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The term whose leader produced the state.
    pub term: u64,
    /// Rounds completed.
    pub round: u64,
    /// The parameters hash after `round`.
    pub params: [u8; 32],
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
        ParameterRef::write_list(&self.parameters, root.reborrow().init_parameters(list_len(self.parameters.len())));
        let mut participants = root.reborrow().init_participants(list_len(self.participants.len()));
        for (i, p) in (0..).zip(&self.participants) {
            participants.set(i, &p[..]);
        }
        root.set_finished(self.finished);
        root.set_term(self.term);
        if let Some(state) = &self.state {
            state.write(root.reborrow().init_state());
            root.set_has_state(true);
        }
        if let Some(update) = &self.update {
            update.blob.write(root.reborrow().init_update());
            root.set_update_base(&update.base[..]);
            root.set_has_update(true);
        }
        root.set_budget_ms(self.budget_ms);
        root.set_steps_end_unix_ms(self.steps_end_unix_ms);
        if self.screen_commit != [0; 32] {
            root.set_screen_commit(&self.screen_commit[..]);
        }
        if self.screen_reveal != [0; 32] {
            root.set_screen_reveal(&self.screen_reveal[..]);
        }
        if let Some(blob) = &self.participants_blob {
            blob.write(root.reborrow().init_participants_blob());
            root.set_has_participants_blob(true);
        }
        if !self.aggregators.is_empty() {
            let list = root.reborrow().init_aggregators(list_len(self.aggregators.len()));
            ShardAggregators::write_list(&self.aggregators, list);
        }
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = RoundAnnouncement::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<round_announcement::Reader<'_>>().map_err(|e| malformed(W, e))?;
            let list = r.get_participants().map_err(|e| malformed(W, e))?;
            let mut participants = Vec::with_capacity(list.len() as usize);
            for p in list.iter() {
                participants.push(fixed(W, "participants", p.map_err(|e| malformed(W, e))?)?);
            }
            Ok(Self {
                run: fixed(W, "run", r.get_run().map_err(|e| malformed(W, e))?)?,
                round: r.get_round(),
                parameters: ParameterRef::read_list(W, r.get_parameters())?,
                deadline_unix_ms: r.get_deadline_unix_ms(),
                participants,
                participants_blob: match r.get_has_participants_blob() {
                    true => Some(ParameterRef::read(W, r.get_participants_blob().map_err(|e| malformed(W, e))?)?),
                    false => None,
                },
                finished: r.get_finished(),
                term: r.get_term(),
                state: match r.get_has_state() {
                    true => Some(ParameterRef::read(W, r.get_state().map_err(|e| malformed(W, e))?)?),
                    false => None,
                },
                update: match r.get_has_update() {
                    true => Some(Update {
                        blob: ParameterRef::read(W, r.get_update().map_err(|e| malformed(W, e))?)?,
                        base: fixed(W, "updateBase", r.get_update_base().map_err(|e| malformed(W, e))?)?,
                    }),
                    false => None,
                },
                budget_ms: r.get_budget_ms(),
                steps_end_unix_ms: r.get_steps_end_unix_ms(),
                screen_commit: optional_hash(W, "screenCommit", r.get_screen_commit().map_err(|e| malformed(W, e))?)?,
                screen_reveal: optional_hash(W, "screenReveal", r.get_screen_reveal().map_err(|e| malformed(W, e))?)?,
                aggregators: ShardAggregators::read_list(W, r.get_aggregators())?,
            })
        })
    }
}

impl Message for Contribution {
    const NAME: &'static str = "Contribution";
    const MAX_SIZE: usize = MAX_CONTRIBUTION;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<contribution::Builder<'_>>();
        root.set_run(&self.run[..]);
        root.set_round(self.round);
        root.set_inner_steps(self.inner_steps);
        root.set_samples(self.samples);
        self.pseudo_gradient.write(root.reborrow().init_pseudo_gradient());
        root.set_loss(self.loss);
        root.set_delta(&self.delta);
        root.set_bytes_down(self.bytes_down);
        root.set_term(self.term);
        root.set_params_hash(&self.params_hash[..]);
        root.set_train_ms(self.train_ms);
        root.set_wall_ms(self.wall_ms);
        root.set_sent_unix_ms(self.sent_unix_ms);
        if !self.slice_hashes.is_empty() {
            let mut hashes = root.reborrow().init_slice_hashes(list_len(self.slice_hashes.len()));
            for (i, h) in (0..).zip(&self.slice_hashes) {
                hashes.set(i, &h[..]);
            }
        }
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
                loss: r.get_loss(),
                delta: r.get_delta().map_err(|e| malformed(W, e))?.to_vec(),
                bytes_down: r.get_bytes_down(),
                term: r.get_term(),
                params_hash: optional_hash(W, "paramsHash", r.get_params_hash().map_err(|e| malformed(W, e))?)?,
                train_ms: r.get_train_ms(),
                wall_ms: r.get_wall_ms(),
                sent_unix_ms: r.get_sent_unix_ms(),
                slice_hashes: {
                    let list = r.get_slice_hashes().map_err(|e| malformed(W, e))?;
                    let mut hashes = Vec::with_capacity(list.len() as usize);
                    for h in list.iter() {
                        hashes.push(fixed(W, "sliceHashes", h.map_err(|e| malformed(W, e))?)?);
                    }
                    hashes
                },
            })
        })
    }
}

impl Heartbeat {
    /// A plain heartbeat of `run`'s `round` sent at `unix_ms`: no term, no state, no
    /// failover message, no announcement held. Set the rest with struct update
    /// syntax: `Heartbeat { follows, ..Heartbeat::new(run, round, now) }`.
    pub fn new(run: [u8; 32], round: u64, unix_ms: u64) -> Self {
        Heartbeat {
            run,
            round,
            unix_ms,
            free_memory_bytes: 0,
            term: 0,
            follows: 0,
            held: None,
            consensus: None,
            known: None,
            deadline_unix_ms: 0,
        }
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
        root.set_term(self.term);
        root.set_follows(self.follows);
        if let Some(h) = &self.held {
            root.set_held_term(h.term);
            root.set_held_round(h.round);
            root.set_held_params(&h.params[..]);
            root.set_has_held(true);
        }
        if let Some(c) = &self.consensus {
            root.set_consensus(match c.kind {
                ConsensusKind::Lease => 1,
                ConsensusKind::Answer => 2,
                ConsensusKind::VoteRequest => 3,
                ConsensusKind::Vote => 4,
            });
            root.set_sent_ms(c.sent_ms);
            root.set_granted(c.granted);
            root.set_pre(c.pre);
            if c.blob != [0; 32] {
                root.set_held_blob(&c.blob[..]);
            }
        }
        if let Some(known) = &self.known {
            root.set_known(&known[..]);
        }
        root.set_deadline_unix_ms(self.deadline_unix_ms);
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
                term: r.get_term(),
                follows: r.get_follows(),
                held: match r.get_has_held() {
                    true => Some(Held {
                        term: r.get_held_term(),
                        round: r.get_held_round(),
                        params: fixed(W, "heldParams", r.get_held_params().map_err(|e| malformed(W, e))?)?,
                    }),
                    false => None,
                },
                consensus: {
                    let kind = match r.get_consensus() {
                        0 => None,
                        1 => Some(ConsensusKind::Lease),
                        2 => Some(ConsensusKind::Answer),
                        3 => Some(ConsensusKind::VoteRequest),
                        4 => Some(ConsensusKind::Vote),
                        k => return Err(DecodeError::Malformed { what: W, reason: format!("consensus kind {k}") }),
                    };
                    match kind {
                        None => None,
                        Some(kind) => {
                            let blob = r.get_held_blob().map_err(|e| malformed(W, e))?;
                            Some(Consensus {
                                kind,
                                sent_ms: r.get_sent_ms(),
                                granted: r.get_granted(),
                                pre: r.get_pre(),
                                blob: if blob.is_empty() { [0; 32] } else { fixed(W, "heldBlob", blob)? },
                            })
                        }
                    }
                },
                known: {
                    let known = r.get_known().map_err(|e| malformed(W, e))?;
                    if known.is_empty() { None } else { Some(fixed(W, "known", known)?) }
                },
                deadline_unix_ms: r.get_deadline_unix_ms(),
            })
        })
    }
}

impl Message for Ack {
    const NAME: &'static str = "Ack";
    const MAX_SIZE: usize = MAX_CONTROL_MESSAGE;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<ack::Builder<'_>>();
        root.set_run(&self.run[..]);
        root.set_round(self.round);
        root.set_accepted(self.accepted);
        root.set_reason(self.reason.as_str());
        root.set_code(self.code.to_wire());
        root.set_pow_bits(self.pow_bits);
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = Ack::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<ack::Reader<'_>>().map_err(|e| malformed(W, e))?;
            Ok(Self {
                run: fixed(W, "run", r.get_run().map_err(|e| malformed(W, e))?)?,
                round: r.get_round(),
                accepted: r.get_accepted(),
                reason: codec::text(W, "reason", r.get_reason())?,
                // a code this build does not know (a newer peer's) is a plain refusal
                code: r.get_code().map_or(AckCode::Other, AckCode::from_wire),
                pow_bits: r.get_pow_bits(),
            })
        })
    }
}
