//! `cargo xtask check-layers`: the typed crate's import graph points only down, and every
//! raw system call is in `numapin-sys`.
//!
//! Three rules, read from the source text (comments and strings aside):
//! 1. A module of `src/` names (`crate::x`) only modules of lower layers in [`LAYERS`];
//!    a module missing from the list is an error, so a new room is placed deliberately.
//! 2. Paths name a module, not one of the root's re-exports (`crate::Node` hides the arrow
//!    to `node`, and can hide a loop).
//! 3. No `libc::` function is called outside `sys/` (constants and types are fine):
//!    syscalls go through `numapin_sys` (or rustix, which is a syscall crate itself).
//!
//! `src/lib.rs` itself may hold only modules and re-exports: no `fn`, `struct`, `enum`,
//! `static` or `impl` outside `#[cfg(doctest)]` items.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The modules of `src/`, bottom up. A module may name the modules of lower layers only.
pub const LAYERS: &[&[&str]] = &[
    &["nodeset", "page"],
    &["error"],
    &["node", "capability", "jemalloc", "routing"],
    &["calls", "diag", "topology", "serve"],
    &["policy", "probe"],
    &["region"],
    &["source"],
    &["store"],
    &["cache", "model"],
    &["planner"],
    &["cli"],
];

pub fn run() -> Result<(), String> {
    let root = crate::root();
    let mut problems = check_crate(&root.join("src"))?;
    problems.sort();
    if problems.is_empty() {
        eprintln!("xtask: check-layers: the import graph points down; syscalls are in sys/");
        Ok(())
    } else {
        for p in &problems {
            eprintln!("  {p}");
        }
        Err(format!("check-layers: {} problems above", problems.len()))
    }
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

/// Every problem in the crate whose sources are under `src`.
pub fn check_crate(src: &Path) -> Result<Vec<String>, String> {
    let mut problems = Vec::new();
    let mut files = Vec::new();
    collect(src, &mut files)?;
    let modules: Vec<String> = LAYERS
        .iter()
        .flat_map(|l| l.iter().map(|m| m.to_string()))
        .collect();
    for file in files {
        let rel = file.strip_prefix(src).unwrap_or(&file).to_path_buf();
        // `src/bin/`: the binaries' roots, crates of their own that call `numapin::cli`.
        if rel.starts_with("bin") {
            continue;
        }
        let text =
            std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let code = strip_comments_and_strings(&text);
        let shown = format!("src/{}", rel.display());
        for (line, call) in libc_calls(&code) {
            problems.push(format!("{shown}:{line}: raw `libc::{call}` outside sys/"));
        }
        let Some(module) = module_of(&rel) else {
            problems.extend(check_root(&shown, &code));
            continue;
        };
        let Some(layer) = layer_of(&module) else {
            problems.push(format!(
                "{shown}: module `{module}` is in no layer of xtask's LAYERS"
            ));
            continue;
        };
        for (line, target) in crate_paths(&code) {
            if target == module {
                continue;
            }
            match layer_of(&target) {
                Some(t) if t < layer => {}
                Some(_) => problems.push(format!(
                    "{shown}:{line}: `{module}` names `crate::{target}`, which is not below it"
                )),
                None if modules.contains(&target) => {}
                None => problems.push(format!(
                    "{shown}:{line}: `crate::{target}` is not a module (a re-export from the \
                     root hides the arrow: name the module that defines it)"
                )),
            }
        }
    }
    Ok(problems)
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        if path.is_dir() {
            collect(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// `region/pages.rs` → `region`, `diag.rs` → `diag`, `lib.rs` → `None` (the root).
fn module_of(rel: &Path) -> Option<String> {
    let first = rel
        .components()
        .next()?
        .as_os_str()
        .to_string_lossy()
        .into_owned();
    let name = first.strip_suffix(".rs").unwrap_or(&first).to_string();
    (name != "lib").then_some(name)
}

/// The root holds modules and re-exports only (a `#[cfg(doctest)]` item, with whatever
/// its braces hold, aside).
fn check_root(shown: &str, code: &str) -> Vec<String> {
    const ITEMS: [&str; 13] = [
        "fn ",
        "pub fn ",
        "pub(crate) fn ",
        "struct ",
        "pub struct ",
        "enum ",
        "pub enum ",
        "static ",
        "pub static ",
        "impl ",
        "impl<",
        "const ",
        "pub const ",
    ];
    let mut problems = Vec::new();
    let (mut doctest, mut depth) = (false, 0i64);
    for (i, line) in code.lines().enumerate() {
        let t = line.trim_start();
        if depth > 0 {
            depth += brace_balance(t);
            continue;
        }
        if t.starts_with("#[cfg(doctest)]") {
            doctest = true;
            continue;
        }
        if t.starts_with("#[") || t.is_empty() {
            continue;
        }
        if doctest {
            depth = brace_balance(t).max(0);
            doctest = false;
            continue;
        }
        if ITEMS.iter().any(|k| t.starts_with(k)) {
            problems.push(format!(
                "{shown}:{}: the root defines an item (`{}`): lib.rs holds modules and \
                 re-exports only",
                i + 1,
                t.chars().take(40).collect::<String>()
            ));
        }
    }
    problems
}

fn brace_balance(line: &str) -> i64 {
    line.bytes()
        .map(|b| match b {
            b'{' => 1,
            b'}' => -1,
            _ => 0,
        })
        .sum()
}

/// The source with comments and the contents of string and char literals blanked (line
/// structure kept), so that only code is searched.
pub fn strip_comments_and_strings(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        i = match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => line_comment_end(b, i),
            b'/' if b.get(i + 1) == Some(&b'*') => blank_block_comment(b, i, &mut out),
            b'r' if matches!(b.get(i + 1), Some(b'"' | b'#'))
                && (starts_token(b, i)
                    || (i > 0 && matches!(b[i - 1], b'b' | b'c') && starts_token(b, i - 1))) =>
            {
                blank_raw_string(b, i, &mut out)
            }
            b'"' => blank_string(b, i, &mut out),
            b'\'' => blank_char(b, i, &mut out),
            c => {
                // Multi-byte UTF-8 passes through whole.
                let len = utf8_len(c);
                out.push_str(&text[i..(i + len).min(text.len())]);
                i + len
            }
        };
    }
    out
}

/// A blanked byte: a space, or the newline it was (the line structure is kept).
fn blank(out: &mut String, c: u8) {
    out.push(if c == b'\n' { '\n' } else { ' ' });
}

/// Where the `//` comment at `i` ends: at its newline, which is kept.
fn line_comment_end(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i] != b'\n' {
        i += 1;
    }
    i
}

/// Blanks the `/* */` comment at `i`, nested ones inside it too; returns where it ends.
fn blank_block_comment(b: &[u8], mut i: usize, out: &mut String) -> usize {
    let mut depth = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            depth += 1;
            i += 2;
        } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                break;
            }
        } else {
            blank(out, b[i]);
            i += 1;
        }
    }
    i
}

