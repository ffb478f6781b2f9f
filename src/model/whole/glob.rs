//! Glob patterns of a placement plan's overrides: `*` any run of characters, `?` one
//! character, matched against checkpoint tensor names.

/// `glob` with each run of `*` as one `*` (the same pattern): the match below costs
/// a step per pattern byte before it reads a name byte, so a megabyte of stars against a
/// checkpoint's tens of thousands of names would take minutes.
pub(super) fn collapse_stars(glob: String) -> String {
    if !glob.contains("**") {
        return glob;
    }
    let mut out = String::with_capacity(glob.len());
    for c in glob.chars() {
        if !(c == '*' && out.ends_with('*')) {
            out.push(c);
        }
    }
    out
}

/// Bytes of the UTF-8 character that starts with `lead`.
fn char_len(lead: u8) -> usize {
    match lead {
        0xf0.. => 4,
        0xe0.. => 3,
        0xc0.. => 2,
        _ => 1,
    }
}

/// Whether `name` matches `glob` (`*` any run of characters, `?` one character), without
/// recursion: the classic two-pointer match with the last `*` to fall back to. Bytes
/// are compared (UTF-8 makes a byte match of a whole pattern character a character
/// match); `?` and the fall back step over one whole character, so `?` matches `é`.
pub(crate) fn glob_match(glob: &str, name: &str) -> bool {
    let (p, s) = (glob.as_bytes(), name.as_bytes());
    let (mut i, mut j) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while j < s.len() {
        if i < p.len() && p[i] == b'?' {
            i += 1;
            j += char_len(s[j]);
        } else if i < p.len() && p[i] == s[j] {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == b'*' {
            star = Some((i, j));
            i += 1;
        } else if let Some((si, sj)) = star {
            let next = sj + char_len(s[sj]);
            i = si + 1;
            j = next;
            star = Some((si, next));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&b| b == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        let yes = [
            ("*.self_attn.*", "model.layers.0.self_attn.q_proj.weight"),
            ("*", ""),
            ("blk.?.attn_*", "blk.3.attn_q.weight"),
            ("a*b*c", "axxbyyc"),
            ("*norm*", "output_norm.weight"),
            ("blk.?.attn", "blk.é.attn"),
            ("*é?", "aéé€"),
            ("*?", "€"),
        ];
        let no = [
            ("*.self_attn.*", "model.layers.0.mlp.gate.weight"),
            ("blk.?.attn_*", "blk.13.attn_q.weight"),
            ("a*b*c", "axxbyy"),
            ("", "x"),
            ("blk.??.attn", "blk.é.attn"),
            ("?", "€€"),
        ];
        for (g, n) in yes {
            assert!(glob_match(g, n), "{g} {n}");
        }
        for (g, n) in no {
            assert!(!glob_match(g, n), "{g} {n}");
        }
    }
}
