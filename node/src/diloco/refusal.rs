//! A role's refusal of a request: a code its peer's program decides on
//! ([`AckCode`], on the wire), and a reason for people, which no program reads.

use pcp_schema::{Ack, AckCode};

/// A refusal to answer a request with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    /// What the peer's program decides on.
    pub(crate) code: AckCode,
    /// With [`AckCode::ProofOfWork`]: the leading zero bits the run needs.
    pub(crate) pow_bits: u8,
    /// Why, for people.
    pub(crate) reason: String,
}

impl Refusal {
    /// A refusal with `code`.
    pub(crate) fn new(code: AckCode, reason: impl Into<String>) -> Self {
        Self { code, pow_bits: 0, reason: reason.into() }
    }

    /// A run's admission refused `refusal`'s key: a short proof of work says the bits
    /// the run needs.
    pub(crate) fn admission(refusal: &pcp_protocol::admit::Refusal) -> Self {
        match refusal {
            pcp_protocol::admit::Refusal::WeakProofOfWork { needed, .. } => {
                Self { code: AckCode::ProofOfWork, pow_bits: *needed, reason: refusal.to_string() }
            }
            other => Self::new(AckCode::NotAdmitted, other.to_string()),
        }
    }

    /// The answer for round `round` of `run`.
    pub(crate) fn ack(self, run: [u8; 32], round: u64) -> Ack {
        Ack { pow_bits: self.pow_bits, ..Ack::refuse(run, round, self.code, self.reason) }
    }
}

impl From<String> for Refusal {
    /// A refusal without a code of its own.
    fn from(reason: String) -> Self {
        Self::new(AckCode::Other, reason)
    }
}

impl From<&str> for Refusal {
    /// A refusal without a code of its own.
    fn from(reason: &str) -> Self {
        Self::new(AckCode::Other, reason)
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pcp_protocol::Identity;

    #[test]
    fn a_short_proof_of_work_says_the_bits_as_a_field() {
        let key = Identity::from_secret([3; 32]).public();
        let short = pcp_protocol::admit::Refusal::WeakProofOfWork { key, bits: 3, needed: 17 };
        let ack = Refusal::admission(&short).ack([1; 32], 0);
        assert_eq!((ack.accepted, ack.code, ack.pow_bits), (false, AckCode::ProofOfWork, 17));
        let other = pcp_protocol::admit::Refusal::NotAllowed { key };
        assert_eq!(Refusal::admission(&other).ack([1; 32], 0).code, AckCode::NotAdmitted);
        assert_eq!(Refusal::from("busy".to_owned()).code, AckCode::Other);
    }
}
