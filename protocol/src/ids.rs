//! Keys and hashes as newtypes with a short display.

use std::fmt;
use std::str::FromStr;

/// Hex digits shown by the short `Display` of ids.
const SHORT_HEX: usize = 12;

/// Why a hex id could not be parsed.
#[derive(Debug, thiserror::Error)]
pub enum ParseIdError {
    /// Not 64 hex digits.
    #[error("{what} `{input}` is not 64 hex digits")]
    Hex {
        /// The id type.
        what: &'static str,
        /// What was given (truncated).
        input: String,
    },
}

macro_rules! id32 {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub [u8; 32]);

        impl $name {
            /// The raw bytes.
            pub fn as_bytes(&self) -> &[u8; 32] {
                &self.0
            }

            /// All 64 hex digits.
            pub fn to_hex(&self) -> String {
                hex::encode(self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                if f.alternate() {
                    f.write_str(&self.to_hex())
                } else {
                    f.write_str(&self.to_hex()[..SHORT_HEX])
                }
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({self})", stringify!($name))
            }
        }

        impl FromStr for $name {
            type Err = ParseIdError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                let mut out = [0u8; 32];
                hex::decode_to_slice(s.trim(), &mut out).map_err(|_| ParseIdError::Hex {
                    what: stringify!($name),
                    input: s.chars().take(80).collect(),
                })?;
                Ok(Self(out))
            }
        }
    };
}

id32!(
    /// A training run's id.
    RunId
);
id32!(
    /// A blob's content id: the blake3 hash of its bytes.
    BlobHash
);

impl BlobHash {
    /// The content id of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }
}

impl From<blake3::Hash> for BlobHash {
    fn from(h: blake3::Hash) -> Self {
        Self(*h.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_short_and_alternate_is_full() {
        let h = BlobHash::of(b"hello");
        assert_eq!(h.to_string().len(), SHORT_HEX);
        assert_eq!(format!("{h:#}"), blake3::hash(b"hello").to_hex().as_str());
        assert_eq!(format!("{h:?}"), format!("BlobHash({h})"));
    }

    #[test]
    fn parses_full_hex_and_rejects_garbage() {
        let h = BlobHash::of(b"x");
        assert_eq!(h.to_hex().parse::<BlobHash>().ok(), Some(h));
        let err = "zz".parse::<RunId>().err().map(|e| e.to_string());
        assert_eq!(err.as_deref(), Some("RunId `zz` is not 64 hex digits"));
        assert!(h.to_string().parse::<BlobHash>().is_err(), "short form is not an id");
    }
}
