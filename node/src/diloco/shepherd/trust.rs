//! Who may join a run and how far the shepherd trusts them: `--admit` and the caps,
//! probation and bounds that hold untrusted participants, as flags, as the signed
//! manifest records them, and as the state machine takes them.

use std::collections::BTreeSet;

use pcp_protocol::admit::{Admit, Difficulty, JoinCertificate, Proof};
use pcp_protocol::diloco::rating::Policy;
use pcp_protocol::{PublicKey, RunId};
use pcp_schema::Admission;

use crate::Failure;

/// The most keys an allowlist may hold: they travel in the run manifest, a control
/// message of at most 256 KiB (34 bytes a key).
const MAX_ALLOWLIST_KEYS: usize = 4096;
/// The largest allowlist file read (comments included).
const MAX_ALLOWLIST_BYTES: u64 = 4 << 20;

/// The trust flags of a shepherd (`pcp-node --shepherd`, `sim`).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct TrustArgs {
    /// Who may join: `open` (anyone; with --pow-bits, a key that solved a proof of
    /// work), `allowlist FILE` (the hex public keys in FILE, one a line), or
    /// `authorizer KEY` (a key holding an unexpired join certificate that KEY signed:
    /// `pcp-node certify`). Checked at hello and at every contribution.
    #[arg(long, num_args = 1..=2, value_names = ["MODE", "ARG"], default_values_t = ["open".to_owned()])]
    pub(crate) admit: Vec<String>,
    /// `--admit open`: the leading zero bits of blake3(run, key, nonce) a worker's
    /// identity must reach at least (each bit doubles a key's cost; 0: none).
    /// `--shepherd`'s default is 28, about a CPU-minute; `sim`'s is 0.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=32))]
    pub(crate) pow_bits: Option<u8>,
    /// `--admit open`: new keys an hour admitted at --pow-bits; each doubling of the
    /// last hour's joins beyond it asks one bit more of a new key (0: --pow-bits always).
    #[arg(long, default_value_t = pcp_protocol::admit::DEFAULT_JOINS_PER_HOUR)]
    pub(crate) pow_joins_per_hour: u32,
    /// The most participants a round, the best-rated workers first (0: every live worker).
    #[arg(long, default_value_t = 0)]
    pub(crate) max_participants: u32,
    /// The most contributions aggregated a round, the best-rated (0: all).
    #[arg(long, default_value_t = 0)]
    pub(crate) aggregate_max: u32,
    /// Screens a new key must pass before its contributions count in full.
    #[arg(long, default_value_t = 3)]
    pub(crate) probation_rounds: u32,
    /// The weight of a contribution on probation, as a share of its samples.
    #[arg(long, default_value_t = 0.25)]
    pub(crate) probation_weight: f64,
    /// Once screening has taken --screen-share of a round, a rated peer's
    /// contribution is screened with this probability (and one on probation is
    /// refused for the round).
    #[arg(long, default_value_t = 0.25)]
    pub(crate) screen_sample: f32,
    /// The share of a round (the last one's duration) screening may take in full.
    #[arg(long, default_value_t = 0.25)]
    pub(crate) screen_share: f64,
    /// Each tensor of a contribution is scaled down to this × the median norm of that
    /// tensor in rated peers' last contributions (0: off).
    #[arg(long, default_value_t = 2.0)]
    pub(crate) tensor_bound: f64,
    /// Each value of a contribution is clipped to this × the median largest
    /// magnitude of its tensor in rated peers' last contributions (0: off).
    #[arg(long, default_value_t = 4.0)]
    pub(crate) element_clip: f64,
    /// The most worker identities one IPv4 address or IPv6 /64 may hold (loopback
    /// is not counted: `sim` runs every node on it).
    #[arg(long, default_value_t = 4)]
    pub(crate) max_workers_per_ip: usize,
    /// Rated workers that score each contribution on their own devices (its
    /// screening committee, drawn from the round's secret seed); the shepherd takes
    /// their median, and scores a contribution itself when they disagree, fall
    /// silent or the spot check draws it. 0: the shepherd scores them all.
    /// [default: 3 in open runs, 0 in allowlist and authorizer runs]
    #[arg(long)]
    pub(crate) screeners: Option<u32>,
    /// With --screeners: the share of contributions the shepherd scores itself
    /// however their committee answered.
    #[arg(long, default_value_t = DEFAULT_SPOT_RATE)]
    pub(crate) screen_spot_rate: f64,
}

