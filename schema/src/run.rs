//! Run manifests and the blob references they carry.

use crate::codec::{self, DecodeError, MAX_CONTROL_MESSAGE, Message, fixed, list_len, malformed, optional_hash};
use crate::wire::pcp_capnp::{artifact_ref, data_spec, parameter_ref, run_manifest, schedule, tensor_spec};

/// A compiled training step for one (backend, target), stored as a blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArtifactRef {
    /// Backend name.
    pub backend: String,
    /// Target name.
    pub target: String,
    /// blake3 content id of the VMFB.
    pub blob: [u8; 32],
    /// Size in bytes.
    pub size: u64,
    /// Micro-batches a batch is split into (gradient accumulation: the module has
    /// `grad_step` and `apply_step` for a micro-batch); 0 or 1: `train_step` on the
    /// whole batch.
    pub micro_batches: u32,
    /// The step's recomputation when a device too small for the run's needed a
    /// stronger one; empty: the run's.
    pub recompute: String,
    /// The step's expected peak memory, in bytes, that the split was planned for
    /// (0: not planned).
    pub estimate_bytes: u64,
}

/// One shard of parameters (or of a pseudo-gradient), stored as a blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParameterRef {
    /// Parameter or group name.
    pub name: String,
    /// Shard index.
    pub shard: u32,
    /// blake3 content id.
    pub blob: [u8; 32],
    /// Size in bytes.
    pub size: u64,
}

/// A parameter tensor: its name and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Parameter name.
    pub name: String,
    /// Dimensions.
    pub shape: Vec<u64>,
}

/// The training data: a corpus blob, how to tokenize it, and the batch shape.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DataSpec {
    /// blake3 content id of the corpus.
    pub blob: [u8; 32],
    /// Its size in bytes.
    pub size: u64,
    /// `char`, `byte` or `u16`.
    pub tokenizer: String,
    /// Fraction held out for validation.
    pub val_fraction: f64,
    /// Sequences per batch.
    pub batch: u32,
    /// Tokens per sequence.
    pub block: u32,
    /// Whether token inputs are i64 (else i32).
    pub int64: bool,
}

/// The inner learning-rate schedule: warmup, then cosine decay.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Schedule {
    /// Peak inner learning rate.
    pub learning_rate: f64,
    /// Floor of the cosine.
    pub min_lr: f64,
    /// Linear warmup steps.
    pub warmup_steps: u64,
    /// Rounds × inner steps.
    pub total_steps: u64,
}

/// Everything a worker needs to join a run, signed by the shepherd.
#[derive(Debug, Clone, PartialEq)]
pub struct RunManifest {
    /// Run id.
    pub run: [u8; 32],
    /// Human-readable name.
    pub name: String,
    /// The shepherd's ed25519 public key.
    pub shepherd: [u8; 32],
    /// DiLoCo inner steps per round.
    pub inner_steps: u32,
    /// One artifact per supported (backend, target).
    pub artifacts: Vec<ArtifactRef>,
    /// Initial parameters.
    pub parameters: Vec<ParameterRef>,
    /// blake3 of the loss module.
    pub model_hash: [u8; 32],
    /// Outer rounds.
    pub rounds: u64,
    /// Run seed (initialisation and data order).
    pub seed: u64,
    /// Inner learning-rate schedule.
    pub schedule: Schedule,
    /// Outer Nesterov learning rate.
    pub outer_lr: f32,
    /// Outer Nesterov momentum.
    pub outer_momentum: f32,
    /// The training data.
    pub data: DataSpec,
    /// Parameter tensors, in argument order.
    pub tensors: Vec<TensorSpec>,
    /// Optimizer state tensors per parameter (2 for AdamW).
    pub state_per_param: u32,
    /// Pseudo-gradient encoding: `fp32`, `bf16` or `int8`.
    pub encoding: String,
    /// How the shepherd screens contributions: `score` (each must lower a held-out
    /// loss) or `norm` (norm bound only); empty in manifests from before it existed.
    pub screen: String,
    /// The coordinate-wise trimmed mean's fraction at each end; 0 for the
    /// token-weighted mean.
    pub trim: f32,
    /// The ed25519 keys of the coordinator candidates besides the creator
    /// (`shepherd`); empty: the creator alone leads.
    pub candidates: Vec<[u8; 32]>,
    /// How long candidates wait without a leader's lease before the next takes over.
    pub lease_ms: u64,
    /// The run id's salt: the id is blake3 over the creator, the model, the salt and
    /// the candidates, so a manifest served by a successor is checked against the id.
    pub salt: [u8; 32],
    /// blake3 of the experiment (JSON) blob a successor leads with; zero: none.
    pub experiment: [u8; 32],
    /// Workers overlap: they train the next round while a round's contribution,
    /// aggregation and update are on the way, and rebase onto the update.
    pub overlap: bool,
    /// Streaming DiLoCo's fragments: the parameters split into this many groups of
    /// tensors, round r syncing group (r − 1) mod P after `inner_steps` (τ/P) steps;
    /// 0 or 1: the whole model every round.
    pub fragments: u32,
    /// The training step's matmul precision: `f32`, or `bf16` (mixed precision:
    /// parameters, optimizer state, pseudo-gradients and loss stay f32). Manifests
    /// from before the field read as `f32`.
    pub precision: String,
    /// Activations the training step's backward recomputes instead of keeping:
    /// `none`, `attention`, `elementwise` or `blocks` (the same values either way; less memory,
    /// more compute). Manifests from before the field read as `none`.
    pub recompute: String,
    /// Who may join and how far the shepherd trusts them.
    pub admission: Admission,
    /// How the candidates agree: 0 by their count (a majority from 3), 1 a
    /// majority, 2 best effort (`--failover`).
    pub failover: u8,
}

