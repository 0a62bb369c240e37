//! Who may join a public run: the run's admission policy ([`Admit`]), recorded in its
//! signed manifest, and what a worker's hello carries to meet it ([`Proof`]).
//!
//! - [`Admit::Open`]: anyone whose key carries a proof of work of the run's difficulty
//!   ([`pow_bits`], [`solve_pow`]). A new identity then costs `2^pow_bits` hashes, which
//!   prices Sybil floods without an authority; `pow_bits: 0` admits everyone. A
//!   shepherd raises the bits a new key needs with the run's join rate ([`Difficulty`]).
//! - [`Admit::Allowlist`]: only the listed keys (a file of hex keys: [`parse_allowlist`]).
//! - [`Admit::Authorizer`]: anyone holding a [`JoinCertificate`] for this run and this key,
//!   signed by the run's authorizer key and not expired.
//!
//! Pure: the caller passes `now`. The byte formats and test vectors are published in
//! `docs/test-vectors/join-certificate.md`.

use std::collections::BTreeSet;

mod difficulty;

pub use difficulty::{DEFAULT_JOINS_PER_HOUR, DEFAULT_POW_BITS, Difficulty, JoinRate};

use crate::identity::{Identity, PublicKey};
use crate::ids::RunId;

/// The domain tag that starts the message a join certificate's signature covers: it never
/// verifies as a signature of anything else (an envelope, say).
const CERTIFICATE_DOMAIN: &[u8] = b"pcp/join-certificate/v1\0";
/// The domain tag that starts the input of an identity's proof-of-work hash.
const POW_DOMAIN: &[u8] = b"pcp/identity-pow/v1\0";

/// The most proof-of-work bits a worker should agree to solve for a run: `2^32` hashes,
/// about a quarter of an hour on one core. [`solve_pow`] takes `2^bits` hashes on average whatever `bits`
/// is, so a worker refuses a run that asks more rather than search forever.
pub const MAX_POW_BITS: u8 = 32;

/// A run's admission policy: who may join it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    /// Anyone whose key, with the nonce in its [`Proof`], hashes to at least `pow_bits`
    /// leading zero bits (see [`pow_bits`]). `pow_bits: 0` admits everyone.
    Open {
        /// The leading zero bits a proof of work must have.
        pow_bits: u8,
    },
    /// Only these keys.
    Allowlist(BTreeSet<PublicKey>),
    /// Anyone with an unexpired [`JoinCertificate`] signed by this key.
    Authorizer(PublicKey),
}

/// What a worker's hello carries to be admitted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Proof {
    /// Its join certificate, for a run with an [`Admit::Authorizer`].
    pub certificate: Option<JoinCertificate>,
    /// Its proof-of-work nonce, for an [`Admit::Open`] run (see [`solve_pow`]).
    pub pow_nonce: u64,
}

/// Why a key was not admitted to a run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The run admits only its allowlist.
    #[error("{key} is not on the run's allowlist")]
    NotAllowed {
        /// The key refused.
        key: PublicKey,
    },
    /// The run admits only holders of a join certificate, and none came.
    #[error("{key} has no join certificate, and the run admits only keys its authorizer certified")]
    NoCertificate {
        /// The key refused.
        key: PublicKey,
    },
    /// The certificate certifies another key.
    #[error("{key} presented a join certificate for another key, {certified}")]
    WrongKey {
        /// The key refused.
        key: PublicKey,
        /// The key the certificate names.
        certified: PublicKey,
    },
    /// The certificate is for another run.
    #[error("{key} presented a join certificate for run {certified}, not {run}")]
    WrongRun {
        /// The key refused.
        key: PublicKey,
        /// The run joined.
        run: RunId,
        /// The run the certificate names.
        certified: RunId,
    },
    /// The certificate has expired.
    #[error("join certificate of {key} expired at {expires_unix_ms} ms (now {now_unix_ms} ms)")]
    Expired {
        /// The key refused.
        key: PublicKey,
        /// When the certificate expired, unix milliseconds.
        expires_unix_ms: u64,
        /// Now, unix milliseconds.
        now_unix_ms: u64,
    },
    /// The certificate's signature does not verify against the run's authorizer.
    #[error("join certificate of {key}: signature does not verify against the run's authorizer {authorizer}")]
    BadSignature {
        /// The key refused.
        key: PublicKey,
        /// The run's authorizer.
        authorizer: PublicKey,
    },
    /// The proof of work is too weak.
    #[error("proof of work of {key} has {bits} leading zero bits, the run needs {needed}")]
    WeakProofOfWork {
        /// The key refused.
        key: PublicKey,
        /// The leading zero bits its nonce gives.
        bits: u32,
        /// The leading zero bits the run needs.
        needed: u8,
    },
}

