//! Checkpoint reading and writing (see issue #2).