/// A run's admission and trust settings, in its signed manifest: who may join
/// (`admit`), and the caps and screen that hold untrusted participants.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Admission {
    /// `open`, `allowlist` or `authorizer` (manifests from before the field: `open`).
    pub admit: String,
    /// `authorizer`: the key whose join certificates admit a worker (zeros: none).
    pub authorizer: [u8; 32],
    /// `allowlist`: the keys admitted.
    pub allowlist: Vec<[u8; 32]>,
    /// `open`: the leading zero bits a worker identity's proof of work must have.
    pub pow_bits: u32,
    /// `open`: new keys an hour admitted at `pow_bits`; each doubling of the last
    /// hour's joins beyond it asks one bit more of a new key (0: `pow_bits` always).
    pub pow_joins_per_hour: u32,
    /// The most participants a round (0: every live worker).
    pub max_participants: u32,
    /// The most contributions aggregated a round, the best-rated (0: all).
    pub aggregate_max: u32,
    /// Screens a new key passes before it counts in full.
    pub probation_rounds: u32,
    /// The probability a rated peer's contribution is screened once screening
    /// passes its share of the round.
    pub screen_sample: f32,
    /// The share of aggregated shards the shepherd sums itself whatever their
    /// replicas vote (spot checks; it shrinks past 1,000 contributions a round).
    pub aggregator_spot_rate: f32,
    /// Rated workers that score each contribution (its screening committee); 0:
    /// the shepherd scores every contribution itself.
    pub screeners: u32,
    /// With `screeners`: the share of contributions the shepherd scores itself
    /// whatever their committee says (spot checks, within its screening budget).
    pub screen_spot_rate: f32,
}

impl TensorSpec {
    fn write(&self, mut b: tensor_spec::Builder<'_>) {
        b.set_name(self.name.as_str());
        let mut shape = b.init_shape(list_len(self.shape.len()));
        for (i, d) in (0..).zip(&self.shape) {
            shape.set(i, *d);
        }
    }

    fn read(w: &'static str, r: tensor_spec::Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            name: codec::text(w, "name", r.get_name())?,
            shape: r.get_shape().map_err(|e| malformed(w, e))?.iter().collect(),
        })
    }
}

impl DataSpec {
    fn write(&self, mut b: data_spec::Builder<'_>) {
        b.set_blob(&self.blob[..]);
        b.set_size(self.size);
        b.set_tokenizer(self.tokenizer.as_str());
        b.set_val_fraction(self.val_fraction);
        b.set_batch(self.batch);
        b.set_block(self.block);
        b.set_int64(self.int64);
    }

    fn read(w: &'static str, r: data_spec::Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            blob: fixed(w, "data.blob", r.get_blob().map_err(|e| malformed(w, e))?)?,
            size: r.get_size(),
            tokenizer: codec::text(w, "data.tokenizer", r.get_tokenizer())?,
            val_fraction: r.get_val_fraction(),
            batch: r.get_batch(),
            block: r.get_block(),
            int64: r.get_int64(),
        })
    }
}

impl Schedule {
    fn write(&self, mut b: schedule::Builder<'_>) {
        b.set_learning_rate(self.learning_rate);
        b.set_min_lr(self.min_lr);
        b.set_warmup_steps(self.warmup_steps);
        b.set_total_steps(self.total_steps);
    }

