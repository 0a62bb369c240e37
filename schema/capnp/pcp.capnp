# The pcp wire schema. Every message that crosses the network is defined here.
# Byte fields that hold keys and hashes are fixed-size (32 or 64 bytes); the Rust
# decoders in `pcp-schema` reject any other length.
@0xde0620fa3d48b3db;

# --- node identity and capabilities ---------------------------------------

struct Backend {
  name @0 :Text;            # e.g. "rocm", "cuda", "vulkan", "cpu"
  targets @1 :List(Text);   # e.g. "gfx942", "sm_90"
}

struct Capabilities {
  backends @0 :List(Backend);
  freeMemoryBytes @1 :UInt64;
  aggregate @2 :Bool;       # offers to sum parameter shards (`--aggregate`)
}

struct NodeHello {
  peer @0 :Data;            # ed25519 public key, 32 bytes
  protocolVersion @1 :UInt32;
  agent @2 :Text;
  capabilities @3 :Capabilities;
  certificate @4 :Data;     # a join certificate from the run's authorizer (pcp_protocol::admit); empty: none
  powNonce @5 :UInt64;      # the nonce of the identity's proof of work for the run (open runs that ask one)
}

# --- runs, artifacts and parameters ----------------------------------------

struct ArtifactRef {
  backend @0 :Text;
  target @1 :Text;
  blob @2 :Data;            # blake3 content id, 32 bytes
  size @3 :UInt64;
  microBatches @4 :UInt32;  # the step is grad_step + apply_step over this many micro-batches a batch (0 or 1: train_step, whole)
  recompute @5 :Text;       # the step's recomputation when stronger than the run's (a small device); empty: the run's
  estimateBytes @6 :UInt64; # the step's expected peak memory the shepherd planned it for (0: not planned)
}

struct ParameterRef {
  name @0 :Text;
  shard @1 :UInt32;
  blob @2 :Data;            # blake3 content id, 32 bytes
  size @3 :UInt64;
}

struct TensorSpec {
  name @0 :Text;
  shape @1 :List(UInt64);
}

struct DataSpec {
  blob @0 :Data;            # the corpus, blake3 content id, 32 bytes
  size @1 :UInt64;
  tokenizer @2 :Text;       # "char", "byte" or "u16"
  valFraction @3 :Float64;
  batch @4 :UInt32;
  block @5 :UInt32;
  int64 @6 :Bool;           # token inputs are i64 (else i32)
}

struct Schedule {
  learningRate @0 :Float64; # peak inner learning rate
  minLr @1 :Float64;
  warmupSteps @2 :UInt64;
  totalSteps @3 :UInt64;    # rounds x inner steps
}

struct RunManifest {
  run @0 :Data;             # run id, 32 bytes
  name @1 :Text;
  shepherd @2 :Data;        # ed25519 public key, 32 bytes
  innerSteps @3 :UInt32;
  artifacts @4 :List(ArtifactRef);
  parameters @5 :List(ParameterRef);
  modelHash @6 :Data;       # blake3 of the loss module, 32 bytes
  rounds @7 :UInt64;
  seed @8 :UInt64;
  schedule @9 :Schedule;
  outerLr @10 :Float32;
  outerMomentum @11 :Float32;
  data @12 :DataSpec;
  tensors @13 :List(TensorSpec);
  statePerParam @14 :UInt32; # optimizer state tensors per parameter
  encoding @15 :Text;       # pseudo-gradient encoding: "fp32", "bf16" or "int8"
  screen @16 :Text;         # how contributions are screened: "score" (held-out loss) or "norm"
  trim @17 :Float32;        # trimmed-mean fraction at each end; 0: the token-weighted mean
  candidates @18 :List(Data); # ed25519 keys of the coordinator candidates besides the creator
  leaseMs @19 :UInt64;      # a leader's lease: candidates take over after this long without one
  salt @20 :Data;           # 32 bytes; the run id is blake3 over creator, model, salt and candidates
  experiment @21 :Data;     # blake3 of the experiment (JSON) blob a successor needs; empty: none
  overlap @22 :Bool;        # workers train the next round while a round syncs (rebase merge)
  fragments @23 :UInt32;    # Streaming DiLoCo: round r syncs fragment (r-1) mod P of P (0 or 1: the whole model)
  precision @24 :Text;      # the step's matmuls: "f32" or "bf16" (mixed: weights, optimizer, loss f32); empty: f32
  recompute @25 :Text;      # activations the backward recomputes: "none", "attention", "elementwise", "blocks"; empty: none
  admit @26 :Text;          # who may join: "open", "allowlist" or "authorizer"; empty: open
  authorizer @27 :Data;     # "authorizer": the key whose join certificates admit a worker, 32 bytes; else empty
  allowlist @28 :List(Data); # "allowlist": the ed25519 keys admitted, 32 bytes each; else empty
  powBits @29 :UInt32;      # "open": leading zero bits of the identity's proof of work (0: none)
  maxParticipants @30 :UInt32; # the most participants a round (0: every live worker)
  aggregateMax @31 :UInt32; # the most contributions aggregated a round, the best-rated (0: all)
  probationRounds @32 :UInt32; # screens a new key passes before it counts in full
  screenSample @33 :Float32; # a rated peer's contribution is screened with this probability once screening passes its share of the round
  failover @34 :UInt8;      # how candidates agree: 0 by their count (majority from 3), 1 majority, 2 best effort
  powJoinsPerHour @35 :UInt32; # "open": new keys an hour admitted at powBits; each doubling beyond adds a bit (0: powBits always)
  aggregatorSpotRate @36 :Float32; # the share of aggregated shards the shepherd sums itself whatever their replicas vote (up to 1,000 contributions a round)
  screeners @37 :UInt32;    # rated workers that score each contribution (its committee); 0: the shepherd scores them all
  screenSpotRate @38 :Float32; # with screeners: the share of contributions the shepherd scores itself whatever their committee says
}