impl Admit {
    /// The policy's name: `open`, `allowlist` or `authorizer`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Open { .. } => "open",
            Self::Allowlist(_) => "allowlist",
            Self::Authorizer(_) => "authorizer",
        }
    }

    /// Whether `key` may join `run` with `proof`, at `now_unix_ms`.
    pub fn check(&self, run: &RunId, key: &PublicKey, proof: &Proof, now_unix_ms: u64) -> Result<(), Refusal> {
        match self {
            Self::Open { pow_bits: needed } => {
                if *needed == 0 {
                    return Ok(());
                }
                let bits = pow_bits(run, key, proof.pow_nonce);
                if bits < u32::from(*needed) {
                    return Err(Refusal::WeakProofOfWork { key: *key, bits, needed: *needed });
                }
                Ok(())
            }
            Self::Allowlist(keys) => {
                if keys.contains(key) {
                    Ok(())
                } else {
                    Err(Refusal::NotAllowed { key: *key })
                }
            }
            Self::Authorizer(authorizer) => {
                let certificate = proof.certificate.as_ref().ok_or(Refusal::NoCertificate { key: *key })?;
                certificate.verify(authorizer, run, key, now_unix_ms)
            }
        }
    }
}

/// Leave to join one run, for one key, until an expiry, signed by the run's authorizer.
///
/// The signature is ed25519 (verified strictly) over `pcp/join-certificate/v1\0` ‖ the
/// authorizer's key ‖ `run` ‖ `key` ‖ `expires_unix_ms` (8 bytes little-endian), so it
/// verifies only against the authorizer that issued it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JoinCertificate {
    /// The run it admits to.
    pub run: RunId,
    /// The key it admits.
    pub key: PublicKey,
    /// The first unix millisecond at which it no longer admits.
    pub expires_unix_ms: u64,
    /// The authorizer's signature.
    pub signature: [u8; 64],
}

/// Why bytes are not a join certificate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CertificateError {
    /// Not [`JoinCertificate::LEN`] bytes.
    #[error("join certificate is {len} bytes, expected {}", JoinCertificate::LEN)]
    Length {
        /// The length given.
        len: usize,
    },
}

impl JoinCertificate {
    /// The length of its encoding: run (32) ‖ key (32) ‖ expiry (8, little-endian) ‖
    /// signature (64).
    pub const LEN: usize = 32 + 32 + 8 + 64;

    /// A certificate, signed by `authorizer`, that admits `key` to `run` until
    /// `expires_unix_ms`.
    pub fn issue(authorizer: &Identity, run: RunId, key: PublicKey, expires_unix_ms: u64) -> Self {
        let signature = authorizer.sign_raw(&signed_message(&authorizer.public(), &run, &key, expires_unix_ms));
        Self { run, key, expires_unix_ms, signature }
    }