/// Blanks the raw string `r"…"`, `r#"…"#` at `i` (the `r` of one; a `b` or `c` before it
/// is already out), keeping its quotes; an `r` that starts none is kept as it is.
fn blank_raw_string(b: &[u8], i: usize, out: &mut String) -> usize {
    let mut j = i + 1;
    let mut hashes = 0;
    while b.get(j) == Some(&b'#') {
        hashes += 1;
        j += 1;
    }
    if b.get(j) != Some(&b'"') {
        out.push(b[i] as char);
        return i + 1;
    }
    out.push('"');
    j += 1;
    loop {
        if j >= b.len() {
            break;
        }
        if b[j] == b'"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&b'#')) {
            j += 1 + hashes;
            break;
        }
        blank(out, b[j]);
        j += 1;
    }
    out.push('"');
    j
}

/// Blanks the string literal at `i` (escapes included), keeping its quotes.
fn blank_string(b: &[u8], mut i: usize, out: &mut String) -> usize {
    out.push('"');
    i += 1;
    while i < b.len() && b[i] != b'"' {
        if b[i] == b'\\' {
            blank(out, b[i]);
            i += 1;
        }
        if i < b.len() {
            blank(out, b[i]);
            i += 1;
        }
    }
    out.push('"');
    i + 1
}

/// Blanks the char literal at `i` ('x', '\n', '\u{1F600}') to `' '`; a lifetime ('a)
/// keeps its quote.
fn blank_char(b: &[u8], i: usize, out: &mut String) -> usize {
    // The escaped character is skipped ('\'' ends at i + 3), and a multi-byte one ('é')
    // is one char.
    let end = if b.get(i + 1) == Some(&b'\\') {
        b.get(i + 3..)
            .and_then(|rest| rest.iter().position(|&c| c == b'\''))
            .map(|p| i + 3 + p)
    } else if let Some(&c) = b.get(i + 1)
        && b.get(i + 1 + utf8_len(c)) == Some(&b'\'')
    {
        Some(i + 1 + utf8_len(c))
    } else {
        None
    };
    match end {
        Some(e) => {
            out.push_str("' '");
            e + 1
        }
        None => {
            out.push('\'');
            i + 1
        }
    }
}