# --- rounds ----------------------------------------------------------------

struct RoundAnnouncement {
  run @0 :Data;
  round @1 :UInt64;
  parameters @2 :List(ParameterRef);
  deadlineUnixMs @3 :UInt64;
  participants @4 :List(Data); # ed25519 public keys expected to contribute
  finished @5 :Bool;        # the run is over; `parameters` are the final ones
  term @6 :UInt64;          # the signer's term as leader (1: the creator's)
  state @7 :ParameterRef;   # the leader's state after the last completed round, for successors
  hasState @8 :Bool;        # whether `state` is set
  update @9 :ParameterRef;  # a sparse run: the last round's update (the parameters before it minus these)
  updateBase @10 :Data;     # blake3 of the parameters blob the update applies to
  hasUpdate @11 :Bool;      # whether `update` is set
  budgetMs @12 :UInt64;     # overlap: milliseconds of inner steps a round (0: none, tau steps)
  stepsEndUnixMs @13 :UInt64; # overlap: when the median worker's steps of this round end (0: unknown)
  screenCommit @14 :Data;   # blake3 of the secret seed of this round's screen batch, 32 bytes; empty: none
  screenReveal @15 :Data;   # the previous round's screen seed, 32 bytes, to audit its commit; empty: none
  participantsBlob @16 :ParameterRef; # past the shepherd's inline threshold: the participants, a blob
                                      # of sorted 32-byte keys (and `participants` empty)
  hasParticipantsBlob @17 :Bool;
  aggregators @18 :List(ShardAggregators); # parameter-shard aggregators, one entry a shard
                                           # (empty: the shepherd sums alone)
}

# Who sums one parameter shard of a round: its replicas in order (workers upload
# the shard's slice to the first, which forwards it), and any auditor.
struct ShardAggregators {
  replicas @0 :List(Data);  # ed25519 public keys
  auditor @1 :Data;         # an ed25519 public key; empty: none
  tensorBounds @2 :List(Float64);  # the round's per-tensor L2 bounds of the shard's tensors
  elementBounds @3 :List(Float32); # and its per-element bounds (infinite: none)
}

struct Contribution {
  run @0 :Data;
  round @1 :UInt64;
  innerSteps @2 :UInt32;
  samples @3 :UInt64;
  pseudoGradient @4 :ParameterRef; # content id and size of `delta`
  loss @5 :Float32;         # mean inner loss
  delta @6 :Data;           # the encoded pseudo-gradient, inline
  bytesDown @7 :UInt64;     # parameter bytes the worker fetched for this round (its report)
  term @8 :UInt64;          # the term whose announcement the worker trained from (fencing)
  paramsHash @9 :Data;      # blake3 of the parameters blob it trained from (fencing)
  trainMs @10 :UInt64;      # the worker's milliseconds in inner steps since its last contribution
  wallMs @11 :UInt64;       # and the wall milliseconds they took place in (its utilization's parts)
  sentUnixMs @12 :UInt64;   # when the worker sent it, its clock (0: not said; overlap's deadline)
  sliceHashes @13 :List(Data); # an aggregated round: each shard's slice hash (and `delta` empty)
}

# --- parameter-shard aggregators --------------------------------------------

