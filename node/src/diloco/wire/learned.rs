//! A shepherd's ratings and references ([`Learned`]) as JSON, in its checkpoint's
//! metadata and in the replicated state: keys in hex, each rating one array.
//! Reading checks every bound before the state machine sees it: at most
//! [`MAX_RATED`] ratings and [`MAX_EARNED`] earned records, one tensor reference
//! per tensor, 32-byte keys and finite values.

use pcp_protocol::PublicKey;
use pcp_protocol::diloco::rating::{MAX_RATED, Rating};
use pcp_protocol::diloco::shepherd::Learned;
use pcp_protocol::diloco::shepherd::reference::MAX_EARNED;

/// [`Learned`] as it is stored.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct LearnedRecord {
    /// `(key, passed, score, since, caught, sits_out_until)` per rated live worker.
    #[serde(default)]
    ratings: Vec<(String, u32, f64, u64, u32, u64)>,
    /// `(key, samples)` per live worker with earned work.
    #[serde(default)]
    earned: Vec<(String, f64)>,
    /// Each tensor's (norm, largest magnitude) reference.
    #[serde(default)]
    tensors: Vec<Option<(f64, f32)>>,
    #[serde(default)]
    step_ms: Option<f64>,
    #[serde(default)]
    rated_norms: bool,
}

/// Why a stored [`LearnedRecord`] was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LearnedError {
    #[error("{what}: {count} records, at most {max}")]
    TooMany { what: &'static str, count: usize, max: usize },
    #[error("{what}: bad key {key:?} (64 hex digits)")]
    BadKey { what: &'static str, key: String },
    #[error("{what}: key {key} listed twice")]
    Duplicate { what: &'static str, key: String },
    #[error("{what}: non-finite or negative value for key {key}")]
    BadValue { what: &'static str, key: String },
    #[error("tensor references: {count} for a model of {tensors} tensors")]
    Tensors { count: usize, tensors: usize },
    #[error("tensor reference {index} is not positive and finite")]
    BadTensor { index: usize },
    #[error("step time {ms} ms is not positive and finite")]
    StepMs { ms: f64 },
}

impl LearnedRecord {
    pub(crate) fn of(l: &Learned<PublicKey>) -> Self {
        Self {
            ratings: l
                .ratings
                .iter()
                .map(|(k, r)| (hex::encode(k.0), r.passed, r.score, r.since, r.caught, r.sits_out_until))
                .collect(),
            earned: l.earned.iter().map(|(k, w)| (hex::encode(k.0), *w)).collect(),
            tensors: l.tensors.clone(),
            step_ms: l.step_ms,
            rated_norms: l.rated_norms,
        }
    }

    /// The record checked, for a model of `tensors` tensors.
    pub(crate) fn read(&self, tensors: usize) -> Result<Learned<PublicKey>, LearnedError> {
        let many =
            |what, count, max| if count > max { Err(LearnedError::TooMany { what, count, max }) } else { Ok(()) };
        many("ratings", self.ratings.len(), MAX_RATED)?;
        many("earned work", self.earned.len(), MAX_EARNED)?;
        let mut seen = std::collections::BTreeSet::new();
        let mut ratings = Vec::with_capacity(self.ratings.len());
        for (key, passed, score, since, caught, sits_out_until) in &self.ratings {
            let k = key_of("ratings", key, &mut seen)?;
            if !score.is_finite() || *score < 0.0 {
                return Err(LearnedError::BadValue { what: "ratings", key: key.clone() });
            }
            let rating = Rating {
                passed: *passed,
                score: *score,
                since: *since,
                caught: *caught,
                sits_out_until: *sits_out_until,
            };
            ratings.push((k, rating));
        }
        seen.clear();
        let mut earned = Vec::with_capacity(self.earned.len());
        for (key, work) in &self.earned {
            let k = key_of("earned work", key, &mut seen)?;
            if !work.is_finite() || *work < 0.0 {
                return Err(LearnedError::BadValue { what: "earned work", key: key.clone() });
            }
            earned.push((k, *work));
        }
        if self.tensors.len() > tensors {
            return Err(LearnedError::Tensors { count: self.tensors.len(), tensors });
        }
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if let Some(index) =
            self.tensors.iter().position(|t| t.is_some_and(|(n, m)| !positive(n) || !positive(f64::from(m))))
        {
            return Err(LearnedError::BadTensor { index });
        }
        if let Some(ms) = self.step_ms.filter(|ms| !positive(*ms)) {
            return Err(LearnedError::StepMs { ms });
        }
        Ok(Learned {
            ratings,
            earned,
            tensors: self.tensors.clone(),
            step_ms: self.step_ms,
            rated_norms: self.rated_norms,
        })
    }
}

/// `key` as a key, listed once in `what`.
fn key_of(
    what: &'static str,
    key: &str,
    seen: &mut std::collections::BTreeSet<[u8; 32]>,
) -> Result<PublicKey, LearnedError> {
    let bytes: [u8; 32] = hex::decode(key)
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| LearnedError::BadKey { what, key: key.chars().take(80).collect() })?;
    if !seen.insert(bytes) {
        return Err(LearnedError::Duplicate { what, key: key.to_owned() });
    }
    Ok(PublicKey(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn learned() -> Learned<PublicKey> {
        let rating = Rating { passed: 3, score: 0.125, since: 2, caught: 1, sits_out_until: 9 };
        Learned {
            ratings: vec![(PublicKey([1; 32]), rating)],
            earned: vec![(PublicKey([1; 32]), 19.375), (PublicKey([2; 32]), 0.5)],
            tensors: vec![Some((0.25, 0.5)), None],
            step_ms: Some(12.5),
            rated_norms: true,
        }
    }

    #[test]
    fn learned_records_round_trip_through_json() {
        let record = LearnedRecord::of(&learned());
        let json = serde_json::to_vec(&record).expect("json");
        let back: LearnedRecord = serde_json::from_slice(&json).expect("parses");
        assert_eq!(back.read(2).expect("valid"), learned());
        // an older record without any of it reads as nothing learned
        let empty: LearnedRecord = serde_json::from_slice(b"{}").expect("parses");
        assert_eq!(empty.read(2).expect("valid"), Learned::default());
    }

    #[test]
    fn a_hostile_record_is_refused_with_the_problem_named() {
        let good = LearnedRecord::of(&learned());
        let refused = |r: LearnedRecord, tensors: usize, says: &str| {
            let e = r.read(tensors).expect_err("refused").to_string();
            assert!(e.contains(says), "{e}");
        };
        refused(good.clone(), 1, "2 for a model of 1 tensors");
        let mut r = good.clone();
        r.ratings[0].0 = "zz".into();
        refused(r, 2, "bad key");
        let mut r = good.clone();
        r.earned[1].0 = r.earned[0].0.clone();
        refused(r, 2, "listed twice");
        let mut r = good.clone();
        r.earned[0].1 = -1.0;
        refused(r, 2, "earned work: non-finite or negative");
        let mut r = good.clone();
        r.tensors[1] = Some((0.0, 1.0));
        refused(r, 2, "tensor reference 1");
        let mut r = good.clone();
        r.step_ms = Some(-3.0);
        refused(r, 2, "step time");
        let mut r = good;
        r.ratings = (0..=MAX_RATED).map(|i| (format!("{i:064x}"), 0, 0.0, 0, 0, 0)).collect();
        refused(r, 2, "ratings: 65537 records");
        // NaN has no JSON form: a record with one does not parse
        assert!(serde_json::from_slice::<LearnedRecord>(br#"{"step_ms": NaN}"#).is_err());
    }
}
