//! The DeepSeek-V4 layer as data (see issue #3).
