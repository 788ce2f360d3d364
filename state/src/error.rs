//! The store's error type: I/O, corrupt bytes (naming file and offset), and invalid values.

use std::path::PathBuf;

pub use weir_io::{FormatError, IoError};

/// Errors of the state store and keyed state.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    #[error(transparent)]
    Io(#[from] IoError),
    #[error(transparent)]
    Format(#[from] FormatError),
    /// An archived value did not validate (read from disk).
    #[error("invalid archived value for state {state_id} from {source_desc}: {reason}")]
    BadValue {
        state_id: u16,
        source_desc: String,
        reason: String,
    },
    /// A state read or written with another kind or value type than its first use in this
    /// process (its in-memory values are read unchecked, as that type).
    #[error(
        "state `{state}` is used as {now}, but it was used as {first}: a state keeps one kind \
         and one value type (give the other use its own name)"
    )]
    TypeMismatch {
        state: String,
        first: &'static str,
        now: &'static str,
    },
    /// A restored state used as another kind or value type than the checkpoint recorded (its
    /// restored values would be read as the new type).
    #[error(
        "state `{state}` is used as {now}, but the checkpoint restored holds it as {restored}: \
         a state keeps its kind and value type across restores (give the new use its own name)"
    )]
    RestoredTypeMismatch {
        state: String,
        restored: String,
        now: String,
    },
    /// An operator restored from a checkpoint that recorded another key type: its keys
    /// encode differently, so no restored state or timer would be found under them.
    #[error(
        "the checkpoint restored holds this operator's state keyed by {restored}, the job keys \
         it by {now}: keys of another type encode differently, and no restored state or timer \
         would be found under them (key the operator as before, or give it a new uid)"
    )]
    RestoredKeyTypeMismatch { restored: String, now: String },
    /// Two state names whose ids (a hash of the name) are equal.
    #[error("state names `{first}` and `{second}` hash to one id; rename one")]
    NameCollision { first: String, second: String },
    /// Serializing a value failed.
    #[error("serializing a value for state {state_id}: {reason}")]
    Serialize { state_id: u16, reason: String },
    /// A snapshot handle does not decode.
    #[error("snapshot handle: {reason} at offset {offset}")]
    BadHandle { offset: u64, reason: String },
    /// A segment named in a snapshot handle differs from what the handle recorded.
    #[error("{file}: {what} mismatch: handle says {expected}, file has {actual}")]
    HandleMismatch {
        file: PathBuf,
        what: &'static str,
        expected: u64,
        actual: u64,
    },
    /// Handles to restore disagree (max parallelism).
    #[error("incompatible snapshot handles: {reason}")]
    Incompatible { reason: String },
    /// A flush or compaction stopped because its yield hook said so (its store is gone); it
    /// wrote nothing that stays.
    #[error("the maintenance job was cancelled")]
    Cancelled,
    /// A key, namespace or map key longer than keyed state takes ([`crate::MAX_KEY_BYTES`]).
    #[error("a {what} of {len} bytes (encoded) is longer than the {max} bytes keyed state takes")]
    KeyTooLong {
        what: &'static str,
        len: usize,
        max: usize,
    },
}

impl StateError {
    /// The format error inside, if any (tests and tools inspect file and offset).
    pub fn as_format(&self) -> Option<&FormatError> {
        match self {
            StateError::Format(f) => Some(f),
            _ => None,
        }
    }
}