    /// Whether it admits `key` to `run` at `now_unix_ms`, signed by `authorizer`.
    pub fn verify(
        &self,
        authorizer: &PublicKey,
        run: &RunId,
        key: &PublicKey,
        now_unix_ms: u64,
    ) -> Result<(), Refusal> {
        if self.key != *key {
            return Err(Refusal::WrongKey { key: *key, certified: self.key });
        }
        if self.run != *run {
            return Err(Refusal::WrongRun { key: *key, run: *run, certified: self.run });
        }
        if now_unix_ms >= self.expires_unix_ms {
            return Err(Refusal::Expired { key: *key, expires_unix_ms: self.expires_unix_ms, now_unix_ms });
        }
        let message = signed_message(authorizer, &self.run, &self.key, self.expires_unix_ms);
        authorizer
            .verify_raw(&message, &self.signature)
            .map_err(|_| Refusal::BadSignature { key: *key, authorizer: *authorizer })
    }

    /// Its fixed-size encoding ([`Self::LEN`] bytes).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(Self::LEN);
        out.extend_from_slice(&self.run.0);
        out.extend_from_slice(&self.key.0);
        out.extend_from_slice(&self.expires_unix_ms.to_le_bytes());
        out.extend_from_slice(&self.signature);
        out
    }

    /// Decodes [`Self::to_bytes`]; any other length is refused. The signature is not
    /// checked here (see [`Self::verify`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, CertificateError> {
        let bytes: &[u8; Self::LEN] = bytes.try_into().map_err(|_| CertificateError::Length { len: bytes.len() })?;
        let (run, rest) = bytes.split_at(32);
        let (key, rest) = rest.split_at(32);
        let (expiry, signature) = rest.split_at(8);
        let array32 = |b: &[u8]| {
            let mut a = [0u8; 32];
            a.copy_from_slice(b);
            a
        };
        let mut expires = [0u8; 8];
        expires.copy_from_slice(expiry);
        let mut sig = [0u8; 64];
        sig.copy_from_slice(signature);
        Ok(Self {
            run: RunId(array32(run)),
            key: PublicKey(array32(key)),
            expires_unix_ms: u64::from_le_bytes(expires),
            signature: sig,
        })
    }
}

/// What a join certificate's signature covers.
fn signed_message(authorizer: &PublicKey, run: &RunId, key: &PublicKey, expires_unix_ms: u64) -> Vec<u8> {
    let mut m = Vec::with_capacity(CERTIFICATE_DOMAIN.len() + 32 * 3 + 8);
    m.extend_from_slice(CERTIFICATE_DOMAIN);
    m.extend_from_slice(&authorizer.0);
    m.extend_from_slice(&run.0);
    m.extend_from_slice(&key.0);
    m.extend_from_slice(&expires_unix_ms.to_le_bytes());
    m
}

/// The proof-of-work digest of `key` for `run` with `nonce`: blake3 of `pcp/identity-pow/v1\0` ‖
/// `run` ‖ `key` ‖ `nonce` (8 bytes little-endian).
pub fn pow_digest(run: &RunId, key: &PublicKey, nonce: u64) -> [u8; 32] {
    let mut hasher = blake3::Hasher::new();
    hasher.update(POW_DOMAIN);
    hasher.update(&run.0);
    hasher.update(&key.0);
    hasher.update(&nonce.to_le_bytes());
    *hasher.finalize().as_bytes()
}

/// The leading zero bits of [`pow_digest`]`(run, key, nonce)` (0 to 256): the work
/// `key` proved for `run` with `nonce`. Bound to the run, so work done for one run
/// buys nothing in another.
pub fn pow_bits(run: &RunId, key: &PublicKey, nonce: u64) -> u32 {
    let digest = pow_digest(run, key, nonce);
    let mut bits = 0;
    for byte in digest {
        bits += byte.leading_zeros();
        if byte != 0 {
            break;
        }
    }
    bits
}

