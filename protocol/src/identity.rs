//! A node's ed25519 identity. The same 32-byte secret is the node's libp2p key, so its
//! [`PublicKey`] and its PeerId name the same peer.

use std::fmt;

use ed25519_dalek::{Signer, SigningKey, VerifyingKey};

/// A node's signing key. Generated from 32 bytes of caller-supplied randomness.
#[derive(Clone)]
pub struct Identity {
    key: SigningKey,
}

/// A node's ed25519 public key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct PublicKey(pub [u8; 32]);

impl AsRef<[u8]> for PublicKey {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Identity {
    /// The identity whose secret key is `secret` (32 uniformly random bytes).
    pub fn from_secret(secret: [u8; 32]) -> Self {
        Self { key: SigningKey::from_bytes(&secret) }
    }

    /// The secret key bytes, for persisting and for deriving the libp2p keypair.
    pub fn secret(&self) -> [u8; 32] {
        self.key.to_bytes()
    }

    /// The public key.
    pub fn public(&self) -> PublicKey {
        PublicKey(self.key.verifying_key().to_bytes())
    }

    /// Signs `msg` (already domain-separated by the caller).
    pub(crate) fn sign_raw(&self, msg: &[u8]) -> [u8; 64] {
        self.key.sign(msg).to_bytes()
    }
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Identity({})", self.public())
    }
}

/// Why a signature did not verify.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum VerifyFailure {
    /// The claimed key is not a valid ed25519 point.
    InvalidKey,
    /// The signature does not match the key and message.
    BadSignature,
}

impl PublicKey {
    /// Verifies `signature` over `msg` with strict (non-malleable) ed25519 rules.
    pub(crate) fn verify_raw(&self, msg: &[u8], signature: &[u8; 64]) -> Result<(), VerifyFailure> {
        let key = VerifyingKey::from_bytes(&self.0).map_err(|_| VerifyFailure::InvalidKey)?;
        key.verify_strict(msg, &ed25519_dalek::Signature::from_bytes(signature))
            .map_err(|_| VerifyFailure::BadSignature)
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(&self.0[..6]))
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({self})")
    }
}
