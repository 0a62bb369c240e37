//! What can go wrong.

use std::path::PathBuf;

/// A simulation that could not run or whose outputs could not be written.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting out of range.
    #[error("invalid simulation setting: {0}")]
    Invalid(String),
    /// The table could not be written.
    #[error("writing the table: {0}")]
    Table(#[source] std::io::Error),
    /// A file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The report could not be encoded.
    #[error("encoding the report: {0}")]
    Json(#[from] serde_json::Error),
    /// A calibration table could not be read.
    #[error("calibration table {path}: {reason}")]
    Calibration {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The fault simulator saw an invariant broken.
    #[error("{0}")]
    Broken(crate::faults::Violation),
    /// A plot could not be drawn.
    #[error("plotting {path}: {reason}")]
    Plot {
        /// The PNG.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}