/// The first nonce from `from` upward (wrapping) whose [`pow_bits`] is at least `bits`.
///
/// Costs `2^bits` hashes on average: about 4 million hashes a second on one core
/// (4.4 million measured on a shared AMD EPYC core, release build), so 20 bits take a
/// quarter of a second and [`MAX_POW_BITS`] (32) about a quarter of an hour. Never returns for bits no nonce
/// reaches: callers bound `bits` (by [`MAX_POW_BITS`]). Pure: run it on a blocking
/// thread, and resume from the last nonce tried to spread the search.
pub fn solve_pow(run: &RunId, key: &PublicKey, bits: u8, from: u64) -> u64 {
    let mut nonce = from;
    while pow_bits(run, key, nonce) < u32::from(bits) {
        nonce = nonce.wrapping_add(1);
    }
    nonce
}

/// Why an allowlist file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllowlistError {
    /// A line is not a key.
    #[error("allowlist line {line}: `{text}` is not 64 hex digits (an ed25519 public key)")]
    NotHex {
        /// The line number, from 1.
        line: usize,
        /// The line's text (truncated).
        text: String,
    },
    /// A line is 64 hex digits but not a valid ed25519 public key (not a point, or of
    /// small order).
    #[error("allowlist line {line}: {key} is not a valid ed25519 public key")]
    InvalidKey {
        /// The line number, from 1.
        line: usize,
        /// The key given.
        key: PublicKey,
    },
}