    fn read(r: schedule::Reader<'_>) -> Self {
        Self {
            learning_rate: r.get_learning_rate(),
            min_lr: r.get_min_lr(),
            warmup_steps: r.get_warmup_steps(),
            total_steps: r.get_total_steps(),
        }
    }
}

impl ArtifactRef {
    fn write(&self, mut b: artifact_ref::Builder<'_>) {
        b.set_backend(self.backend.as_str());
        b.set_target(self.target.as_str());
        b.set_blob(&self.blob[..]);
        b.set_size(self.size);
        b.set_micro_batches(self.micro_batches);
        b.set_recompute(self.recompute.as_str());
        b.set_estimate_bytes(self.estimate_bytes);
    }

    fn read(w: &'static str, r: artifact_ref::Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            backend: codec::text(w, "backend", r.get_backend())?,
            target: codec::text(w, "target", r.get_target())?,
            blob: fixed(w, "blob", r.get_blob().map_err(|e| malformed(w, e))?)?,
            size: r.get_size(),
            micro_batches: r.get_micro_batches(),
            recompute: codec::text(w, "recompute", r.get_recompute())?,
            estimate_bytes: r.get_estimate_bytes(),
        })
    }
}

impl ParameterRef {
    pub(crate) fn write(&self, mut b: parameter_ref::Builder<'_>) {
        b.set_name(self.name.as_str());
        b.set_shard(self.shard);
        b.set_blob(&self.blob[..]);
        b.set_size(self.size);
    }

    pub(crate) fn read(w: &'static str, r: parameter_ref::Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            name: codec::text(w, "name", r.get_name())?,
            shard: r.get_shard(),
            blob: fixed(w, "blob", r.get_blob().map_err(|e| malformed(w, e))?)?,
            size: r.get_size(),
        })
    }

    pub(crate) fn write_list(list: &[Self], mut b: capnp::struct_list::Builder<'_, parameter_ref::Owned>) {
        for (i, p) in (0..).zip(list) {
            p.write(b.reborrow().get(i));
        }
    }

    pub(crate) fn read_list(
        w: &'static str,
        r: capnp::Result<capnp::struct_list::Reader<'_, parameter_ref::Owned>>,
    ) -> Result<Vec<Self>, DecodeError> {
        let r = r.map_err(|e| malformed(w, e))?;
        let mut out = Vec::with_capacity(r.len() as usize);
        for p in r.iter() {
            out.push(Self::read(w, p)?);
        }
        Ok(out)
    }
}

