//! The layer range of a run (`--layers`, a probe spec's `layers`): parsed once, from the command
//! line or the spec, into a [`LayerRange`], and held to a model's layer count in one place
//! ([`LayerRange::check`]).

use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

/// Layers `first..=last` (the syntax is inclusive: `0..4` is five layers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerRange {
    pub first: usize,
    pub last: usize,
}

impl LayerRange {
    pub fn new(first: usize, last: usize) -> LayerRange {
        LayerRange { first, last }
    }

    /// The first five layers, or all of a smaller model: what a run without `--layers` and
    /// without a spec range probes.
    pub fn default_for(num_layers: usize) -> LayerRange {
        LayerRange::new(0, num_layers.saturating_sub(1).min(4))
    }

    /// `(first, last)` when the model has layer `last`; otherwise the refusal, naming the range
    /// and the layers the model has.
    pub fn check(self, num_layers: usize) -> Result<(usize, usize)> {
        if self.last >= num_layers || self.first > self.last {
            return Err(Error::usage(format!(
                "--layers {self}: the model has {num_layers} layers (0..{})",
                num_layers.saturating_sub(1)
            )));
        }
        Ok((self.first, self.last))
    }
}

impl fmt::Display for LayerRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.first, self.last)
    }
}

/// `A..B` (inclusive), `A..=B` or `N`.
impl FromStr for LayerRange {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        let bad = || format!("`{s}`: expected A..B (inclusive) or N");
        let num = |x: &str| x.trim().parse::<usize>().map_err(|_| bad());
        let (a, b) = match s.split_once("..") {
            Some((a, b)) => (num(a)?, num(b.strip_prefix('=').unwrap_or(b))?),
            None => {
                let n = num(s)?;
                (n, n)
            }
        };
        if b < a {
            return Err(bad());
        }
        Ok(LayerRange::new(a, b))
    }
}

/// `0..4`, the built-in probe spec's range.
impl Default for LayerRange {
    fn default() -> Self {
        LayerRange::new(0, 4)
    }
}

impl serde::Serialize for LayerRange {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for LayerRange {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syntax() {
        let p = |s: &str| s.parse::<LayerRange>();
        assert_eq!(p("0..4"), Ok(LayerRange::new(0, 4)));
        assert_eq!(p("2..=3"), Ok(LayerRange::new(2, 3)));
        assert_eq!(p(" 3 "), Ok(LayerRange::new(3, 3)));
        assert!(p("4..1").is_err());
        assert!(p("a..b").is_err());
        assert!(p("1..").is_err());
        assert_eq!(LayerRange::new(1, 3).to_string(), "1..3");
    }

    #[test]
    fn check_names_the_model_layers() {
        assert_eq!(LayerRange::new(0, 4).check(5).unwrap(), (0, 4));
        let e = LayerRange::new(2, 5).check(5).unwrap_err().to_string();
        assert!(
            e.contains("--layers 2..5: the model has 5 layers (0..4)"),
            "{e}"
        );
        assert_eq!(LayerRange::default_for(61), LayerRange::new(0, 4));
        assert_eq!(LayerRange::default_for(3), LayerRange::new(0, 2));
    }
}
