//! Device catalog, wear projections and `strata size` (placeholder, being written).
use clap::Args;

#[derive(Debug, thiserror::Error)]
pub enum SizingError {
    #[error("{0}")]
    Invalid(String),
}

/// Flags of `strata size`.
#[derive(Debug, Clone, Args)]
pub struct SizeArgs {}

/// Runs `strata size`; returns the text to print (a table, or JSON when `json`).
pub fn run(_args: &SizeArgs, _json: bool) -> Result<String, SizingError> {
    Err(SizingError::Invalid("not implemented yet".into()))
}