# A worker's slice of one shard of its contribution, to the shard's first
# replica (signed by the worker), or forwarded by it to the others (signed by
# the replica; the slice's hash is checked against the worker's commitment).
struct Slice {
  run @0 :Data;
  round @1 :UInt64;
  shard @2 :UInt32;
  worker @3 :Data;          # the contributing worker's key
  bytes @4 :Data;           # the slice, encoded as the run's contributions are
}

# What an aggregator found in slices it holds, to the shepherd, in batches.
struct SliceReports {
  run @0 :Data;
  round @1 :UInt64;
  reports @2 :List(SliceReportEntry);
}

struct SliceReportEntry {
  shard @0 :UInt32;
  worker @1 :Data;
  hash @2 :Data;            # the slice's hash (pcp/aggregators/slice/v1)
  norms @3 :List(Float64);  # each tensor's raw L2 norm
  maxes @4 :List(Float32);  # each tensor's largest magnitude
  boundedNorm @5 :Float64;  # the slice's L2 norm once bounded
}

# The shepherd's accepted contributions of a round, in its order, as one
# aggregator needs them (the hashes of that aggregator's shards only), and,
# once the round closes, its count.
struct Accepts {
  run @0 :Data;
  round @1 :UInt64;
  entries @2 :List(AcceptEntry);
  closed @3 :Bool;
  count @4 :UInt64;         # with `closed`: contributions the round accepted
}

struct AcceptEntry {
  worker @0 :Data;
  seq @1 :UInt64;
  weight @2 :Float64;
  norm @3 :Float64;
  bound @4 :Float64;
  hashes @5 :List(ShardHash);
}

struct ShardHash {
  shard @0 :UInt32;
  hash @1 :Data;
}

# An aggregator's signed hash of a shard's update, and the blob holding it.
struct ShardVote {
  run @0 :Data;
  round @1 :UInt64;
  shard @2 :UInt32;
  hash @3 :Data;            # pcp/aggregators/update/v1 of the mean and its divisor
  update @4 :ParameterRef;  # the update's blob (with `failure` none)
  failure @5 :ShardFailure; # why the shard could not be summed (none: it was)
}

enum ShardFailure {
  none @0;
  missing @1;               # an accepted slice never reached the aggregator
  duplicate @2;             # a place in the order was given twice
  pastClose @3;             # places past the round's count were given
}

# The shepherd asks a screener (a rated worker on the contribution's committee)
# to score one contribution of the open round, on a batch from the withheld split.
struct ScreenRequest {
  run @0 :Data;
  round @1 :UInt64;             # the open round: its parameters are the base
  contribution @2 :Data;        # blake3 of the encoded pseudo-gradient: its id
  contributionRound @3 :UInt64; # the round it was made for (its encoding's seed and fragment)
  paramsHash @4 :Data;          # the parameters blob it is scored at
  delta @5 :Data;               # the pseudo-gradient, encoded as its sender sent it
  tensorBounds @6 :List(Float64); # the round's per-tensor L2 bounds (infinite: none)
  elementBounds @7 :List(Float32); # the round's per-element clips (infinite: none)
  boundScale @8 :Float32;       # the global norm bound's scale, after the per-tensor bounds
  outerScale @9 :Float32;       # the scale the outer step applies it at
  rows @10 :UInt32;             # the batch's windows
  windows @11 :Data;            # rows x (block + 1) u16 tokens, little-endian
  sliceHashes @12 :List(Data);  # an aggregated contribution: its shards' slice hashes, in shard order (`delta` empty)
  sender @13 :Data;             # with sliceHashes: the contributor's key, which serves the slices
  sliceHolders @14 :List(List(Data)); # with sliceHashes: each shard's aggregators' keys, which hold its slice (fetched from them first)
}

# A screener's held-out losses for one contribution: the answer to a ScreenRequest.
struct ScreenReport {
  run @0 :Data;
  round @1 :UInt64;
  contribution @2 :Data;
  before @3 :Float32;           # at the round's parameters
  after @4 :Float32;            # with the contribution applied
  reversed @5 :Float32;         # with it applied reversed
}

# The shepherd's answer to a contribution, or its refusal of any request.
struct Ack {
  run @0 :Data;
  round @1 :UInt64;
  accepted @2 :Bool;
  reason @3 :Text;          # for people: never decided on
  code @4 :AckCode;         # what a program decides on
  powBits @5 :UInt8;        # code proofOfWork: the leading zero bits the run needs
}

