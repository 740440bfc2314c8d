//! Reading the files a user hands the tool (config, index, token lists, run JSON, rules, probe
//! specs): regular files only, with a size cap, and JSON without duplicate keys.
//!
//! Why: opening a FIFO blocks forever, `/dev/zero` never ends, a symlink loop is not "missing",
//! and `serde_json` silently keeps the last of two equal keys — so a config or header with a
//! repeated key would be read as something its author did not see. Every error names the path.

use std::fs::Metadata;
use std::path::Path;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

use crate::{Error, Result};

/// Default cap for small JSON/TOML inputs (configs, specs, rules, token lists).
pub const SMALL_FILE_MAX: u64 = 256 << 20;
/// Cap for run JSON reports (a run of every op of a 61-layer model is a few MB).
pub const REPORT_FILE_MAX: u64 = 1 << 30;

/// What a path is, for messages: "a FIFO", "a directory", "a character device", ….
fn kind_of(m: &Metadata) -> &'static str {
    let ft = m.file_type();
    if ft.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if ft.is_char_device() {
            return "a character device";
        }
        if ft.is_block_device() {
            return "a block device";
        }
        if ft.is_socket() {
            return "a socket";
        }
    }
    "not a regular file"
}

/// The metadata of `path` if it is a regular file (symlinks followed); otherwise an error that
/// says what it is instead: missing, a dangling symlink, a symlink loop, a FIFO, a device, ….
/// Checked before any `open`, because opening a FIFO for reading blocks until a writer appears.
pub fn regular_file(path: &Path, what: &str) -> Result<Metadata> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(m),
        Ok(m) => Err(Error::bad(
            path,
            None,
            format!("{what} is {}, not a regular file", kind_of(&m)),
        )),
        Err(e) => Err(Error::bad(
            path,
            None,
            format!("{what}: {}", why_missing(path, &e)),
        )),
    }
}

/// Why `metadata` failed, in words: a dangling symlink or a symlink loop read as "does not
/// exist" otherwise.
pub fn why_missing(path: &Path, e: &std::io::Error) -> String {
    // ELOOP: too many levels of symbolic links
    if e.raw_os_error() == Some(40) {
        return "symlink loop (too many levels of symbolic links)".into();
    }
    match (e.kind(), std::fs::symlink_metadata(path)) {
        (std::io::ErrorKind::NotFound, Ok(l)) if l.file_type().is_symlink() => {
            let target = std::fs::read_link(path)
                .map(|t| t.display().to_string())
                .unwrap_or_else(|_| "?".into());
            format!("dangling symlink (points to `{target}`, which does not exist)")
        }
        (std::io::ErrorKind::NotFound, _) => "does not exist".into(),
        _ => format!("cannot be read: {e}"),
    }
}

/// Read a regular file of at most `max` bytes as UTF-8 text.
pub fn read_text(path: &Path, what: &str, max: u64) -> Result<String> {
    let bytes = read_bytes(path, what, max)?;
    String::from_utf8(bytes)
        .map_err(|e| Error::bad(path, None, format!("{what} is not UTF-8 text: {e}")))
}

/// Read a regular file of at most `max` bytes. The size is checked before reading, and the read
/// itself is bounded too (the file may grow in between).
pub fn read_bytes(path: &Path, what: &str, max: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let m = regular_file(path, what)?;
    if m.len() > max {
        return Err(Error::bad(
            path,
            None,
            format!(
                "{what} is {} bytes, more than the {} bytes this tool reads for it",
                m.len(),
                max
            ),
        ));
    }
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut out = Vec::with_capacity(m.len() as usize);
    f.take(max + 1)
        .read_to_end(&mut out)
        .map_err(|e| Error::io(path, e))?;
    if out.len() as u64 > max {
        return Err(Error::bad(
            path,
            None,
            format!("{what} grew past {max} bytes while being read"),
        ));
    }
    Ok(out)
}

/// Parse JSON text, refusing a key that appears twice in one object (anywhere in the document).
/// `what` names the document in messages ("config", "safetensors header", …).
pub fn parse_json(path: &Path, text: &str, what: &str) -> Result<serde_json::Value> {
    if let Some(dup) = duplicate_key(text) {
        return Err(Error::bad(
            path,
            None,
            format!(
                "{what} has the key `{}` twice (JSON readers silently keep only one of them)",
                dup.join(".")
            ),
        ));
    }
    serde_json::from_str(text)
        .map_err(|e| Error::bad(path, None, format!("{what} is not valid JSON: {e}")))
}

/// The first key that appears twice in one object, as its path from the root (`["t", "dtype"]`);
/// None when there is none or the text is not JSON (the real parser reports that).
pub fn duplicate_key(text: &str) -> Option<Vec<String>> {
    let mut de = serde_json::Deserializer::from_str(text);
    match (DupSeed { path: &[] }).deserialize(&mut de) {
        Ok(()) => None,
        Err(e) => {
            let m = e.to_string();
            let rest = m.strip_prefix(DUP_MARK)?;
            let rest = rest.rsplit_once(DUP_END).map_or(rest, |(a, _)| a);
            Some(rest.split(DUP_SEP).map(str::to_string).collect())
        }
    }
}