impl Message for RunManifest {
    const NAME: &'static str = "RunManifest";
    const MAX_SIZE: usize = MAX_CONTROL_MESSAGE;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<run_manifest::Builder<'_>>();
        root.set_run(&self.run[..]);
        root.set_name(self.name.as_str());
        root.set_shepherd(&self.shepherd[..]);
        root.set_inner_steps(self.inner_steps);
        let mut artifacts = root.reborrow().init_artifacts(list_len(self.artifacts.len()));
        for (i, a) in (0..).zip(&self.artifacts) {
            a.write(artifacts.reborrow().get(i));
        }
        ParameterRef::write_list(&self.parameters, root.reborrow().init_parameters(list_len(self.parameters.len())));
        root.set_model_hash(&self.model_hash[..]);
        root.set_rounds(self.rounds);
        root.set_seed(self.seed);
        self.schedule.write(root.reborrow().init_schedule());
        root.set_outer_lr(self.outer_lr);
        root.set_outer_momentum(self.outer_momentum);
        self.data.write(root.reborrow().init_data());
        let mut tensors = root.reborrow().init_tensors(list_len(self.tensors.len()));
        for (i, t) in (0..).zip(&self.tensors) {
            t.write(tensors.reborrow().get(i));
        }
        root.set_state_per_param(self.state_per_param);
        root.set_encoding(self.encoding.as_str());
        root.set_screen(self.screen.as_str());
        root.set_trim(self.trim);
        let mut candidates = root.reborrow().init_candidates(list_len(self.candidates.len()));
        for (i, c) in (0..).zip(&self.candidates) {
            candidates.set(i, &c[..]);
        }
        root.set_lease_ms(self.lease_ms);
        root.set_failover(self.failover);
        root.set_salt(&self.salt[..]);
        root.set_experiment(&self.experiment[..]);
        root.set_overlap(self.overlap);
        root.set_fragments(self.fragments);
        root.set_precision(self.precision.as_str());
        root.set_recompute(self.recompute.as_str());
        let a = &self.admission;
        root.set_admit(a.admit.as_str());
        if a.authorizer != [0; 32] {
            root.set_authorizer(&a.authorizer[..]);
        }
        let mut allowlist = root.reborrow().init_allowlist(list_len(a.allowlist.len()));
        for (i, k) in (0..).zip(&a.allowlist) {
            allowlist.set(i, &k[..]);
        }
        root.set_pow_bits(a.pow_bits);
        root.set_pow_joins_per_hour(a.pow_joins_per_hour);
        root.set_max_participants(a.max_participants);
        root.set_aggregate_max(a.aggregate_max);
        root.set_probation_rounds(a.probation_rounds);
        root.set_screen_sample(a.screen_sample);
        root.set_aggregator_spot_rate(a.aggregator_spot_rate);
        root.set_screeners(a.screeners);
        root.set_screen_spot_rate(a.screen_spot_rate);
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = RunManifest::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<run_manifest::Reader<'_>>().map_err(|e| malformed(W, e))?;
            let list = r.get_artifacts().map_err(|e| malformed(W, e))?;
            let mut artifacts = Vec::with_capacity(list.len() as usize);
            for a in list.iter() {
                artifacts.push(ArtifactRef::read(W, a)?);
            }
            let list = r.get_tensors().map_err(|e| malformed(W, e))?;
            let mut tensors = Vec::with_capacity(list.len() as usize);
            for t in list.iter() {
                tensors.push(TensorSpec::read(W, t)?);
            }
            let list = r.get_allowlist().map_err(|e| malformed(W, e))?;
            let mut allowlist = Vec::with_capacity(list.len() as usize);
            for k in list.iter() {
                allowlist.push(fixed(W, "allowlist", k.map_err(|e| malformed(W, e))?)?);
            }
            let list = r.get_candidates().map_err(|e| malformed(W, e))?;
            let mut candidates = Vec::with_capacity(list.len() as usize);
            for c in list.iter() {
                candidates.push(fixed(W, "candidates", c.map_err(|e| malformed(W, e))?)?);
            }
            Ok(Self {
                run: fixed(W, "run", r.get_run().map_err(|e| malformed(W, e))?)?,
                name: codec::text(W, "name", r.get_name())?,
                shepherd: fixed(W, "shepherd", r.get_shepherd().map_err(|e| malformed(W, e))?)?,
                inner_steps: r.get_inner_steps(),
                artifacts,
                parameters: ParameterRef::read_list(W, r.get_parameters())?,
                model_hash: fixed(W, "model_hash", r.get_model_hash().map_err(|e| malformed(W, e))?)?,
                rounds: r.get_rounds(),
                seed: r.get_seed(),
                schedule: Schedule::read(r.get_schedule().map_err(|e| malformed(W, e))?),
                outer_lr: r.get_outer_lr(),
                outer_momentum: r.get_outer_momentum(),
                data: DataSpec::read(W, r.get_data().map_err(|e| malformed(W, e))?)?,
                tensors,
                state_per_param: r.get_state_per_param(),
                encoding: codec::text(W, "encoding", r.get_encoding())?,
                screen: codec::text(W, "screen", r.get_screen())?,
                trim: r.get_trim(),
                candidates,
                lease_ms: r.get_lease_ms(),
                failover: r.get_failover(),
                salt: fixed(W, "salt", r.get_salt().map_err(|e| malformed(W, e))?)?,
                experiment: fixed(W, "experiment", r.get_experiment().map_err(|e| malformed(W, e))?)?,
                overlap: r.get_overlap(),
                fragments: r.get_fragments(),
                precision: match codec::text(W, "precision", r.get_precision())? {
                    p if p.is_empty() => "f32".to_owned(),
                    p => p,
                },
                recompute: match codec::text(W, "recompute", r.get_recompute())? {
                    p if p.is_empty() => "none".to_owned(),
                    p => p,
                },
                admission: Admission {
                    admit: match codec::text(W, "admit", r.get_admit())? {
                        a if a.is_empty() => "open".to_owned(),
                        a => a,
                    },
                    authorizer: optional_hash(W, "authorizer", r.get_authorizer().map_err(|e| malformed(W, e))?)?,
                    allowlist,
                    pow_bits: r.get_pow_bits(),
                    pow_joins_per_hour: r.get_pow_joins_per_hour(),
                    max_participants: r.get_max_participants(),
                    aggregate_max: r.get_aggregate_max(),
                    probation_rounds: r.get_probation_rounds(),
                    screen_sample: r.get_screen_sample(),
                    aggregator_spot_rate: r.get_aggregator_spot_rate(),
                    screeners: r.get_screeners(),
                    screen_spot_rate: r.get_screen_spot_rate(),
                },
            })
        })
    }
}