/// `--screen-spot-rate`'s default: a tenth of contributions.
pub(crate) const DEFAULT_SPOT_RATE: f64 = pcp_protocol::diloco::committee::DEFAULT_SPOT_RATE;

/// A spot-check rate as a fraction (NaN, from the flag or a manifest: the default).
fn spot_rate(rate: f64) -> f64 {
    if rate.is_nan() { DEFAULT_SPOT_RATE } else { rate.clamp(0.0, 1.0) }
}

/// `--screeners`' default in open runs, where identities are free and a round's
/// contributions too many for the shepherd's own screen.
pub(crate) const DEFAULT_SCREENERS: usize = pcp_protocol::diloco::committee::DEFAULT_SCREENERS as usize;

/// `--screeners`' default: committees of [`DEFAULT_SCREENERS`] in open runs; in
/// allowlist and authorizer runs the shepherd scores every contribution itself.
pub(crate) fn default_screeners(admit: &Admit) -> usize {
    match admit {
        Admit::Open { .. } => DEFAULT_SCREENERS,
        Admit::Allowlist(_) | Admit::Authorizer(_) => 0,
    }
}

impl Default for TrustArgs {
    fn default() -> Self {
        Self {
            admit: vec!["open".to_owned()],
            pow_bits: Some(0),
            pow_joins_per_hour: pcp_protocol::admit::DEFAULT_JOINS_PER_HOUR,
            max_participants: 0,
            aggregate_max: 0,
            probation_rounds: 3,
            probation_weight: 0.25,
            screen_sample: 0.25,
            screen_share: 0.25,
            tensor_bound: 2.0,
            element_clip: 4.0,
            max_workers_per_ip: 4,
            screeners: None,
            screen_spot_rate: DEFAULT_SPOT_RATE,
        }
    }
}

/// A run's trust settings, resolved.
#[derive(Debug, Clone)]
pub(crate) struct Trust {
    pub(crate) admit: Admit,
    /// `open`: new keys an hour admitted at the floor ([`Difficulty`]).
    pub(crate) joins_per_hour: u32,
    pub(crate) max_participants: u32,
    pub(crate) aggregate_max: u32,
    pub(crate) policy: Policy,
    pub(crate) screen_sample: f32,
    pub(crate) screen_share: f64,
    pub(crate) tensor_bound: f64,
    pub(crate) element_clip: f64,
    pub(crate) max_workers_per_ip: usize,
    /// Screeners a committee (0: none).
    pub(crate) screeners: usize,
    /// The share of committee-screened contributions the shepherd scores itself.
    pub(crate) spot_rate: f64,
}

impl Default for Trust {
    fn default() -> Self {
        let args = TrustArgs::default();
        Self {
            admit: Admit::Open { pow_bits: 0 },
            joins_per_hour: args.pow_joins_per_hour,
            max_participants: 0,
            aggregate_max: 0,
            policy: Policy {
                probation_rounds: args.probation_rounds,
                probation_weight: args.probation_weight,
                ..Policy::default()
            },
            screen_sample: args.screen_sample,
            screen_share: args.screen_share,
            tensor_bound: args.tensor_bound,
            element_clip: args.element_clip,
            max_workers_per_ip: args.max_workers_per_ip,
            screeners: DEFAULT_SCREENERS,
            spot_rate: args.screen_spot_rate,
        }
    }
}

/// A key given on the command line: a peer id or 64 hex characters.
pub(crate) fn parse_key(spec: &str, flag: &str) -> Result<PublicKey, Failure> {
    if let Ok(peer) = spec.parse::<pcp_bootstrap::PeerId>()
        && let Some(key) = pcp_bootstrap::key_of(&peer)
    {
        return Ok(key);
    }
    spec.parse::<pcp_protocol::BlobHash>()
        .map(|h| PublicKey(h.0))
        .map_err(|_| Failure::input(anyhow::anyhow!("{flag} {spec:?} is neither a peer id nor a hex public key")))
}

