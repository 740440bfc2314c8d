//! The one glob matcher of the tool (op ids in probe specs and gate rules, weight names in
//! `inspect --filter`, ignore lists in a checkpoint's quantization config): `*` matches any run of
//! characters (dots included), `?` exactly one, everything else itself. It backtracks only to the
//! last `*` (at worst pattern × text steps), so a hostile pattern (`*a*a*a*…b` against a long name)
//! cannot hang a command the way naive recursion does.

/// Does `pattern` match all of `text`?
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == '*' {
        pi += 1;
    }
    pi == p.len()
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn stars_questions_and_literals() {
        assert!(glob_match("L*.ffn.experts", "L12.ffn.experts"));
        assert!(glob_match("layers.?.attn.*", "layers.3.attn.wq_a"));
        assert!(!glob_match("layers.?.attn.*", "layers.13.attn.wq_a"));
        assert!(glob_match("*", ""));
        assert!(!glob_match("a", ""));
        assert!(glob_match("a*b*c", "aXXbYYc"));
        assert!(!glob_match("a*b*c", "aXXbYY"));
        assert!(glob_match("exact", "exact"));
    }

    /// The pathological case of naive recursion: 40 stars against 10,000 characters answers at
    /// once (the recursive matcher this replaced took exponential time).
    #[test]
    fn hostile_patterns_answer_at_once() {
        let pattern = "*a".repeat(40) + "b";
        let text = "a".repeat(10_000);
        let t0 = std::time::Instant::now();
        assert!(!glob_match(&pattern, &text));
        assert!(t0.elapsed().as_secs_f64() < 2.0);
    }
}
