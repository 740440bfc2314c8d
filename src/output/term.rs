//! The width of terminal output and what keeps every line within it: tables sized by comfy-table,
//! prose wrapped at word boundaries, long dotted names broken at their dots. Every command that
//! prints a table or findings (run, lint, compare, inspect, bisect, gate) lays its lines out for
//! [`width`].

use comfy_table::{presets, ColumnConstraint, ContentArrangement, Table, Width};

/// The width when stdout is not a terminal (a pipe, a file, CI logs).
pub const DEFAULT_WIDTH: usize = 120;

/// Narrower than this, tables cannot be laid out sensibly; lines are laid out for this width.
const MIN_WIDTH: usize = 60;

/// The width terminal output is laid out for: the terminal's columns when stdout is one
/// (comfy-table asks the terminal), else [`DEFAULT_WIDTH`].
pub fn width() -> usize {
    match Table::new().width() {
        Some(w) => (w as usize).max(MIN_WIDTH),
        None => DEFAULT_WIDTH,
    }
}

/// A table in the tools' style laid out within `width` columns: cells wrap (at spaces) only when
/// the table would be wider.
pub fn table(width: usize) -> Table {
    let mut t = Table::new();
    t.load_style(presets::UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_width(width.min(u16::MAX as usize) as u16);
    t
}

/// Keep column `col` of `t` (once it has rows) at least `width` characters of content wide: the
/// table's layout wraps other columns first. For cells without spaces (names, numbers), which
/// would otherwise be split inside a word.
pub fn keep(t: &mut Table, col: usize, width: usize) {
    if let Some(c) = t.column_mut(col) {
        // comfy-table's widths count the cell's padding (one space each side)
        let w = width + c.padding_width() as usize;
        c.set_constraint(ColumnConstraint::LowerBoundary(Width::Fixed(
            w.min(u16::MAX as usize) as u16,
        )));
    }
}

fn chars(s: &str) -> usize {
    s.chars().count()
}

/// Is this line part of a box-drawn table (comfy-table's borders and rows)?
fn is_table_line(l: &str) -> bool {
    l.starts_with(['┌', '│', '╞', '├', '└', '╭', '╰', '+', '|'])
}

/// The indent of a line's continuation: its own leading spaces, and a list marker (`1. `,
/// `- `) after them; two spaces under a line that has neither, so that a continuation reads as
/// one.
fn hanging_indent(line: &str) -> usize {
    let lead = line.len() - line.trim_start_matches(' ').len();
    let rest = &line[lead..];
    let digits = rest.chars().take_while(|c| c.is_ascii_digit()).count();
    let marker = if digits > 0 && rest[digits..].starts_with(". ") {
        digits + 2
    } else if rest.starts_with("- ") || rest.starts_with("* ") {
        2
    } else {
        0
    };
    match lead + marker {
        0 => 2,
        n => n,
    }
}

/// One line broken at spaces into lines of at most `width` characters, continuation lines
/// indented by `indent` spaces. A word longer than a line is broken inside it (after a `.`,
/// `_`, `/` or `,` where it can be, else anywhere).
pub fn wrap_with(line: &str, width: usize, indent: usize) -> Vec<String> {
    let width = width.max(indent + 20);
    if chars(line) <= width {
        return vec![line.to_string()];
    }
    let lead = line.len() - line.trim_start_matches(' ').len();
    let pad = " ".repeat(indent);
    let mut out: Vec<String> = Vec::new();
    let mut cur = line[..lead].to_string();
    let mut cur_len = lead;
    let mut fresh = true; // nothing but indentation on the current line
    for word in line[lead..].split(' ') {
        let wl = chars(word);
        let sep = usize::from(!fresh);
        if cur_len + sep + wl <= width {
            if !fresh {
                cur.push(' ');
            }
            cur.push_str(word);
            cur_len += sep + wl;
            fresh = false;
            continue;
        }
        if !fresh {
            out.push(std::mem::take(&mut cur));
            cur = pad.clone();
            cur_len = indent;
        }
        // the word alone may still be too long: break it where the names break
        let mut rest: &str = word;
        while cur_len + chars(rest) > width {
            let room = width.saturating_sub(cur_len);
            let cut = name_cut(rest, room);
            cur.push_str(&rest[..cut]);
            out.push(std::mem::take(&mut cur));
            cur = pad.clone();
            cur_len = indent;
            rest = &rest[cut..];
        }
        cur.push_str(rest);
        cur_len += chars(rest);
        fresh = rest.is_empty();
    }
    if cur_len > indent || out.is_empty() {
        out.push(cur);
    }
    out
}

/// The byte index to cut `s` at so that its head has at most `room` characters: after the last
/// `.`, `:`, `/` or `,` within them when there is one past a third of the room, else after the
/// last `_` or `-` there, else at `room`.
fn name_cut(s: &str, room: usize) -> usize {
    let room = room.max(1);
    let (mut best, mut second) = (None, None);
    let mut end = s.len();
    for (n, (i, c)) in s.char_indices().enumerate() {
        if n >= room {
            end = i;
            break;
        }
        if n + 1 >= room / 3 {
            if matches!(c, '.' | ':' | '/' | ',') {
                best = Some(i + c.len_utf8());
            } else if matches!(c, '_' | '-') {
                second = Some(i + c.len_utf8());
            }
        }
    }
    best.or(second).filter(|&b| b < s.len()).unwrap_or(end)
}

/// [`wrap_with`] with the line's own hanging indent (its leading spaces and list marker).
pub fn wrap(line: &str, width: usize) -> Vec<String> {
    wrap_with(line, width, hanging_indent(line))
}

/// Every line of `text` within `width`: prose lines wrapped ([`wrap`]), table lines (laid out by
/// comfy-table for the width) left as they are. Keeps a final newline.
pub fn fit(text: &str, width: usize) -> String {
    let mut out = String::with_capacity(text.len() + 64);
    for (i, line) in text.split('\n').enumerate() {
        if i > 0 {
            out.push('\n');
        }
        if is_table_line(line) {
            out.push_str(line);
        } else {
            out.push_str(&wrap(line, width).join("\n"));
        }
    }
    out
}

/// A dotted name (a tensor, an op) broken after its dots or underscores into lines of at most
/// `max` characters, for a table cell.
pub fn wrap_name(name: &str, max: usize) -> String {
    let max = max.max(8);
    let mut lines = Vec::new();
    let mut rest = name;
    while chars(rest) > max {
        let cut = name_cut(rest, max);
        lines.push(&rest[..cut]);
        rest = &rest[cut..];
    }
    lines.push(rest);
    lines.join("\n")
}

/// The widest line of a (possibly multi-line) cell.
pub fn cell_width(s: &str) -> usize {
    s.lines().map(chars).max().unwrap_or(0)
}

/// What is left of `width` for one more column beside columns of these content widths, in a
/// table with borders and one space of padding on each side of every cell.
pub fn spare(width: usize, others: &[usize]) -> usize {
    let used: usize = others.iter().map(|w| w + 3).sum::<usize>() + 1 + 3;
    width.saturating_sub(used)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prose_wraps_at_spaces_with_a_hanging_indent() {
        let line = format!("1. error [harmful] {}", "word ".repeat(60));
        let w = wrap(line.trim_end(), 50);
        assert!(w.len() > 5);
        for l in &w {
            assert!(chars(l) <= 50, "{l}");
        }
        assert!(w[1].starts_with("   word"), "{:?}", w[1]);
        let joined: Vec<&str> = w.iter().flat_map(|l| l.split_whitespace()).collect();
        assert_eq!(joined.len(), line.split_whitespace().count());
    }

    #[test]
    fn long_names_break_at_their_dots() {
        let n = "model.layers.12.self_attn.compressor.indexer.k_norm";
        let w = wrap_name(n, 20);
        for l in w.lines() {
            assert!(chars(l) <= 20, "{l}");
        }
        assert_eq!(w.replace('\n', ""), n);
        assert!(w.lines().next().unwrap().ends_with('.'), "{w}");
        let line = format!("        evidence `{n}` and `{n}`");
        for l in wrap(&line, 40) {
            assert!(chars(l.as_str()) <= 40, "{l}");
        }
    }

    #[test]
    fn short_lines_and_tables_stay_as_they_are() {
        let t = format!("┌{}┐\nshort\n", "─".repeat(200));
        assert_eq!(fit(&t, 80), t);
        assert_eq!(wrap("", 80), vec![String::new()]);
    }

    #[test]
    fn a_kept_column_is_not_wrapped() {
        let mut t = table(60);
        t.set_header(vec!["name", "prose"]);
        let name = "layers.0.ffn.experts.255.w2";
        t.add_row(vec![name.to_string(), "some words to wrap ".repeat(5)]);
        keep(&mut t, 0, name.len());
        let s = t.to_string();
        assert!(s.contains(name), "{s}");
        for l in s.lines() {
            assert!(chars(l) <= 60, "{l}");
        }
    }

    #[test]
    fn a_table_is_laid_out_within_the_width() {
        let mut t = table(60);
        t.set_header(vec!["name", "value"]);
        t.add_row(vec![
            "a rather long cell of several words ".repeat(4),
            "1.0".into(),
        ]);
        for l in t.to_string().lines() {
            assert!(chars(l) <= 60, "{l}");
        }
    }
}
