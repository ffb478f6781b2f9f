//! Bounded quotes of what a file chose (a tensor name, a dtype, a key, a list of names):
//! an error never repeats megabytes a hostile file put there.

/// The most bytes of one file-chosen string (a tensor name, a dtype, a key) an error
/// quotes.
pub(crate) const QUOTE_MAX: usize = 200;
/// The most items of a file-chosen list an error quotes.
pub(crate) const LIST_MAX: usize = 5;
/// The most bytes of a path an error keeps (Linux's `PATH_MAX`).
pub(crate) const PATH_MAX: usize = 4096;
/// The most bytes of an error's reason: a backstop behind [`quote`] and [`quote_list`].
pub(crate) const REASON_MAX: usize = 8192;

/// The longest prefix of `text` of at most `max` bytes that ends on a character
/// boundary, and whether anything was cut.
pub(crate) fn clip(text: &str, max: usize) -> (&str, bool) {
    if text.len() <= max {
        return (text, false);
    }
    // `str::floor_char_boundary` is 1.91; the MSRV is 1.88. A char is at most 4 bytes.
    let end = (max.saturating_sub(3)..=max)
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    (&text[..end], true)
}

pub(crate) fn clip_owned(mut text: String, max: usize) -> String {
    if let (head, true) = clip(&text, max) {
        let (cut, len) = (head.len(), text.len());
        text.truncate(cut);
        text.push_str(&format!("… ({len} bytes)"));
    }
    text
}

/// A caller- or file-chosen value shown as its `Display` form (a JSON value, a number
/// given as text), at most [`QUOTE_MAX`] bytes of it and its length:
/// `["x","x",… (262150 bytes)`. For a string, prefer [`quote`].
pub(crate) fn shown(value: impl std::fmt::Display) -> String {
    clip_owned(value.to_string(), QUOTE_MAX)
}

/// A file-chosen string quoted for a message: `"abc"`, or at most [`QUOTE_MAX`] bytes of
/// it and its length, `"abc…" (4194304 bytes)`.
pub(crate) fn quote(text: &str) -> String {
    match clip(text, QUOTE_MAX) {
        (text, false) => format!("{text:?}"),
        (head, true) => format!("{:?} ({} bytes)", format!("{head}…"), text.len()),
    }
}

/// At most [`LIST_MAX`] items of a file-chosen list, each [`quote`]d, and how many there
/// are when some are left out: `"a", "b" and 3 more (5)`.
pub(crate) fn quote_list<'a>(items: impl IntoIterator<Item = &'a str>) -> String {
    let mut out = String::new();
    let mut count = 0usize;
    for item in items {
        if count < LIST_MAX {
            if count > 0 {
                out.push_str(", ");
            }
            out.push_str(&quote(item));
        }
        count += 1;
    }
    if count > LIST_MAX {
        out.push_str(&format!(" and {} more ({count} in all)", count - LIST_MAX));
    }
    out
}