/// The keys of an allowlist file: one key a line as 64 hex digits (the key's raw bytes,
/// not a libp2p PeerId); blank lines, and everything from a `#` to the end of its line,
/// are ignored. A line that is not a valid key is refused, naming its number.
pub fn parse_allowlist(text: &str) -> Result<BTreeSet<PublicKey>, AllowlistError> {
    let mut keys = BTreeSet::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let entry = raw.split('#').next().unwrap_or_default().trim();
        if entry.is_empty() {
            continue;
        }
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(entry, &mut bytes)
            .map_err(|_| AllowlistError::NotHex { line, text: entry.chars().take(80).collect() })?;
        let key = PublicKey(bytes);
        if ed25519_dalek::VerifyingKey::from_bytes(&bytes).map_or(true, |k| k.is_weak()) {
            return Err(AllowlistError::InvalidKey { line, key });
        }
        keys.insert(key);
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const NOW: u64 = 1_700_000_000_000;

    fn authorizer() -> Identity {
        Identity::from_secret([7; 32])
    }

    fn worker() -> Identity {
        Identity::from_secret([9; 32])
    }

    const RUN: RunId = RunId([1; 32]);

    fn with_certificate(c: JoinCertificate) -> Proof {
        Proof { certificate: Some(c), pow_nonce: 0 }
    }

    #[test]
    fn names() {
        assert_eq!(Admit::Open { pow_bits: 0 }.name(), "open");
        assert_eq!(Admit::Allowlist(BTreeSet::new()).name(), "allowlist");
        assert_eq!(Admit::Authorizer(authorizer().public()).name(), "authorizer");
    }

    #[test]
    fn open_without_work_admits_everyone() {
        let any = PublicKey([0xff; 32]);
        assert_eq!(Admit::Open { pow_bits: 0 }.check(&RUN, &any, &Proof::default(), NOW), Ok(()));
    }

    #[test]
    fn open_with_work_admits_a_solved_key_and_refuses_a_weak_proof() {
        let key = worker().public();
        let admit = Admit::Open { pow_bits: 12 };
        let nonce = solve_pow(&RUN, &key, 12, 0);
        assert!(pow_bits(&RUN, &key, nonce) >= 12);
        assert_eq!(admit.check(&RUN, &key, &Proof { certificate: None, pow_nonce: nonce }, NOW), Ok(()));
        // the same work is worth nothing for another key or another run
        let weak = (0..).find(|n| pow_bits(&RUN, &key, *n) < 12).expect("most nonces are weak");
        let bits = pow_bits(&RUN, &key, weak);
        let refused = admit.check(&RUN, &key, &Proof { certificate: None, pow_nonce: weak }, NOW);
        assert_eq!(refused, Err(Refusal::WeakProofOfWork { key, bits, needed: 12 }));
        let message = refused.err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(message, format!("proof of work of {key} has {bits} leading zero bits, the run needs 12"));
        assert!(!message.contains('\n'));
        let other_run = RunId([2; 32]);
        let other_key = authorizer().public();
        assert!(pow_bits(&other_run, &key, nonce) < 12 && pow_bits(&RUN, &other_key, nonce) < 12);
        let elsewhere = admit.check(&other_run, &key, &Proof { certificate: None, pow_nonce: nonce }, NOW);
        assert!(matches!(elsewhere, Err(Refusal::WeakProofOfWork { .. })));
    }

    #[test]
    fn solving_resumes_from_the_nonce_given() {
        let key = worker().public();
        let first = solve_pow(&RUN, &key, 8, 0);
        let second = solve_pow(&RUN, &key, 8, first + 1);
        assert!(second > first && pow_bits(&RUN, &key, second) >= 8);
        assert!((first + 1..second).all(|n| pow_bits(&RUN, &key, n) < 8), "the first from where it starts");
    }

    #[test]
    fn allowlist_admits_only_its_keys() {
        let (listed, stranger) = (worker().public(), authorizer().public());
        let admit = Admit::Allowlist([listed].into());
        assert_eq!(admit.check(&RUN, &listed, &Proof::default(), NOW), Ok(()));
        let refused = admit.check(&RUN, &stranger, &Proof::default(), NOW);
        assert_eq!(refused, Err(Refusal::NotAllowed { key: stranger }));
        assert_eq!(
            refused.err().map(|e| e.to_string()).as_deref(),
            Some(format!("{stranger} is not on the run's allowlist").as_str())
        );
    }

    #[test]
    fn authorizer_admits_a_certified_key_until_expiry() {
        let (auth, me) = (authorizer(), worker().public());
        let admit = Admit::Authorizer(auth.public());
        let certificate = JoinCertificate::issue(&auth, RUN, me, NOW + 1);
        assert_eq!(admit.check(&RUN, &me, &with_certificate(certificate), NOW), Ok(()));
        let expired = admit.check(&RUN, &me, &with_certificate(certificate), NOW + 1);
        assert_eq!(expired, Err(Refusal::Expired { key: me, expires_unix_ms: NOW + 1, now_unix_ms: NOW + 1 }));
        assert_eq!(
            expired.err().map(|e| e.to_string()),
            Some(format!("join certificate of {me} expired at {} ms (now {} ms)", NOW + 1, NOW + 1))
        );
    }

    #[test]
    fn authorizer_refuses_a_missing_misdirected_or_forged_certificate() {
        let (auth, me) = (authorizer(), worker().public());
        let admit = Admit::Authorizer(auth.public());
        assert_eq!(admit.check(&RUN, &me, &Proof::default(), NOW), Err(Refusal::NoCertificate { key: me }));

        // someone else's certificate
        let other = Identity::from_secret([3; 32]).public();
        let theirs = JoinCertificate::issue(&auth, RUN, other, NOW + 10);
        let refused = admit.check(&RUN, &me, &with_certificate(theirs), NOW);
        assert_eq!(refused, Err(Refusal::WrongKey { key: me, certified: other }));

        // a certificate for another run
        let elsewhere = RunId([2; 32]);
        let there = JoinCertificate::issue(&auth, elsewhere, me, NOW + 10);
        let refused = admit.check(&RUN, &me, &with_certificate(there), NOW);
        assert_eq!(refused, Err(Refusal::WrongRun { key: me, run: RUN, certified: elsewhere }));

        // signed by another authorizer
        let impostor = Identity::from_secret([4; 32]);
        let forged = JoinCertificate::issue(&impostor, RUN, me, NOW + 10);
        let refused = admit.check(&RUN, &me, &with_certificate(forged), NOW);
        assert_eq!(refused, Err(Refusal::BadSignature { key: me, authorizer: auth.public() }));

        // a genuine certificate whose expiry was pushed back
        let mut extended = JoinCertificate::issue(&auth, RUN, me, NOW);
        extended.expires_unix_ms = u64::MAX;
        assert!(matches!(admit.check(&RUN, &me, &with_certificate(extended), NOW), Err(Refusal::BadSignature { .. })));

        // every refusal is one line that names the key
        for refusal in [
            Refusal::NoCertificate { key: me },
            Refusal::WrongKey { key: me, certified: other },
            Refusal::WrongRun { key: me, run: RUN, certified: elsewhere },
            Refusal::BadSignature { key: me, authorizer: auth.public() },
        ] {
            let text = refusal.to_string();
            assert!(text.contains(&me.to_string()) && !text.contains('\n'), "{text}");
        }
    }

    #[test]
    fn a_certificate_does_not_verify_as_another_authorizers() {
        // the authorizer's key is inside the signed message: a certificate verifies only
        // against the key that issued it
        let (auth, me) = (authorizer(), worker().public());
        let certificate = JoinCertificate::issue(&auth, RUN, me, NOW + 10);
        assert_eq!(certificate.verify(&auth.public(), &RUN, &me, NOW), Ok(()));
        let other = Identity::from_secret([5; 32]).public();
        assert!(matches!(certificate.verify(&other, &RUN, &me, NOW), Err(Refusal::BadSignature { .. })));
    }

    #[test]
    fn decoding_refuses_any_other_length() {
        let certificate = JoinCertificate::issue(&authorizer(), RUN, worker().public(), NOW);
        let mut bytes = certificate.to_bytes();
        assert_eq!(bytes.len(), JoinCertificate::LEN);
        bytes.push(0);
        let err = JoinCertificate::from_bytes(&bytes);
        assert_eq!(err, Err(CertificateError::Length { len: 137 }));
        assert_eq!(err.err().map(|e| e.to_string()).as_deref(), Some("join certificate is 137 bytes, expected 136"));
        assert!(JoinCertificate::from_bytes(&[]).is_err());
    }

    /// The published vectors (`docs/test-vectors/join-certificate.md`).
    #[test]
    fn test_vectors() {
        let (auth, me) = (authorizer(), worker());
        assert_eq!(hex::encode(auth.public().0), "ea4a6c63e29c520abef5507b132ec5f9954776aebebe7b92421eea691446d22c");
        assert_eq!(hex::encode(me.public().0), "fd1724385aa0c75b64fb78cd602fa1d991fdebf76b13c58ed702eac835e9f618");
        let certificate = JoinCertificate::issue(&auth, RUN, me.public(), NOW);
        assert_eq!(
            hex::encode(signed_message(&auth.public(), &RUN, &me.public(), NOW)),
            "7063702f6a6f696e2d63657274696669636174652f763100\
             ea4a6c63e29c520abef5507b132ec5f9954776aebebe7b92421eea691446d22c\
             0101010101010101010101010101010101010101010101010101010101010101\
             fd1724385aa0c75b64fb78cd602fa1d991fdebf76b13c58ed702eac835e9f618\
             0068e5cf8b010000"
        );
        assert_eq!(
            hex::encode(certificate.to_bytes()),
            "0101010101010101010101010101010101010101010101010101010101010101\
             fd1724385aa0c75b64fb78cd602fa1d991fdebf76b13c58ed702eac835e9f618\
             0068e5cf8b010000\
             582f40fcd441d1e464b46e6d80c33e9bb0c1b20ed5fdc192fb1ae3273543111344f34765b3a992a8637d8525b3f1ad84d1e11c4154ae27167f82ef9f123bc500"
        );
        assert_eq!(JoinCertificate::from_bytes(&certificate.to_bytes()), Ok(certificate));
        assert_eq!(certificate.verify(&auth.public(), &RUN, &me.public(), NOW - 1), Ok(()));

        let pow = |nonce| (hex::encode(pow_digest(&RUN, &me.public(), nonce)), pow_bits(&RUN, &me.public(), nonce));
        assert_eq!(pow(0), ("c77cf905f29995cf9a28c378fbeaa4a07de5ca13eb5d448e14374e85bb0b7444".into(), 0));
        assert_eq!(pow(5195), ("000d41f5e4289ecc685a20d96f77968b2b05edaf43e8e8839a169b8ff9e170ef".into(), 12));
        assert_eq!(pow(5398), ("00009c63e0dc3a74bb336e2481b9adc84813500cf4dfa72b330219e2f09d1abf".into(), 16));
        assert_eq!(solve_pow(&RUN, &me.public(), 12, 0), 5195);
        assert_eq!(solve_pow(&RUN, &me.public(), 16, 0), 5398);
    }

    /// Not a benchmark: solves a small proof and checks that it admits.
    #[test]
    fn solves_12_bits() {
        let key = worker().public();
        let nonce = solve_pow(&RUN, &key, 12, 0);
        assert!(pow_bits(&RUN, &key, nonce) >= 12);
        assert_eq!(
            Admit::Open { pow_bits: 12 }.check(&RUN, &key, &Proof { certificate: None, pow_nonce: nonce }, 0),
            Ok(())
        );
    }

    #[test]
    fn allowlist_files() {
        let (a, b) = (authorizer().public(), worker().public());
        let text = format!("# workers\n\n{}\n  {}  # bob\n#{}\n", hex::encode(a.0), hex::encode(b.0), "x".repeat(3));
        assert_eq!(parse_allowlist(&text), Ok([a, b].into()));
        assert_eq!(parse_allowlist("\n# nobody\n"), Ok(BTreeSet::new()));

        let short = format!("{}\nabc\n", hex::encode(a.0));
        let err = parse_allowlist(&short);
        assert_eq!(err, Err(AllowlistError::NotHex { line: 2, text: "abc".into() }));
        assert_eq!(
            err.err().map(|e| e.to_string()).as_deref(),
            Some("allowlist line 2: `abc` is not 64 hex digits (an ed25519 public key)")
        );
        let peer_id = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA";
        assert!(matches!(parse_allowlist(peer_id), Err(AllowlistError::NotHex { line: 1, .. })), "hex only");
        // 64 hex digits that are no point on the curve
        let not_a_point = format!("\n02{}\n", "00".repeat(31));
        let err = parse_allowlist(&not_a_point);
        assert!(matches!(err, Err(AllowlistError::InvalidKey { line: 2, .. })), "{err:?}");
        // the identity point: a weak key, whose signatures prove nothing
        let weak = format!("01{}", "00".repeat(31));
        assert!(matches!(parse_allowlist(&weak), Err(AllowlistError::InvalidKey { line: 1, .. })));
    }

    fn arbitrary_certificate() -> impl Strategy<Value = JoinCertificate> {
        (any::<[u8; 32]>(), any::<[u8; 32]>(), any::<u64>(), proptest::collection::vec(any::<u8>(), 64)).prop_map(
            |(run, key, expires_unix_ms, sig)| {
                let mut signature = [0u8; 64];
                signature.copy_from_slice(&sig);
                JoinCertificate { run: RunId(run), key: PublicKey(key), expires_unix_ms, signature }
            },
        )
    }

    proptest! {
        #[test]
        fn certificate_bytes_round_trip(c in arbitrary_certificate()) {
            prop_assert_eq!(JoinCertificate::from_bytes(&c.to_bytes()), Ok(c));
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            match JoinCertificate::from_bytes(&bytes) {
                Ok(c) => prop_assert_eq!(c.to_bytes(), bytes),
                Err(CertificateError::Length { len }) => prop_assert_ne!(len, JoinCertificate::LEN),
            }
        }

        #[test]
        fn a_random_certificate_never_admits(c in arbitrary_certificate()) {
            let admit = Admit::Authorizer(authorizer().public());
            prop_assert!(admit.check(&c.run, &c.key, &with_certificate(c), 0).is_err());
        }
    }
}