const DUP_MARK: &str = "duplicate key \u{1}";
const DUP_END: &str = "\u{1}";
const DUP_SEP: char = '\u{2}';

/// Walks a JSON document without building it, remembering each object's keys.
struct DupSeed<'p> {
    path: &'p [String],
}

impl<'de> DeserializeSeed<'de> for DupSeed<'_> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for DupSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("JSON")
    }
    fn visit_bool<E>(self, _: bool) -> std::result::Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> std::result::Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> std::result::Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> std::result::Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> std::result::Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> std::result::Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        while seq
            .next_element_seed(DupSeed { path: self.path })?
            .is_some()
        {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(k) = map.next_key::<String>()? {
            let mut full = self.path.to_vec();
            full.push(k.clone());
            if !seen.insert(k) {
                let joined: Vec<&str> = full.iter().map(String::as_str).collect();
                return Err(de::Error::custom(format!(
                    "{DUP_MARK}{}{DUP_END}",
                    joined.join(&DUP_SEP.to_string())
                )));
            }
            map.next_value_seed(DupSeed { path: &full })?;
        }
        Ok(())
    }
}

/// The safetensors reader parses the header into a map, keeping the last of two equal keys: a
/// header naming a tensor twice would be read as only one of them, and later errors would name
/// the wrong tensor. Refuse it, naming the tensor (a cheap scan; the header is small).
pub fn check_safetensors_keys(path: &Path, buf: &[u8]) -> Result<()> {
    let Some(n) = buf
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    else {
        return Ok(());
    };
    let Some(text) = usize::try_from(n)
        .ok()
        .and_then(|n| buf.get(8..8usize.checked_add(n)?))
        .and_then(|h| std::str::from_utf8(h).ok())
    else {
        return Ok(()); // the full validation below says what is wrong
    };
    match crate::input::duplicate_key(text) {
        None => Ok(()),
        Some(p) if p.len() == 1 => Err(Error::bad(
            path,
            Some(&p[0]),
            "appears twice in the safetensors header (readers keep only the last entry)",
        )),
        Some(p) => Err(Error::bad(
            path,
            Some(&p[0]),
            format!(
                "header entry has the key `{}` twice (readers keep only the last)",
                p[1..].join(".")
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_keys_are_found_at_any_depth() {
        let p = |v: &[&str]| Some(v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(duplicate_key(r#"{"a":1,"b":2}"#), None);
        assert_eq!(duplicate_key(r#"{"a":1,"a":2}"#), p(&["a"]));
        assert_eq!(
            duplicate_key(r#"{"t.x":{"dtype":"F32","dtype":"BF16"}}"#),
            p(&["t.x", "dtype"])
        );
        assert_eq!(
            duplicate_key(r#"[{"x":1},{"x":1,"y":[{"z":0,"z":1}]}]"#),
            p(&["y", "z"])
        );
        // keys with the separators' look-alikes and escapes survive
        assert_eq!(duplicate_key(r#"{"a b\"c":1,"a b\"c":2}"#), p(&["a b\"c"]));
        // the same key in two different objects is fine
        assert_eq!(duplicate_key(r#"{"a":{"k":1},"b":{"k":2}}"#), None);
        // not JSON: left to the real parser
        assert_eq!(duplicate_key("{"), None);
    }

    #[test]
    fn non_regular_files_say_what_they_are() {
        let d = tempfile::tempdir().unwrap();
        let e = regular_file(d.path(), "config").unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
        let e = regular_file(&d.path().join("nope"), "config")
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not exist"), "{e}");
        #[cfg(unix)]
        {
            let l = d.path().join("loop");
            std::os::unix::fs::symlink(&l, &l).unwrap();
            let e = regular_file(&l, "config").unwrap_err().to_string();
            assert!(e.contains("symlink loop"), "{e}");
            let g = d.path().join("dangling");
            std::os::unix::fs::symlink(d.path().join("gone"), &g).unwrap();
            let e = regular_file(&g, "config").unwrap_err().to_string();
            assert!(e.contains("dangling symlink"), "{e}");
            let z = d.path().join("zero");
            std::os::unix::fs::symlink("/dev/null", &z).unwrap();
            let e = regular_file(&z, "shard").unwrap_err().to_string();
            assert!(e.contains("character device"), "{e}");
        }
    }

    #[test]
    fn reads_are_capped() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        std::fs::write(&p, b"0123456789").unwrap();
        assert_eq!(read_bytes(&p, "f", 10).unwrap().len(), 10);
        let e = read_bytes(&p, "f", 9).unwrap_err().to_string();
        assert!(e.contains("10 bytes"), "{e}");
    }
}
