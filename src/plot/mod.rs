//! placeholder
use std::path::{Path, PathBuf};
pub fn plot_run(_t: &str, _o: &Path) -> crate::Result<Vec<PathBuf>> {
    Ok(vec![])
}
