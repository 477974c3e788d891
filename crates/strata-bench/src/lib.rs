//! `strata bench` (placeholder, being written).
use clap::Args;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Invalid(String),
}

/// Flags of `strata bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {}

/// Runs `strata bench` to completion; writes its report files and prints its summary.
pub fn run(_args: &BenchArgs) -> Result<(), BenchError> {
    Err(BenchError::Invalid("not implemented yet".into()))
}