/// Whether `b[i]` starts a token: no identifier character right before it.
fn starts_token(b: &[u8], i: usize) -> bool {
    i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

fn utf8_len(first: u8) -> usize {
    match first {
        0xf0..=0xff => 4,
        0xe0..=0xef => 3,
        0xc0..=0xdf => 2,
        _ => 1,
    }
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// (line, first segment) of every `crate::…` path, `use crate::{a, b::c}` groups included.
pub fn crate_paths(code: &str) -> Vec<(usize, String)> {
    let b = code.as_bytes();
    let mut found = Vec::new();
    let mut line_starts = BTreeMap::new();
    let mut line = 1;
    line_starts.insert(0, 1);
    for (i, &c) in b.iter().enumerate() {
        if c == b'\n' {
            line += 1;
            line_starts.insert(i + 1, line);
        }
    }
    let line_at = |i: usize| {
        *line_starts
            .range(..=i)
            .next_back()
            .map(|(_, l)| l)
            .unwrap_or(&1)
    };
    let mut i = 0;
    while let Some(p) = code[i..].find("crate::") {
        let at = i + p;
        i = at + "crate::".len();
        if at > 0 && (is_ident(b[at - 1]) || b[at - 1] == b'$') {
            continue; // `$crate::`, `numapin_crate::`
        }
        let mut j = i;
        while j < b.len() && b[j].is_ascii_whitespace() {
            j += 1;
        }
        if b.get(j) == Some(&b'{') {
            // A group: its top-level names, each up to `::`, `,` or `}`.
            let mut depth = 0;
            let mut k = j + 1;
            let mut expect_name = true;
            while k < b.len() {
                match b[k] {
                    b'{' => depth += 1,
                    b'}' if depth == 0 => break,
                    b'}' => depth -= 1,
                    b',' if depth == 0 => expect_name = true,
                    c if expect_name && is_ident(c) => {
                        let s = k;
                        while k < b.len() && is_ident(b[k]) {
                            k += 1;
                        }
                        let name = &code[s..k];
                        if name != "self" {
                            found.push((line_at(s), name.to_string()));
                        }
                        expect_name = false;
                        continue;
                    }
                    _ => {}
                }
                k += 1;
            }
            continue;
        }
        let s = j;
        while j < b.len() && is_ident(b[j]) {
            j += 1;
        }
        if j > s {
            found.push((line_at(s), code[s..j].to_string()));
        }
    }
    found
}

/// (line, name) of every call of a `libc::` function (a lower-case name followed by `(`).
pub fn libc_calls(code: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let mut rest = line;
        while let Some(p) = rest.find("libc::") {
            let after = &rest[p + "libc::".len()..];
            let name: String = after
                .chars()
                .take_while(|&c| c.is_ascii_alphanumeric() || c == '_')
                .collect();
            let called = after[name.len()..].trim_start().starts_with('(');
            if called && name.starts_with(|c: char| c.is_ascii_lowercase()) {
                found.push((n + 1, name.clone()));
            }
            rest = &after[name.len()..];
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_groups_comments_and_strings() {
        let code = strip_comments_and_strings(
            "use crate::{diag, page::size, region::{Region, bind}};\n\
             // crate::store in a comment\n\
             /// [`x`](crate::store::PinStore)\n\
             let s = \"crate::model\"; let r = r#\"crate::cache\"#;\n\
             let n = crate::Node(1); let c = 'x'; fn f<'a>(x: &'a u8) {}\n\
             unsafe { libc::ioctl(fd, 1) }; let k = libc::O_DIRECT; libc::c_int::MAX;\n",
        );
        let paths: Vec<String> = crate_paths(&code).into_iter().map(|(_, p)| p).collect();
        assert_eq!(paths, ["diag", "page", "region", "Node"]);
        assert_eq!(libc_calls(&code), [(6, "ioctl".to_string())]);
    }

    #[test]
    fn escaped_quotes_multibyte_chars_and_prefixed_raw_strings() {
        // Each line names one real path after a literal that once threw the lexer off:
        // '\'' ended at its escaped quote, 'é' was read as a lifetime, br"\" and cr"\"
        // were read as ordinary strings whose \" escaped the closing quote.
        let code = strip_comments_and_strings(
            "let q = ['\\'','\"']; use crate::diag; let s = \"\";\n\
             let e = ('é','\"'); use crate::page; let s = \"\";\n\
             let b = br\"\\\"; use crate::region; let s = \"\";\n\
             let c = cr\"\\\"; use crate::node; let s = \"\";\n\
             let s = \"crate::model\";\n",
        );
        let paths: Vec<String> = crate_paths(&code).into_iter().map(|(_, p)| p).collect();
        assert_eq!(paths, ["diag", "page", "region", "node"], "{code}");
    }

    #[test]
    fn the_root_may_hold_modules_re_exports_and_doctest_items_only() {
        let root = "mod a;\npub use a::B;\n#[cfg(doctest)]\nmod docs {\n    pub struct D;\n}\n\
                    pub fn page_size() -> usize {\n    4096\n}\nstruct S;\n";
        let problems = check_root("src/lib.rs", root);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].starts_with("src/lib.rs:7:"), "{problems:?}");
        assert!(problems[1].starts_with("src/lib.rs:10:"), "{problems:?}");
    }
}
