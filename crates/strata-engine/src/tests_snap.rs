//! Snapshots, clones and rollback against a reference model.