# Why a request was refused (none: accepted, or a refusal without a code of its own).
enum AckCode {
  none @0;
  other @1;            # refused; the reason says why
  standby @2;          # a standby candidate, not the run's leader
  noArtifact @3;       # the shepherd cannot compile for the hello's backend or target
  proofOfWork @4;      # the hello's proof of work is short of powBits
  notAdmitted @5;      # admission refused the key (certificate, allowlist, address cap)
  full @6;             # the shepherd holds as many workers as it can
  wrongRun @7;         # for a run the shepherd does not run
  wrongRound @8;       # for a round that is not open
  late @9;             # for a round that already closed
  notParticipant @10;  # not asked to take part in the round
  duplicate @11;       # a second contribution for the round
  malformed @12;       # undecodable, the wrong shape, or a non-finite value
  samples @13;         # claims samples the manifest does not allow
  empty @14;           # an update of zeros
  screen @15;          # refused by the shepherd's screen (its losses are not told)
  notSelected @16;     # not among the contributions the round aggregates
  fenced @17;          # trained under another term or from other parameters
  unscreened @18;      # past the round's screening budget while on probation
  tooSimilar @19;      # too close to another contribution or to the last update
  sitsOut @20;         # the screen refused this key lately: it sits out some rounds
}

struct Heartbeat {
  run @0 :Data;
  round @1 :UInt64;
  unixMs @2 :UInt64;
  freeMemoryBytes @3 :UInt64;
  term @4 :UInt64;          # the leader's term when a leader sends it (its lease); 0 otherwise
  follows @5 :UInt64;       # the highest term the sender follows (workers and standbys)
  heldTerm @6 :UInt64;      # a candidate's replicated state: the term that produced it,
  heldRound @7 :UInt64;     # the rounds it completed,
  heldParams @8 :Data;      # and its parameters hash
  hasHeld @9 :Bool;         # whether the candidate holds a state
  # Between candidates (failover): 0 none; 1 a lease (term @4, the leader's state
  # in held*), 2 an answer (term @4: the term it follows; held*: what it holds),
  # 3 a vote request (term @4; held*: the campaigner's state), 4 a vote.
  consensus @10 :UInt8;
  sentMs @11 :UInt64;       # a lease's send time on its leader's clock, echoed by the answer
  granted @12 :Bool;        # a vote: granted
  pre @13 :Bool;            # a vote request or vote: a pre-vote
  heldBlob @14 :Data;       # a lease: the blob of the leader's state (32 bytes)
  # A worker's: blake3 of the round announcement it holds (its signed payload;
  # empty: none). A leader whose current announcement it is answers with a small
  # heartbeat of its own (term @4, and this hash) instead of the announcement.
  known @15 :Data;
  # A leader's: its open round's deadline now (Unix ms; 0: no round open). The
  # deadline moves when a round has no quorum at it; a worker whose round lapsed
  # at the announced deadline takes it up again.
  deadlineUnixMs @16 :UInt64;
}

# --- blob transfer (request-response) --------------------------------------

struct BlobRequest {
  blob @0 :Data;            # content id, 32 bytes
  union {
    outboard @1 :Void;      # ask for the blob's size and chunk chaining values
    chunk @2 :UInt32;       # ask for one chunk by index
  }
}

struct BlobResponse {
  union {
    outboard :group {
      size @0 :UInt64;
      chunkCvs @1 :Data;    # 32 bytes per chunk, in order
    }
    chunk @2 :Data;
    notFound @3 :Void;
    refused @4 :Text;
  }
}

# --- signed envelope -------------------------------------------------------

enum MessageKind {
  nodeHello @0;
  runManifest @1;
  roundAnnouncement @2;
  contribution @3;
  heartbeat @4;
  ack @5;
  slice @6;
  sliceReports @7;
  accepts @8;
  shardVote @9;
  screenRequest @10;
  screenReport @11;
}

struct SignedEnvelope {
  kind @0 :MessageKind;
  signer @1 :Data;          # ed25519 public key, 32 bytes
  run @2 :Data;             # run id, 32 bytes
  round @3 :UInt64;
  nonce @4 :UInt64;
  unixMs @5 :UInt64;
  payload @6 :Data;         # the encoded message of `kind`
  signature @7 :Data;       # 64 bytes over the domain, the header fields and the payload
}

# The head of a request-response frame (`/pcp/diloco/2.0.0`): a SignedEnvelope
# without its payload, which follows the head on the stream as `payloadLen` raw
# bytes. The signature covers the payload's blake3 hash, so a receiver verifies
# the head, and decides whether it wants the payload, before reading any of it.
struct FrameHead {
  kind @0 :MessageKind;
  signer @1 :Data;          # ed25519 public key, 32 bytes
  run @2 :Data;             # run id, 32 bytes
  round @3 :UInt64;
  nonce @4 :UInt64;
  unixMs @5 :UInt64;
  payloadLen @6 :UInt64;
  payloadHash @7 :Data;     # blake3 of the payload, 32 bytes
  signature @8 :Data;       # the envelope's signature
}
