//! What an engine or transformers tensor name maps to: the op id and the layout of its rows.
//! Its own file so that V4's name maps (`names.rs`) and the families' (`family_names.rs`) share
//! it without importing each other both ways.

/// How a trace tensor relates to the op output it maps to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapped {
    pub op: String,
    /// True when the tensor's rows are token rows (so `rows` metadata selects them); false for
    /// compressed rows, indexer picks and other non-token layouts, which are kept whole.
    pub token_rows: bool,
}