impl Trust {
    /// Resolves the flags (reading an allowlist file); an open run without
    /// `--pow-bits` asks `default_pow_bits`.
    pub(crate) fn from_args(args: &TrustArgs, default_pow_bits: u8) -> Result<Self, Failure> {
        let bad = |what: String| Failure::input(anyhow::anyhow!("--admit {}: {what}", args.admit.join(" ")));
        let admit = match args.admit.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
            ["open"] => Admit::Open { pow_bits: args.pow_bits.unwrap_or(default_pow_bits) },
            ["allowlist", file] => {
                let len = std::fs::metadata(file).map_err(|e| bad(format!("cannot read {file}: {e}")))?.len();
                if len > MAX_ALLOWLIST_BYTES {
                    return Err(bad(format!("{file} is {len} bytes, more than {MAX_ALLOWLIST_BYTES}")));
                }
                let text = std::fs::read_to_string(file).map_err(|e| bad(format!("cannot read {file}: {e}")))?;
                let keys = pcp_protocol::admit::parse_allowlist(&text).map_err(|e| bad(format!("{file}: {e}")))?;
                if keys.is_empty() {
                    return Err(bad(format!("{file} lists no key")));
                }
                if keys.len() > MAX_ALLOWLIST_KEYS {
                    return Err(bad(format!(
                        "{file} lists {} keys; the signed manifest carries at most {MAX_ALLOWLIST_KEYS} (use `authorizer`)",
                        keys.len()
                    )));
                }
                Admit::Allowlist(keys)
            }
            ["authorizer", key] => Admit::Authorizer(parse_key(key, "--admit authorizer")?),
            _ => return Err(bad("expected `open`, `allowlist FILE` or `authorizer KEY`".into())),
        };
        if args.pow_bits.is_some_and(|b| b > 0) && !matches!(admit, Admit::Open { .. }) {
            return Err(bad("--pow-bits applies to `--admit open` only".into()));
        }
        let screeners = args.screeners.map_or_else(|| default_screeners(&admit), |k| k as usize);
        let factor = |f: f64| if f > 0.0 { f } else { f64::INFINITY };
        Ok(Self {
            admit,
            joins_per_hour: args.pow_joins_per_hour,
            max_participants: args.max_participants,
            aggregate_max: args.aggregate_max,
            policy: Policy {
                probation_rounds: args.probation_rounds,
                probation_weight: args.probation_weight.clamp(0.0, 1.0),
                ..Policy::default()
            },
            screen_sample: args.screen_sample.clamp(0.0, 1.0),
            screen_share: args.screen_share.max(0.0),
            tensor_bound: factor(args.tensor_bound),
            element_clip: factor(args.element_clip),
            max_workers_per_ip: args.max_workers_per_ip.max(1),
            screeners,
            spot_rate: spot_rate(args.screen_spot_rate),
        })
    }

    /// What the signed manifest records.
    pub(crate) fn manifest(&self) -> Admission {
        let (authorizer, allowlist, pow_bits) = match &self.admit {
            Admit::Open { pow_bits } => ([0; 32], Vec::new(), u32::from(*pow_bits)),
            Admit::Allowlist(keys) => ([0; 32], keys.iter().map(|k| k.0).collect(), 0),
            Admit::Authorizer(key) => (key.0, Vec::new(), 0),
        };
        Admission {
            admit: self.admit.name().to_owned(),
            authorizer,
            allowlist,
            pow_bits,
            pow_joins_per_hour: self.joins_per_hour,
            max_participants: self.max_participants,
            aggregate_max: self.aggregate_max,
            probation_rounds: self.policy.probation_rounds,
            screen_sample: self.screen_sample,
            // the shepherd's plan sets it (`--aggregator-spot-rate`)
            aggregator_spot_rate: 0.0,
            screeners: u32::try_from(self.screeners).unwrap_or(u32::MAX),
            screen_spot_rate: self.spot_rate as f32,
        }
    }

    /// A successor's settings, from the run's manifest (the bounds and shares the
    /// manifest does not record are the defaults).
    pub(crate) fn from_manifest(a: &Admission) -> Result<Self, Failure> {
        let admit = match a.admit.as_str() {
            "" | "open" => Admit::Open { pow_bits: u8::try_from(a.pow_bits.min(32)).unwrap_or(32) },
            "allowlist" => Admit::Allowlist(a.allowlist.iter().map(|k| PublicKey(*k)).collect::<BTreeSet<_>>()),
            "authorizer" => Admit::Authorizer(PublicKey(a.authorizer)),
            other => return Err(Failure::input(anyhow::anyhow!("the run's manifest admits {other:?}"))),
        };
        let defaults = Self::default();
        Ok(Self {
            screeners: a.screeners as usize,
            spot_rate: spot_rate(f64::from(a.screen_spot_rate)),
            admit,
            joins_per_hour: a.pow_joins_per_hour,
            max_participants: a.max_participants,
            aggregate_max: a.aggregate_max,
            policy: Policy { probation_rounds: a.probation_rounds, ..defaults.policy },
            screen_sample: a.screen_sample,
            ..defaults
        })
    }

    /// The proof-of-work rule of an open run (floor 0 for the others).
    pub(crate) fn difficulty(&self) -> Difficulty {
        let floor = match self.admit {
            Admit::Open { pow_bits } => pow_bits,
            _ => 0,
        };
        Difficulty { floor, joins_per_hour: self.joins_per_hour }
    }

    /// Whether `key` may take part in `run` with the proof its hello carried
    /// (`certificate`, `pow_nonce`), now, an open run asking a proof of work of
    /// `pow_bits` (see [`super::hellos`]): the one-line reason if not.
    pub(crate) fn check_at(
        &self,
        run: &RunId,
        key: &PublicKey,
        (certificate, pow_nonce): (&[u8], u64),
        now_ms: u64,
        pow_bits: u8,
    ) -> Result<(), crate::diloco::Refusal> {
        use crate::diloco::Refusal;
        let certificate =
            match certificate {
                [] => None,
                bytes => Some(JoinCertificate::from_bytes(bytes).map_err(|e| {
                    Refusal::new(pcp_schema::AckCode::NotAdmitted, format!("bad join certificate: {e}"))
                })?),
            };
        let admit = match self.admit {
            Admit::Open { .. } => &Admit::Open { pow_bits },
            ref other => other,
        };
        admit.check(run, key, &Proof { certificate, pow_nonce }, now_ms).map_err(|e| Refusal::admission(&e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_runs_screen_by_committees_of_three_unless_told_and_closed_runs_on_the_shepherd() {
        let resolve = |admit: &[&str], screeners: Option<u32>| {
            let args =
                TrustArgs { admit: admit.iter().map(|s| (*s).to_owned()).collect(), screeners, ..TrustArgs::default() };
            Trust::from_args(&args, 0).expect("resolves").screeners
        };
        let authorizer = ["authorizer", &"ab".repeat(32)];
        assert_eq!(resolve(&["open"], None), DEFAULT_SCREENERS);
        assert_eq!(resolve(&["open"], Some(0)), 0, "a test of the shepherd's own screen pins 0");
        assert_eq!(resolve(&authorizer, None), 0);
        assert_eq!(resolve(&authorizer, Some(5)), 5);
        // a successor screens as the run's signed manifest says
        let pinned = TrustArgs { screeners: Some(0), screen_spot_rate: 0.5, ..TrustArgs::default() };
        let succeeded = Trust::from_manifest(&Trust::from_args(&pinned, 0).expect("open").manifest()).expect("open");
        assert_eq!((succeeded.screeners, succeeded.spot_rate), (0, 0.5));
        let nan = TrustArgs { screen_spot_rate: f64::NAN, ..TrustArgs::default() };
        assert_eq!(Trust::from_args(&nan, 0).expect("open").spot_rate, DEFAULT_SPOT_RATE);
        let open = Trust::from_manifest(&Trust::default().manifest()).expect("open");
        assert_eq!((open.screeners, open.spot_rate), (DEFAULT_SCREENERS, f64::from(DEFAULT_SPOT_RATE as f32)));
    }
}
